/* The expected call compiled (collectives/hot.py says what it is for; docs/collectives.md, "Small
 * messages", what it costs).
 *
 * `allreduce_now` does what small.allreduce_now does for a blocking allreduce that every rank
 * expected (expectation.py) and that everything about is as usual: the call is the expected
 * plan's (found by a memo on the plan of the arguments and the call site that reached it last), no
 * `i*` call is outstanding, no failure ended the communicator, no other thread is in a call on it.
 * Then it numbers the call, records it, runs the library's allreduce of the data and the agreeing
 * element, and on agreement updates the expectation and returns the result. Anything else it hands,
 * untouched, to the Python function (`configure`'s `fallback`); a disagreement or an MPI error
 * after the library call goes to `settle`, which ends the call as the Python path does.
 *
 * The state it reads lives in the structs of the base classes below, which the Python classes
 * (channels.Channel, expectation.Expectation and LibraryPlan, recorder.Recorder) derive from, so
 * both paths read and write the same fields. MPI is reached without its header: MPI_Allreduce and
 * MPI_Finalized come from the library mpi4py loaded, handles from `MPI._handleof`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#if PY_VERSION_HEX < 0x030A0000 /* Py_NewRef came with 3.10 */
static inline PyObject *Py_NewRef(PyObject *o) {
    Py_INCREF(o);
    return o;
}
#endif
#include <structmember.h>
#include <pythread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if PY_VERSION_HEX < 0x030B0000 || defined(Py_GIL_DISABLED)
#error "the compiled hot path needs CPython 3.11 or later with the GIL (hot.py falls back to Python)"
#endif

/* NumPy's array struct as every compiled NumPy extension reads it (PyArray_DATA and friends are
 * these fields): the ABI NumPy keeps, read here without NumPy's headers. */
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
    int flags;
} Array;
#define C_CONTIGUOUS 0x0001
#define CARRAY (0x0001 | 0x0100 | 0x0400) /* C-contiguous, aligned, writeable */
#define MOST_DIMS 8

/* ------------------------------------------------------------------ Busy: a channel's call flag */

typedef struct {
    PyObject_HEAD
    int held;
} Busy;

static PyObject *Busy_acquire(Busy *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 1 || PyObject_IsTrue(args[0])) {
        PyErr_SetString(PyExc_ValueError, "Busy.acquire takes only False: it never waits");
        return NULL;
    }
    if (self->held)
        Py_RETURN_FALSE;
    self->held = 1;
    Py_RETURN_TRUE;
}

static PyObject *Busy_release(Busy *self, PyObject *unused) {
    if (!self->held) {
        PyErr_SetString(PyExc_RuntimeError, "release unlocked lock");
        return NULL;
    }
    self->held = 0;
    Py_RETURN_NONE;
}

static PyObject *Busy_locked(Busy *self, PyObject *unused) { return PyBool_FromLong(self->held); }

static PyMethodDef Busy_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))Busy_acquire, METH_FASTCALL,
     "acquire(False): take the flag if no thread holds it; whether it was taken"},
    {"release", (PyCFunction)Busy_release, METH_NOARGS, "release(): give the flag back"},
    {"locked", (PyCFunction)Busy_locked, METH_NOARGS, "locked(): whether a thread holds the flag"},
    {NULL}};

static PyTypeObject Busy_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "collectives._hot.Busy",
    .tp_basicsize = sizeof(Busy),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The flag a thread holds while it issues a call on a channel: threading.Lock's "
              "acquire(False) and release, read in place by the compiled path (the GIL orders them).",
    .tp_methods = Busy_methods,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------- the base classes' shared fields */

typedef struct {
    PyObject_HEAD
    PyObject *busy, *last, *failure, *intruders, *label, *blocking, *background, *expectation;
    long long calls, completed;
    unsigned long issuer;
    char freed;
} ChannelCore;

typedef struct {
    PyObject_HEAD
    PyObject *last, *expected, *follows;
    long long number;
} ExpectationCore;

typedef struct {
    PyObject_HEAD
    PyObject *ident, *comm, *buffer, *datatype, *mpi_op, *finish, *what;
    Py_ssize_t count;
    unsigned long long agreeing;
    /* compiled path only: */
    PyObject *bound;       /* the `comm` whose handle is in h_comm (held: compared by identity) */
    intptr_t h_comm, h_datatype, h_op;
    char handles;          /* h_datatype and h_op read */
    void *send;            /* the library call's send buffer: count + 1 elements */
    Py_ssize_t itemsize;
    /* the memo: the arguments and call site that last reached this plan */
    PyObject *m_descr, *m_op, *m_algorithm, *m_override, *m_tuning;
    int m_nd;
    Py_ssize_t m_dims[MOST_DIMS];
    PyObject *m_code, *m_site, *m_last; /* code object, (fingerprint, text), (ident, fingerprint) */
    int m_lasti;
    long long m_fingerprint;
} PlanCore;

typedef struct {
    PyObject_HEAD
    PyObject *ring;
    Py_ssize_t capacity;
    long long count;
} RecorderCore;

#define OBJ(type, field, flags) {#field, T_OBJECT_EX, offsetof(type, field), flags, NULL}
#define NONE(type, field) {#field, T_OBJECT, offsetof(type, field), 0, NULL}

static PyMemberDef ChannelCore_members[] = {
    OBJ(ChannelCore, busy, 0), NONE(ChannelCore, last), NONE(ChannelCore, failure),
    OBJ(ChannelCore, intruders, 0), OBJ(ChannelCore, label, 0), OBJ(ChannelCore, blocking, 0),
    OBJ(ChannelCore, background, 0), OBJ(ChannelCore, expectation, 0),
    {"calls", T_LONGLONG, offsetof(ChannelCore, calls), 0, NULL},
    {"completed", T_LONGLONG, offsetof(ChannelCore, completed), 0, NULL},
    {"issuer", T_ULONG, offsetof(ChannelCore, issuer), 0, NULL},
    {"freed", T_BOOL, offsetof(ChannelCore, freed), 0, NULL},
    {NULL}};

static PyMemberDef ExpectationCore_members[] = {
    OBJ(ExpectationCore, last, 0), NONE(ExpectationCore, expected), OBJ(ExpectationCore, follows, 0),
    {"number", T_LONGLONG, offsetof(ExpectationCore, number), 0, NULL},
    {NULL}};

static PyMemberDef PlanCore_members[] = {
    OBJ(PlanCore, ident, 0), OBJ(PlanCore, comm, 0), OBJ(PlanCore, buffer, 0),
    OBJ(PlanCore, datatype, 0), OBJ(PlanCore, mpi_op, 0), NONE(PlanCore, finish), OBJ(PlanCore, what, 0),
    {"count", T_PYSSIZET, offsetof(PlanCore, count), 0, NULL},
    {"agreeing", T_ULONGLONG, offsetof(PlanCore, agreeing), 0, NULL},
    {NULL}};

static PyMemberDef RecorderCore_members[] = {
    OBJ(RecorderCore, ring, 0),
    {"capacity", T_PYSSIZET, offsetof(RecorderCore, capacity), 0, NULL},
    {"count", T_LONGLONG, offsetof(RecorderCore, count), 0, NULL},
    {NULL}};

static int ChannelCore_traverse(ChannelCore *self, visitproc visit, void *arg) {
    Py_VISIT(self->busy); Py_VISIT(self->last); Py_VISIT(self->failure); Py_VISIT(self->intruders);
    Py_VISIT(self->label); Py_VISIT(self->blocking); Py_VISIT(self->background);
    Py_VISIT(self->expectation);
    return 0;
}
static int ChannelCore_clear(ChannelCore *self) {
    Py_CLEAR(self->busy); Py_CLEAR(self->last); Py_CLEAR(self->failure); Py_CLEAR(self->intruders);
    Py_CLEAR(self->label); Py_CLEAR(self->blocking); Py_CLEAR(self->background);
    Py_CLEAR(self->expectation);
    return 0;
}
static int ExpectationCore_traverse(ExpectationCore *self, visitproc visit, void *arg) {
    Py_VISIT(self->last); Py_VISIT(self->expected); Py_VISIT(self->follows);
    return 0;
}
static int ExpectationCore_clear(ExpectationCore *self) {
    Py_CLEAR(self->last); Py_CLEAR(self->expected); Py_CLEAR(self->follows);
    return 0;
}
static int PlanCore_traverse(PlanCore *self, visitproc visit, void *arg) {
    Py_VISIT(self->ident); Py_VISIT(self->comm); Py_VISIT(self->buffer); Py_VISIT(self->datatype);
    Py_VISIT(self->mpi_op); Py_VISIT(self->finish); Py_VISIT(self->what); Py_VISIT(self->bound);
    Py_VISIT(self->m_descr); Py_VISIT(self->m_op); Py_VISIT(self->m_algorithm);
    Py_VISIT(self->m_override); Py_VISIT(self->m_tuning); Py_VISIT(self->m_code);
    Py_VISIT(self->m_site); Py_VISIT(self->m_last);
    return 0;
}
static int PlanCore_clear(PlanCore *self) {
    Py_CLEAR(self->ident); Py_CLEAR(self->comm); Py_CLEAR(self->buffer); Py_CLEAR(self->datatype);
    Py_CLEAR(self->mpi_op); Py_CLEAR(self->finish); Py_CLEAR(self->what); Py_CLEAR(self->bound);
    Py_CLEAR(self->m_descr); Py_CLEAR(self->m_op); Py_CLEAR(self->m_algorithm);
    Py_CLEAR(self->m_override); Py_CLEAR(self->m_tuning); Py_CLEAR(self->m_code);
    Py_CLEAR(self->m_site); Py_CLEAR(self->m_last);
    return 0;
}
static int RecorderCore_traverse(RecorderCore *self, visitproc visit, void *arg) {
    Py_VISIT(self->ring);
    return 0;
}
static int RecorderCore_clear(RecorderCore *self) {
    Py_CLEAR(self->ring);
    return 0;
}

/* A static type's dealloc: a Python subclass's (subtype_dealloc) drops the reference to its type. */
#define DEALLOC(Type, extra)                                                   \
    static void Type##_dealloc(Type *self) {                                   \
        PyObject_GC_UnTrack(self);                                             \
        Type##_clear(self);                                                    \
        extra;                                                                 \
        Py_TYPE(self)->tp_free((PyObject *)self);                              \
    }
DEALLOC(ChannelCore, (void)0)
DEALLOC(ExpectationCore, (void)0)
DEALLOC(PlanCore, PyMem_Free(self->send); self->send = NULL)
DEALLOC(RecorderCore, (void)0)

#define BASE_TYPE(Type, doc)                                                   \
    static PyTypeObject Type##_Type = {                                        \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "collectives._hot." #Type,    \
        .tp_basicsize = sizeof(Type),                                          \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, \
        .tp_doc = doc,                                                         \
        .tp_traverse = (traverseproc)Type##_traverse,                          \
        .tp_clear = (inquiry)Type##_clear,                                     \
        .tp_dealloc = (destructor)Type##_dealloc,                              \
        .tp_members = Type##_members,                                          \
        .tp_new = PyType_GenericNew,                                           \
    };
BASE_TYPE(ChannelCore, "channels.Channel's fields that the compiled path reads and writes")
BASE_TYPE(ExpectationCore, "expectation.Expectation's fields that the compiled path reads and writes")
BASE_TYPE(PlanCore, "expectation.LibraryPlan's fields that the compiled path reads, and its memo")
BASE_TYPE(RecorderCore, "recorder.Recorder's ring, capacity and count")

/* ------------------------------------------------------------------------------ configuration */

typedef int (*Allreduce8)(const void *, void *, int, void *, void *, void *);
typedef int (*Allreduce4)(const void *, void *, int, int32_t, int32_t, int32_t);
typedef int (*Finalized)(int *);
typedef void *(*CommHandle)(PyObject *); /* mpi4py's C API: PyMPIComm_Get */
#define CHANNELS 4 /* communicators whose channel is remembered, besides COMM_WORLD's */

static struct {
    int ready, enabled, check_sites, handle_size;
    void *allreduce;
    Finalized finalized;
    CommHandle comm_handle;
    struct { PyObject *comm, *channel; intptr_t handle; } channels[CHANNELS];
    int next_channel;
    PyObject *channel_of, *fallback, *settle, *finished, *handleof, *channels_module, *recorder, *sites, *environment;
    PyObject *pass_through; /* planning._PASS_THROUGH: files whose frames pass calls on */
    PyObject *override_name, *tuning_name, *ndarray, *world_name, *copy_name, *intruded_name;
    PyObject *no_site, *auto_name, *mpi_name;
    long long compiled; /* calls completed on the compiled path (for tests) */
} S = {.enabled = 1};

static PyObject *configure(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"fallback", "settle", "finished", "handleof", "channels", "recorder",
                            "sites", "check_sites", "environment", "override", "tuning", "ndarray",
                            "allreduce", "finalized", "handle_size", "channel_of", "comm_handle",
                            "pass_through", NULL};
    PyObject *fallback, *settle, *finished, *handleof, *channels, *recorder, *sites, *environment;
    PyObject *override_name, *tuning_name, *ndarray, *channel_of, *comm_handle, *pass_through;
    unsigned long long allreduce, finalized;
    int check_sites, handle_size;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO!O!O!pOOOO!KKiOO!O!", names, &fallback, &settle,
                                     &finished, &handleof, &PyDict_Type, &channels,
                                     &RecorderCore_Type, &recorder, &PyDict_Type, &sites,
                                     &check_sites, &environment, &override_name, &tuning_name,
                                     &PyType_Type, &ndarray, &allreduce, &finalized, &handle_size,
                                     &channel_of, &PyCapsule_Type, &comm_handle, &PySet_Type,
                                     &pass_through))
        return NULL;
    void *get = PyCapsule_GetPointer(comm_handle, "MPI_Comm *(PyObject *)");
    if (!get)
        return NULL;
    if (handle_size != 4 && handle_size != 8) {
        PyErr_Format(PyExc_ValueError, "MPI handles of %d bytes are not supported", handle_size);
        return NULL;
    }
#define KEEP(field, value) do { Py_INCREF(value); Py_XSETREF(S.field, value); } while (0)
    KEEP(fallback, fallback); KEEP(settle, settle); KEEP(finished, finished);
    KEEP(handleof, handleof); KEEP(channels_module, channels); KEEP(recorder, recorder); KEEP(sites, sites);
    KEEP(environment, environment); KEEP(override_name, override_name);
    KEEP(tuning_name, tuning_name); KEEP(ndarray, ndarray); KEEP(channel_of, channel_of);
    KEEP(pass_through, pass_through);
    S.comm_handle = (CommHandle)get;
    S.check_sites = check_sites;
    S.handle_size = handle_size;
    S.allreduce = (void *)(uintptr_t)allreduce;
    S.finalized = (Finalized)(uintptr_t)finalized;
    if (!S.world_name) {
        S.world_name = PyUnicode_InternFromString("world");
        S.copy_name = PyUnicode_InternFromString("copy");
        S.intruded_name = PyUnicode_InternFromString("intruded");
        S.auto_name = PyUnicode_InternFromString("auto");
        S.mpi_name = PyUnicode_InternFromString("mpi");
        S.no_site = Py_BuildValue("(is)", 0, "");
        if (!S.world_name || !S.copy_name || !S.intruded_name || !S.auto_name || !S.mpi_name ||
            !S.no_site)
            return NULL;
    }
    S.ready = 1;
    Py_RETURN_NONE;
}

static PyObject *enable(PyObject *module, PyObject *flag) {
    int was = S.enabled;
    int on = PyObject_IsTrue(flag);
    if (on < 0)
        return NULL;
    S.enabled = on;
    return PyBool_FromLong(was);
}

static PyObject *use_allreduce(PyObject *module, PyObject *address) {
    unsigned long long value = PyLong_AsUnsignedLongLong(address);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (!S.ready || !value) {
        PyErr_SetString(PyExc_RuntimeError, "the compiled path is not configured, or no function given");
        return NULL;
    }
    void *was = S.allreduce;
    S.allreduce = (void *)(uintptr_t)value;
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)was);
}

static PyObject *compiled_calls(PyObject *module, PyObject *unused) {
    return PyLong_FromLongLong(S.compiled);
}

/* ---------------------------------------------------------------------------------- the call */

static double monotonic(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int read_handle(PyObject *object, intptr_t *handle) {
    PyObject *value = PyObject_CallOneArg(S.handleof, object);
    if (!value)
        return -1;
    unsigned long long bits = PyLong_AsUnsignedLongLongMask(value);
    Py_DECREF(value);
    if (bits == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *handle = S.handle_size == 8 ? (intptr_t)bits : (intptr_t)(int32_t)(uint32_t)bits;
    return 0;
}

/* The plan's handles, read once (the communicator's again when `comm` changed); 0, or -1 with
 * an exception set, or 1 where the plan cannot take the call (no communicator bound yet). */
static int bound(PlanCore *plan) {
    if (!plan->comm || !plan->buffer || !plan->datatype || !plan->mpi_op ||
        Py_TYPE(plan->buffer) != (PyTypeObject *)S.ndarray)
        return 1;
    if (plan->bound != plan->comm) {
        int live = PyObject_IsTrue(plan->comm); /* MPI.COMM_NULL until bound */
        if (live <= 0)
            return live < 0 ? -1 : 1;
        if (read_handle(plan->comm, &plan->h_comm) < 0)
            return -1;
        Py_INCREF(plan->comm);
        Py_XSETREF(plan->bound, plan->comm);
    }
    if (!plan->handles) {
        Array *buffer = (Array *)plan->buffer;
        if (buffer->nd != 1 || buffer->dimensions[0] != plan->count + 1 || plan->count <= 0)
            return 1;
        if (read_handle(plan->datatype, &plan->h_datatype) < 0 || read_handle(plan->mpi_op, &plan->h_op) < 0)
            return -1;
        plan->itemsize = buffer->strides[0];
        if (plan->itemsize != 1 && plan->itemsize != 2 && plan->itemsize != 4 && plan->itemsize != 8)
            return 1;
        plan->send = PyMem_Malloc((size_t)(plan->count + 1) * (size_t)plan->itemsize);
        if (!plan->send) {
            PyErr_NoMemory();
            return -1;
        }
        plan->handles = 1;
    }
    return 0;
}

static PyObject *settings_value(PyObject *name) {
    PyObject *value = PyDict_GetItemWithError(S.environment, name);
    return value ? value : (PyErr_Occurred() ? NULL : Py_None);
}

/* Whether the memo says this plan is what (x, op, algorithm) takes; 1 yes, 0 no, -1 error. Where
 * the memo holds another call, the lane's cache is asked, as small.allreduce_now asks it. */
static int reaches(PlanCore *plan, PyObject *lane, Array *x, PyObject *op, PyObject *algorithm) {
    int is_auto = algorithm == S.auto_name;
    PyObject *override = Py_None, *tuning = Py_None;
    if (is_auto || algorithm != S.mpi_name) {
        /* `auto` chooses by the settings; any other name is compared as the cache key has it */
        if (!(override = settings_value(S.override_name)) || !(tuning = settings_value(S.tuning_name)))
            return -1;
    }
    if (x->nd <= MOST_DIMS && plan->m_descr == x->descr && plan->m_op == op &&
        plan->m_algorithm == algorithm && plan->m_nd == x->nd && plan->m_override == override &&
        plan->m_tuning == tuning &&
        (x->nd == 0 || memcmp(plan->m_dims, x->dimensions, x->nd * sizeof(Py_ssize_t)) == 0))
        return 1;
    if (x->nd > MOST_DIMS || !PyUnicode_CheckExact(op) || !PyUnicode_CheckExact(algorithm))
        return 0;
    PyObject *lane_small = PyObject_GetAttrString(lane, "small");
    if (!lane_small)
        return -1;
    if (!PyDict_CheckExact(lane_small)) {
        Py_DECREF(lane_small);
        return 0;
    }
    /* the cache's key (small.allreduce_now's): shape, dtype, op, algorithm, override, tuning */
    PyObject *shape = PyTuple_New(x->nd);
    if (!shape) {
        Py_DECREF(lane_small);
        return -1;
    }
    for (int i = 0; i < x->nd; i++) {
        PyObject *dim = PyLong_FromSsize_t(x->dimensions[i]);
        if (!dim) {
            Py_DECREF(shape);
            Py_DECREF(lane_small);
            return -1;
        }
        PyTuple_SET_ITEM(shape, i, dim);
    }
    if (algorithm == S.mpi_name) {  /* the key has the settings, whatever they are */
        if (!(override = settings_value(S.override_name)) || !(tuning = settings_value(S.tuning_name))) {
            Py_DECREF(shape);
            Py_DECREF(lane_small);
            return -1;
        }
    }
    PyObject *key = PyTuple_Pack(6, shape, x->descr, op, algorithm, override, tuning);
    Py_DECREF(shape);
    PyObject *found = key ? PyDict_GetItemWithError(lane_small, key) : NULL;
    Py_XDECREF(key);
    Py_DECREF(lane_small);
    if (!key)
        return -1;
    if (found != (PyObject *)plan)
        return PyErr_Occurred() ? -1 : 0;
    if (algorithm == S.mpi_name)
        override = tuning = Py_None;
    Py_INCREF(x->descr); Py_XSETREF(plan->m_descr, x->descr);
    Py_INCREF(op); Py_XSETREF(plan->m_op, op);
    Py_INCREF(algorithm); Py_XSETREF(plan->m_algorithm, algorithm);
    Py_INCREF(override); Py_XSETREF(plan->m_override, override);
    Py_INCREF(tuning); Py_XSETREF(plan->m_tuning, tuning);
    plan->m_nd = x->nd;
    if (x->nd) /* a 0-d array's dimensions may be NULL */
        memcpy(plan->m_dims, x->dimensions, x->nd * sizeof(Py_ssize_t));
    return 1;
}

/* Whether `code` is of a file whose frames pass calls on (planning.pass_through); -1: error. */
static int passes_on(PyCodeObject *code) {
    if (!S.pass_through || PySet_GET_SIZE(S.pass_through) == 0)
        return 0;
    return PySet_Contains(S.pass_through, code->co_filename);
}

/* The frame above the pass-through frames from `caller` (a new reference, consumed): NULL where
 * there is none, or an error. */
static PyFrameObject *above_pass_through(PyFrameObject *caller) {
    for (;;) {
        PyCodeObject *code = PyFrame_GetCode(caller);
        int passing = passes_on(code);
        Py_DECREF(code);
        if (passing <= 0) {
            if (passing < 0) {
                Py_DECREF(caller);
                return NULL;
            }
            return caller;
        }
        PyFrameObject *up = PyFrame_GetBack(caller);
        Py_DECREF(caller);
        if (!up)
            return NULL;
        caller = up;
    }
}

/* planning.SITES' entry of a frame's instruction: borrowed, NULL if none (or an error). */
static PyObject *known_site(PyCodeObject *code, int lasti) {
    PyObject *key = Py_BuildValue("(nn)", (Py_ssize_t)(uintptr_t)code, (Py_ssize_t)lasti);
    PyObject *found = key ? PyDict_GetItemWithError(S.sites, key) : NULL;
    Py_XDECREF(key);
    return found;
}

/* The call site's (fingerprint, text) from the memo, or from planning.SITES; NULL without an
 * exception where neither knows it yet (then the Python path works it out). Borrowed. A call made
 * through pass-through files (hpcdl.allreduce on a tensor) is keyed by the frame above them, as
 * planning.call_site keys it. */
static PyObject *site_of(PlanCore *plan, long long *fingerprint) {
    if (!S.check_sites) {
        *fingerprint = 0;
        return S.no_site;
    }
    PyFrameObject *frame = PyEval_GetFrame(); /* the public function's: the caller is its caller */
    if (!frame)
        return NULL;
    PyFrameObject *caller = PyFrame_GetBack(frame);
    if (!caller)
        return NULL;
    caller = above_pass_through(caller); /* consumes caller */
    if (!caller)
        return NULL; /* an error, or nothing above them: the Python path decides */
    PyCodeObject *code = PyFrame_GetCode(caller);
    int lasti = PyFrame_GetLasti(caller);
    Py_DECREF(caller);
    PyObject *site = NULL;
    if (plan->m_code == (PyObject *)code && plan->m_lasti == lasti) {
        site = plan->m_site;
        *fingerprint = plan->m_fingerprint;
    } else {
        PyObject *found = known_site(code, lasti);
        if (found && PyTuple_Check(found) && PyTuple_GET_SIZE(found) == 2 &&
            PyTuple_Check(PyTuple_GET_ITEM(found, 0)) && PyTuple_GET_SIZE(PyTuple_GET_ITEM(found, 0)) == 2) {
            site = PyTuple_GET_ITEM(found, 0);
            long long value = PyLong_AsLongLong(PyTuple_GET_ITEM(site, 0));
            if (value == -1 && PyErr_Occurred()) {
                site = NULL;
            } else {
                Py_INCREF(code); Py_XSETREF(plan->m_code, (PyObject *)code);
                Py_INCREF(site); Py_XSETREF(plan->m_site, site);
                plan->m_lasti = lasti;
                *fingerprint = plan->m_fingerprint = value;
                Py_CLEAR(plan->m_last);
            }
        }
    }
    Py_DECREF(code);
    return site;
}

/* The channel of a communicator other than the default (a new reference: the slot that holds it
 * may be given to another communicator while the call runs Python code), from the few remembered, else
 * from channels.channel_of (which raises what the Python path raises); NULL without an exception
 * where the Python path should take the call. A communicator is known by its object and handle:
 * a freed one has another handle (MPI_COMM_NULL), and its channel is marked `freed`. */
static ChannelCore *channel_of(PyObject *comm) {
    void *where = S.comm_handle(comm);
    if (!where) {  /* not a communicator: the Python path says so */
        PyErr_Clear();
        return NULL;
    }
    intptr_t handle = S.handle_size == 8 ? *(intptr_t *)where : (intptr_t)*(int32_t *)where;
    for (int i = 0; i < CHANNELS; i++) {
        if (S.channels[i].comm == comm) {
            ChannelCore *channel = (ChannelCore *)S.channels[i].channel;
            if (S.channels[i].handle == handle && !channel->freed) {
                Py_INCREF(channel);
                return channel;
            }
            Py_CLEAR(S.channels[i].comm);
            Py_CLEAR(S.channels[i].channel);
        }
    }
    PyObject *channel = PyObject_CallOneArg(S.channel_of, comm);
    if (!channel)
        return NULL;
    if (!PyObject_TypeCheck(channel, &ChannelCore_Type) || ((ChannelCore *)channel)->freed) {
        Py_DECREF(channel);
        return NULL;
    }
    int i = S.next_channel;
    S.next_channel = (i + 1) % CHANNELS;
    Py_INCREF(comm);
    Py_XSETREF(S.channels[i].comm, comm);
    Py_INCREF(channel);
    Py_XSETREF(S.channels[i].channel, channel);
    S.channels[i].handle = handle;
    return (ChannelCore *)channel;
}

static PyObject *fall_back(PyObject *const *args) {
    return PyObject_Vectorcall(S.fallback, args, 5, NULL);
}

static PyObject *expected_plan_call(PyObject *channel_object, PyObject *expected, PyObject *const *args);

/* The call on the channel `channel_object` (held by the caller). */
static PyObject *expected_call(PyObject *channel_object, PyObject *const *args) {
    ChannelCore *channel = (ChannelCore *)channel_object;
    if (!channel->busy || Py_TYPE(channel->busy) != &Busy_Type || ((Busy *)channel->busy)->held ||
        channel->blocking == channel->background || !channel->blocking || channel->freed ||
        (channel->last && channel->last != Py_None) || (channel->failure && channel->failure != Py_None) ||
        !channel->expectation || !PyObject_TypeCheck(channel->expectation, &ExpectationCore_Type) ||
        !channel->label || !channel->intruders || !PyList_Check(channel->intruders))
        return fall_back(args);
    ExpectationCore *expectation = (ExpectationCore *)channel->expectation;
    PyObject *expected = expectation->expected;
    if (!expected || !PyTuple_CheckExact(expected) || PyTuple_GET_SIZE(expected) != 2 ||
        !PyObject_TypeCheck(PyTuple_GET_ITEM(expected, 0), &PlanCore_Type) ||
        channel->calls != expectation->number || !expectation->follows || /* the next call's number */
        !PyDict_CheckExact(expectation->follows))
        return fall_back(args);
    Py_INCREF(expected); /* held: compared again, by identity, once the plan and site are found */
    PyObject *result = expected_plan_call(channel_object, expected, args);
    Py_DECREF(expected);
    return result;
}

/* Whether `array` is shaped as the plan's memo says (dtype and dimensions): read again just before
 * the call, since another thread may have resized or reshaped an array meanwhile. */
static int same_shape(PlanCore *plan, Array *array) {
    return array->nd == plan->m_nd && array->descr == plan->m_descr && array->nd <= MOST_DIMS &&
           (array->nd == 0 || memcmp(plan->m_dims, array->dimensions, array->nd * sizeof(Py_ssize_t)) == 0);
}

/* The call on `channel_object` where `expected` (held by the caller) is its expectation's. */
static PyObject *expected_plan_call(PyObject *channel_object, PyObject *expected, PyObject *const *args) {
    PyObject *x_object = args[0], *op = args[2], *algorithm = args[3], *out = args[4];
    Array *x = (Array *)x_object;
    ChannelCore *channel = (ChannelCore *)channel_object;
    ExpectationCore *expectation = (ExpectationCore *)channel->expectation;
    PlanCore *plan = (PlanCore *)PyTuple_GET_ITEM(expected, 0);
    if (!plan->what)
        return fall_back(args);
    int found = reaches(plan, channel->blocking, x, op, algorithm);
    if (found <= 0)
        return found < 0 ? NULL : fall_back(args);
    long long fingerprint;
    PyObject *site = site_of(plan, &fingerprint);
    if (!site)
        return PyErr_Occurred() ? NULL : fall_back(args);
    long long wanted = PyLong_AsLongLong(PyTuple_GET_ITEM(expected, 1));
    if (wanted == -1 && PyErr_Occurred())
        return NULL;
    if (wanted != fingerprint)
        return fall_back(args);
    int ok = bound(plan);
    if (ok != 0)
        return ok < 0 ? NULL : fall_back(args);
    RecorderCore *recorder = (RecorderCore *)S.recorder;
    if (recorder->capacity && (!recorder->ring || !PyList_CheckExact(recorder->ring) ||
                               PyList_GET_SIZE(recorder->ring) != recorder->capacity))
        return fall_back(args);

    /* Everything that may run Python code (an allocation may start the garbage collector, and so
     * other threads) is done before the channel's state is read again: the record, and for
     * out=None the result array (private to this call, so its size cannot change under it). */
    long long number = channel->calls + 1;
    unsigned long issuer = PyThread_get_thread_ident();
    PyObject *record = NULL, *fresh = NULL;
    if (recorder->capacity) { /* made before anything changes: a failure here changes nothing */
        PyObject *fields[8] = {channel->label, PyLong_FromLongLong(number), plan->what,
                               PyTuple_GET_ITEM(site, 1), Py_None, PyLong_FromUnsignedLong(issuer),
                               PyFloat_FromDouble(monotonic()), PyFloat_FromDouble(0.0)};
        record = PyList_New(8);
        if (!record || !fields[1] || !fields[5] || !fields[6] || !fields[7]) {
            Py_XDECREF(record); Py_XDECREF(fields[1]); Py_XDECREF(fields[5]);
            Py_XDECREF(fields[6]); Py_XDECREF(fields[7]);
            return NULL;
        }
        for (int i = 0; i < 8; i++) {
            if (i != 1 && i < 5)
                Py_INCREF(fields[i]);
            PyList_SET_ITEM(record, i, fields[i]);
        }
    }
    int finishing = plan->finish && plan->finish != Py_None;
    if (out == Py_None && !finishing) {
        fresh = PyObject_CallMethodNoArgs(x_object, S.copy_name);
        if (!fresh) {
            Py_XDECREF(record);
            return NULL;
        }
    }
    /* The lookups above may have run Python code (where the memos missed), and so other threads:
     * the channel's state, and the arrays' shapes (another thread may resize or reshape them), are
     * read again, just before the call is taken; nothing between here and taking the flag can run
     * Python code. */
    Array *o = (Array *)out, *f = (Array *)fresh;
    if (((Busy *)channel->busy)->held || (channel->last && channel->last != Py_None) ||
        (channel->failure && channel->failure != Py_None) || channel->freed ||
        (PyObject *)expectation != channel->expectation || expectation->expected != expected ||
        channel->calls != expectation->number || channel->calls + 1 != number ||
        Py_TYPE(channel->busy) != &Busy_Type || !PyList_Check(channel->intruders) ||
        !same_shape(plan, x) || !(x->flags & C_CONTIGUOUS) ||
        (fresh && (Py_TYPE(fresh) != (PyTypeObject *)S.ndarray || !same_shape(plan, f))) ||
        (out != Py_None && out != x_object && (!same_shape(plan, o) || (o->flags & CARRAY) != CARRAY)) ||
        (out == x_object && (x->flags & CARRAY) != CARRAY)) {
        Py_XDECREF(record);
        Py_XDECREF(fresh);
        return fall_back(args);
    }

    /* The call is the expected one: from here on it is this rank's call `number`. */
    PyObject *flag = Py_NewRef(channel->busy);
    ((Busy *)flag)->held = 1; /* `Channel.enter` */
    channel->issuer = issuer;
    channel->calls = number;
    if (record) { /* `Recorder.enter` */
        PyObject **slot = &((PyListObject *)recorder->ring)->ob_item[recorder->count % recorder->capacity];
        Py_INCREF(record);
        Py_XSETREF(*slot, record);
        recorder->count += 1;
    }
    Py_INCREF(plan); /* with its buffers, alive until the library call is over on every path */
    PyObject *buffer = Py_NewRef(plan->buffer);
    Py_INCREF(expected);
    Py_INCREF(site);
    Py_SETREF(expectation->expected, Py_NewRef(Py_None));
    Py_DECREF(expected);

    Py_ssize_t count = plan->count, itemsize = plan->itemsize, nbytes = count * itemsize;
    char *send = plan->send, *receive = ((Array *)buffer)->data;
    memcpy(send, x->data, (size_t)nbytes);
    unsigned long long agreeing = plan->agreeing, got = 0;
    switch (itemsize) {
    case 1: { uint8_t v = (uint8_t)agreeing; memcpy(send + nbytes, &v, 1); break; }
    case 2: { uint16_t v = (uint16_t)agreeing; memcpy(send + nbytes, &v, 2); break; }
    case 4: { uint32_t v = (uint32_t)agreeing; memcpy(send + nbytes, &v, 4); break; }
    default: { uint64_t v = (uint64_t)agreeing; memcpy(send + nbytes, &v, 8); break; }
    }
    /* read while the GIL is held: no other thread may change them during the call */
    void *function = S.allreduce;
    int handle_size = S.handle_size, elements = (int)count + 1;
    intptr_t h_datatype = plan->h_datatype, h_op = plan->h_op, h_comm = plan->h_comm;
    int error;
    Py_BEGIN_ALLOW_THREADS
    if (handle_size == 8)
        error = ((Allreduce8)function)(send, receive, elements, (void *)h_datatype, (void *)h_op,
                                       (void *)h_comm);
    else
        error = ((Allreduce4)function)(send, receive, elements, (int32_t)h_datatype, (int32_t)h_op,
                                       (int32_t)h_comm);
    Py_END_ALLOW_THREADS
    PyObject *result = NULL;
    if (error == 0) {
        switch (itemsize) {
        case 1: { uint8_t v; memcpy(&v, receive + nbytes, 1); got = v; break; }
        case 2: { uint16_t v; memcpy(&v, receive + nbytes, 2); got = v; break; }
        case 4: { uint32_t v; memcpy(&v, receive + nbytes, 4); got = v; break; }
        default: { uint64_t v; memcpy(&v, receive + nbytes, 8); got = v; break; }
        }
    }
    if (error != 0 || got != agreeing) {
        /* some rank declined, or MPI failed: small.settle ends the call as the Python path would */
        PyObject *rest[8] = {channel_object, (PyObject *)plan, PyLong_FromLongLong(number), site, x_object, out,
                             record ? record : Py_None, PyLong_FromLong(error)};
        if (rest[2] && rest[7])
            result = PyObject_Vectorcall(S.settle, rest, 8, NULL);
        Py_XDECREF(rest[2]);
        Py_XDECREF(rest[7]);
        /* Where settle did not get to leave the call (no memory to call it, a RecursionError on
         * entering it, its `finally` failing before the flag was given back), the call is still
         * this one's: it is left here, as that `finally` would. */
        if (!result && ((Busy *)flag)->held && channel->calls == number && channel->issuer == issuer)
            goto leave;
        goto done;
    }
    /* `Expectation.confirmed`: (ident, call site), remade where the memo's is another site's */
    long long fingerprint_now = PyLong_AsLongLong(PyTuple_GET_ITEM(site, 0));
    if (fingerprint_now == -1 && PyErr_Occurred())
        goto leave;
    PyObject *last = plan->m_last;
    if (last) {
        long long was = PyLong_AsLongLong(PyTuple_GET_ITEM(last, 1));
        if (was == -1 && PyErr_Occurred())
            PyErr_Clear();
        if (was != fingerprint_now || PyTuple_GET_ITEM(last, 0) != plan->ident)
            last = NULL;
    }
    if (!last) {
        last = PyTuple_Pack(2, plan->ident, PyTuple_GET_ITEM(site, 0));
        if (!last)
            goto leave;
        Py_XSETREF(plan->m_last, last);
    }
    Py_INCREF(last);
    Py_SETREF(expectation->last, last);
    expectation->number = number;
    PyObject *next = PyDict_GetItemWithError(expectation->follows, last);
    if (!next && PyErr_Occurred())
        goto leave;
    Py_SETREF(expectation->expected, Py_NewRef(next ? next : Py_None));
    /* the result: `LibraryPlan.finished` */
    if (finishing) {
        result = PyObject_CallFunctionObjArgs(S.finished, (PyObject *)plan, x_object, out, NULL);
    } else if (out == Py_None) {
        memcpy(f->data, receive, (size_t)nbytes); /* `fresh`: this call's own, of nbytes */
        result = Py_NewRef(fresh);
    } else if (same_shape(plan, o) && (o->flags & CARRAY) == CARRAY) {
        memcpy(o->data, receive, (size_t)nbytes);
        result = Py_NewRef(out);
    } else { /* `out` changed during the call (another thread): np.copyto says what happens */
        result = PyObject_CallFunctionObjArgs(S.finished, (PyObject *)plan, x_object, out, NULL);
    }
    if (result) {
        channel->completed = number;
        S.compiled += 1;
    }
leave: /* the finally: left, the flag given back, intruders reported */
    if (record) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback); /* kept across the float's allocation */
        PyObject *left = PyFloat_FromDouble(monotonic());
        if (left) {
            PyList_SetItem(record, 7, left);
            PyErr_Restore(type, value, traceback);
        } else {
            Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(traceback);
            Py_CLEAR(result);
        }
    }
    ((Busy *)flag)->held = 0;
    if (PyList_Check(channel->intruders) && PyList_GET_SIZE(channel->intruders)) {
        /* raises, in place of any error the call raised */
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(traceback);
        PyObject *raised = PyObject_CallMethodNoArgs(channel_object, S.intruded_name);
        Py_XDECREF(raised);
        Py_CLEAR(result);
    }
done:
    Py_DECREF(flag);
    Py_XDECREF(fresh);
    Py_XDECREF(record);
    Py_DECREF(site);
    Py_DECREF(buffer);
    Py_DECREF(plan);
    return result;
}

/* allreduce_now(x, comm, op, algorithm, out): small.allreduce_now, the expected call compiled. */
static PyObject *allreduce_now(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "allreduce_now takes (x, comm, op, algorithm, out)");
        return NULL;
    }
    if (!S.ready || !S.enabled)
        return fall_back(args);
    PyObject *x_object = args[0], *comm = args[1], *out = args[4];
    if (Py_TYPE(x_object) != (PyTypeObject *)S.ndarray)
        return fall_back(args);
    Array *x = (Array *)x_object;
    /* `out`: None, x itself, or an array like x (small.suits), else the Python path decides */
    if (out == Py_None) {
        if (!(x->flags & C_CONTIGUOUS))
            return fall_back(args);
    } else if (out == x_object) {
        if ((x->flags & CARRAY) != CARRAY)
            return fall_back(args);
    } else {
        Array *o = (Array *)out;
        if (Py_TYPE(out) != (PyTypeObject *)S.ndarray || !(x->flags & C_CONTIGUOUS) ||
            (o->flags & CARRAY) != CARRAY || o->nd != x->nd || o->descr != x->descr ||
            (x->nd && memcmp(o->dimensions, x->dimensions, x->nd * sizeof(Py_ssize_t)) != 0))
            return fall_back(args);
    }
    /* the channel: COMM_WORLD's as small.allreduce_now reads it, or another communicator's */
    int finalized = 0;
    if (S.finalized(&finalized) != 0 || finalized)
        return fall_back(args);
    PyObject *channel_object;
    if (comm == Py_None) {
        channel_object = PyDict_GetItemWithError(S.channels_module, S.world_name); /* channels.world */
        if (!channel_object || !PyObject_TypeCheck(channel_object, &ChannelCore_Type))
            return PyErr_Occurred() ? NULL : fall_back(args);
        Py_INCREF(channel_object); /* alive until the call is over, whatever the others do meanwhile */
    } else { /* owned, as the world's above */
        channel_object = (PyObject *)channel_of(comm);
        if (!channel_object)
            return PyErr_Occurred() ? NULL : fall_back(args);
    }
    PyObject *result = expected_call(channel_object, args);
    Py_DECREF(channel_object);
    return result;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "configure(...): what the compiled path reads (small.py calls it once)"},
    {"allreduce_now", (PyCFunction)(void (*)(void))allreduce_now, METH_FASTCALL,
     "allreduce_now(x, comm, op, algorithm, out): small.allreduce_now, the expected call compiled"},
    {"enable", enable, METH_O, "enable(flag): take the compiled path or not; whether it was taken"},
    {"compiled_calls", compiled_calls, METH_NOARGS, "calls completed on the compiled path so far"},
    {"use_allreduce", use_allreduce, METH_O,
     "use_allreduce(address): call this function as MPI_Allreduce from now on; the one before (tests)"},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "collectives._hot",
                                        "The expected call compiled (collectives/hot.py).", -1, methods};

PyMODINIT_FUNC PyInit__hot(void) {
    PyTypeObject *types[] = {&Busy_Type, &ChannelCore_Type, &ExpectationCore_Type, &PlanCore_Type,
                             &RecorderCore_Type};
    const char *names[] = {"Busy", "ChannelCore", "ExpectationCore", "PlanCore", "RecorderCore"};
    PyObject *module = PyModule_Create(&module_def);
    if (!module)
        return NULL;
    for (int i = 0; i < 5; i++) {
        if (PyType_Ready(types[i]) < 0 || PyModule_AddObjectRef(module, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(module);
            return NULL;
        }
    }
    return module;
}
