/* The fixed-point sum's per-value passes compiled (collectives/fixed_point.py says what they
 * compute; `FixedSum.add_scaled` and `from_fixed_slots` call them where this is built).
 *
 * NumPy takes a pass per operation: a term's float32 gradient is widened and scaled into a float64
 * array, read twice more for its largest magnitude (two `reduceat`), read and written again to
 * round it, and the int64 sum read again to convert it back. Each pass streams the data through
 * memory; at 85 K values a step on this host spent ~0.3 ms in them (benchmarks/results/training/
 * reproducible-cost-profile-2026-11-29.md). Here each term is read once: its largest magnitude
 * is taken and each value scaled, rounded and written into (or added to) the int64 accumulator in
 * the same loop; the conversion back is one loop too.
 *
 * The same bits as the NumPy path, by construction: the same IEEE operations in the same order on
 * each value. A value x is scaled by a power of two s (exact), rounded by adding ROUNDER = 1.5 x
 * 2**52 (the sum lands where the spacing is 1, so the addition rounds to an integer, to nearest,
 * ties to even) and read as int64 less ROUNDER's bits, as `round_biased` does; integers wrap as
 * NumPy's int64 does (the arithmetic is done in uint64, where C defines the wrap). Converting back,
 * int64 -> double (rounded to nearest), times the factor, -> float (rounded to nearest), as
 * NumPy's multiply with dtype=float64 into a float32 array. The product x * s being exact, fusing it
 * with the addition (FMA) could not change a bit either; the build turns contraction off anyway.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#ifdef __clang__
#pragma STDC FP_CONTRACT OFF /* GCC takes -ffp-contract=off (setup.py) */
#endif
#ifdef _MSC_VER
#pragma fp_contract(off) /* MSVC may fuse under /fp:precise with /arch:AVX2 */
#endif

#define ROUNDER 6755399441055744.0          /* 1.5 x 2**52 */
#define ROUNDER_BITS 0x4338000000000000ULL  /* its bits */
#define F32_INF 0x7f800000U                 /* the bits of +inf: a magnitude's bits above are NaN */
#define F64_INF 0x7ff0000000000000ULL

/* Elements in one call from which the GIL is let go during the passes: the communication thread
 * (the int64 allreduce of the last step's buckets, a test's other work) runs beside; below it, the
 * hand-off costs about as much as the pass. */
#define RELEASE_FROM 32768

/* The passes are compiled once per instruction set where the toolchain can pick one at load time
 * (GCC and clang on x86-64 Linux): with AVX-512 (x86-64-v4) the int64 -> double conversion is one vector
 * instruction, without it one value at a time. Every clone computes the same IEEE operations. */
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#ifndef CLONES
#define CLONES
#endif

enum { WRITE = 0, ADD = 1 };

/* acc[i] (=, or += weight x) round(x[i] x s) for one float32 term; the largest |x[i]|'s bits. */
CLONES static uint32_t quantize_f32(const float *x, Py_ssize_t n, double s, uint64_t *acc, int mode,
                                    uint64_t weight) {
    uint32_t most = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, &x[i], 4);
        bits &= 0x7fffffffU;  /* |x|: ordered as the magnitudes, NaN above inf */
        most = bits > most ? bits : most;
        double t = (double)x[i] * s + ROUNDER;
        uint64_t r;
        memcpy(&r, &t, 8);
        r -= ROUNDER_BITS;
        if (mode == WRITE)
            acc[i] = r;
        else
            acc[i] += weight * r;
    }
    return most;
}

/* The same for a float64 term (float64 parameters, the loss). */
CLONES static uint64_t quantize_f64(const double *x, Py_ssize_t n, double s, uint64_t *acc, int mode,
                                    uint64_t weight) {
    uint64_t most = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t bits;
        memcpy(&bits, &x[i], 8);
        bits &= 0x7fffffffffffffffULL;
        most = bits > most ? bits : most;
        double t = x[i] * s + ROUNDER;
        uint64_t r;
        memcpy(&r, &t, 8);
        r -= ROUNDER_BITS;
        if (mode == WRITE)
            acc[i] = r;
        else
            acc[i] += weight * r;
    }
    return most;
}

CLONES static void dequantize_f32(const int64_t *acc, Py_ssize_t n, double factor, float *out) {
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = (float)((double)acc[i] * factor);
}

CLONES static void dequantize_f64(const int64_t *acc, Py_ssize_t n, double factor, double *out) {
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = (double)acc[i] * factor;
}

/* The type code of a buffer of one native scalar type ('f', 'd', 'q' for int64), 0 otherwise. */
static char kind(const Py_buffer *view) {
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=')
        f++;
    if (f[0] == 0 || f[1] != 0)
        return 0;
    if (f[0] == 'f' && view->itemsize == 4)
        return 'f';
    if (f[0] == 'd' && view->itemsize == 8)
        return 'd';
    if ((f[0] == 'l' || f[0] == 'q') && view->itemsize == 8)
        return 'q';
    return 0;
}

/* A C-contiguous, aligned buffer of `obj` (writable where asked); its kind, or 0 and a TypeError. */
static char get(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return 0;
    char k = kind(view);
    if (!k || (uintptr_t)view->buf % (uintptr_t)view->itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: a contiguous, aligned float32, float64 or int64 array is needed", what);
        PyBuffer_Release(view);
        return 0;
    }
    return k;
}

/* The n + 1 offsets of a tuple into bounds, rising from 0 within `size`; -1 with an exception. The
 * offsets are read once, before any buffer is taken: the bounds checked are the bounds used. */
static int read_bounds(PyObject *offsets, Py_ssize_t n, Py_ssize_t size, Py_ssize_t *bounds, const char *what) {
    for (Py_ssize_t i = 0; i <= n; i++) {
        bounds[i] = PyNumber_AsSsize_t(PyTuple_GET_ITEM(offsets, i), PyExc_OverflowError);
        if (bounds[i] == -1 && PyErr_Occurred())
            return -1;
        if (bounds[i] < (i ? bounds[i - 1] : 0) || bounds[i] > size) {
            PyErr_Format(PyExc_ValueError, "%s: the offsets must rise within the accumulator", what);
            return -1;
        }
    }
    return 0;
}

/* The n floats of a tuple into values; -1 with an exception. A float's __float__ may run Python
 * code: the tuple owns its items, and nothing read before depends on what that code changes. */
static int read_floats(PyObject *items, Py_ssize_t n, double *values) {
    for (Py_ssize_t i = 0; i < n; i++) {
        values[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(items, i));
        if (values[i] == -1.0 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

static PyObject *quantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "quantize(terms, scales, offsets, acc, mode, weight, limit)");
        return NULL;
    }
    long mode = PyLong_AsLong(args[4]);
    long long weight = PyLong_AsLongLong(args[5]);
    double limit = PyFloat_AsDouble(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (mode != WRITE && mode != ADD) {
        PyErr_SetString(PyExc_ValueError, "quantize: mode must be 0 (write) or 1 (add)");
        return NULL;
    }
    /* Tuples, which own their items: Python code run while reading them (a __float__) cannot
     * free or change what is read afterwards. */
    PyObject *terms = PySequence_Tuple(args[0]);
    PyObject *scales = terms ? PySequence_Tuple(args[1]) : NULL;
    PyObject *offsets = scales ? PySequence_Tuple(args[2]) : NULL;
    PyObject *result = NULL;
    Py_buffer *views = NULL, accv = {0};
    Py_ssize_t n = 0, got = 0;
    double *scale = NULL;
    Py_ssize_t *bounds = NULL; /* the offsets, read once, before any buffer is taken */
    char *kinds = NULL;
    if (!offsets)
        goto done;
    n = PyTuple_GET_SIZE(terms);
    if (PyTuple_GET_SIZE(scales) != n || PyTuple_GET_SIZE(offsets) != n + 1) {
        PyErr_SetString(PyExc_ValueError, "quantize: one scale per term and one offset more");
        goto done;
    }
    views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    scale = PyMem_Calloc(n ? n : 1, sizeof(double));
    kinds = PyMem_Calloc(n ? n : 1, 1);
    bounds = PyMem_Calloc(n + 1, sizeof(Py_ssize_t));
    if (!views || !scale || !kinds || !bounds) {
        PyErr_NoMemory();
        goto done;
    }
    /* every number read, then every buffer taken and checked, before any value is written */
    if (read_floats(scales, n, scale) < 0)
        goto done;
    if (get(args[3], &accv, 1, "quantize's accumulator") != 'q') {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "quantize's accumulator must be int64");
        if (accv.obj)
            PyBuffer_Release(&accv);
        accv.obj = NULL;
        goto done;
    }
    Py_ssize_t total = 0;
    if (read_bounds(offsets, n, accv.len / 8, bounds, "quantize") < 0)
        goto done;
    for (got = 0; got < n; got++) {
        Py_ssize_t start = bounds[got], stop = bounds[got + 1];
        PyObject *term = PyTuple_GET_ITEM(terms, got);
        if (term == Py_None) {  /* a parameter without a gradient: zero */
            kinds[got] = 0;
            continue;
        }
        kinds[got] = get(term, &views[got], 0, "quantize's term");
        if (!kinds[got] || kinds[got] == 'q' || views[got].len / views[got].itemsize != stop - start) {
            if (kinds[got])
                PyErr_SetString(PyExc_ValueError, "quantize: a term must be float32 or float64 of its slot's size");
            if (kinds[got])
                PyBuffer_Release(&views[got]);
            kinds[got] = 0;
            goto done;
        }
        total += stop - start;
    }
    result = PyList_New(n);
    if (!result)
        goto done;
    uint64_t *acc = accv.buf;
    int fits = 1;
    PyThreadState *saved = total >= RELEASE_FROM ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t start = bounds[i], stop = bounds[i + 1];
        double most;
        if (kinds[i] == 'f') {
            uint32_t bits = quantize_f32(views[i].buf, stop - start, scale[i], acc + start, mode, (uint64_t)weight);
            float value;
            memcpy(&value, &bits, 4);
            most = bits > F32_INF ? Py_NAN : (double)value;
        } else if (kinds[i] == 'd') {
            uint64_t bits = quantize_f64(views[i].buf, stop - start, scale[i], acc + start, mode, (uint64_t)weight);
            memcpy(&most, &bits, 8);
            most = bits > F64_INF ? Py_NAN : most;
        } else {
            if (mode == WRITE)
                memset(acc + start, 0, (size_t)(stop - start) * 8);
            most = 0.0;
        }
        /* in quanta, as the NumPy path compares: x x s is exact, and overflows as it does */
        if (!(most * scale[i] < limit))  /* NaN is not below */
            fits = 0;
        scale[i] = most;  /* this term's scale is used: its place holds the magnitude from here */
    }
    if (saved)
        PyEval_RestoreThread(saved);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PyFloat_FromDouble(scale[i]);
        if (!value) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, value);
    }
    if (!fits) {
        Py_DECREF(result);
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    for (Py_ssize_t i = 0; i < got && views; i++)
        if (kinds[i])
            PyBuffer_Release(&views[i]);
    if (accv.obj)
        PyBuffer_Release(&accv);
    PyMem_Free(views);
    PyMem_Free(scale);
    PyMem_Free(bounds);
    PyMem_Free(kinds);
    Py_XDECREF(terms);
    Py_XDECREF(scales);
    Py_XDECREF(offsets);
    return result;
}

static PyObject *dequantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "dequantize(acc, offsets, factors, out)");
        return NULL;
    }
    Py_buffer accv = {0}, outv = {0};
    PyObject *offsets = NULL, *factors = NULL, *result = NULL;
    Py_ssize_t *bounds = NULL;
    double *factor = NULL;
    if (get(args[0], &accv, 0, "dequantize's accumulator") != 'q') {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "dequantize's accumulator must be int64");
        goto done;
    }
    char k = get(args[3], &outv, 1, "dequantize's output");
    if (k != 'f' && k != 'd') {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "dequantize's output must be float32 or float64");
        goto done;
    }
    Py_ssize_t size = accv.len / 8;
    if (outv.len / outv.itemsize != size) {
        PyErr_SetString(PyExc_ValueError, "dequantize: out must be of acc's size");
        goto done;
    }
    offsets = PySequence_Tuple(args[1]);  /* tuples: see quantize */
    factors = offsets ? PySequence_Tuple(args[2]) : NULL;
    if (!factors)
        goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(factors);
    if (PyTuple_GET_SIZE(offsets) != n + 1) {
        PyErr_SetString(PyExc_ValueError, "dequantize: one offset more than factors");
        goto done;
    }
    bounds = PyMem_Calloc(n + 1, sizeof(Py_ssize_t));
    factor = PyMem_Calloc(n ? n : 1, sizeof(double));
    if (!bounds || !factor) {
        PyErr_NoMemory();
        goto done;
    }
    /* everything read and checked before anything is written; the factors first, whose
     * __float__ may run Python code, then the offsets, checked against the size taken */
    if (read_floats(factors, n, factor) < 0 || read_bounds(offsets, n, size, bounds, "dequantize") < 0)
        goto done;
    PyThreadState *saved = bounds[n] - bounds[0] >= RELEASE_FROM ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t *acc = (const int64_t *)accv.buf + bounds[i];
        if (k == 'f')
            dequantize_f32(acc, bounds[i + 1] - bounds[i], factor[i], (float *)outv.buf + bounds[i]);
        else
            dequantize_f64(acc, bounds[i + 1] - bounds[i], factor[i], (double *)outv.buf + bounds[i]);
    }
    if (saved)
        PyEval_RestoreThread(saved);
    Py_INCREF(Py_None);
    result = Py_None;
done:
    if (accv.obj)
        PyBuffer_Release(&accv);
    if (outv.obj)
        PyBuffer_Release(&outv);
    PyMem_Free(bounds);
    PyMem_Free(factor);
    Py_XDECREF(offsets);
    Py_XDECREF(factors);
    return result;
}

static PyMethodDef methods[] = {
    {"quantize", (PyCFunction)(void (*)(void))quantize, METH_FASTCALL,
     "quantize(terms, scales, offsets, acc, mode, weight, limit): each term i (float32 or float64, "
     "or None for zeros) rounded to round(term x scales[i]) and written into acc[offsets[i]:offsets[i+1]] "
     "(mode 0) or added there weight times (mode 1); the largest magnitude of each term (NaN where "
     "one is), or None where a term's scaled magnitude reached `limit` or was NaN"},
    {"dequantize", (PyCFunction)(void (*)(void))dequantize, METH_FASTCALL,
     "dequantize(acc, offsets, factors, out): out[slot] = acc[slot] x factors[i], each slot "
     "offsets[i]:offsets[i+1], rounded to out's dtype (float32 or float64) through float64"},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "collectives._fixed",
                                        "The fixed-point sum's passes compiled (collectives/fixed_point.py).",
                                        -1, methods};

PyMODINIT_FUNC PyInit__fixed(void) { return PyModule_Create(&module_def); }
