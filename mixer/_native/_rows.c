/* mixer._native._rows: the copies of the padded collate (mixer.collate.collate) and of the packed one
 * (mixer.collate.PackedLayout.collate) in C.
 *
 * Contract (see mixer/collate.py, `_native_rows`): `pad` never decides anything numpy might decide
 * differently. It copies a row only when it is certain of numpy's result: the row is an exact
 * `numpy.ndarray` (found through the buffer protocol, no numpy C API), 1-D, native byte order, of
 * an integer dtype, exactly as long as its length says, and not overlapping the output. Same dtype
 * and contiguous: one memcpy; otherwise an element loop with the wrap-around integer cast numpy's
 * unsafe setitem makes. It pads the rest of the row. At any other row it stops and returns that
 * row's index: the Python side copies that row with numpy (so its error, if any, is numpy's) and
 * calls again from the next one. A batch it cannot vouch for as a whole (the output not a writable
 * contiguous int32/int64 buffer, lengths not ints in [0, seq_len], pad not a Python int the dtype
 * holds) returns -1 before writing anything: the whole batch goes the Python way. One difference
 * is left on purpose: a row whose array is a view into a later row of the output buffer itself
 * (an `out=` buffer the caller also took tokens from; never a new array or a worker's slot) reads
 * what is there, where numpy's code, padding everything first, reads the padding. Checking every
 * row for it first would cost a second buffer lookup per row on every batch.
 *
 * `pack` writes a packed batch's tokens (each segment a slice of its document, then its padding)
 * and position_ids, on the same terms for each document, and only for the geometry numpy's code
 * assumes (segments back to back from 0, none longer than its extent, flat: none padded). At
 * anything else it returns False and numpy's code writes both buffers whole.
 *
 * Every write is checked against the output's length before it happens.
 */
#define PY_SSIZE_T_CLEAN
#ifndef PREFETCH_LINES
#define PREFETCH_LINES 8
#endif
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The integer kind of a struct-module format numpy exports for a native-order 1-D array: 's'
 * signed, 'u' unsigned, 0 anything else (floats, bools, non-native order, records). */
static char int_kind(const char *fmt)
{
    if (fmt == NULL)
        return 0;
    if (fmt[0] == '@' || fmt[0] == '=')
        fmt++;
#if PY_LITTLE_ENDIAN
    else if (fmt[0] == '<')
        fmt++;
#else
    else if (fmt[0] == '>' || fmt[0] == '!')
        fmt++;
#endif
    if (fmt[0] == 0 || fmt[1] != 0)
        return 0;
    switch (fmt[0]) {
    case 'b': case 'h': case 'i': case 'l': case 'q': case 'n':
        return 's';
    case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N':
        return 'u';
    default:
        return 0;
    }
}

/* One element of an integer buffer as its two's-complement bits, sign- or zero-extended. */
static inline uint64_t load(const char *p, Py_ssize_t size, char kind)
{
    switch (size) {
    case 1: return kind == 's' ? (uint64_t)(int64_t)*(const int8_t *)p : (uint64_t)*(const uint8_t *)p;
    case 2: { int16_t s; uint16_t u; if (kind == 's') { memcpy(&s, p, 2); return (uint64_t)(int64_t)s; } memcpy(&u, p, 2); return u; }
    case 4: { int32_t s; uint32_t u; if (kind == 's') { memcpy(&s, p, 4); return (uint64_t)(int64_t)s; } memcpy(&u, p, 4); return u; }
    default: { uint64_t u; memcpy(&u, p, 8); return u; }
    }
}

/* Whether [a, a+an) and [b, b+bn) share a byte. */
static int overlaps(const char *a, Py_ssize_t an, const char *b, Py_ssize_t bn)
{
    return an > 0 && bn > 0 && a < b + bn && b < a + an;
}

/* The buffer of row `obj` when it is an exact ndarray that exports one (1), else 0. */
static int acquire(PyObject *obj, PyTypeObject *ndarray, Py_buffer *v)
{
    if (Py_TYPE(obj) != ndarray)
        return 0;
    if (PyObject_GetBuffer(obj, v, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* Whether the row in `v` is one the copies below take: 1-D, native-order integers. */
static char row_kind(const Py_buffer *v)
{
    Py_ssize_t isz = v->itemsize;
    if (v->ndim != 1 || (isz != 1 && isz != 2 && isz != 4 && isz != 8))
        return 0;
    return int_kind(v->format);
}

/* Copy `k` elements of the row in `v` from element `first` on to `dst` (itemsize `osize`), cast
 * as numpy's unsafe casts do; 0 (nothing written) when the source bytes overlap [lo, lo+span). */
static int copy_elems(const Py_buffer *v, char kind, Py_ssize_t first, char *dst, Py_ssize_t k, Py_ssize_t osize,
                      const char *guard, Py_ssize_t guard_len)
{
    Py_ssize_t isz = v->itemsize;
    Py_ssize_t stride = v->strides ? v->strides[0] : isz;
    const char *src = (const char *)v->buf + first * stride;
    /* the bytes the elements span, whichever way the stride runs */
    const char *lo = k == 0 ? src : (stride < 0 ? src + (k - 1) * stride : src);
    Py_ssize_t span = k == 0 ? 0 : (k - 1) * (stride < 0 ? -stride : stride) + isz;
    if (overlaps(lo, span, guard, guard_len))
        return 0;
    if (isz == osize && stride == isz) { /* same bits as the cast */
        memcpy(dst, src, (size_t)(k * osize));
    } else if (osize == 4) {
        for (Py_ssize_t j = 0; j < k; j++) {
            uint32_t x = (uint32_t)load(src + j * stride, isz, kind);
            memcpy(dst + 4 * j, &x, 4);
        }
    } else {
        for (Py_ssize_t j = 0; j < k; j++) {
            uint64_t x = load(src + j * stride, isz, kind);
            memcpy(dst + 8 * j, &x, 8);
        }
    }
    return 1;
}

/* Copy the row in `v` (`k` elements) to `dst`; 1 when done, 0 when numpy must. */
static int copy_row(const Py_buffer *v, char *dst, Py_ssize_t k, Py_ssize_t osize)
{
    char kind = row_kind(v);
    if (!kind || v->shape[0] != k)
        return 0;
    return copy_elems(v, kind, 0, dst, k, osize, dst, k * osize);
}

/* Ask for the first cache lines of the next row's tokens while this row is copied: rows lie
 * scattered in memory, mostly out of cache, and each row's start is otherwise a full miss (~10%
 * of the copy's time on the throughput benchmark's batches). A prefetch past a short row's end is
 * harmless: it is a hint, it never faults. */
static void prefetch(const Py_buffer *v)
{
#if defined(__GNUC__)
    const char *p = (const char *)v->buf;
    for (int j = 0; j < PREFETCH_LINES; j++)
        __builtin_prefetch(p + 64 * j, 0, 3);
#else
    (void)v;
#endif
}

static void fill(char *dst, Py_ssize_t count, Py_ssize_t osize, int64_t pad)
{
    if (pad == 0) {
        memset(dst, 0, (size_t)(count * osize));
    } else if (osize == 4) {
        int32_t x = (int32_t)pad;
        for (Py_ssize_t j = 0; j < count; j++)
            memcpy(dst + 4 * j, &x, 4);
    } else {
        for (Py_ssize_t j = 0; j < count; j++)
            memcpy(dst + 8 * j, &pad, 8);
    }
}

PyDoc_STRVAR(pad_doc,
"pad(flat, arrays, rows, seq_len, pad_id, start, ndarray) -> int\n\n"
"Write rows start.. of the padded grid (row i at flat[i*seq_len:], its tokens arrays[i], rows[i]\n"
"long, then pad_id to seq_len). Returns the first row it left to numpy (len(arrays) when none),\n"
"or -1, having written nothing, when the batch as a whole is not one it vouches for.");

static PyObject *rows_pad(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "pad() takes 7 arguments");
        return NULL;
    }
    PyObject *flat = args[0], *arrays = args[1], *rows = args[2], *pad_obj = args[4], *ndarray = args[6];
    Py_ssize_t seq_len = PyLong_AsSsize_t(args[3]);
    Py_ssize_t start = PyLong_AsSsize_t(args[5]);
    if ((seq_len == -1 || start == -1) && PyErr_Occurred())
        return NULL;
    if (!PyType_Check(ndarray)) {
        PyErr_SetString(PyExc_TypeError, "pad(): ndarray must be a type");
        return NULL;
    }
    if (!PyList_CheckExact(arrays) || !PyList_CheckExact(rows) || !PyLong_Check(pad_obj) || seq_len < 0)
        return PyLong_FromLong(-1);
    Py_ssize_t b = PyList_GET_SIZE(arrays);
    if (PyList_GET_SIZE(rows) != b || start < 0 || start > b)
        return PyLong_FromLong(-1);
    int overflow = 0;
    long long pad = PyLong_AsLongLongAndOverflow(pad_obj, &overflow);
    if (pad == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return PyLong_FromLong(-1);
    }
    if (overflow)
        return PyLong_FromLong(-1);
    Py_buffer out;
    if (PyObject_GetBuffer(flat, &out, PyBUF_CONTIG | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return PyLong_FromLong(-1);
    }
    Py_ssize_t osize = out.itemsize;
    Py_ssize_t result = -1;
    if (int_kind(out.format) != 's' || (osize != 4 && osize != 8) || out.ndim != 1)
        goto done;
    if (osize == 4 && (pad < INT32_MIN || pad > INT32_MAX))
        goto done;
    if (seq_len > 0 && b > out.shape[0] / seq_len)
        goto done;
    for (Py_ssize_t i = 0; i < b; i++) {
        PyObject *k = PyList_GET_ITEM(rows, i);
        if (!PyLong_CheckExact(k))
            goto done;
        Py_ssize_t v = PyLong_AsSsize_t(k);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto done;
        }
        if (v < 0 || v > seq_len)
            goto done;
    }
    result = start;
    char *base = (char *)out.buf;
    Py_buffer views[2]; /* this row's and the next one's, alternating (never copied) */
    int have[2] = {0, 0};
    have[result & 1] = result < b && acquire(PyList_GET_ITEM(arrays, result), (PyTypeObject *)ndarray, &views[result & 1]);
    for (; result < b; result++) {
        int c = (int)(result & 1), n = c ^ 1;
        if (!have[c])
            break;
        have[n] = result + 1 < b && acquire(PyList_GET_ITEM(arrays, result + 1), (PyTypeObject *)ndarray, &views[n]);
        if (have[n])
            prefetch(&views[n]);
        Py_ssize_t k = PyLong_AsSsize_t(PyList_GET_ITEM(rows, result)); /* checked above */
        char *dst = base + result * seq_len * osize;
        int done = copy_row(&views[c], dst, k, osize);
        PyBuffer_Release(&views[c]);
        have[c] = 0;
        if (!done) {
            if (have[n])
                PyBuffer_Release(&views[n]);
            break;
        }
        fill(dst + k * osize, seq_len - k, osize, (int64_t)pad);
    }
done:
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(result);
}

/* Item i of a list of exact Python ints, into *out; 0 when it is not one or does not fit. */
static int list_int(PyObject *list, Py_ssize_t i, Py_ssize_t *out)
{
    PyObject *x = PyList_GET_ITEM(list, i);
    if (!PyLong_CheckExact(x))
        return 0;
    *out = PyLong_AsSsize_t(x);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* A writable contiguous 1-D signed int32/int64 buffer of exactly `count` elements. */
static int get_out(PyObject *obj, Py_buffer *v, Py_ssize_t count)
{
    if (PyObject_GetBuffer(obj, v, PyBUF_CONTIG | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    if (int_kind(v->format) != 's' || (v->itemsize != 4 && v->itemsize != 8) || v->ndim != 1 || v->shape[0] != count) {
        PyBuffer_Release(v);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(pack_doc,
"pack(tokens, positions, arrays, starts, counts, pos, extent, pad_id, flat, ndarray) -> bool\n\n"
"The tokens and position_ids of a packed batch: segment i is arrays[i][starts[i]:starts[i]+counts[i]]\n"
"at tokens[pos[i]:], padded with pad_id to extent[i] (flat: no padding, every extent its count),\n"
"its positions 0..extent[i]-1. False when numpy must do the batch (the geometry, an array, the\n"
"buffers or pad_id not ones it vouches for); it may then have written some of both buffers, which\n"
"numpy's collate writes whole.");

static PyObject *rows_pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "pack() takes 10 arguments");
        return NULL;
    }
    PyObject *arrays = args[2], *starts = args[3], *counts = args[4], *pos = args[5], *extent = args[6];
    PyObject *pad_obj = args[7], *ndarray = args[9];
    int flat = PyObject_IsTrue(args[8]);
    if (flat < 0)
        return NULL;
    if (!PyType_Check(ndarray)) {
        PyErr_SetString(PyExc_TypeError, "pack(): ndarray must be a type");
        return NULL;
    }
    if (!PyList_CheckExact(arrays) || !PyList_CheckExact(starts) || !PyList_CheckExact(counts) || !PyList_CheckExact(pos) ||
        !PyList_CheckExact(extent))
        Py_RETURN_FALSE;
    Py_ssize_t n = PyList_GET_SIZE(arrays);
    if (n == 0 || PyList_GET_SIZE(starts) != n || PyList_GET_SIZE(counts) != n || PyList_GET_SIZE(pos) != n ||
        PyList_GET_SIZE(extent) != n)
        Py_RETURN_FALSE;
    /* the geometry numpy's code assumes without checking: segments back to back from 0, each at
     * least as long as its tokens (flat: exactly), every document slice within its array */
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t o, k, p, e;
        if (!list_int(starts, i, &o) || !list_int(counts, i, &k) || !list_int(pos, i, &p) || !list_int(extent, i, &e))
            Py_RETURN_FALSE;
        if (p != total || k < 0 || o < 0 || e < k || (flat && e != k) || e > PY_SSIZE_T_MAX - total)
            Py_RETURN_FALSE;
        total += e;
    }
    long long pad = 0;
    if (!flat) {
        int overflow = 0;
        if (!PyLong_Check(pad_obj))
            Py_RETURN_FALSE;
        pad = PyLong_AsLongLongAndOverflow(pad_obj, &overflow);
        if (overflow || (pad == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
    }
    Py_buffer tok, posn;
    if (!get_out(args[0], &tok, total))
        Py_RETURN_FALSE;
    if (!get_out(args[1], &posn, total)) {
        PyBuffer_Release(&tok);
        Py_RETURN_FALSE;
    }
    int ok = 0;
    Py_ssize_t osize = tok.itemsize, psize = posn.itemsize;
    if ((osize == 4 && (pad < INT32_MIN || pad > INT32_MAX)) || (psize == 4 && total > INT32_MAX))
        goto done;
    /* positions first, as numpy's collate writes them before it reads any document */
    char *pbase = (char *)posn.buf;
    for (Py_ssize_t i = 0, at = 0; i < n; i++) {
        Py_ssize_t e;
        list_int(extent, i, &e);
        for (Py_ssize_t j = 0; j < e; j++, at++) {
            if (psize == 4) {
                int32_t x = (int32_t)j;
                memcpy(pbase + 4 * at, &x, 4);
            } else {
                int64_t x = (int64_t)j;
                memcpy(pbase + 8 * at, &x, 8);
            }
        }
    }
    char *tbase = (char *)tok.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t o, k, p, e;
        list_int(starts, i, &o);
        list_int(counts, i, &k);
        list_int(pos, i, &p);
        list_int(extent, i, &e);
        Py_buffer v;
        if (!acquire(PyList_GET_ITEM(arrays, i), (PyTypeObject *)ndarray, &v))
            goto done;
        char kind = row_kind(&v);
        /* numpy reads every document before it writes a token: none may share a byte with them */
        int copied = kind && o <= v.shape[0] && k <= v.shape[0] - o &&
                     copy_elems(&v, kind, o, tbase + p * osize, k, osize, tbase, total * osize);
        PyBuffer_Release(&v);
        if (!copied)
            goto done;
        if (!flat)
            fill(tbase + (p + k) * osize, e - k, osize, (int64_t)pad);
    }
    ok = 1;
done:
    PyBuffer_Release(&tok);
    PyBuffer_Release(&posn);
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"pad", (PyCFunction)(void (*)(void))rows_pad, METH_FASTCALL, pad_doc},
    {"pack", (PyCFunction)(void (*)(void))rows_pack, METH_FASTCALL, pack_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rows", "The padded collate's row copies (see mixer/batching/collate.py).", -1, methods};

PyMODINIT_FUNC PyInit__rows(void)
{
    return PyModule_Create(&module);
}
