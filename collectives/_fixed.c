/* The fixed-point sum's per-value passes compiled (collectives/fixed_point.py says what they
 * compute; `FixedSum.add_scaled` and `from_fixed_slots` call them where this is built).
 *
 * NumPy takes a pass per operation: a term's float32 gradient is widened and scaled into a float64
 * array, read twice more for its largest magnitude (two `reduceat`), read and written again to
 * round it, and the int64 sum read again to convert it back. Each pass streams the data through
 * memory; at 85 K values a step on this host spent ~0.3 ms in them (benchmarks/results/training/
 * reproducible-cost-profile-2026-11-29.md). Here each term is read once: its largest magnitude
 * is taken and each value scaled, rounded and written into (or added to) the int64 accumulator in
 * the same loop; the conversion back is one loop too. Where each rank sends its float32 term as it
 * is (`PersistentExactSum`), `pack` copies it into the alltoall's chunks taking each slot's largest
 * magnitude, and `sum_terms` rounds every rank's chunk, adds the integers and converts back, one
 * tile of values at a time (its int64 partial sums stay in L1).
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

/* Elements of a block summed together in `sum_terms`: their partial sums stay in L1 while every
 * rank's term is added (one stream per rank read at a time), then are converted at once. */
#define TILE 512

/* One slot of a float32 term copied to where its elements go in `pack`'s chunked layout (element e
 * of the term to send[(e / block) * stride + e % block]); the largest |x|'s bits. */
CLONES static uint32_t pack_f32(const float *x, Py_ssize_t start, Py_ssize_t stop, Py_ssize_t block,
                                Py_ssize_t stride, float *send) {
    uint32_t most = 0;
    for (Py_ssize_t e = start; e < stop;) {
        Py_ssize_t chunk = e / block, at = e % block;
        Py_ssize_t n = block - at < stop - e ? block - at : stop - e;
        float *to = send + chunk * stride + at;
        const float *from = x + (e - start);
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t bits;
            memcpy(&bits, &from[i], 4);
            bits &= 0x7fffffffU;
            most = bits > most ? bits : most;
            to[i] = from[i];
        }
        e += n;
    }
    return most;
}

/* out[i] = (sum over ranks j of weight[j] x round(x_j[i] x s)) x factor, for n elements, x_j at
 * x + j * stride: the same IEEE operations per value as quantize_f32 then dequantize_f32, the
 * integers added in uint64 (wrapping as int64 does; the order cannot matter). */
CLONES static void sum_f32(const float *x, Py_ssize_t ranks, Py_ssize_t stride, Py_ssize_t n, double s,
                           const uint64_t *weight, double factor, float *out) {
    uint64_t acc[TILE];
    for (Py_ssize_t first = 0; first < n; first += TILE) {
        Py_ssize_t m = n - first < TILE ? n - first : TILE;
        for (Py_ssize_t i = 0; i < m; i++)
            acc[i] = 0;
        for (Py_ssize_t j = 0; j < ranks; j++) {
            const float *term = x + j * stride + first;
            uint64_t w = weight[j];
            for (Py_ssize_t i = 0; i < m; i++) {
                double t = (double)term[i] * s + ROUNDER;
                uint64_t r;
                memcpy(&r, &t, 8);
                acc[i] += w * (r - ROUNDER_BITS);
            }
        }
        for (Py_ssize_t i = 0; i < m; i++)
            out[first + i] = (float)((double)(int64_t)acc[i] * factor);
    }
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

/* The length of a float32 buffer `obj` (writable where asked) into `view`; -1 with a TypeError. */
static Py_ssize_t get_f32(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    char k = get(obj, view, writable, what);
    if (k == 'f')
        return view->len / 4;
    if (k) {
        PyErr_Format(PyExc_TypeError, "%s must be float32", what);
        PyBuffer_Release(view);
    }
    view->obj = NULL;
    return -1;
}

static PyObject *pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "pack(terms, offsets, send, block, stride)");
        return NULL;
    }
    Py_ssize_t block = PyNumber_AsSsize_t(args[3], PyExc_OverflowError);
    Py_ssize_t stride = block == -1 && PyErr_Occurred() ? -1 : PyNumber_AsSsize_t(args[4], PyExc_OverflowError);
    if (PyErr_Occurred())
        return NULL;
    if (block < 1 || stride < block) {
        PyErr_SetString(PyExc_ValueError, "pack: block must be at least 1 and stride at least block");
        return NULL;
    }
    PyObject *terms = PySequence_Tuple(args[0]);  /* tuples: see quantize */
    PyObject *offsets = terms ? PySequence_Tuple(args[1]) : NULL;
    PyObject *result = NULL;
    Py_buffer *views = NULL, sendv = {0};
    Py_ssize_t *bounds = NULL, n = 0, got = 0;
    if (!offsets)
        goto done;
    n = PyTuple_GET_SIZE(terms);
    if (PyTuple_GET_SIZE(offsets) != n + 1) {
        PyErr_SetString(PyExc_ValueError, "pack: one offset more than terms");
        goto done;
    }
    views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    bounds = PyMem_Calloc(n + 1, sizeof(Py_ssize_t));
    if (!views || !bounds) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t room = get_f32(args[2], &sendv, 1, "pack's send buffer");
    if (room < 0)
        goto done;
    /* the last element's place must lie in the buffer: the bounds are checked against it */
    if (read_bounds(offsets, n, PY_SSIZE_T_MAX, bounds, "pack") < 0)
        goto done;
    Py_ssize_t size = bounds[n];
    if (size > 0 && (size - 1) / block * stride + (size - 1) % block >= room) {
        PyErr_SetString(PyExc_ValueError, "pack: the send buffer is too short for the terms' chunks");
        goto done;
    }
    for (got = 0; got < n; got++) {
        PyObject *term = PyTuple_GET_ITEM(terms, got);
        if (term == Py_None)
            continue;
        Py_ssize_t len = get_f32(term, &views[got], 0, "pack's term");
        if (len < 0)
            goto done;
        if (len != bounds[got + 1] - bounds[got]) {
            PyErr_SetString(PyExc_ValueError, "pack: a term must be of its slot's size");
            PyBuffer_Release(&views[got]);
            views[got].obj = NULL;
            goto done;
        }
    }
    result = PyList_New(n);
    if (!result)
        goto done;
    uint32_t *most = PyMem_Calloc(n ? n : 1, sizeof(uint32_t));
    if (!most) {
        Py_CLEAR(result);
        PyErr_NoMemory();
        goto done;
    }
    PyThreadState *saved = size >= RELEASE_FROM ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (views[i].obj) {
            most[i] = pack_f32(views[i].buf, bounds[i], bounds[i + 1], block, stride, sendv.buf);
        } else {  /* no gradient: zeros */
            for (Py_ssize_t e = bounds[i]; e < bounds[i + 1]; e++)
                ((float *)sendv.buf)[e / block * stride + e % block] = 0.0f;
        }
    }
    if (saved)
        PyEval_RestoreThread(saved);
    for (Py_ssize_t i = 0; i < n; i++) {
        float value;
        memcpy(&value, &most[i], 4);
        PyObject *item = PyFloat_FromDouble(most[i] > F32_INF ? Py_NAN : (double)value);
        if (!item) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, item);
    }
    PyMem_Free(most);
done:
    for (Py_ssize_t i = 0; i < got && views; i++)
        if (views[i].obj)
            PyBuffer_Release(&views[i]);
    if (sendv.obj)
        PyBuffer_Release(&sendv);
    PyMem_Free(views);
    PyMem_Free(bounds);
    Py_XDECREF(terms);
    Py_XDECREF(offsets);
    return result;
}

static PyObject *sum_terms(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "sum_terms(received, stride, start, offsets, scales, factors, weights, out)");
        return NULL;
    }
    Py_ssize_t stride = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    Py_ssize_t start = stride == -1 && PyErr_Occurred() ? -1 : PyNumber_AsSsize_t(args[2], PyExc_OverflowError);
    if (PyErr_Occurred())
        return NULL;
    PyObject *offsets = PySequence_Tuple(args[3]);  /* tuples: see quantize */
    PyObject *scales = offsets ? PySequence_Tuple(args[4]) : NULL;
    PyObject *factors = scales ? PySequence_Tuple(args[5]) : NULL;
    PyObject *weights = factors ? PySequence_Tuple(args[6]) : NULL;
    PyObject *result = NULL;
    Py_buffer recv = {0}, outv = {0};
    Py_ssize_t *bounds = NULL, n = 0, ranks = 0;
    double *scale = NULL, *factor = NULL;
    uint64_t *weight = NULL;
    if (!weights)
        goto done;
    n = PyTuple_GET_SIZE(scales);
    ranks = PyTuple_GET_SIZE(weights);
    if (PyTuple_GET_SIZE(factors) != n || PyTuple_GET_SIZE(offsets) != n + 1 || ranks < 1) {
        PyErr_SetString(PyExc_ValueError, "sum_terms: one scale and one factor per slot, one offset more, "
                                          "one weight per rank");
        goto done;
    }
    bounds = PyMem_Calloc(n + 1, sizeof(Py_ssize_t));
    scale = PyMem_Calloc(n ? n : 1, sizeof(double));
    factor = PyMem_Calloc(n ? n : 1, sizeof(double));
    weight = PyMem_Calloc(ranks, sizeof(uint64_t));
    if (!bounds || !scale || !factor || !weight) {
        PyErr_NoMemory();
        goto done;
    }
    if (read_floats(scales, n, scale) < 0 || read_floats(factors, n, factor) < 0)
        goto done;
    for (Py_ssize_t j = 0; j < ranks; j++) {
        long long w = PyLong_AsLongLong(PyTuple_GET_ITEM(weights, j));
        if (w == -1 && PyErr_Occurred())
            goto done;
        weight[j] = (uint64_t)w;
    }
    if (read_bounds(offsets, n, PY_SSIZE_T_MAX, bounds, "sum_terms") < 0)
        goto done;
    Py_ssize_t have = get_f32(args[0], &recv, 0, "sum_terms' received terms");
    Py_ssize_t block = have < 0 ? -1 : get_f32(args[7], &outv, 1, "sum_terms' output");
    if (block < 0)
        goto done;
    if (stride < block || start < 0 || (ranks - 1) * stride + block > have) {
        PyErr_SetString(PyExc_ValueError, "sum_terms: the received terms hold one chunk of stride >= the "
                                          "output's size per weight");
        goto done;
    }
    PyThreadState *saved = ranks * block >= RELEASE_FROM ? PyEval_SaveThread() : NULL;
    float *out = outv.buf;
    Py_ssize_t stop = start + block;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t lo = bounds[i] > start ? bounds[i] : start, hi = bounds[i + 1] < stop ? bounds[i + 1] : stop;
        if (lo < hi)
            sum_f32((const float *)recv.buf + (lo - start), ranks, stride, hi - lo, scale[i], weight, factor[i],
                    out + (lo - start));
    }
    /* the slots follow each other: what lies before the first and after the last is 0 */
    for (Py_ssize_t e = start; e < stop && e < bounds[0]; e++)
        out[e - start] = 0.0f;
    for (Py_ssize_t e = bounds[n] > start ? bounds[n] : start; e < stop; e++)
        out[e - start] = 0.0f;
    if (saved)
        PyEval_RestoreThread(saved);
    Py_INCREF(Py_None);
    result = Py_None;
done:
    if (recv.obj)
        PyBuffer_Release(&recv);
    if (outv.obj)
        PyBuffer_Release(&outv);
    PyMem_Free(bounds);
    PyMem_Free(scale);
    PyMem_Free(factor);
    PyMem_Free(weight);
    Py_XDECREF(offsets);
    Py_XDECREF(scales);
    Py_XDECREF(factors);
    Py_XDECREF(weights);
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
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL,
     "pack(terms, offsets, send, block, stride): each float32 term i (or None for zeros) copied into "
     "send, element e of the terms (slot i from offsets[i]) to send[(e // block) * stride + e % block]; "
     "the largest magnitude of each term (NaN where one is)"},
    {"sum_terms", (PyCFunction)(void (*)(void))sum_terms, METH_FASTCALL,
     "sum_terms(received, stride, start, offsets, scales, factors, weights, out): for the elements "
     "start .. start + len(out) of the terms, out[i] = factor x sum over ranks j of weights[j] x "
     "round(received[j * stride + i] x scale), each element's slot's scale and factor (offsets as "
     "pack's, slot i + 1 starting where slot i stops), rounded through float64 and int64 as quantize "
     "and dequantize do; 0 outside the slots"},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "collectives._fixed",
                                        "The fixed-point sum's passes compiled (collectives/fixed_point.py).",
                                        -1, methods};

PyMODINIT_FUNC PyInit__fixed(void) { return PyModule_Create(&module_def); }
