/* mixer._loops: per-sample loops of mixing in C: the deficit selector's choose and update
 * (mixer/selector.py, class Deficit) and a shuffle buffer's pop (mixer.world.Draws.take).
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

static PyMethodDef methods[] = {
    {"take", (PyCFunction)(void (*)(void))take_item, METH_FASTCALL, "A shuffle buffer's pop at int(u * len(items))."},
    {"choose", (PyCFunction)(void (*)(void))choose, METH_FASTCALL, "Deficit.choose's argmax, or None."},
    {"update", (PyCFunction)(void (*)(void))update, METH_FASTCALL, "Deficit.update in place, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_loops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__loops(void)
{
    return PyModule_Create(&module);
}
