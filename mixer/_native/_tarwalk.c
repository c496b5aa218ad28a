/* mixer._native._tarwalk: the common case of mixer.tario (tar walk + key grouping) and of
 * mixer.decode.default_tokens (canonical 1-D integer .npy), as a pure parser over bytes.
 *
 * Contract (see mixer/tario.py, `_read_native`): `scan` never decides anything the pure-Python
 * reader might decide differently. It handles plain ustar members with strictly octal numbers and
 * a valid unsigned checksum (ustar prefixes applied), optionally preceded by one local PAX header
 * whose records parse cleanly or one GNU long-name header, and names that split by the fast rule. Anything else (a bad or signed checksum,
 * base-256 or odd numbers, global PAX headers, several extension headers in a row, links, directories, sparse members,
 * meta or odd names, duplicate extensions) makes it stop *before* that member with FALLBACK, and
 * the Python reader takes over from that byte with the pending sample, so every error, message and
 * damage field comes from the one implementation the tests pin. It also stops (NEED) when the next
 * header or data is not wholly in the buffer (I/O stays in Python), and (MORE) after BATCH samples.
 *
 * Every read of `buf` is checked against its length before it happens.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 512
enum { ST_NEED = 0, ST_END = 1, ST_FALLBACK = 2, ST_MORE = 3 };
#define BATCH 64 /* samples per call at most: the caller holds no more than these at once */

static PyObject *s_key, *s_url, *s_offset, *s_end, *s_tokens, *s_input_ids, *s_txt;

/* A numeric header field exactly as `int(field.rstrip(b"\0 "), 8)` reads it, for the only
 * spelling we accept: 1..width octal digits followed by NULs/spaces. 0: not that spelling. */
static int strict_octal(const unsigned char *f, int width, int64_t *out)
{
    int n = width;
    while (n > 0 && (f[n - 1] == 0 || f[n - 1] == ' '))
        n--;
    if (n == 0)
        return 0;
    int64_t v = 0;
    for (int i = 0; i < n; i++) {
        if (f[i] < '0' || f[i] > '7')
            return 0;
        v = v * 8 + (f[i] - '0');
    }
    *out = v;
    return 1;
}

/* 1..18 ASCII decimal digits, nothing else (Python's int() accepts more: those go the slow way). */
static int strict_decimal(const unsigned char *s, Py_ssize_t n, int64_t *out)
{
    if (n < 1 || n > 18)
        return 0;
    int64_t v = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return 0;
        v = v * 10 + (s[i] - '0');
    }
    *out = v;
    return 1;
}

typedef struct {
    const unsigned char *path;  /* last "path" record's value, or NULL */
    Py_ssize_t path_len;
    const unsigned char *size;  /* last "size" record's value, or NULL */
    Py_ssize_t size_len;
} Pax;

/* tarheader.parse_pax for payload[0:n], as `re.match(rb"(\d+) ([^=]+)=")` + slicing does it.
 * Returns 0 where the Python reader must judge (length 0, huge lengths, GNU sparse records). */
static int parse_pax(const unsigned char *pl, Py_ssize_t n, Pax *pax)
{
    Py_ssize_t q = 0;
    pax->path = pax->size = NULL;
    pax->path_len = pax->size_len = 0;
    while (q < n) {
        Py_ssize_t d = q;
        while (d < n && pl[d] >= '0' && pl[d] <= '9')
            d++;
        if (d == q || d >= n || pl[d] != ' ')
            return 1; /* no match: tarfile stops here */
        Py_ssize_t k = d + 1;
        if (k >= n || pl[k] == '=')
            return 1;
        const unsigned char *eq = memchr(pl + k, '=', (size_t)(n - k));
        if (eq == NULL)
            return 1;
        Py_ssize_t e = eq - pl;
        int64_t length;
        if (!strict_decimal(pl + q, d - q, &length) || length == 0)
            return 0;
        Py_ssize_t vstart = e + 1;
        int64_t vend = (int64_t)q + length - 1; /* Python slice semantics: clipped, never reversed */
        if (vend > n)
            vend = n;
        if (vend < vstart)
            vend = vstart;
        Py_ssize_t klen = e - k;
        if (klen >= 11 && memcmp(pl + k, "GNU.sparse.", 11) == 0)
            return 0;
        if (klen == 4 && memcmp(pl + k, "path", 4) == 0) {
            pax->path = pl + vstart;
            pax->path_len = (Py_ssize_t)vend - vstart;
        } else if (klen == 4 && memcmp(pl + k, "size", 4) == 0) {
            pax->size = pl + vstart;
            pax->size_len = (Py_ssize_t)vend - vstart;
        }
        q = (Py_ssize_t)((int64_t)q + length);
    }
    return 1;
}

static int is_reserved(const char *s, Py_ssize_t n)
{
    return (n == 7 && (memcmp(s, "__key__", 7) == 0 || memcmp(s, "__url__", 7) == 0)) ||
           (n == 10 && memcmp(s, "__offset__", 10) == 0) || (n == 7 && memcmp(s, "__end__", 7) == 0);
}

#define N_SUFFIXES 8
static PyObject *suffixes[N_SUFFIXES]; /* recently seen extensions (ASCII str), round robin */
static int next_suffix;

/* scan(buf, pos, end, base, url, sample, key, out) -> (status, pos, need, sample, key): walks
 * buf[pos:end] (any contiguous buffer: bytes, or the bytearray the stream is read into). */
static PyObject *scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 8 || !PyList_CheckExact(args[7])) {
        PyErr_SetString(PyExc_TypeError, "scan(buf, pos, end, base, url, sample, key, out: list)");
        return NULL;
    }
    Py_ssize_t p = PyLong_AsSsize_t(args[1]);
    if (p == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t blen = PyLong_AsSsize_t(args[2]);
    if (blen == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t base = PyLong_AsSsize_t(args[3]);
    if (base == -1 && PyErr_Occurred())
        return NULL;
    PyObject *url = args[4], *out = args[7];
    PyObject *sample = args[5] == Py_None ? NULL : args[5];
    PyObject *key = args[6] == Py_None ? NULL : args[6];
    if ((sample != NULL && !PyDict_CheckExact(sample)) || (key != NULL && !PyUnicode_CheckExact(key))) {
        PyErr_SetString(PyExc_TypeError, "scan: sample must be a dict or None, key a str or None");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (p < 0 || blen < p || blen > view.len || base < 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "scan: need 0 <= pos <= end <= len(buf) and base >= 0");
        return NULL;
    }
    const unsigned char *buf = (const unsigned char *)view.buf;
    Py_XINCREF(sample);
    Py_XINCREF(key);
    int status;
    Py_ssize_t need = 0;
    Py_ssize_t first = -1; /* buffer index of a pending PAX header */
    Pax pax = {NULL, 0, NULL, 0};
    int longname = 0;            /* the pending extension header is a GNU long name, not PAX */
    unsigned char joined[256];   /* ustar prefix + "/" + name: at most 155 + 1 + 100 bytes */
    char lowered[100];

    for (;;) {
        Py_ssize_t rb = first >= 0 ? first : p; /* where this member begins */
        if (blen - p < BLOCK) {
            status = ST_NEED;
            need = p + BLOCK - rb;
            p = rb;
            break;
        }
        const unsigned char *h = buf + p;
        int zero = 1;
        for (int i = 0; i < BLOCK; i++)
            if (h[i]) {
                zero = 0;
                break;
            }
        if (zero) {
            status = first >= 0 ? ST_FALLBACK : ST_END;
            p = rb;
            break;
        }
        int64_t stored, size;
        if (!strict_octal(h + 148, 8, &stored) || !strict_octal(h + 124, 12, &size)) {
            status = ST_FALLBACK;
            p = rb;
            break;
        }
        int64_t sum = 256;
        for (int i = 0; i < 148; i++)
            sum += h[i];
        for (int i = 156; i < BLOCK; i++)
            sum += h[i];
        if (sum != stored) {
            status = ST_FALLBACK;
            p = rb;
            break;
        }
        unsigned char type = h[156];
        if (type == 'x' || type == 'X' || type == 'L') {
            int64_t span = BLOCK + ((size + 511) & ~(int64_t)511);
            if (first >= 0) { /* a second extension header: their precedence is Python's to apply */
                status = ST_FALLBACK;
                p = rb;
                break;
            }
            if (span > blen - p) {
                status = ST_NEED;
                need = (Py_ssize_t)span;
                break;
            }
            if (type == 'L') { /* GNU long name: the payload up to its first NUL, as tarheader.nts */
                const unsigned char *end = memchr(h + BLOCK, 0, (size_t)size);
                pax.path = h + BLOCK;
                pax.path_len = end ? end - (h + BLOCK) : (Py_ssize_t)size;
                pax.size = NULL;
                longname = 1;
            } else if (!parse_pax(h + BLOCK, (Py_ssize_t)size, &pax)) {
                status = ST_FALLBACK;
                break;
            } else
                longname = 0;
            first = p;
            p += (Py_ssize_t)span;
            continue;
        }
        if (type != '0' && type != 0 && type != '7') {
            status = ST_FALLBACK;
            p = rb;
            break;
        }
        const unsigned char *nm = h;
        const unsigned char *nul = memchr(h, 0, 100);
        Py_ssize_t nlen = nul ? nul - h : 100;
        if (type == 0 && nlen > 0 && nm[nlen - 1] == '/') {
            status = ST_FALLBACK; /* a V7 directory */
            p = rb;
            break;
        }
        if (h[345] != 0) { /* ustar prefix: "prefix/name", whatever the magic says (as tarfile) */
            const unsigned char *pend = memchr(h + 345, 0, 155);
            Py_ssize_t plen = pend ? pend - (h + 345) : 155;
            memcpy(joined, h + 345, (size_t)plen);
            joined[plen] = '/';
            memcpy(joined + plen + 1, h, (size_t)nlen);
            nm = joined;
            nlen += plen + 1;
        }
        if (first >= 0) {
            if (pax.path != NULL) {
                nm = pax.path;
                nlen = pax.path_len;
                while (!longname && nlen > 0 && nm[nlen - 1] == '/')
                    nlen--;
            }
            if (pax.size != NULL && !strict_decimal(pax.size, pax.size_len, &size)) {
                status = ST_FALLBACK;
                p = rb;
                break;
            }
        }
        int64_t span = BLOCK + ((size + 511) & ~(int64_t)511);
        if (span > blen - p) {
            status = ST_NEED;
            need = (Py_ssize_t)(span + (p - rb));
            p = rb;
            break;
        }
        /* The fast split of group_samples: no "__" start, no newline, and a dot after the last
         * slash that is not the component's first character; a short ASCII extension. */
        Py_ssize_t slash = -1, dot = -1;
        int odd = nlen >= 2 && nm[0] == '_' && nm[1] == '_';
        for (Py_ssize_t i = 0; i < nlen && !odd; i++) {
            if (nm[i] == '\n')
                odd = 1;
            else if (nm[i] == '/') {
                slash = i;
                dot = -1;
            } else if (nm[i] == '.' && dot < 0)
                dot = i;
        }
        Py_ssize_t slen = nlen - dot - 1;
        if (odd || dot <= slash + 1 || slen > (Py_ssize_t)sizeof(lowered)) {
            status = ST_FALLBACK;
            p = rb;
            break;
        }
        for (Py_ssize_t i = 0; i < slen; i++) {
            unsigned char c = nm[dot + 1 + i];
            if (c >= 0x80) {
                odd = 1;
                break;
            }
            lowered[i] = (char)(c >= 'A' && c <= 'Z' ? c + 32 : c);
        }
        if (odd) {
            status = ST_FALLBACK;
            p = rb;
            break;
        }
        PyObject *prefix = PyUnicode_DecodeUTF8((const char *)nm, dot, "surrogateescape");
        if (prefix == NULL)
            goto error;
        int same = key != NULL && PyUnicode_Compare(prefix, key) == 0;
        if (PyErr_Occurred()) {
            Py_DECREF(prefix);
            goto error;
        }
        /* A shard repeats a handful of extensions: reuse their str objects (and cached hashes). */
        PyObject *suffix = NULL;
        for (int c = 0; c < N_SUFFIXES && suffixes[c] != NULL; c++)
            if (PyUnicode_GET_LENGTH(suffixes[c]) == slen && memcmp(PyUnicode_DATA(suffixes[c]), lowered, (size_t)slen) == 0) {
                suffix = Py_NewRef(suffixes[c]);
                break;
            }
        if (suffix == NULL) {
            suffix = PyUnicode_FromStringAndSize(lowered, slen);
            if (suffix != NULL) {
                Py_XDECREF(suffixes[next_suffix]);
                suffixes[next_suffix] = Py_NewRef(suffix);
                next_suffix = (next_suffix + 1) % N_SUFFIXES;
            }
        }
        if (suffix == NULL) {
            Py_DECREF(prefix);
            goto error;
        }
        int clash = same ? PyDict_Contains(sample, suffix) : is_reserved(lowered, slen);
        if (clash != 0) {
            Py_DECREF(prefix);
            Py_DECREF(suffix);
            if (clash < 0)
                goto error;
            status = ST_FALLBACK;
            p = rb;
            break;
        }
        PyObject *offset = PyLong_FromSsize_t(base + rb);
        PyObject *data = PyBytes_FromStringAndSize((const char *)h + BLOCK, (Py_ssize_t)size);
        if (offset == NULL || data == NULL)
            goto fail_member;
        if (!same) {
            if (sample != NULL) {
                if (PyDict_SetItem(sample, s_end, offset) < 0 || PyList_Append(out, sample) < 0)
                    goto fail_member;
                Py_CLEAR(sample);
            }
            PyObject *fresh = PyDict_New();
            if (fresh == NULL || PyDict_SetItem(fresh, s_key, prefix) < 0 || PyDict_SetItem(fresh, s_url, url) < 0 ||
                PyDict_SetItem(fresh, s_offset, offset) < 0 || PyDict_SetItem(fresh, s_end, Py_None) < 0) {
                Py_XDECREF(fresh);
                goto fail_member;
            }
            sample = fresh;
            Py_XSETREF(key, prefix);
            prefix = NULL;
        }
        if (PyDict_SetItem(sample, suffix, data) < 0)
            goto fail_member;
        Py_XDECREF(prefix);
        Py_DECREF(suffix);
        Py_DECREF(offset);
        Py_DECREF(data);
        first = -1;
        p += (Py_ssize_t)span;
        if (PyList_GET_SIZE(out) >= BATCH) {
            status = ST_MORE;
            break;
        }
        continue;
    fail_member:
        Py_XDECREF(prefix);
        Py_DECREF(suffix);
        Py_XDECREF(offset);
        Py_XDECREF(data);
        goto error;
    }
    PyObject *result = Py_BuildValue("(innOO)", status, p, need, sample ? sample : Py_None, key ? key : Py_None);
    Py_XDECREF(sample);
    Py_XDECREF(key);
    PyBuffer_Release(&view);
    return result;
error:
    Py_XDECREF(sample);
    Py_XDECREF(key);
    PyBuffer_Release(&view);
    return NULL;
}

/* ---- default_tokens: canonical "\x93NUMPY" 1.0 headers of 1-D native integer arrays ---------- */

#define MAX_DTYPES 16
static struct {
    char descr[8];
    Py_ssize_t len;
    Py_ssize_t itemsize;
    PyObject *dtype;
} dtypes[MAX_DTYPES];
static int n_dtypes;
static PyObject *frombuffer, *uint8;

/* setup(np.frombuffer, [(descr: bytes, dtype, itemsize), ...], np.dtype("uint8")) */
static PyObject *setup(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *fb, *table, *u8;
    if (!PyArg_ParseTuple(args, "OO!O", &fb, &PyList_Type, &table, &u8))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(table);
    if (n > MAX_DTYPES) {
        PyErr_SetString(PyExc_ValueError, "setup: too many dtypes");
        return NULL;
    }
    for (int i = 0; i < n_dtypes; i++)
        Py_CLEAR(dtypes[i].dtype);
    n_dtypes = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *descr;
        Py_ssize_t len, itemsize;
        PyObject *dtype;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(table, i), "y#On", &descr, &len, &dtype, &itemsize))
            return NULL;
        if (len < 1 || len > 7 || itemsize < 1) {
            PyErr_SetString(PyExc_ValueError, "setup: bad dtype entry");
            return NULL;
        }
        memcpy(dtypes[n_dtypes].descr, descr, (size_t)len);
        dtypes[n_dtypes].len = len;
        dtypes[n_dtypes].itemsize = itemsize;
        Py_INCREF(dtype);
        dtypes[n_dtypes].dtype = dtype;
        n_dtypes++;
    }
    Py_INCREF(fb);
    Py_XSETREF(frombuffer, fb);
    Py_INCREF(u8);
    Py_XSETREF(uint8, u8);
    Py_RETURN_NONE;
}

static int match(const unsigned char *d, Py_ssize_t end, Py_ssize_t *i, const char *lit)
{
    Py_ssize_t n = (Py_ssize_t)strlen(lit);
    if (end - *i < n || memcmp(d + *i, lit, (size_t)n) != 0)
        return 0;
    *i += n;
    return 1;
}

/* A sample without a token array: its txt member's bytes as uint8 (mixer.decode.default_tokens),
 * or None (a str member, no txt: Python's to judge). */
static PyObject *text_tokens(PyObject *sample, int64_t *count)
{
    PyObject *text = PyDict_GetItemWithError(sample, s_txt);
    if (text == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    if (!PyBytes_CheckExact(text) || uint8 == NULL)
        Py_RETURN_NONE;
    PyObject *argv[2] = {text, uint8};
    PyObject *result = PyObject_Vectorcall(frombuffer, argv, 2, NULL);
    *count = PyBytes_GET_SIZE(text);
    return result;
}

/* The sample's canonical 1-D integer tokens (its element count in *count), or None where
 * mixer.decode must look (txt, other layouts, errors); NULL with an exception set. */
static PyObject *tokens_of(PyObject *sample, int64_t *count)
{
    if (!PyDict_CheckExact(sample) || frombuffer == NULL)
        Py_RETURN_NONE;
    PyObject *data = PyDict_GetItemWithError(sample, s_tokens);
    if (data == NULL && !PyErr_Occurred())
        data = PyDict_GetItemWithError(sample, s_input_ids);
    if (data == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return text_tokens(sample, count);
    }
    if (!PyBytes_CheckExact(data))
        Py_RETURN_NONE;
    const unsigned char *d = (const unsigned char *)PyBytes_AS_STRING(data);
    Py_ssize_t len = PyBytes_GET_SIZE(data);
    if (len < 10 || memcmp(d, "\x93NUMPY\x01\x00", 8) != 0)
        Py_RETURN_NONE;
    Py_ssize_t end = 10 + (d[8] | (d[9] << 8));
    if (end > len)
        Py_RETURN_NONE;
    Py_ssize_t i = 10;
    if (!match(d, end, &i, "{'descr': '"))
        Py_RETURN_NONE;
    int which = -1;
    for (int t = 0; t < n_dtypes; t++) {
        Py_ssize_t n = dtypes[t].len;
        if (end - i > n && memcmp(d + i, dtypes[t].descr, (size_t)n) == 0 && d[i + n] == '\'') {
            which = t;
            i += n;
            break;
        }
    }
    if (which < 0 || !match(d, end, &i, "', 'fortran_order': False, 'shape': ("))
        Py_RETURN_NONE;
    Py_ssize_t digits = i;
    while (i < end && d[i] >= '0' && d[i] <= '9')
        i++;
    int64_t n;
    if (!strict_decimal(d + digits, i - digits, &n) || !match(d, end, &i, ",), }"))
        Py_RETURN_NONE;
    while (i < end - 1 && d[i] == ' ')
        i++;
    if (i != end - 1 || d[i] != '\n')
        Py_RETURN_NONE;
    if (n > (len - end) / dtypes[which].itemsize)
        Py_RETURN_NONE;
    PyObject *items = PyLong_FromLongLong(n), *start = PyLong_FromSsize_t(end);
    PyObject *result = NULL;
    if (items != NULL && start != NULL) {
        PyObject *argv[4] = {data, dtypes[which].dtype, items, start};
        result = PyObject_Vectorcall(frombuffer, argv, 4, NULL);
    }
    Py_XDECREF(items);
    Py_XDECREF(start);
    *count = n;
    return result;
}

/* tokens(sample) -> array, or None where mixer.decode must look (txt, other layouts, errors). */
static PyObject *tokens(PyObject *self, PyObject *sample)
{
    (void)self;
    int64_t n;
    return tokens_of(sample, &n);
}

/* Whether the collector may ignore obj: not a container, or one it has untracked. */
static int is_atom(PyObject *obj)
{
    return !PyObject_IS_GC(obj) || !PyObject_GC_IsTracked(obj);
}

/* samples(raws, pos, stop, shard, longest, Sample, out) -> (pos, end): mixer.sample.make_sample's
 * default case for raws[pos:stop] (no decode or length function on the source), in one call:
 * appends Sample(key, tokens, n, shard, offset) to out for each raw sample whose tokens tokens()
 * reads and whose n <= longest, and stops at the first one that is not so (the caller takes that
 * one through make_sample: the other decodes, the length policy, every error). Returns where it
 * stopped and the __end__ of the last sample converted (None when none was). */
static PyObject *samples(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[6]) || !PyType_Check(args[5]) ||
        !PyType_IsSubtype((PyTypeObject *)args[5], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "samples(raws: list, pos, stop, shard, longest, Sample: tuple type, out: list)");
        return NULL;
    }
    PyObject *raws = args[0], *shard = args[3], *out = args[6];
    PyTypeObject *type = (PyTypeObject *)args[5];
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t stop = PyLong_AsSsize_t(args[2]);
    if (stop == -1 && PyErr_Occurred())
        return NULL;
    long long longest = PyLong_AsLongLong(args[4]);
    if (longest == -1 && PyErr_Occurred())
        return NULL;
    if (pos < 0 || stop > PyList_GET_SIZE(raws)) {
        PyErr_SetString(PyExc_ValueError, "samples: need 0 <= pos and stop <= len(raws)");
        return NULL;
    }
    PyObject *end = Py_None;
    Py_INCREF(end);
    for (; pos < stop; pos++) {
        PyObject *raw = PyList_GET_ITEM(raws, pos);
        int64_t n = 0;
        PyObject *toks = tokens_of(raw, &n);
        if (toks == NULL)
            goto error;
        if (toks == Py_None || n > longest) {
            Py_DECREF(toks);
            break;
        }
        /* scan() made these (str, int, int); anything else is make_sample's to judge */
        PyObject *key = PyDict_GetItemWithError(raw, s_key);
        PyObject *offset = key ? PyDict_GetItemWithError(raw, s_offset) : NULL;
        PyObject *stop_at = offset ? PyDict_GetItemWithError(raw, s_end) : NULL;
        if (stop_at == NULL || !PyLong_CheckExact(stop_at)) {
            Py_DECREF(toks);
            if (PyErr_Occurred())
                goto error;
            break;
        }
        PyObject *length = PyLong_FromLongLong(n);
        PyObject *sample = length ? type->tp_alloc(type, 5) : NULL;
        if (sample == NULL) {
            Py_DECREF(toks);
            Py_XDECREF(length);
            goto error;
        }
        PyTuple_SET_ITEM(sample, 0, Py_NewRef(key));
        PyTuple_SET_ITEM(sample, 1, toks);
        PyTuple_SET_ITEM(sample, 2, length);
        PyTuple_SET_ITEM(sample, 3, Py_NewRef(shard));
        PyTuple_SET_ITEM(sample, 4, Py_NewRef(offset));
        /* What CPython does for a plain tuple of atoms at its next collection, and never for a
         * tuple subclass: a Sample holds a str, an (untracked) array and ints, so it can be in no
         * cycle. Tracked, every Sample held in a buffer would age into the oldest generation and
         * bring a full collection of the whole heap every ~50k samples. */
        if (is_atom(key) && is_atom(toks) && is_atom(offset))
            PyObject_GC_UnTrack(sample);
        int failed = PyList_Append(out, sample);
        Py_DECREF(sample);
        if (failed)
            goto error;
        Py_SETREF(end, Py_NewRef(stop_at));
    }
    PyObject *result = Py_BuildValue("(nN)", pos, end);
    return result;
error:
    Py_DECREF(end);
    return NULL;
}

static PyMethodDef methods[] = {
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL, "Walk whole members of a tar buffer into samples."},
    {"setup", setup, METH_VARARGS, "Register np.frombuffer, the integer dtypes tokens() may return and uint8 (txt)."},
    {"tokens", tokens, METH_O, "A sample's canonical 1-D integer tokens.npy/input_ids.npy, or None."},
    {"samples", (PyCFunction)(void (*)(void))samples, METH_FASTCALL, "make_sample's default case for a run of raw samples."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tarwalk", NULL, -1, methods};

PyMODINIT_FUNC PyInit__tarwalk(void)
{
    s_key = PyUnicode_InternFromString("__key__");
    s_url = PyUnicode_InternFromString("__url__");
    s_offset = PyUnicode_InternFromString("__offset__");
    s_end = PyUnicode_InternFromString("__end__");
    s_tokens = PyUnicode_InternFromString("tokens.npy");
    s_input_ids = PyUnicode_InternFromString("input_ids.npy");
    s_txt = PyUnicode_InternFromString("txt");
    if (!s_key || !s_url || !s_offset || !s_end || !s_tokens || !s_input_ids || !s_txt)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "NEED", ST_NEED) < 0 || PyModule_AddIntConstant(m, "END", ST_END) < 0 ||
        PyModule_AddIntConstant(m, "FALLBACK", ST_FALLBACK) < 0 || PyModule_AddIntConstant(m, "MORE", ST_MORE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
