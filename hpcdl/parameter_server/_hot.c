/* The parameter server's common exchange compiled (hpcdl/parameter_server/hot.py says what it is
 * for, benchmarks/results/strategies/ps-compiled-2026-11-30.txt what it costs).
 *
 * WorkerCore and ServerCore are the bases of worker.WorkerClient and server.Server: their fields
 * (the counters, the header bookkeeping) are read and written by both paths. Each has one method
 * that runs the common case without Python:
 *
 * - WorkerCore._fast_pull / _fast_push: a pull that fetches every shard (or a skipped fetch without
 *   `until`), a push of the parameters' `.grad` sent at once (n_push 1); the messages posted as
 *   worker._exchange posts them, spun on for polling.SPIN_S, the pulled pieces copied into the
 *   parameters (their version counters bumped, as torch's copy_ bumps them). A wait that outlasts
 *   the spin, or an MPI error, is handed back with the requests (and the Python code waits, or
 *   keeps them in flight and raises, as it does for its own); anything else unusual (closed,
 *   slowdown, accumulation, a gradient of another shape, dtype, layout or device, a parameter whose
 *   storage moved) returns None before anything is done, and the Python path takes the call.
 * - ServerCore._serve_fast: server.serve's loop for PUSH and PULL messages that the Python code
 *   would handle straight (async and ssp pushes applied at once by plain SGD on float32 runs, the
 *   pulls of `async`, no events recorded, no learning-rate schedule), until no message comes within
 *   the spin; any other message (another tag, size or sender, a push the model queues, a pull it
 *   may defer, a version from the future) is handed to Python's `_handle` unreceived, with the
 *   caller's Status filled in as Improbe fills it.
 *
 * MPI is reached without its header: the functions are the library's that mpi4py loaded (their
 * addresses from hot.configure), handles are pointer-sized (Open MPI; elsewhere hot.configure
 * leaves the compiled path off), MPI_Status's source and tag offsets are found by hot.configure
 * from a Status it filled, and requests and messages handed to Python become mpi4py objects
 * through mpi4py's C API.
 *
 * The SGD step must give torch's bits: hot.configure checks this module's step (fused
 * multiply-add, or multiply then add) against torch's `add_(g, alpha=-lr)` on probe data and
 * turns the compiled push handling off where neither matches.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if PY_VERSION_HEX < 0x030A0000 || defined(Py_GIL_DISABLED)
#error "the compiled parameter server needs CPython 3.10 or later with the GIL (hot.py falls back to Python)"
#endif

typedef void *Handle;
typedef int (*Irecv_f)(void *, int, Handle, int, int, Handle, Handle *);
typedef int (*Isend_f)(const void *, int, Handle, int, int, Handle, Handle *);
typedef int (*Testall_f)(int, Handle *, int *, void *);
typedef int (*Test_f)(Handle *, int *, void *);
typedef int (*Improbe_f)(int, int, Handle, int *, Handle *, void *);
typedef int (*Mrecv_f)(void *, int, Handle, Handle *, void *);
typedef int (*Get_count_f)(const void *, Handle, int *);
typedef PyObject *(*NewHandle_f)(Handle);
typedef Handle *(*GetHandle_f)(PyObject *);
typedef void *(*GetStatus_f)(PyObject *);

#define HEADER_FIELDS 4
#define HEADER_BYTES (HEADER_FIELDS * 8)
#define HISTOGRAM_BINS 64
/* protocol.py's tags and header fields */
enum { PULL = 11, PARAMS = 12, PUSH = 13 };
enum { CLOCK = 0, UNTIL = 1, VERSION = 0, PROGRESS = 1, STOP = 2, PUSH_CLOCK = 1, PUSH_STEPS = 2 };
#define MOST_STATUS 64

static struct {
    int ready;
    Irecv_f irecv;
    Isend_f isend;
    Testall_f testall;
    Test_f test;
    Improbe_f improbe;
    Mrecv_f mrecv;
    Get_count_f get_count;
    NewHandle_f new_request, new_message;
    GetHandle_f get_comm;
    GetStatus_f get_status;
    Handle byte, request_null;
    int any_source, any_tag, status_size, source_at, tag_at;
    int sgd; /* 0: no compiled step; 1: fused multiply-add; 2: multiply, then add */
    double spin_s;
    PyObject *exception;    /* MPI.Exception */
    PyObject *bump;         /* torch._C._increment_version, on a list of tensors */
    PyObject *tensor_type;  /* torch.Tensor */
    PyObject *strided, *int64_descr;
    PyTypeObject *ndarray;
    long long compiled;     /* messages handled and calls completed on the compiled path (tests) */
} S;

static PyObject *N_grad, *N_dtype, *N_shape, *N_layout, *N_is_cpu, *N_is_contiguous, *N_data_ptr,
    *N_param_groups, *N_lr, *N_momentum, *N_weight_decay, *N_maximize, *N_histogram, *N_count,
    *N_total, *N_max, *N_finish_sends, *N_hold_reply, *N_send_failed, *N_answer_deferred;

/* NumPy's array struct (the ABI every compiled NumPy extension reads), without NumPy's headers. */
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
#define CARRAY (0x0001 | 0x0100 | 0x0400) /* C-contiguous, aligned, writeable */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* An ndarray of `n` int64, contiguous and writeable (a versions array); its data or NULL. */
static int64_t *int64s(PyObject *object, Py_ssize_t n) {
    if (!object || Py_TYPE(object) != S.ndarray)
        return NULL;
    Array *a = (Array *)object;
    if (a->descr != S.int64_descr || a->nd != 1 || a->dimensions[0] != n || (a->flags & CARRAY) != CARRAY)
        return NULL;
    return (int64_t *)a->data;
}

static PyObject *mpi_error(int code) {
    PyObject *exc = PyObject_CallFunction(S.exception, "i", code);
    if (exc) {
        PyErr_SetObject(S.exception, exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/* Requests handed to Python: a list of mpi4py Requests over `handles` (the null ones included). */
static PyObject *requests_of(Handle *handles, int n) {
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        PyObject *r = S.new_request(handles[i]);
        if (!r) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, r);
    }
    return list;
}

/* (requests, code): a wait for Python (code 0) or an MPI error `code` with what was posted. */
static PyObject *hand_back(Handle *handles, int n, int code) {
    PyObject *requests = requests_of(handles, n);
    if (!requests)
        return NULL;
    return Py_BuildValue("(Ni)", requests, code);
}

/* Post nothing more; spin on Testall for SPIN_S with the GIL released: 1 done, 0 not yet, -code. */
static int spin_testall(Handle *handles, int n, char *statuses) {
    int flag = 0, code = 0;
    Py_BEGIN_ALLOW_THREADS
    double until = now() + S.spin_s;
    for (;;) {
        code = S.testall(n, handles, &flag, statuses);
        if (code || flag || now() > until)
            break;
    }
    Py_END_ALLOW_THREADS
    return code ? -code : flag;
}

/* ============================================================================ the worker */

typedef struct {
    int param, server;
    Py_ssize_t at_param, at_message, nbytes; /* bytes: into the parameter, into the message */
} Piece;

typedef struct {
    PyObject_HEAD
    long long clock, progress, stop_signal, bytes_sent, bytes_received, accumulated, n_fetch, n_push;
    double slowdown;
    char must_pull, pulled_since_push, closed;
    PyObject *since_fetch, *versions, *push_versions;
    /* the compiled plan (`_bind`); `plan` holds every object whose memory it points into */
    PyObject *plan, *params, *dtypes, *shapes;
    Handle comm;
    int servers, nparams, npieces;
    int *ranks;
    char *request, **pulled, **pushed, **targets;
    Py_ssize_t pulled_bytes, pushed_bytes, *pulled_n, *pushed_n;
    Piece *pieces;
    Handle *handles;
    char *statuses;
} WorkerCore;

static void worker_unbind(WorkerCore *self);
static PyObject *Worker_unbind(WorkerCore *self, PyObject *unused) {
    worker_unbind(self);
    Py_RETURN_NONE;
}
static void worker_unbind(WorkerCore *self) {
    Py_CLEAR(self->plan); Py_CLEAR(self->params); Py_CLEAR(self->dtypes); Py_CLEAR(self->shapes);
    PyMem_Free(self->ranks); PyMem_Free(self->pulled); PyMem_Free(self->pushed);
    PyMem_Free(self->pulled_n); PyMem_Free(self->pushed_n); PyMem_Free(self->pieces);
    PyMem_Free(self->handles); PyMem_Free(self->statuses); PyMem_Free(self->targets);
    self->targets = NULL;
    self->ranks = NULL; self->pulled = self->pushed = NULL; self->pulled_n = self->pushed_n = NULL;
    self->pieces = NULL; self->handles = NULL; self->statuses = NULL;
    self->servers = self->npieces = self->nparams = 0;
}

static int WorkerCore_traverse(WorkerCore *self, visitproc visit, void *arg) {
    Py_VISIT(self->since_fetch); Py_VISIT(self->versions); Py_VISIT(self->push_versions);
    Py_VISIT(self->plan); Py_VISIT(self->params); Py_VISIT(self->dtypes); Py_VISIT(self->shapes);
    return 0;
}
static int WorkerCore_clear(WorkerCore *self) {
    Py_CLEAR(self->since_fetch); Py_CLEAR(self->versions); Py_CLEAR(self->push_versions);
    worker_unbind(self);
    return 0;
}
static void WorkerCore_dealloc(WorkerCore *self) {
    PyObject_GC_UnTrack(self);
    WorkerCore_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The data of a uint8 ndarray (a message buffer) of at least `n` bytes, or NULL. */
static char *bytes_of(PyObject *object, Py_ssize_t *n) {
    Array *a = (Array *)object;
    if (Py_TYPE(object) != S.ndarray)
        return NULL;
    if (a->nd != 1 || (a->flags & CARRAY) != CARRAY || a->strides[0] != 1)
        return NULL;
    *n = a->dimensions[0];
    return a->data;
}

/* _bind(comm, servers, request, pulled, pushed, pieces, params, dtypes, shapes): the plan. `pieces`
 * are (param, server, byte offset in the parameter, byte offset in the server's message, bytes). */
static PyObject *Worker_bind(WorkerCore *self, PyObject *args) {
    PyObject *comm, *servers, *request, *pulled, *pushed, *pieces, *params, *dtypes, *shapes;
    if (!PyArg_ParseTuple(args, "OO!OO!O!O!O!O!O!", &comm, &PyList_Type, &servers, &request, &PyList_Type,
                          &pulled, &PyList_Type, &pushed, &PyList_Type, &pieces, &PyTuple_Type, &params,
                          &PyTuple_Type, &dtypes, &PyTuple_Type, &shapes))
        return NULL;
    if (!S.ready) {
        PyErr_SetString(PyExc_RuntimeError, "the compiled parameter server is not configured");
        return NULL;
    }
    worker_unbind(self);
    int n = (int)PyList_GET_SIZE(servers), np = (int)PyList_GET_SIZE(pieces);
    if (PyList_GET_SIZE(pulled) != n || PyList_GET_SIZE(pushed) != n) {
        PyErr_SetString(PyExc_ValueError, "one pulled and one pushed buffer per server");
        return NULL;
    }
    self->ranks = PyMem_Calloc(n ? n : 1, sizeof(int));
    self->pulled = PyMem_Calloc(n ? n : 1, sizeof(char *));
    self->pushed = PyMem_Calloc(n ? n : 1, sizeof(char *));
    self->pulled_n = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    self->pushed_n = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    self->pieces = PyMem_Calloc(np ? np : 1, sizeof(Piece));
    self->handles = PyMem_Calloc(2 * n + 1, sizeof(Handle));
    self->statuses = PyMem_Calloc(2 * n + 1, (size_t)S.status_size);
    self->targets = PyMem_Calloc(PyTuple_GET_SIZE(params) + 1, sizeof(char *));
    if (!self->targets || !self->ranks || !self->pulled || !self->pushed || !self->pulled_n || !self->pushed_n ||
        !self->pieces || !self->handles || !self->statuses) {
        worker_unbind(self);
        return PyErr_NoMemory();
    }
    Handle *h = S.get_comm(comm);
    if (!h)
        goto fail;
    self->comm = *h;
    Py_ssize_t n_request;
    self->request = bytes_of(request, &n_request);
    if (!self->request || n_request != HEADER_BYTES)
        goto bad;
    self->pulled_bytes = self->pushed_bytes = 0;
    for (int k = 0; k < n; k++) {
        self->ranks[k] = (int)PyLong_AsLong(PyList_GET_ITEM(servers, k));
        if (PyErr_Occurred())
            goto fail;
        self->pulled[k] = bytes_of(PyList_GET_ITEM(pulled, k), &self->pulled_n[k]);
        self->pushed[k] = bytes_of(PyList_GET_ITEM(pushed, k), &self->pushed_n[k]);
        if (!self->pulled[k] || !self->pushed[k] || self->pulled_n[k] > INT_MAX ||
            self->pushed_n[k] > INT_MAX || self->pulled_n[k] < HEADER_BYTES || self->pushed_n[k] < HEADER_BYTES)
            goto bad;
        self->pulled_bytes += self->pulled_n[k];
        self->pushed_bytes += self->pushed_n[k];
    }
    for (int i = 0; i < np; i++) {
        Piece *p = &self->pieces[i];
        if (!PyArg_ParseTuple(PyList_GET_ITEM(pieces, i), "iinnn", &p->param, &p->server, &p->at_param,
                              &p->at_message, &p->nbytes))
            goto fail;
        if (p->server < 0 || p->server >= n || p->param < 0 || p->param >= PyTuple_GET_SIZE(params) ||
            p->at_message < HEADER_BYTES || p->at_message + p->nbytes > self->pulled_n[p->server])
            goto bad;
    }
    /* the lists are the caller's: keep copies, so that a later change of them is no change here */
    self->plan = (Py_BuildValue("(OONN)", comm, request, PyList_GetSlice(pulled, 0, n),
                                        PyList_GetSlice(pushed, 0, n)));
    if (!self->plan)
        goto fail;
    self->params = Py_NewRef(params);
    self->dtypes = Py_NewRef(dtypes);
    self->shapes = Py_NewRef(shapes);
    self->servers = n;
    self->npieces = np;
    self->nparams = (int)PyTuple_GET_SIZE(params);
    Py_RETURN_NONE;
bad:
    PyErr_SetString(PyExc_ValueError, "the compiled parameter server cannot take these buffers");
fail:
    worker_unbind(self);
    return NULL;
}

/* The parameters' data pointers as `_bind` saw them: whether they still are (-1: an error). */
static int params_unmoved(WorkerCore *self, PyObject *expected) {
    for (int i = 0; i < self->nparams; i++) {
        PyObject *ptr = PyObject_CallMethodNoArgs(PyTuple_GET_ITEM(self->params, i), N_data_ptr);
        if (!ptr)
            return -1;
        int same = PyObject_RichCompareBool(ptr, PyTuple_GET_ITEM(expected, i), Py_EQ);
        if (same > 0)
            self->targets[i] = (char *)PyLong_AsVoidPtr(ptr);
        Py_DECREF(ptr);
        if (same <= 0 || PyErr_Occurred())
            return PyErr_Occurred() ? -1 : same;
    }
    return 1;
}

/* After a pull's messages arrived: the headers' fields, the copies into the parameters. */
static int worker_after_pull(WorkerCore *self) {
    int64_t *versions = int64s(self->versions, self->servers);
    long long least = 0, stop = 0;
    for (int k = 0; k < self->servers; k++) {
        const int64_t *head = (const int64_t *)self->pulled[k];
        versions[k] = head[VERSION];
        if (k == 0 || head[PROGRESS] < least)
            least = head[PROGRESS];
        if (k == 0 || head[STOP] > stop)
            stop = head[STOP];
    }
    self->progress = least;
    if (!self->stop_signal)
        self->stop_signal = stop;
    for (int i = 0; i < self->npieces; i++) {
        Piece *p = &self->pieces[i];
        if (p->nbytes)
            memcpy(self->targets[p->param] + p->at_param, self->pulled[p->server] + p->at_message,
                   (size_t)p->nbytes);
    }
    /* as torch's in-place copy_ does: autograd then refuses a backward over the old values */
    PyObject *bumped = PyObject_CallOneArg(S.bump, self->params);
    if (!bumped)
        return -1;
    Py_DECREF(bumped);
    self->bytes_sent += (long long)HEADER_BYTES * self->servers;
    self->bytes_received += self->pulled_bytes;
    Py_SETREF(self->since_fetch, PyLong_FromLong(0));
    self->pulled_since_push = 1;
    S.compiled++;
    return 0;
}

/* _fast_pull(until, pointers): the progress (an int) where the compiled path did the whole pull;
 * (requests, code) where Python must wait (code 0) or raise MPI error `code`, the requests posted;
 * None where it did nothing (the Python path takes the call). `pointers`: the parameters' data
 * pointers the plan was made for. */
static PyObject *Worker_fast_pull(WorkerCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyTuple_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "_fast_pull(until, pointers)");
        return NULL;
    }
    long long until = PyLong_AsLongLong(args[0]);
    if (until == -1 && PyErr_Occurred())
        return NULL;
    if (!self->plan || self->closed || self->slowdown > 1 || PyTuple_GET_SIZE(args[1]) != self->nparams)
        Py_RETURN_NONE;
    PyObject *since = self->since_fetch;
    int fetch = since == Py_None;
    if (!fetch) {
        if (!since || !PyLong_CheckExact(since))
            Py_RETURN_NONE;
        long long value = PyLong_AsLongLong(since);
        if (value == -1 && PyErr_Occurred())
            return NULL;
        fetch = value >= self->n_fetch;
    }
    if (!fetch) {
        if (until)
            Py_RETURN_NONE; /* the progress is asked for: Python's */
        self->pulled_since_push = 1;
        return PyLong_FromLongLong(self->progress);
    }
    if (!int64s(self->versions, self->servers))
        Py_RETURN_NONE;
    int unmoved = params_unmoved(self, args[1]);
    if (unmoved <= 0)
        return unmoved < 0 ? NULL : Py_NewRef(Py_None);
    int64_t *fields = (int64_t *)self->request;
    fields[CLOCK] = self->clock;
    fields[UNTIL] = until;
    int n = self->servers, posted = 0, code = 0;
    for (int k = 0; k < n && !code; k++) {
        code = S.irecv(self->pulled[k], (int)self->pulled_n[k], S.byte, self->ranks[k], PARAMS, self->comm,
                       &self->handles[posted]);
        if (!code)
            posted++;
    }
    for (int k = 0; k < n && !code; k++) {
        code = S.isend(self->request, HEADER_BYTES, S.byte, self->ranks[k], PULL, self->comm,
                       &self->handles[posted]);
        if (!code)
            posted++;
    }
    if (code)
        return hand_back(self->handles, posted, code);
    int done = spin_testall(self->handles, posted, self->statuses);
    if (done <= 0)
        return hand_back(self->handles, posted, -done);
    if (worker_after_pull(self) < 0)
        return NULL;
    return PyLong_FromLongLong(self->progress);
}

/* _finish_pull(): the rest of a pull whose messages Python waited for. */
static PyObject *Worker_finish_pull(WorkerCore *self, PyObject *unused) {
    if (!self->plan || !int64s(self->versions, self->servers)) {
        PyErr_SetString(PyExc_RuntimeError, "the compiled pull lost its plan");
        return NULL;
    }
    if (worker_after_pull(self) < 0)
        return NULL;
    return PyLong_FromLongLong(self->progress);
}

/* p.grad of each parameter, checked as push() checks it and more (a plain strided CPU tensor,
 * contiguous): its data pointer into `data` (NULL for None); 1 all usable, 0 not, -1 error. */
static int gradients(WorkerCore *self, char **data) {
    for (int i = 0; i < self->nparams; i++) {
        PyObject *grad = PyObject_GetAttr(PyTuple_GET_ITEM(self->params, i), N_grad);
        if (!grad)
            return -1;
        data[i] = NULL;
        if (grad == Py_None) {
            Py_DECREF(grad);
            continue;
        }
        int ok = Py_TYPE(grad) == (PyTypeObject *)S.tensor_type;
        PyObject *value = NULL;
#define CHECK(expr)                                                            \
        if (ok) {                                                              \
            value = (expr);                                                    \
            if (!value) {                                                      \
                Py_DECREF(grad);                                               \
                return -1;                                                     \
            }
#define END Py_DECREF(value); }
        CHECK(PyObject_GetAttr(grad, N_dtype)) ok = value == PyTuple_GET_ITEM(self->dtypes, i); END
        CHECK(PyObject_GetAttr(grad, N_layout)) ok = value == S.strided; END
        CHECK(PyObject_GetAttr(grad, N_shape))
            ok = PyObject_RichCompareBool(value, PyTuple_GET_ITEM(self->shapes, i), Py_EQ);
            if (ok < 0) {
                Py_DECREF(value);
                Py_DECREF(grad);
                return -1;
            }
        END
        CHECK(PyObject_GetAttr(grad, N_is_cpu)) ok = value == Py_True; END
        CHECK(PyObject_CallMethodNoArgs(grad, N_is_contiguous)) ok = value == Py_True; END
        CHECK(PyObject_CallMethodNoArgs(grad, N_data_ptr)) data[i] = (char *)PyLong_AsVoidPtr(value); END
#undef CHECK
#undef END
        Py_DECREF(grad);
        if (ok < 0 || PyErr_Occurred())
            return -1;
        if (!ok)
            return 0;
    }
    return 1;
}

/* _fast_push(): True where the compiled path sent the push; (requests, code) as for _fast_pull,
 * the push's bookkeeping done (Python then waits, counts its bytes and clears the accumulation);
 * None where it did nothing. */
static PyObject *Worker_fast_push(WorkerCore *self, PyObject *unused) {
    if (!self->plan || self->closed || self->slowdown > 1 || self->accumulated != 0 || self->n_push != 1 ||
        (self->must_pull && !self->pulled_since_push))
        Py_RETURN_NONE;
    int64_t *versions = int64s(self->versions, self->servers);
    int64_t *push_versions = int64s(self->push_versions, self->servers);
    PyObject *since = self->since_fetch;
    if (!versions || !push_versions || !since || (since != Py_None && !PyLong_CheckExact(since)))
        Py_RETURN_NONE;
    char *stack[16], **data = self->nparams <= 16 ? stack : PyMem_Malloc(sizeof(char *) * self->nparams);
    if (!data)
        return PyErr_NoMemory();
    int usable = gradients(self, data);
    if (usable <= 0) {
        if (data != stack)
            PyMem_Free(data);
        return usable < 0 ? NULL : Py_NewRef(Py_None);
    }
    long long before = since == Py_None ? 0 : PyLong_AsLongLong(since);
    if (before == -1 && PyErr_Occurred()) {
        if (data != stack)
            PyMem_Free(data);
        return NULL;
    }
    PyObject *after = PyLong_FromLongLong(before + 1);
    if (!after) {
        if (data != stack)
            PyMem_Free(data);
        return NULL;
    }
    memcpy(push_versions, versions, sizeof(int64_t) * (size_t)self->servers);
    for (int i = 0; i < self->npieces; i++) {
        Piece *p = &self->pieces[i];
        char *into = self->pushed[p->server] + p->at_message;
        if (data[p->param])
            memcpy(into, data[p->param] + p->at_param, (size_t)p->nbytes);
        else
            memset(into, 0, (size_t)p->nbytes);
    }
    if (data != stack)
        PyMem_Free(data);
    self->accumulated = 1;
    self->clock += 1;
    Py_SETREF(self->since_fetch, after);
    self->pulled_since_push = 0;
    int n = self->servers, posted = 0, code = 0;
    for (int k = 0; k < n; k++) {
        int64_t *fields = (int64_t *)self->pushed[k];
        fields[VERSION] = push_versions[k];
        fields[PUSH_CLOCK] = self->clock;
        fields[PUSH_STEPS] = self->accumulated;
    }
    for (int k = 0; k < n && !code; k++) {
        code = S.isend(self->pushed[k], (int)self->pushed_n[k], S.byte, self->ranks[k], PUSH, self->comm,
                       &self->handles[posted]);
        if (!code)
            posted++;
    }
    if (code)
        return hand_back(self->handles, posted, code);
    int done = spin_testall(self->handles, posted, self->statuses);
    if (done <= 0)
        return hand_back(self->handles, posted, -done);
    self->bytes_sent += self->pushed_bytes;
    self->accumulated = 0;
    S.compiled++;
    Py_RETURN_TRUE;
}

#define LL(type, name, field) {name, T_LONGLONG, offsetof(type, field), 0, NULL}
static PyMemberDef WorkerCore_members[] = {
    LL(WorkerCore, "clock", clock), LL(WorkerCore, "progress", progress),
    LL(WorkerCore, "stop_signal", stop_signal), LL(WorkerCore, "bytes_sent", bytes_sent),
    LL(WorkerCore, "bytes_received", bytes_received), LL(WorkerCore, "_accumulated", accumulated),
    LL(WorkerCore, "n_fetch", n_fetch), LL(WorkerCore, "n_push", n_push),
    {"slowdown", T_DOUBLE, offsetof(WorkerCore, slowdown), 0, NULL},
    {"must_pull", T_BOOL, offsetof(WorkerCore, must_pull), 0, NULL},
    {"_pulled_since_push", T_BOOL, offsetof(WorkerCore, pulled_since_push), 0, NULL},
    {"closed", T_BOOL, offsetof(WorkerCore, closed), 0, NULL},
    {"_since_fetch", T_OBJECT, offsetof(WorkerCore, since_fetch), 0, NULL},
    {"versions", T_OBJECT_EX, offsetof(WorkerCore, versions), 0, NULL},
    {"_push_versions", T_OBJECT_EX, offsetof(WorkerCore, push_versions), 0, NULL},
    {NULL}};

static PyMethodDef WorkerCore_methods[] = {
    {"_bind", (PyCFunction)Worker_bind, METH_VARARGS, "make the compiled plan over these buffers"},
    {"_unbind", (PyCFunction)Worker_unbind, METH_NOARGS, "drop the compiled plan"},
    {"_fast_pull", (PyCFunction)(void (*)(void))Worker_fast_pull, METH_FASTCALL, "a pull, compiled"},
    {"_finish_pull", (PyCFunction)Worker_finish_pull, METH_NOARGS, "a waited pull's copies"},
    {"_fast_push", (PyCFunction)Worker_fast_push, METH_NOARGS, "a push, compiled"},
    {NULL}};

static PyTypeObject WorkerCore_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hpcdl.parameter_server._hot.WorkerCore",
    .tp_basicsize = sizeof(WorkerCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "worker.WorkerClient's counters, and its compiled pull and push",
    .tp_traverse = (traverseproc)WorkerCore_traverse,
    .tp_clear = (inquiry)WorkerCore_clear,
    .tp_dealloc = (destructor)WorkerCore_dealloc,
    .tp_members = WorkerCore_members,
    .tp_methods = WorkerCore_methods,
    .tp_new = PyType_GenericNew,
};

/* ============================================================================ the server */

typedef struct {
    PyObject_HEAD
    long long version, updates, pushes, pulls, bytes_sent, bytes_received, max_clock_gap, retired_steps,
        stop_signal, told_progress, told_stop;
    PyObject *clocks, *based_on, *active, *pending, *deferred, *sends, *events, *lr_schedule, *staleness,
        *optimizer;
    /* the compiled plan (`_bind`) */
    PyObject *plan, *status;
    Handle comm;
    char *reply, *push, *request;
    Py_ssize_t reply_n, push_n;
    int pushes_at_once, pulls_at_once, sgd, nruns;
    Py_ssize_t *runs; /* (byte offset after the header, float32 count) pairs */
} ServerCore;

static void server_unbind(ServerCore *self);
static PyObject *Server_unbind(ServerCore *self, PyObject *unused) {
    server_unbind(self);
    Py_RETURN_NONE;
}
static void server_unbind(ServerCore *self) {
    Py_CLEAR(self->plan); Py_CLEAR(self->status);
    PyMem_Free(self->push); PyMem_Free(self->request); PyMem_Free(self->runs);
    self->push = self->request = NULL;
    self->runs = NULL;
    self->nruns = 0;
}

#define SERVER_OBJECTS(F)                                                      \
    F(clocks) F(based_on) F(active) F(pending) F(deferred) F(sends) F(events) F(lr_schedule) \
    F(staleness) F(optimizer) F(plan) F(status)
static int ServerCore_traverse(ServerCore *self, visitproc visit, void *arg) {
#define V(f) Py_VISIT(self->f);
    SERVER_OBJECTS(V)
#undef V
    return 0;
}
static int ServerCore_clear(ServerCore *self) {
#define C(f) Py_CLEAR(self->f);
    SERVER_OBJECTS(C)
#undef C
    server_unbind(self);
    return 0;
}
static void ServerCore_dealloc(ServerCore *self) {
    PyObject_GC_UnTrack(self);
    ServerCore_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* _bind(comm, reply, status, pushes_at_once, pulls_at_once, runs): `reply` the shard's message
 * (uint8 ndarray), `status` the Status the loop hands Python, `runs` the float32 runs (byte offset
 * after the header, element count) where plain SGD may be compiled, else None. */
static PyObject *Server_bind(ServerCore *self, PyObject *args) {
    PyObject *comm, *reply, *status, *runs;
    int pushes_at_once, pulls_at_once;
    if (!PyArg_ParseTuple(args, "OOOppO", &comm, &reply, &status, &pushes_at_once, &pulls_at_once, &runs))
        return NULL;
    if (!S.ready) {
        PyErr_SetString(PyExc_RuntimeError, "the compiled parameter server is not configured");
        return NULL;
    }
    server_unbind(self);
    Handle *h = S.get_comm(comm);
    if (!h || !S.get_status(status))
        return NULL;
    self->comm = *h;
    self->reply = bytes_of(reply, &self->reply_n);
    if (!self->reply || self->reply_n > INT_MAX || self->reply_n < HEADER_BYTES) {
        PyErr_SetString(PyExc_ValueError, "the compiled parameter server cannot take this shard");
        return NULL;
    }
    self->push_n = self->reply_n;
    self->push = PyMem_Malloc((size_t)self->push_n);
    self->request = PyMem_Malloc(HEADER_BYTES);
    if (!self->push || !self->request) {
        server_unbind(self);
        return PyErr_NoMemory();
    }
    self->sgd = 0;
    if (runs != Py_None) {
        if (!PyList_Check(runs)) {
            server_unbind(self);
            PyErr_SetString(PyExc_TypeError, "runs: a list of (offset, count)");
            return NULL;
        }
        self->nruns = (int)PyList_GET_SIZE(runs);
        self->runs = PyMem_Calloc(2 * (size_t)self->nruns + 1, sizeof(Py_ssize_t));
        if (!self->runs) {
            server_unbind(self);
            return PyErr_NoMemory();
        }
        for (int i = 0; i < self->nruns; i++) {
            Py_ssize_t *r = &self->runs[2 * i];
            if (!PyArg_ParseTuple(PyList_GET_ITEM(runs, i), "nn", &r[0], &r[1])) {
                server_unbind(self);
                return NULL;
            }
            if (r[0] < 0 || r[0] % 4 || HEADER_BYTES + r[0] + 4 * r[1] > self->reply_n) {
                server_unbind(self);
                PyErr_SetString(PyExc_ValueError, "a run outside the shard");
                return NULL;
            }
        }
        self->sgd = S.sgd;
    }
    self->pushes_at_once = pushes_at_once;
    self->pulls_at_once = pulls_at_once;
    self->plan = PyTuple_Pack(2, comm, reply);
    self->status = Py_NewRef(status);
    if (!self->plan) {
        server_unbind(self);
        return NULL;
    }
    Py_RETURN_NONE;
}

static int is_zero(PyObject *value) {
    if (PyLong_CheckExact(value) || PyFloat_CheckExact(value) || PyBool_Check(value)) {
        int truth = PyObject_IsTrue(value);
        return truth < 0 ? -1 : !truth;
    }
    return 0;
}

/* The optimizer's plain-SGD step size as optimizers.plain_sgd_step finds it: 1 with *alpha, 0 if
 * it is not plain SGD now (one group, no momentum, weight decay or maximize, a float lr), -1. */
static int plain_sgd(ServerCore *self, double *alpha) {
    PyObject *groups = PyObject_GetAttr(self->optimizer, N_param_groups);
    if (!groups)
        return -1;
    int ok = PyList_CheckExact(groups) && PyList_GET_SIZE(groups) == 1 &&
             PyDict_CheckExact(PyList_GET_ITEM(groups, 0));
    if (ok) {
        PyObject *group = PyList_GET_ITEM(groups, 0), *v;
        v = PyDict_GetItemWithError(group, N_lr);
        ok = v && PyFloat_CheckExact(v);
        if (ok)
            *alpha = -PyFloat_AS_DOUBLE(v);
        PyObject *zeros[] = {N_momentum, N_weight_decay};
        for (int i = 0; ok > 0 && i < 2; i++) {
            v = PyDict_GetItemWithError(group, zeros[i]);
            ok = v ? is_zero(v) : 0;
        }
        if (ok > 0) {
            v = PyDict_GetItemWithError(group, N_maximize);
            ok = v == Py_False;
        }
    }
    Py_DECREF(groups);
    return PyErr_Occurred() ? -1 : ok;
}

static void sgd_separate(float *p, const float *g, float a, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        float product = a * g[i];
        p[i] = p[i] + product;
    }
}

static void sgd_fused_plain(float *p, const float *g, float a, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        p[i] = fmaf(g[i], a, p[i]);
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) static void sgd_fused_fma(float *p, const float *g, float a, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        p[i] = __builtin_fmaf(g[i], a, p[i]);
}
#endif

static void sgd_fused(float *p, const float *g, float a, Py_ssize_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
    static int fma = -1;
    if (fma < 0) {
        __builtin_cpu_init();
        fma = __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2");
    }
    if (fma) {
        sgd_fused_fma(p, g, a, n);
        return;
    }
#endif
    sgd_fused_plain(p, g, a, n);
}

static void sgd(int how, float *p, const float *g, double alpha, Py_ssize_t n) {
    float a = (float)alpha; /* torch's Scalar alpha, as a float32 tensor reads it */
    if (how == 1)
        sgd_fused(p, g, a, n);
    else
        sgd_separate(p, g, a, n);
}

/* sgd(values, grads, alpha, how): the compiled step on float32 ndarrays (hot.configure's probe). */
static PyObject *probe_sgd(PyObject *module, PyObject *args) {
    PyObject *values, *grads;
    double alpha;
    int how;
    if (!PyArg_ParseTuple(args, "OOdi", &values, &grads, &alpha, &how))
        return NULL;
    Array *p = (Array *)values, *g = (Array *)grads;
    if (p->nd != 1 || g->nd != 1 || p->dimensions[0] != g->dimensions[0] || p->strides[0] != 4 ||
        g->strides[0] != 4 || (p->flags & CARRAY) != CARRAY) {
        PyErr_SetString(PyExc_ValueError, "two float32 vectors of one length");
        return NULL;
    }
    sgd(how, (float *)p->data, (const float *)g->data, alpha, p->dimensions[0]);
    Py_RETURN_NONE;
}

static int set_long(PyObject *object, PyObject *name, long long value) {
    PyObject *v = PyLong_FromLongLong(value);
    if (!v)
        return -1;
    int r = PyObject_SetAttr(object, name, v);
    Py_DECREF(v);
    return r;
}

static long long get_long(PyObject *object, PyObject *name, int *error) {
    PyObject *v = PyObject_GetAttr(object, name);
    if (!v) {
        *error = 1;
        return 0;
    }
    long long value = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (value == -1 && PyErr_Occurred())
        *error = 1;
    return value;
}

/* staleness.StalenessLog.record(tau), on its fields. */
static int record_staleness(PyObject *log, long long tau) {
    PyObject *histogram = PyObject_GetAttr(log, N_histogram);
    if (!histogram)
        return -1;
    int64_t *bins = int64s(histogram, HISTOGRAM_BINS);
    if (bins)
        bins[tau < HISTOGRAM_BINS - 1 ? tau : HISTOGRAM_BINS - 1] += 1;
    Py_DECREF(histogram);
    if (!bins) {
        PyObject *r = PyObject_CallMethod(log, "record", "L", tau);
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    int error = 0;
    long long count = get_long(log, N_count, &error), total = get_long(log, N_total, &error),
              most = get_long(log, N_max, &error);
    if (error || set_long(log, N_count, count + 1) < 0 || set_long(log, N_total, total + tau) < 0 ||
        (tau > most && set_long(log, N_max, tau) < 0))
        return -1;
    return 0;
}

static int dict_set(PyObject *dict, long long key, long long value) {
    PyObject *k = PyLong_FromLongLong(key), *v = PyLong_FromLongLong(value);
    int r = k && v ? PyDict_SetItem(dict, k, v) : -1;
    Py_XDECREF(k);
    Py_XDECREF(v);
    return r;
}

static int call_method(PyObject *self, PyObject *name) {
    PyObject *r = PyObject_CallMethodNoArgs(self, name);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* A push (server._on_push then _apply_push): received into the plan's buffer. 0, -1 error, or 1:
 * Python must take it (a version from the future: `_take_push` copies the buffer). */
static int server_push(ServerCore *self, int worker, double alpha) {
    const int64_t *head = (const int64_t *)self->push;
    long long version = head[VERSION], clock = head[PUSH_CLOCK];
    if (version > self->version)
        return 1;
    self->pushes += 1;
    if (dict_set(self->clocks, worker, clock) < 0 || dict_set(self->based_on, worker, version) < 0)
        return -1;
    if (PyList_GET_SIZE(self->sends) && call_method((PyObject *)self, N_finish_sends) < 0)
        return -1; /* the replies in flight read the shard this update changes */
    for (int i = 0; i < self->nruns; i++) {
        Py_ssize_t at = HEADER_BYTES + self->runs[2 * i];
        sgd(self->sgd, (float *)(self->reply + at), (const float *)(self->push + at), alpha, self->runs[2 * i + 1]);
    }
    if (record_staleness(self->staleness, self->version - version) < 0)
        return -1;
    self->version += 1;
    self->updates += 1;
    ((int64_t *)self->reply)[VERSION] = self->version;
    if (PyList_GET_SIZE(self->deferred) && call_method((PyObject *)self, N_answer_deferred) < 0)
        return -1;
    return 0;
}

/* A pull answered at once (server._answer, `async`), as _send_params answers it. */
static int server_pull(ServerCore *self, int worker) {
    const int64_t *head = (const int64_t *)self->request;
    long long clock = head[CLOCK], least = clock, progress = self->retired_steps;
    int first = 1;
    PyObject *w, *value, *members = PyObject_GetIter(self->active);
    if (!members)
        return -1;
    while ((w = PyIter_Next(members))) {
        value = PyDict_GetItemWithError(self->clocks, w);
        if (!value) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, w);
            Py_DECREF(w);
            Py_DECREF(members);
            return -1;
        }
        Py_DECREF(w);
        long long c = PyLong_AsLongLong(value);
        if (c == -1 && PyErr_Occurred()) {
            Py_DECREF(members);
            return -1;
        }
        if (first || c < least)
            least = c;
        first = 0;
    }
    Py_DECREF(members);
    if (PyErr_Occurred())
        return -1;
    Py_ssize_t pos = 0;
    while (PyDict_Next(self->clocks, &pos, &w, &value)) {
        long long c = PyLong_AsLongLong(value);
        if (c == -1 && PyErr_Occurred())
            return -1;
        progress += c;
    }
    long long gap = clock - least;
    if (gap > self->max_clock_gap)
        self->max_clock_gap = gap;
    if (progress != self->told_progress || self->stop_signal != self->told_stop) {
        if (PyList_GET_SIZE(self->sends) && call_method((PyObject *)self, N_finish_sends) < 0)
            return -1; /* replies in flight are sent from this same header */
        int64_t *fields = (int64_t *)self->reply;
        fields[PROGRESS] = self->told_progress = progress;
        fields[STOP] = self->told_stop = self->stop_signal;
    }
    Handle request;
    int done = 0, code = S.isend(self->reply, (int)self->reply_n, S.byte, worker, PARAMS, self->comm, &request);
    if (!code) {
        self->bytes_sent += self->reply_n;
        char status[MOST_STATUS];
        code = S.test(&request, &done, status);
    }
    if (code) { /* Python's _send decides: a reply to a lost worker is dropped */
        PyObject *r = PyObject_CallMethod((PyObject *)self, "_send_failed", "ii", code, worker);
        Py_XDECREF(r);
        if (!r)
            return -1;
    } else if (!done) {
        PyObject *held = S.new_request(request);
        if (!held)
            return -1;
        PyObject *r = PyObject_CallMethod((PyObject *)self, "_hold_reply", "Ni", held, worker);
        Py_XDECREF(r);
        if (!r)
            return -1;
    }
    self->pulls += 1;
    return 0;
}

/* _serve_fast(spin): handle the PUSH and PULL messages the compiled path may take until none comes
 * within `spin` seconds (or at once, where replies are in flight: Python reaps them); returns how
 * many it handled, or the MPI.Message of one it may not (the plan's Status filled in for Python's
 * `_handle`), or a worker's rank (a negative number, -1 - rank) whose push Python must take. */
static PyObject *Server_serve_fast(ServerCore *self, PyObject *arg) {
    double spin = PyFloat_AsDouble(arg);
    if (spin == -1.0 && PyErr_Occurred())
        return NULL;
    if (!self->plan) {
        PyErr_SetString(PyExc_RuntimeError, "the compiled server has no plan");
        return NULL;
    }
    void *status = S.get_status(self->status);
    if (!status)
        return NULL;
    long long handled = 0;
    for (;;) {
        if (PyErr_CheckSignals() < 0)
            return NULL;
        int flag = 0, code = 0;
        Handle message;
        double wait = PyList_GET_SIZE(self->sends) ? 0.0 : spin;
        Py_BEGIN_ALLOW_THREADS
        double until = now() + wait;
        for (;;) {
            code = S.improbe(S.any_source, S.any_tag, self->comm, &flag, &message, status);
            if (code || flag || wait <= 0 || now() > until)
                break;
        }
        Py_END_ALLOW_THREADS
        if (code)
            return mpi_error(code);
        if (!flag)
            return PyLong_FromLongLong(handled);
        int source = *(int *)((char *)status + S.source_at), tag = *(int *)((char *)status + S.tag_at), count = -1;
        code = S.get_count(status, S.byte, &count);
        if (code)
            return mpi_error(code);
        PyObject *worker = PyLong_FromLong(source);
        if (!worker)
            return NULL;
        int known = PyDict_Contains(self->clocks, worker);
        Py_DECREF(worker);
        if (known < 0)
            return NULL;
        double alpha = 0;
        int mine = 0;
        if (known && self->events == Py_None) {
            if (tag == PUSH && count == self->push_n && self->sgd && self->pushes_at_once &&
                self->lr_schedule == Py_None && PyList_GET_SIZE(self->pending) == 0) {
                mine = plain_sgd(self, &alpha);
                if (mine < 0)
                    return NULL;
            } else if (tag == PULL && count == HEADER_BYTES && self->pulls_at_once &&
                       PyList_GET_SIZE(self->deferred) == 0) {
                mine = 1;
            }
        }
        if (!mine)
            return S.new_message(message);
        code = S.mrecv(tag == PUSH ? self->push : self->request, count, S.byte, &message, status);
        if (code)
            return mpi_error(code);
        self->bytes_received += count;
        if (tag == PUSH) {
            int taken = server_push(self, source, alpha);
            if (taken < 0)
                return NULL;
            if (taken)
                return PyLong_FromLong(-1 - source);
        } else if (server_pull(self, source) < 0) {
            return NULL;
        }
        handled++;
        S.compiled++;
    }
}

/* _take_push(into): the push the compiled loop handed over, copied into `into` (uint8 ndarray). */
static PyObject *Server_take_push(ServerCore *self, PyObject *into) {
    Py_ssize_t n;
    char *data = bytes_of(into, &n);
    if (!self->push || !data || n != self->push_n) {
        PyErr_SetString(PyExc_ValueError, "a buffer of the push's size");
        return NULL;
    }
    memcpy(data, self->push, (size_t)n);
    Py_RETURN_NONE;
}

#define OBJECT(name, field, kind) {name, kind, offsetof(ServerCore, field), 0, NULL}
static PyMemberDef ServerCore_members[] = {
    LL(ServerCore, "version", version), LL(ServerCore, "updates", updates), LL(ServerCore, "pushes", pushes),
    LL(ServerCore, "pulls", pulls), LL(ServerCore, "bytes_sent", bytes_sent),
    LL(ServerCore, "bytes_received", bytes_received), LL(ServerCore, "max_clock_gap", max_clock_gap),
    LL(ServerCore, "retired_steps", retired_steps), LL(ServerCore, "stop_signal", stop_signal),
    LL(ServerCore, "_told_progress", told_progress), LL(ServerCore, "_told_stop", told_stop),
    OBJECT("clocks", clocks, T_OBJECT_EX), OBJECT("based_on", based_on, T_OBJECT_EX),
    OBJECT("active", active, T_OBJECT_EX), OBJECT("pending", pending, T_OBJECT_EX),
    OBJECT("_deferred", deferred, T_OBJECT_EX), OBJECT("_sends", sends, T_OBJECT_EX),
    OBJECT("events", events, T_OBJECT), OBJECT("lr_schedule", lr_schedule, T_OBJECT),
    OBJECT("staleness", staleness, T_OBJECT_EX), OBJECT("optimizer", optimizer, T_OBJECT_EX),
    {NULL}};

static PyMethodDef ServerCore_methods[] = {
    {"_bind", (PyCFunction)Server_bind, METH_VARARGS, "make the compiled plan over this shard"},
    {"_unbind", (PyCFunction)Server_unbind, METH_NOARGS, "drop the compiled plan"},
    {"_serve_fast", (PyCFunction)Server_serve_fast, METH_O, "serve the common messages, compiled"},
    {"_take_push", (PyCFunction)Server_take_push, METH_O, "the push handed over, into a buffer"},
    {NULL}};

static PyTypeObject ServerCore_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hpcdl.parameter_server._hot.ServerCore",
    .tp_basicsize = sizeof(ServerCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "server.Server's counters and state, and its compiled loop",
    .tp_traverse = (traverseproc)ServerCore_traverse,
    .tp_clear = (inquiry)ServerCore_clear,
    .tp_dealloc = (destructor)ServerCore_dealloc,
    .tp_members = ServerCore_members,
    .tp_methods = ServerCore_methods,
    .tp_new = PyType_GenericNew,
};

/* ============================================================================ configuration */

static void *capsule(PyObject *capi, const char *name, const char *signature) {
    PyObject *c = PyDict_GetItemString(capi, name);
    return c ? PyCapsule_GetPointer(c, signature) : (PyErr_Format(PyExc_LookupError, "%s", name), NULL);
}

/* configure(functions, capi, byte, request_null, any_source, any_tag, status, source, tag,
 * exception, bump, tensor_type, strided, int64, ndarray, spin): see hot.configure. `status` is an MPI.Status
 * whose source and tag were set to `source` and `tag`, to find where MPI_Status keeps them. */
static PyObject *configure(PyObject *module, PyObject *args) {
    PyObject *functions, *capi, *status, *exception, *bump, *tensor_type, *strided, *int64, *ndarray;
    unsigned long long byte, request_null;
    int any_source, any_tag, source, tag, status_size;
    double spin;
    if (!PyArg_ParseTuple(args, "O!O!KKiiOiiiOOOOOO!d", &PyDict_Type, &functions, &PyDict_Type, &capi, &byte,
                          &request_null, &any_source, &any_tag, &status, &status_size, &source, &tag,
                          &exception, &bump, &tensor_type, &strided, &int64, &PyType_Type, &ndarray, &spin))
        return NULL;
    const char *names[] = {"MPI_Irecv", "MPI_Isend", "MPI_Testall", "MPI_Test", "MPI_Improbe", "MPI_Mrecv",
                           "MPI_Get_count"};
    void *f[7];
    for (int i = 0; i < 7; i++) {
        PyObject *a = PyDict_GetItemString(functions, names[i]);
        f[i] = a ? PyLong_AsVoidPtr(a) : NULL;
        if (!f[i]) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_LookupError, "%s not given", names[i]);
            return NULL;
        }
    }
    if (status_size <= 0 || status_size > MOST_STATUS) {
        PyErr_Format(PyExc_ValueError, "an MPI_Status of %d bytes", status_size);
        return NULL;
    }
    GetStatus_f get_status = capsule(capi, "PyMPIStatus_Get", "MPI_Status *(PyObject *)");
    NewHandle_f new_request = capsule(capi, "PyMPIRequest_New", "PyObject *(MPI_Request)");
    NewHandle_f new_message = capsule(capi, "PyMPIMessage_New", "PyObject *(MPI_Message)");
    GetHandle_f get_comm = capsule(capi, "PyMPIComm_Get", "MPI_Comm *(PyObject *)");
    if (!get_status || !new_request || !new_message || !get_comm)
        return NULL;
    char *fields = get_status(status);
    if (!fields)
        return NULL;
    int source_at = -1, tag_at = -1;
    for (int at = 0; at + (int)sizeof(int) <= status_size; at += (int)sizeof(int)) {
        int value;
        memcpy(&value, fields + at, sizeof(int));
        if (value == source && source_at < 0)
            source_at = at;
        else if (value == tag && tag_at < 0)
            tag_at = at;
    }
    if (source_at < 0 || tag_at < 0) {
        PyErr_SetString(PyExc_LookupError, "MPI_Status's source and tag fields not found");
        return NULL;
    }
    S.irecv = (Irecv_f)f[0]; S.isend = (Isend_f)f[1]; S.testall = (Testall_f)f[2]; S.test = (Test_f)f[3];
    S.improbe = (Improbe_f)f[4]; S.mrecv = (Mrecv_f)f[5]; S.get_count = (Get_count_f)f[6];
    S.get_status = get_status; S.new_request = new_request; S.new_message = new_message; S.get_comm = get_comm;
    S.byte = (Handle)(uintptr_t)byte;
    S.request_null = (Handle)(uintptr_t)request_null;
    S.any_source = any_source; S.any_tag = any_tag;
    S.status_size = status_size; S.source_at = source_at; S.tag_at = tag_at;
    S.spin_s = spin;
    Py_XSETREF(S.exception, Py_NewRef(exception));
    Py_XSETREF(S.bump, Py_NewRef(bump));
    Py_XSETREF(S.tensor_type, Py_NewRef(tensor_type));
    Py_XSETREF(S.strided, Py_NewRef(strided));
    Py_XSETREF(S.int64_descr, Py_NewRef(int64));
    Py_INCREF(ndarray);
    Py_XSETREF(S.ndarray, (PyTypeObject *)ndarray);
    S.ready = 1;
    Py_RETURN_NONE;
}

static PyObject *use_sgd(PyObject *module, PyObject *arg) {
    long how = PyLong_AsLong(arg);
    if (how == -1 && PyErr_Occurred())
        return NULL;
    if (how < 0 || how > 2) {
        PyErr_SetString(PyExc_ValueError, "0 (none), 1 (fused) or 2 (multiply, then add)");
        return NULL;
    }
    S.sgd = (int)how;
    Py_RETURN_NONE;
}

static PyObject *compiled_calls(PyObject *module, PyObject *unused) { return PyLong_FromLongLong(S.compiled); }

static PyMethodDef module_methods[] = {
    {"configure", configure, METH_VARARGS, "hand the compiled path what it needs of MPI, mpi4py and torch"},
    {"use_sgd", use_sgd, METH_O, "which compiled SGD step matches torch's (0: none)"},
    {"sgd", probe_sgd, METH_VARARGS, "sgd(values, grads, alpha, how): the compiled step, for the probe"},
    {"compiled_calls", compiled_calls, METH_NOARGS, "pulls, pushes and messages done compiled"},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "hpcdl.parameter_server._hot",
                                        "The parameter server's common exchange compiled (see hot.py).", -1,
                                        module_methods};

PyMODINIT_FUNC PyInit__hot(void) {
    struct { PyObject **name; const char *text; } names[] = {
        {&N_grad, "grad"}, {&N_dtype, "dtype"}, {&N_shape, "shape"}, {&N_layout, "layout"},
        {&N_is_cpu, "is_cpu"}, {&N_is_contiguous, "is_contiguous"}, {&N_data_ptr, "data_ptr"},
        {&N_param_groups, "param_groups"}, {&N_lr, "lr"}, {&N_momentum, "momentum"},
        {&N_weight_decay, "weight_decay"}, {&N_maximize, "maximize"}, {&N_histogram, "histogram"},
        {&N_count, "count"}, {&N_total, "total"}, {&N_max, "max"}, {&N_finish_sends, "_finish_sends"},
        {&N_hold_reply, "_hold_reply"}, {&N_send_failed, "_send_failed"},
        {&N_answer_deferred, "_answer_deferred"}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (!(*names[i].name = PyUnicode_InternFromString(names[i].text)))
            return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (!module)
        return NULL;
    if (PyType_Ready(&WorkerCore_Type) < 0 || PyType_Ready(&ServerCore_Type) < 0 ||
        PyModule_AddObjectRef(module, "WorkerCore", (PyObject *)&WorkerCore_Type) < 0 ||
        PyModule_AddObjectRef(module, "ServerCore", (PyObject *)&ServerCore_Type) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
