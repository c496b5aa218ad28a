/* mixer._native._loops: per-sample loops of mixing in C: the deficit selector's choose and update
 * (mixer/selector.py, class Deficit), a shuffle buffer's pop (mixer.world.Draws.take) and a
 * bucketer's add (BucketCore, the base of mixer.batchers.Bucketer; see its comment below).
 *
 * With mix="sample" the selector picks a source for every sample: numpy's five array operations
 * per pick cost ~3 us at any number of sources, most of it call overhead. These loops do the same
 * IEEE-754 double arithmetic element by element, in the same order, so they give the same picks
 * and the same state bits as the numpy code (which stays, the fallback and the tests' oracle):
 *
 *   choose: argmax over i of (active[i] and probs[i] > 0) ? (target[i] - delivered[i]) + 1e-9 * probs[i] : -inf
 *           (the first of equal maxima, the first NaN, 0 when none is eligible: np.argmax's rules)
 *   update: target += probs * amount; delivered[source] += amount
 *
 * Products go through a volatile double so that no compiler fuses them into an FMA (one rounding
 * instead of numpy's two). Arrays must be 1-D, C-contiguous, float64 (bool for active) and of one
 * length; otherwise the functions return None and the caller uses numpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

typedef struct {
    Py_buffer view[4];
    int held;
} Views;

static void release(Views *v)
{
    for (int i = 0; i < v->held; i++)
        PyBuffer_Release(&v->view[i]);
    v->held = 0;
}

/* 1 when obj is a 1-D contiguous array of `format` with n items (n < 0: any, set it), 0 when not
 * (no error), -1 on error. */
static int take(Views *v, PyObject *obj, const char *format, Py_ssize_t itemsize, Py_ssize_t *n, int writable)
{
    Py_buffer *b = &v->view[v->held];
    if (PyObject_GetBuffer(obj, b, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    v->held++;
    const char *f = b->format ? b->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    if (b->ndim != 1 || b->itemsize != itemsize || strcmp(f, format) != 0)
        return 0;
    Py_ssize_t len = b->len / itemsize;
    if (*n < 0)
        *n = len;
    return len == *n;
}

/* choose(target, delivered, probs, active) -> int, or None (use numpy) */
static PyObject *choose(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "choose(target, delivered, probs, active)");
        return NULL;
    }
    Views v = {.held = 0};
    Py_ssize_t n = -1;
    int ok;
    if ((ok = take(&v, args[0], "d", 8, &n, 0)) == 1 && (ok = take(&v, args[1], "d", 8, &n, 0)) == 1 &&
        (ok = take(&v, args[2], "d", 8, &n, 0)) == 1)
        ok = take(&v, args[3], "?", 1, &n, 0);
    if (ok != 1) {
        release(&v);
        if (ok < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    const double *t = v.view[0].buf, *d = v.view[1].buf, *p = v.view[2].buf;
    const unsigned char *a = v.view[3].buf;
    Py_ssize_t best = 0;
    double top = -INFINITY;
    for (Py_ssize_t i = 0; i < n; i++) {
        double score = -INFINITY;
        if (a[i] && p[i] > 0) {
            volatile double tie = 1e-9 * p[i];
            score = (t[i] - d[i]) + tie;
        }
        if (isnan(score)) {
            best = i;
            break;
        }
        if (i == 0 || score > top) {
            top = score;
            best = i;
        }
    }
    release(&v);
    return PyLong_FromSsize_t(best);
}

/* update(target, delivered, probs, source, amount) -> True, or None (use numpy) */
static PyObject *update(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "update(target, delivered, probs, source, amount)");
        return NULL;
    }
    Py_ssize_t source = PyLong_AsSsize_t(args[3]);
    if (source == -1 && PyErr_Occurred())
        return NULL;
    double amount = PyFloat_AsDouble(args[4]);
    if (amount == -1.0 && PyErr_Occurred())
        return NULL;
    Views v = {.held = 0};
    Py_ssize_t n = -1;
    int ok;
    if ((ok = take(&v, args[0], "d", 8, &n, 1)) == 1 && (ok = take(&v, args[1], "d", 8, &n, 1)) == 1)
        ok = take(&v, args[2], "d", 8, &n, 0);
    if (ok != 1 || source < 0 || source >= n || v.view[0].buf == v.view[2].buf) {
        release(&v);
        if (ok < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    double *t = v.view[0].buf, *d = v.view[1].buf;
    const double *p = v.view[2].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        volatile double share = p[i] * amount;
        t[i] = t[i] + share;
    }
    d[source] = d[source] + amount;
    release(&v);
    Py_RETURN_TRUE;
}

/* take(items, u) -> the item at int(u * len(items)), removed with the last item taking its place:
 * a shuffle buffer's pop (mixer.world.Draws.take), once per sample. */
static PyObject *take_item(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "take(items: list, u: float)");
        return NULL;
    }
    double u = PyFloat_AsDouble(args[1]);
    if (u == -1.0 && PyErr_Occurred())
        return NULL;
    PyObject *items = args[0];
    Py_ssize_t n = PyList_GET_SIZE(items);
    double x = u * (double)n; /* Python's int(u * len(items)): one rounded product, truncated */
    if (!(x >= 0.0) || x >= (double)n) {
        PyErr_SetString(PyExc_IndexError, "list index out of range");
        return NULL;
    }
    Py_ssize_t j = (Py_ssize_t)x;
    PyObject *out = PyList_GET_ITEM(items, j);
    Py_INCREF(out);
    PyObject *last = PyList_GET_ITEM(items, n - 1);
    Py_INCREF(last);
    PyList_SetItem(items, j, last); /* steals last; releases the reference the list held to out */
    if (PyList_SetSlice(items, n - 1, n, NULL) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}


/* ---- BucketCore: the base of mixer.batchers.Bucketer, with its per-sample add ------------------
 *
 * The counters a bucketer's add touches live here as C integers (count, held, emitted, max_wait,
 * read and written from Python as plain int attributes) with the lists it works on (edges,
 * capacity, buffers, ready, _waiting, _opened, as Python objects the rest of the class keeps
 * using). add() is Bucketer._py_add line for line: the bucket by bisect_left over the edges, the
 * bucket's opening (heappush of (emitted, bucket)), the append, held, a full bucket taken
 * (self._take(b), Python), then the buckets that waited max_wait batches, oldest first. edges and
 * capacity are fixed once set: their values are read into C arrays at the first add after either
 * is (re)assigned. */
#include <structmember.h>

static PyObject *heappush, *heappop, *s_take;

typedef struct {
    PyObject_HEAD
    Py_ssize_t count, held, emitted, max_wait;
    PyObject *edges, *capacity, *buffers, *ready, *waiting, *opened;
    PyObject *cached_edges, *cached_capacity; /* the lists the arrays below were read from */
    long long *cedges, *ccapacity;
    Py_ssize_t n;
} BucketCore;

static int core_traverse(BucketCore *self, visitproc visit, void *arg)
{
    Py_VISIT(self->edges);
    Py_VISIT(self->capacity);
    Py_VISIT(self->buffers);
    Py_VISIT(self->ready);
    Py_VISIT(self->waiting);
    Py_VISIT(self->opened);
    Py_VISIT(self->cached_edges);
    Py_VISIT(self->cached_capacity);
    return 0;
}

static int core_clear(BucketCore *self)
{
    Py_CLEAR(self->edges);
    Py_CLEAR(self->capacity);
    Py_CLEAR(self->buffers);
    Py_CLEAR(self->ready);
    Py_CLEAR(self->waiting);
    Py_CLEAR(self->opened);
    Py_CLEAR(self->cached_edges);
    Py_CLEAR(self->cached_capacity);
    return 0;
}

static void core_dealloc(BucketCore *self)
{
    /* (a Python subclass's dealloc untracks, clears its own part and drops its type's reference) */
    PyObject_GC_UnTrack(self);
    core_clear(self);
    PyMem_Free(self->cedges);
    PyMem_Free(self->ccapacity);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Read edges and capacity (lists of ints of one length) into C arrays, when they changed. */
static int core_cache(BucketCore *self)
{
    if (self->edges == self->cached_edges && self->capacity == self->cached_capacity && self->cedges != NULL)
        return 0;
    if (self->edges == NULL || self->capacity == NULL || !PyList_CheckExact(self->edges) || !PyList_CheckExact(self->capacity) ||
        PyList_GET_SIZE(self->edges) != PyList_GET_SIZE(self->capacity)) {
        PyErr_SetString(PyExc_TypeError, "bucketer: edges and capacity must be lists of one length");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(self->edges);
    long long *e = PyMem_Calloc((size_t)n + 1, sizeof(long long)), *c = PyMem_Calloc((size_t)n + 1, sizeof(long long));
    if (e == NULL || c == NULL) {
        PyMem_Free(e);
        PyMem_Free(c);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        e[i] = PyLong_AsLongLong(PyList_GET_ITEM(self->edges, i));
        c[i] = PyLong_AsLongLong(PyList_GET_ITEM(self->capacity, i));
        if (PyErr_Occurred()) {
            PyMem_Free(e);
            PyMem_Free(c);
            return -1;
        }
    }
    PyMem_Free(self->cedges);
    PyMem_Free(self->ccapacity);
    self->cedges = e;
    self->ccapacity = c;
    self->n = n;
    Py_INCREF(self->edges);
    Py_XSETREF(self->cached_edges, self->edges);
    Py_INCREF(self->capacity);
    Py_XSETREF(self->cached_capacity, self->capacity);
    return 0;
}

static int core_take(BucketCore *self, Py_ssize_t b)
{
    PyObject *index = PyLong_FromSsize_t(b);
    if (index == NULL)
        return -1;
    PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, s_take, index);
    Py_DECREF(index);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* add(item, length) -> whether a batch is ready (Bucketer._py_add) */
static PyObject *core_add(BucketCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "add(item, length)");
        return NULL;
    }
    PyObject *item = args[0];
    long long length = PyLong_AsLongLong(args[1]);
    if (length == -1 && PyErr_Occurred())
        return NULL;
    if (core_cache(self) < 0)
        return NULL;
    if (self->buffers == NULL || !PyList_CheckExact(self->buffers) || self->opened == NULL || !PyList_CheckExact(self->opened) ||
        self->waiting == NULL || !PyList_CheckExact(self->waiting) || self->ready == NULL) {
        PyErr_SetString(PyExc_TypeError, "bucketer: buffers, _opened and _waiting must be lists, ready set");
        return NULL;
    }
    self->count += 1;
    Py_ssize_t lo = 0, hi = self->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (self->cedges[mid] < length)
            lo = mid + 1;
        else
            hi = mid;
    }
    Py_ssize_t b = lo;
    if (b >= PyList_GET_SIZE(self->buffers) || b >= PyList_GET_SIZE(self->opened)) {
        PyErr_SetString(PyExc_IndexError, "list index out of range");
        return NULL;
    }
    PyObject *buf = PyList_GET_ITEM(self->buffers, b);
    if (!PyList_CheckExact(buf)) {
        PyErr_SetString(PyExc_TypeError, "bucketer: a bucket must be a list");
        return NULL;
    }
    Py_INCREF(buf);
    if (PyList_GET_SIZE(buf) == 0) {
        PyObject *when = PyLong_FromSsize_t(self->emitted), *bucket = PyLong_FromSsize_t(b);
        PyObject *entry = (when && bucket) ? PyTuple_Pack(2, when, bucket) : NULL;
        PyObject *r = NULL;
        if (entry != NULL && PyList_SetItem(self->opened, b, Py_NewRef(when)) == 0)
            r = PyObject_CallFunctionObjArgs(heappush, self->waiting, entry, NULL);
        Py_XDECREF(when);
        Py_XDECREF(bucket);
        Py_XDECREF(entry);
        if (r == NULL) {
            Py_DECREF(buf);
            return NULL;
        }
        Py_DECREF(r);
    }
    int failed = PyList_Append(buf, item);
    Py_ssize_t size = PyList_GET_SIZE(buf);
    Py_DECREF(buf);
    if (failed)
        return NULL;
    self->held += (Py_ssize_t)self->cedges[b];
    if (size >= self->ccapacity[b] && core_take(self, b) < 0)
        return NULL;
    for (;;) {
        PyObject *waiting = self->waiting; /* (re-read: _take may not replace it, but Python could) */
        if (!PyList_CheckExact(waiting) || PyList_GET_SIZE(waiting) == 0)
            break;
        PyObject *top = PyList_GET_ITEM(waiting, 0);
        if (!PyTuple_CheckExact(top) || PyTuple_GET_SIZE(top) != 2) {
            PyErr_SetString(PyExc_TypeError, "bucketer: _waiting holds (emitted, bucket) pairs");
            return NULL;
        }
        Py_ssize_t opened = PyLong_AsSsize_t(PyTuple_GET_ITEM(top, 0));
        if (opened == -1 && PyErr_Occurred())
            return NULL;
        if (self->emitted - opened < self->max_wait)
            break;
        PyObject *popped = PyObject_CallOneArg(heappop, waiting);
        if (popped == NULL)
            return NULL;
        Py_ssize_t old = PyLong_AsSsize_t(PyTuple_GET_ITEM(popped, 1));
        opened = PyLong_AsSsize_t(PyTuple_GET_ITEM(popped, 0));
        Py_DECREF(popped);
        if (PyErr_Occurred())
            return NULL;
        if (old < 0 || old >= PyList_GET_SIZE(self->buffers) || old >= PyList_GET_SIZE(self->opened)) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            return NULL;
        }
        PyObject *oldbuf = PyList_GET_ITEM(self->buffers, old);
        Py_ssize_t oldsize = PyObject_Length(oldbuf);
        if (oldsize < 0)
            return NULL;
        if (oldsize > 0) {
            PyObject *o = PyLong_FromSsize_t(opened);
            if (o == NULL)
                return NULL;
            int same = PyObject_RichCompareBool(PyList_GET_ITEM(self->opened, old), o, Py_EQ);
            Py_DECREF(o);
            if (same < 0 || (same && core_take(self, old) < 0))
                return NULL;
        }
    }
    Py_ssize_t ready = PyObject_Length(self->ready);
    if (ready < 0)
        return NULL;
    return PyBool_FromLong(ready > 0);
}

static PyMethodDef core_methods[] = {
    {"add", (PyCFunction)(void (*)(void))core_add, METH_FASTCALL, "Buffer item; returns whether a batch is ready."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef core_members[] = {
    {"count", T_PYSSIZET, offsetof(BucketCore, count), 0, NULL},
    {"held", T_PYSSIZET, offsetof(BucketCore, held), 0, NULL},
    {"emitted", T_PYSSIZET, offsetof(BucketCore, emitted), 0, NULL},
    {"max_wait", T_PYSSIZET, offsetof(BucketCore, max_wait), 0, NULL},
    {"edges", T_OBJECT_EX, offsetof(BucketCore, edges), 0, NULL},
    {"capacity", T_OBJECT_EX, offsetof(BucketCore, capacity), 0, NULL},
    {"buffers", T_OBJECT_EX, offsetof(BucketCore, buffers), 0, NULL},
    {"ready", T_OBJECT_EX, offsetof(BucketCore, ready), 0, NULL},
    {"_waiting", T_OBJECT_EX, offsetof(BucketCore, waiting), 0, NULL},
    {"_opened", T_OBJECT_EX, offsetof(BucketCore, opened), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject BucketCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mixer._native._loops.BucketCore",
    .tp_basicsize = sizeof(BucketCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The base of mixer.batchers.Bucketer: its counters in C and its per-sample add.",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_methods = core_methods,
    .tp_members = core_members,
};

static PyMethodDef methods[] = {
    {"take", (PyCFunction)(void (*)(void))take_item, METH_FASTCALL, "A shuffle buffer's pop at int(u * len(items))."},
    {"choose", (PyCFunction)(void (*)(void))choose, METH_FASTCALL, "Deficit.choose's argmax, or None."},
    {"update", (PyCFunction)(void (*)(void))update, METH_FASTCALL, "Deficit.update in place, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_loops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__loops(void)
{
    PyObject *heapq = PyImport_ImportModule("heapq");
    if (heapq == NULL)
        return NULL;
    heappush = PyObject_GetAttrString(heapq, "heappush");
    heappop = PyObject_GetAttrString(heapq, "heappop");
    Py_DECREF(heapq);
    s_take = PyUnicode_InternFromString("_take");
    if (heappush == NULL || heappop == NULL || s_take == NULL || PyType_Ready(&BucketCoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "BucketCore", (PyObject *)&BucketCoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
