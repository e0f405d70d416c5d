/* The engine's CUDA calls, straight into the CUDA runtime that torch itself loaded.
 *
 * Why: through torch's Python API an event record costs 2.1-2.8 us and a read 0.7-1.5 us on an
 * H100 host (pybind argument parsing, a device guard, a Python Stream/Event object per call); the
 * runtime call underneath is a fraction of that. Four phases take 5 records and 5 reads a step, so
 * this is most of steptimer's host cost.
 *
 * No CUDA headers are needed: the handful of types are opaque pointers and ints, and the functions
 * are looked up with dlsym in the libcudart that torch has already loaded (its path comes from
 * Python), so every call goes to the same runtime, the same context and the same streams as
 * torch's own. Events and streams are passed as integers (torch's `cuda_event` / `cuda_stream`).
 *
 * Built at first use by steptimer/_native.py with the system C compiler, like Triton's launcher
 * stubs; when that is impossible, steptimer uses torch's API instead.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <dlfcn.h>
#include <time.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if PY_VERSION_HEX < 0x030A0000
static inline PyObject *Py_NewRef(PyObject *o) { Py_INCREF(o); return o; }
#endif
static inline PyObject *Py_NewRefNone(void) { Py_INCREF(Py_None); return Py_None; }

typedef int err_t; /* cudaError_t; 0 is cudaSuccess, 600 is cudaErrorNotReady */
typedef void *handle_t;

static err_t (*p_record)(handle_t, handle_t);
static err_t (*p_elapsed)(float *, handle_t, handle_t);
static err_t (*p_query)(handle_t);
static err_t (*p_sync)(handle_t);
static err_t (*p_capturing)(handle_t, int *);
static err_t (*p_last_error)(void);
static const char *(*p_error_string)(err_t);

static PyObject *fail(const char *what, err_t err) {
    /* Clear the runtime's last error, so torch's next launch check does not blame a kernel for it. */
    p_last_error();
    PyErr_Format(PyExc_RuntimeError, "steptimer: %s failed: CUDA error %d (%s)", what, err,
                 p_error_string(err));
    return NULL;
}

static int ready(void) {
    if (p_record) return 1;
    PyErr_SetString(PyExc_RuntimeError, "steptimer._cudart used before init()");
    return 0;
}

static int as_handle(PyObject *o, handle_t *out) {
    *out = PyLong_AsVoidPtr(o);
    return !(*out == NULL && PyErr_Occurred());
}

static PyObject *init(PyObject *self, PyObject *arg) {
    const char *path = PyUnicode_AsUTF8(arg);
    if (!path) return NULL;
    /* RTLD_NOLOAD: only the runtime that is already loaded (torch's), never a second copy. */
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!lib) {
        PyErr_Format(PyExc_OSError, "steptimer: %s is not loaded in this process: %s", path, dlerror());
        return NULL;
    }
    struct { void **slot; const char *name; } syms[] = {
        {(void **)&p_elapsed, "cudaEventElapsedTime"}, {(void **)&p_query, "cudaEventQuery"},
        {(void **)&p_sync, "cudaEventSynchronize"},    {(void **)&p_capturing, "cudaStreamIsCapturing"},
        {(void **)&p_last_error, "cudaGetLastError"},  {(void **)&p_error_string, "cudaGetErrorString"},
        {(void **)&p_record, "cudaEventRecord"}, /* last: init() succeeded iff p_record is set */
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        void *f = dlsym(lib, syms[i].name);
        if (!f) {
            p_record = NULL;
            PyErr_Format(PyExc_OSError, "steptimer: %s has no %s", path, syms[i].name);
            return NULL;
        }
        *syms[i].slot = f;
    }
    Py_RETURN_NONE;
}

/* record(event, stream) */
static PyObject *record(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    handle_t ev, stream;
    if (n != 2 || !ready() || !as_handle(args[0], &ev) || !as_handle(args[1], &stream)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "record(event, stream)");
        return NULL;
    }
    err_t err = p_record(ev, stream);
    if (err) return fail("cudaEventRecord", err);
    Py_RETURN_NONE;
}

/* elapsed_ms(start, end) -> float */
static PyObject *elapsed_ms(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    handle_t a, b;
    float ms = 0.0f;
    if (n != 2 || !ready() || !as_handle(args[0], &a) || !as_handle(args[1], &b)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "elapsed_ms(start, end)");
        return NULL;
    }
    err_t err = p_elapsed(&ms, a, b);
    if (err) return fail("cudaEventElapsedTime", err);
    return PyFloat_FromDouble((double)ms);
}

/* offsets_ms(events) -> [0.0, t(events[1]) - t(events[0]), ...]: one call reads a whole step. */
static PyObject *offsets_ms(PyObject *self, PyObject *seq) {
    if (!ready()) return NULL;
    if (!PyList_Check(seq)) {
        PyErr_SetString(PyExc_TypeError, "offsets_ms(events: list)");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    if (!out || n == 0) return out;
    handle_t ref, ev;
    if (!as_handle(PyList_GET_ITEM(seq, 0), &ref)) goto error;
    PyList_SET_ITEM(out, 0, PyFloat_FromDouble(0.0));
    for (Py_ssize_t i = 1; i < n; i++) {
        float ms = 0.0f;
        if (!as_handle(PyList_GET_ITEM(seq, i), &ev)) goto error;
        err_t err = p_elapsed(&ms, ref, ev);
        if (err) {
            fail("cudaEventElapsedTime", err);
            goto error;
        }
        PyObject *f = PyFloat_FromDouble((double)ms);
        if (!f) goto error;
        PyList_SET_ITEM(out, i, f);
    }
    return out;
error:
    Py_DECREF(out);
    return NULL;
}

/* wait(event): block until the event has completed. A completed event (the usual case with lag >= 1)
 * costs one query; otherwise the GIL is released while waiting, as torch's synchronize does. */
static PyObject *wait(PyObject *self, PyObject *arg) {
    handle_t ev;
    if (!ready() || !as_handle(arg, &ev)) return NULL;
    err_t err = p_query(ev);
    if (err == 0) Py_RETURN_NONE;
    if (err != 600) return fail("cudaEventQuery", err);
    p_last_error(); /* cudaErrorNotReady is not an error; don't leave it behind */
    Py_BEGIN_ALLOW_THREADS
    err = p_sync(ev);
    Py_END_ALLOW_THREADS
    if (err) return fail("cudaEventSynchronize", err);
    Py_RETURN_NONE;
}

/* is_capturing(stream) -> bool */
static PyObject *is_capturing(PyObject *self, PyObject *arg) {
    handle_t stream;
    int status = 0;
    if (!ready() || !as_handle(arg, &stream)) return NULL;
    err_t err = p_capturing(stream, &status);
    if (err) return fail("cudaStreamIsCapturing", err);
    return PyBool_FromLong(status != 0); /* cudaStreamCaptureStatusNone is 0 */
}

/* ------------------------------------------------------------------------------------------------
 * window_stats: a log window's statistics from its rows, in one call (no CUDA involved).
 *
 * Why: numpy computes them in about 70 calls, each a few us on a training host whose caches the
 * loop keeps busy (0.5 ms a window, 10 us a step at the default interval, docs/benchmarks.md). This
 * is steptimer/_stats.py's numpy path (Packed, _Matrix), value for value; tests/test_native.py checks
 * the two against each other.
 *
 * groups: list of (flat, n, warm, spec, sids): `flat` is a list of n rows of m floats (steptimer's
 * row layout, _stats.LEAD), the first `warm` of them warm-up rows; `spec` (doubles) is
 * [S, m, then per series: clamp, nan_col, nterms, (col, coef) x nterms]: series = sum of coef x col
 * (NaN read as 0), clamped at 0 if clamp, NaN where column nan_col (>= 0) is NaN; `sids` (int32 x S)
 * are the series' indices in the window. Returns (count, sum, sumsq, min, max, median, p90, stats, runs,
 * bounds, totals): the first seven are lists of nser (count as ints), the same numbers as stats: 7 x nser
 * doubles (count, sum, sum of squares, min, max, median, p90; nearest rank, exact), runs 3 x R int64
 * (series, bucket, count) sorted by (series, bucket), bounds the nser + 1 offsets of each series'
 * runs, totals per group [rows, cycle ms, samples, rows with samples, tokens, rows with tokens,
 * [sum of each series]] over the rows used (warm-up rows left out with skip_warm).
 */
enum { C_SAMPLES = 1, C_TOKENS = 2, C_STEP_S = 3, C_GAP_S = 4 };

static void sort_doubles(double *a, Py_ssize_t n) {
    /* Quicksort, median of three, insertion sort below 16; no NaN here. */
    while (n > 16) {
        double x = a[0], y = a[n / 2], z = a[n - 1];
        double pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        Py_ssize_t i = 0, j = n - 1;
        for (;;) {
            while (a[i] < pivot) i++;
            while (a[j] > pivot) j--;
            if (i >= j) break;
            double t = a[i]; a[i] = a[j]; a[j] = t;
            i++; j--;
        }
        /* [0, j] <= pivot <= [j + 1, n): recurse into the smaller part, loop on the larger */
        if (j + 1 < n - j - 1) {
            sort_doubles(a, j + 1);
            a += j + 1; n -= j + 1;
        } else {
            sort_doubles(a + j + 1, n - j - 1);
            n = j + 1;
        }
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        double v = a[i];
        Py_ssize_t k = i;
        while (k > 0 && a[k - 1] > v) { a[k] = a[k - 1]; k--; }
        a[k] = v;
    }
}

/* A value's log bucket, floor(log(max(x, base) / base) * inv_log_ratio) capped at nbuckets - 1, the
 * numpy path's formula: computed once per bucket edge (the least double in each bucket, found next to
 * base * e^(i / inv_log_ratio) by stepping one double at a time), then found for each value by an
 * estimate from the value's bits and a compare or two against the edges: no log() per value. */
static double *g_edges, g_base, g_inv, g_log2base;
static Py_ssize_t g_nb;

static int64_t bucket_exact(double x, double base, double inv, Py_ssize_t nb) {
    double b = floor(log((x > base ? x : base) / base) * inv);
    return b >= (double)(nb - 1) ? nb - 1 : (int64_t)b;
}

static int edges_for(double base, double inv, Py_ssize_t nb) {
    if (g_edges && g_base == base && g_inv == inv && g_nb == nb) return 1;
    double *e = PyMem_Realloc(g_edges, (size_t)(nb + 1) * sizeof(double));
    if (!e) { PyErr_NoMemory(); return 0; }
    g_edges = e;
    g_nb = 0; /* invalid until filled */
    e[0] = -INFINITY;
    e[nb] = INFINITY;
    for (Py_ssize_t i = 1; i < nb; i++) {
        double x = base * exp((double)i / inv);
        while (bucket_exact(x, base, inv, nb) >= i) x = nextafter(x, 0.0);
        while (bucket_exact(x, base, inv, nb) < i) x = nextafter(x, INFINITY);
        e[i] = x;
    }
    g_base = base;
    g_log2base = log2(base);
    g_inv = inv;
    g_nb = nb;
    return 1;
}

/* bucket_exact(x) for x > 0 (not NaN) through the edges of edges_for(). */
static inline int64_t bucket_fast(double x) {
    if (!(x > g_base)) return 0;
    uint64_t bits;
    memcpy(&bits, &x, 8);
    double m, l2;
    uint64_t mb = (bits & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull;
    memcpy(&m, &mb, 8);
    /* log2(m) on [1, 2) within 0.0014 (a tenth of a bucket): one compare or two finds the bucket */
    double t = m - 1.5;
    l2 = (double)((int64_t)((bits >> 52) & 0x7FF) - 1023) + (((0.15391353 * t - 0.33688185) * t + 0.96116839) * t + 0.58537839);
    double est = (l2 - g_log2base) * 0.6931471805599453 * g_inv;
    Py_ssize_t i = est < 0.0 ? 0 : est >= (double)(g_nb - 1) ? g_nb - 1 : (Py_ssize_t)est;
    while (i < g_nb - 1 && x >= g_edges[i + 1]) i++;
    while (x < g_edges[i]) i--;
    return i;
}

typedef struct { Py_ssize_t nser, m; const double *spec; const int32_t *sids; const double *rows;
                 Py_ssize_t n, first; Py_buffer view; int has_view; } group_t;

static int parse_group(PyObject *g, group_t *out, Py_ssize_t nser, int skip_warm) {
    PyObject *spec, *sids;
    Py_ssize_t n, warm;
    if (!PyTuple_Check(g) || !PyArg_ParseTuple(g, "y*nnSS", &out->view, &n, &warm, &spec, &sids)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "window_stats: bad group");
        return 0;
    }
    out->has_view = 1; /* released by the caller */
    const double *sp = (const double *)PyBytes_AS_STRING(spec);
    Py_ssize_t nsp = PyBytes_GET_SIZE(spec) / (Py_ssize_t)sizeof(double);
    if (nsp < 2) goto bad;
    out->nser = (Py_ssize_t)sp[0];
    out->m = (Py_ssize_t)sp[1];
    if (out->m < 6 || n < 0 || out->view.len != n * out->m * (Py_ssize_t)sizeof(double) || warm < 0 || warm > n ||
        PyBytes_GET_SIZE(sids) != out->nser * (Py_ssize_t)sizeof(int32_t)) goto bad;
    out->spec = sp;
    out->sids = (const int32_t *)PyBytes_AS_STRING(sids);
    for (Py_ssize_t j = 0; j < out->nser; j++)
        if (out->sids[j] < 0 || out->sids[j] >= nser) goto bad;
    /* check the spec's terms once, so the loops below can trust it */
    Py_ssize_t k = 2;
    for (Py_ssize_t j = 0; j < out->nser; j++) {
        if (k + 3 > nsp) goto bad;
        Py_ssize_t nan_col = (Py_ssize_t)sp[k + 1], nt = (Py_ssize_t)sp[k + 2];
        if (nan_col >= out->m || nt < 0 || k + 3 + 2 * nt > nsp) goto bad;
        for (Py_ssize_t t = 0; t < nt; t++) {
            Py_ssize_t col = (Py_ssize_t)sp[k + 3 + 2 * t];
            if (col < 0 || col >= out->m) goto bad;
        }
        k += 3 + 2 * nt;
    }
    out->rows = (const double *)out->view.buf;
    out->n = n;
    out->first = skip_warm ? warm : 0;
    return 1;
bad:
    PyErr_SetString(PyExc_ValueError, "window_stats: a group's rows, spec or series ids are inconsistent");
    return 0;
}

/* Series j of the group from a row; returns the next series' offset into the spec. */
static Py_ssize_t derive(const double *sp, Py_ssize_t k, const double *row, double *out) {
    int clamp = sp[k] != 0.0;
    Py_ssize_t nan_col = (Py_ssize_t)sp[k + 1], nt = (Py_ssize_t)sp[k + 2];
    double v = 0.0;
    for (Py_ssize_t t = 0; t < nt; t++) {
        double x = row[(Py_ssize_t)sp[k + 3 + 2 * t]];
        if (x == x) v += sp[k + 4 + 2 * t] * x;
    }
    if (clamp && v < 0.0) v = 0.0;
    if (nan_col >= 0 && row[nan_col] != row[nan_col]) v = NAN;
    *out = v;
    return k + 3 + 2 * nt;
}

/* The window's histograms as serialized Summary.value entries (tensorboard/compat/proto/summary.proto):
 * for each series with values, Value{tag (given, encoded), histo = HistogramProto{min, max, num, sum,
 * sum_squares, bucket_limit (packed), bucket (packed)}}. steptimer/_tensorboard.py writes the same
 * message through Python when the kernel isn't there; tests compare the two. */
static PyObject *encode(PyObject *tags, const double *limits, Py_ssize_t nser, const double *st,
                        const int64_t *rb, Py_ssize_t nruns);
static size_t varint_len(uint64_t n) { size_t k = 1; while (n >= 0x80) { n >>= 7; k++; } return k; }
static char *put_varint(char *p, uint64_t n) {
    while (n >= 0x80) { *p++ = (char)((n & 0x7F) | 0x80); n >>= 7; }
    *p++ = (char)n;
    return p;
}
static char *put_double(char *p, unsigned char key, double x) {
    *p++ = (char)key;
    memcpy(p, &x, 8); /* little-endian hosts only: checked by the caller */
    return p + 8;
}

/* encode_histograms(tags, limits, stats, runs) -> bytes, or None on a big-endian host: `tags` the
 * encoded Value.tag of each series (bytes), `limits` the bucket grid's upper edges (doubles), `stats`
 * and `runs` the buffers window_stats returned. */
static PyObject *encode_histograms(PyObject *self, PyObject *args) {
    PyObject *tags;
    Py_buffer lim, stb, rbb;
    if (!PyArg_ParseTuple(args, "O!y*y*y*", &PyList_Type, &tags, &lim, &stb, &rbb)) return NULL;
    PyObject *out = NULL;
    Py_ssize_t nser = PyList_GET_SIZE(tags), nlim = lim.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t nruns = rbb.len / (Py_ssize_t)(3 * sizeof(int64_t));
    const double *limits = lim.buf, *st = stb.buf;
    const int64_t *rb = rbb.buf;
    const uint16_t one = 1;
    if (*(const unsigned char *)&one != 1) { out = Py_None; Py_INCREF(out); goto release; } /* big-endian */
    if (stb.len != 7 * nser * (Py_ssize_t)sizeof(double) || rbb.len != 3 * nruns * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "encode_histograms: stats or runs don't match the tags");
        goto release;
    }
    for (Py_ssize_t r = 0; r < nruns; r++)
        if (rb[r] < 0 || rb[r] >= nser || rb[nruns + r] < 0 || rb[nruns + r] >= nlim || (r && rb[r] < rb[r - 1])) {
            PyErr_SetString(PyExc_ValueError, "encode_histograms: runs out of range or out of order");
            goto release;
        }
    out = encode(tags, limits, nser, st, rb, nruns);
release:
    PyBuffer_Release(&lim);
    PyBuffer_Release(&stb);
    PyBuffer_Release(&rbb);
    return out;
}

static PyObject *encode(PyObject *tags, const double *limits, Py_ssize_t nser, const double *st,
                        const int64_t *rb, Py_ssize_t nruns) {    const int64_t *run_series = rb, *run_bucket = rb + nruns, *run_count = rb + 2 * nruns;
    size_t total = 0;
    Py_ssize_t r0 = 0;
    for (Py_ssize_t s = 0; s < nser; s++) {
        Py_ssize_t r1 = r0;
        while (r1 < nruns && run_series[r1] == s) r1++;
        PyObject *tag = PyList_GET_ITEM(tags, s);
        if (!PyBytes_Check(tag)) { PyErr_SetString(PyExc_TypeError, "window_stats: tags must be bytes"); return NULL; }
        if (st[s] > 0) {
            size_t packed = 8 * (size_t)(r1 - r0);
            size_t histo = 5 * 9 + 2 * (1 + varint_len(packed) + packed);
            size_t body = (size_t)PyBytes_GET_SIZE(tag) + 1 + varint_len(histo) + histo;
            total += 1 + varint_len(body) + body;
        }
        r0 = r1;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (!out) return NULL;
    char *p = PyBytes_AS_STRING(out);
    r0 = 0;
    for (Py_ssize_t s = 0; s < nser; s++) {
        Py_ssize_t r1 = r0;
        while (r1 < nruns && run_series[r1] == s) r1++;
        if (st[s] > 0) {
            PyObject *tag = PyList_GET_ITEM(tags, s);
            size_t packed = 8 * (size_t)(r1 - r0);
            size_t histo = 5 * 9 + 2 * (1 + varint_len(packed) + packed);
            size_t body = (size_t)PyBytes_GET_SIZE(tag) + 1 + varint_len(histo) + histo;
            *p++ = 0x0a; /* Summary.value = 1 */
            p = put_varint(p, body);
            memcpy(p, PyBytes_AS_STRING(tag), (size_t)PyBytes_GET_SIZE(tag));
            p += PyBytes_GET_SIZE(tag);
            *p++ = 0x2a; /* Value.histo = 5 */
            p = put_varint(p, histo);
            p = put_double(p, 0x09, st[3 * nser + s]); /* min = 1 */
            p = put_double(p, 0x11, st[4 * nser + s]); /* max = 2 */
            p = put_double(p, 0x19, st[s]);            /* num = 3 */
            p = put_double(p, 0x21, st[nser + s]);     /* sum = 4 */
            p = put_double(p, 0x29, st[2 * nser + s]); /* sum_squares = 5 */
            *p++ = 0x32;                               /* bucket_limit = 6, packed */
            p = put_varint(p, packed);
            for (Py_ssize_t r = r0; r < r1; r++) { double x = limits[run_bucket[r]]; memcpy(p, &x, 8); p += 8; }
            *p++ = 0x3a;                               /* bucket = 7, packed */
            p = put_varint(p, packed);
            for (Py_ssize_t r = r0; r < r1; r++) { double x = (double)run_count[r]; memcpy(p, &x, 8); p += 8; }
        }
        r0 = r1;
    }
    return out;
}

/* accumulate(counts, exact, rows, stats, runs): add a window's histograms and exact statistics to the
 * run's (steptimer/_stats.py SummaryAccumulator): `counts` int64 [R x nbuckets] and `exact` double
 * [R x 5] (count, sum, sum of squares, min, max) are writable buffers, `rows` int64 [nser] the row
 * of each series (-1: a series without values), `stats` and `runs` window_stats' buffers. */
static PyObject *accumulate(PyObject *self, PyObject *args) {
    Py_buffer cb, eb, rwb, stb, rbb;
    Py_ssize_t nbuckets;
    if (!PyArg_ParseTuple(args, "w*w*y*y*y*n", &cb, &eb, &rwb, &stb, &rbb, &nbuckets)) return NULL;
    PyObject *out = NULL;
    int64_t *counts = cb.buf;
    double *exact = eb.buf;
    const int64_t *rows = rwb.buf, *rb = rbb.buf;
    const double *st = stb.buf;
    Py_ssize_t nser = rwb.len / (Py_ssize_t)sizeof(int64_t), nrows = eb.len / (Py_ssize_t)(5 * sizeof(double));
    Py_ssize_t nruns = rbb.len / (Py_ssize_t)(3 * sizeof(int64_t));
    if (nbuckets < 1 || cb.len != nrows * nbuckets * (Py_ssize_t)sizeof(int64_t) ||
        stb.len != 7 * nser * (Py_ssize_t)sizeof(double) || rbb.len != 3 * nruns * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "accumulate: buffer sizes don't match");
        goto release;
    }
    for (Py_ssize_t s = 0; s < nser; s++)
        if (rows[s] >= nrows || (st[s] > 0 && rows[s] < 0)) {
            PyErr_SetString(PyExc_ValueError, "accumulate: a series with values has no row");
            goto release;
        }
    for (Py_ssize_t r = 0; r < nruns; r++)
        if (rb[r] < 0 || rb[r] >= nser || rows[rb[r]] < 0 || rb[nruns + r] < 0 || rb[nruns + r] >= nbuckets) {
            PyErr_SetString(PyExc_ValueError, "accumulate: runs out of range");
            goto release;
        }
    for (Py_ssize_t r = 0; r < nruns; r++) counts[rows[rb[r]] * nbuckets + rb[nruns + r]] += rb[2 * nruns + r];
    for (Py_ssize_t s = 0; s < nser; s++) {
        if (!(st[s] > 0)) continue;
        double *e = exact + 5 * rows[s];
        e[0] += st[s];
        e[1] += st[nser + s];
        e[2] += st[2 * nser + s];
        if (st[3 * nser + s] < e[3]) e[3] = st[3 * nser + s];
        if (st[4 * nser + s] > e[4]) e[4] = st[4 * nser + s];
    }
    out = Py_None;
    Py_INCREF(out);
release:
    PyBuffer_Release(&cb);
    PyBuffer_Release(&eb);
    PyBuffer_Release(&rwb);
    PyBuffer_Release(&stb);
    PyBuffer_Release(&rbb);
    return out;
}

/* encode_scalars(tags, values) -> the serialized Summary.value entries Value{tag, simple_value}:
 * `tags` a list of str, `values` a list of floats, stored as float32 the way the proto API stores them. */
static PyObject *encode_scalars(PyObject *self, PyObject *args) {
    PyObject *tags, *values;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &tags, &PyList_Type, &values)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(tags);
    if (PyList_GET_SIZE(values) != n) {
        PyErr_SetString(PyExc_ValueError, "encode_scalars: as many values as tags");
        return NULL;
    }
    const uint16_t one = 1;
    if (*(const unsigned char *)&one != 1) Py_RETURN_NONE; /* big-endian: Python encodes instead */
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len;
        if (!PyUnicode_Check(PyList_GET_ITEM(tags, i)) || !PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(tags, i), &len)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "encode_scalars: tags must be str");
            return NULL;
        }
        size_t body = 1 + varint_len((uint64_t)len) + (size_t)len + 5;
        total += 1 + varint_len(body) + body;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (!out) return NULL;
    char *p = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        double x = PyFloat_AsDouble(PyList_GET_ITEM(values, i));
        if (x == -1.0 && PyErr_Occurred()) { Py_DECREF(out); return NULL; }
        float f = (float)x; /* as the proto API's C layer converts (IEEE: past the range, infinity) */
        Py_ssize_t len;
        const char *tag = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(tags, i), &len);
        size_t body = 1 + varint_len((uint64_t)len) + (size_t)len + 5;
        *p++ = 0x0a; /* Summary.value = 1 */
        p = put_varint(p, body);
        *p++ = 0x0a; /* Value.tag = 1 */
        p = put_varint(p, (uint64_t)len);
        memcpy(p, tag, (size_t)len);
        p += len;
        *p++ = 0x15; /* Value.simple_value = 2, a float */
        memcpy(p, &f, 4);
        p += 4;
    }
    return out;
}

/* encode_stats_scalars(order, heads, stats) -> the Summary.value entries of the window's per-series
 * scalars, straight from window_stats' `stats` buffer: for each series index k in `order` (int32) that
 * has values, three entries, mean (sum / count), p90 and max, each the encoded head heads[3i + j] (a
 * Value's tag and the simple_value key, _tensorboard._scalars' cache) and the value as a float32. */
static PyObject *encode_stats_scalars(PyObject *self, PyObject *args) {
    PyObject *heads;
    Py_buffer ob, stb;
    if (!PyArg_ParseTuple(args, "y*O!y*", &ob, &PyList_Type, &heads, &stb)) return NULL;
    PyObject *out = NULL;
    const int32_t *order = ob.buf;
    const double *st = stb.buf;
    Py_ssize_t n = ob.len / (Py_ssize_t)sizeof(int32_t), nser = stb.len / (Py_ssize_t)(7 * sizeof(double));
    const uint16_t one = 1;
    if (*(const unsigned char *)&one != 1) { out = Py_NewRefNone(); goto release; } /* big-endian */
    if (PyList_GET_SIZE(heads) != 3 * n || stb.len != 7 * nser * (Py_ssize_t)sizeof(double)) {
        PyErr_SetString(PyExc_ValueError, "encode_stats_scalars: three heads per series, 7 x nser stats");
        goto release;
    }
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (order[i] < 0 || order[i] >= nser) {
            PyErr_SetString(PyExc_ValueError, "encode_stats_scalars: a series index out of range");
            goto release;
        }
        for (int j = 0; j < 3; j++) {
            PyObject *h = PyList_GET_ITEM(heads, 3 * i + j);
            if (!PyBytes_Check(h)) { PyErr_SetString(PyExc_TypeError, "encode_stats_scalars: heads are bytes"); goto release; }
            if (st[order[i]] > 0) total += (size_t)PyBytes_GET_SIZE(h) + 4;
        }
    }
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (!out) goto release;
    char *p = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t k = order[i];
        if (!(st[k] > 0)) continue;
        double v[3] = {st[nser + k] / st[k], st[6 * nser + k], st[4 * nser + k]}; /* mean, p90, max */
        for (int j = 0; j < 3; j++) {
            PyObject *h = PyList_GET_ITEM(heads, 3 * i + j);
            memcpy(p, PyBytes_AS_STRING(h), (size_t)PyBytes_GET_SIZE(h));
            p += PyBytes_GET_SIZE(h);
            float f = (float)v[j]; /* as encode_scalars stores it */
            memcpy(p, &f, 4);
            p += 4;
        }
    }
release:
    PyBuffer_Release(&ob);
    PyBuffer_Release(&stb);
    return out;
}

static PyObject *window_stats(PyObject *self, PyObject *args) {
    PyObject *groups;
    Py_ssize_t nser;
    int skip_warm;
    double base, inv_log_ratio;
    Py_ssize_t nbuckets;
    if (!PyArg_ParseTuple(args, "O!npddn", &PyList_Type, &groups, &nser, &skip_warm, &base, &inv_log_ratio,
                          &nbuckets))
        return NULL;
    if (nser < 0 || nbuckets < 1 || nbuckets > (1 << 30)) {
        PyErr_SetString(PyExc_ValueError, "window_stats: nser >= 0 and 1 <= nbuckets <= 2**30");
        return NULL;
    }

    Py_ssize_t ng = PyList_GET_SIZE(groups);
    group_t *gs = PyMem_Calloc(ng ? ng : 1, sizeof(group_t));
    Py_ssize_t *count = PyMem_Calloc(nser + 1, sizeof(Py_ssize_t));
    Py_ssize_t *fill = PyMem_Calloc(nser + 1, sizeof(Py_ssize_t));
    Py_ssize_t *start = PyMem_Calloc(nser + 1, sizeof(Py_ssize_t));
    double *vals = NULL, *pick = NULL;
    int64_t *runs = NULL;
    int32_t *bucket = NULL;
    /* The tally of values per bucket, zero between calls (each use clears what it set): a static
     * buffer, so a window neither allocates nor clears it (it would pull its 16 KB into the cache).
     * The GIL, held throughout, keeps two timers' windows from sharing it at once. */
    static int32_t tally[4096];
    PyObject *stats = NULL, *runs_b = NULL, *bounds = NULL, *totals = NULL, *out = NULL;
    if (!gs || !count || !fill || !start) { PyErr_NoMemory(); goto done; }
    if (!edges_for(base, inv_log_ratio, nbuckets)) goto done;
    Py_ssize_t nvals = 0;
    for (Py_ssize_t i = 0; i < ng; i++) {
        if (!parse_group(PyList_GET_ITEM(groups, i), &gs[i], nser, skip_warm)) goto done;
        nvals += (gs[i].n - gs[i].first) * gs[i].nser;
    }
    vals = PyMem_Malloc((nvals + 1) * sizeof(double));
    totals = PyList_New(ng);
    if (!vals || !totals) { if (!PyErr_Occurred()) PyErr_NoMemory(); goto done; }
    /* Each series' values go to their own region, sized by the rows that can give one. */
    for (Py_ssize_t i = 0; i < ng; i++)
        for (Py_ssize_t j = 0; j < gs[i].nser; j++) count[gs[i].sids[j]] += gs[i].n - gs[i].first;
    for (Py_ssize_t s = 0, off = 0; s < nser; s++) { start[s] = fill[s] = off; off += count[s]; }
    for (Py_ssize_t i = 0; i < ng; i++) {
        const group_t *g = &gs[i];
        double cycle = 0.0, samples = 0.0, tokens = 0.0;
        Py_ssize_t n_samples = 0, n_tokens = 0;
        PyObject *sums = PyList_New(g->nser);
        double *acc = PyMem_Calloc(g->nser + 1, sizeof(double));
        if (!sums || !acc) { Py_XDECREF(sums); PyMem_Free(acc); if (!PyErr_Occurred()) PyErr_NoMemory(); goto done; }
        for (Py_ssize_t r = g->first; r < g->n; r++) {
            const double *row = g->rows + r * g->m;
            Py_ssize_t k = 2;
            for (Py_ssize_t j = 0; j < g->nser; j++) {
                double v;
                k = derive(g->spec, k, row, &v);
                if (v != v) continue;
                vals[fill[g->sids[j]]++] = v;
                acc[j] += v;
            }
            double gap = row[C_GAP_S];
            cycle += row[C_STEP_S] * 1e3 + (gap == gap ? gap * 1e3 : 0.0);
            if (row[C_SAMPLES] == row[C_SAMPLES]) { samples += row[C_SAMPLES]; n_samples++; }
            if (row[C_TOKENS] == row[C_TOKENS]) { tokens += row[C_TOKENS]; n_tokens++; }
        }
        for (Py_ssize_t j = 0; j < g->nser; j++) {
            PyObject *f = PyFloat_FromDouble(acc[j]);
            if (!f) { Py_DECREF(sums); PyMem_Free(acc); goto done; }
            PyList_SET_ITEM(sums, j, f);
        }
        PyMem_Free(acc);
        PyObject *t = Py_BuildValue("(nddndnN)", g->n - g->first, cycle, samples, n_samples, tokens, n_tokens, sums);
        if (!t) goto done;
        PyList_SET_ITEM(totals, i, t);
    }
    for (Py_ssize_t s = 0; s < nser; s++) count[s] = fill[s] - start[s];
    /* Per series: the bucket of each value, then the runs of equal buckets from a count per bucket
     * (no sort: buckets are monotone in the value), and each nearest-rank quantile as the right
     * rank among the few values of its bucket. A series spread over more buckets than SPAN is
     * sorted instead. */
    enum { SPAN = 4096 };
    stats = PyBytes_FromStringAndSize(NULL, 7 * nser * (Py_ssize_t)sizeof(double));
    runs = PyMem_Malloc((3 * nvals + 1) * sizeof(int64_t));
    bounds = PyList_New(nser + 1);
    bucket = PyMem_Malloc((nvals + 1) * sizeof(int32_t));
    Py_ssize_t maxc = 0; /* pick holds one series' values at most */
    for (Py_ssize_t s = 0; s < nser; s++) if (count[s] > maxc) maxc = count[s];
    pick = PyMem_Malloc((maxc + 1) * sizeof(double));
    if (!stats || !runs || !bounds || !bucket || !pick) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    double *st = (double *)PyBytes_AS_STRING(stats);
    Py_ssize_t nruns = 0;
    for (Py_ssize_t s = 0; s < nser; s++) {
        Py_ssize_t c = count[s];
        double *v = vals + start[s];
        int32_t *bk = bucket + start[s];
        PyObject *b0 = PyLong_FromSsize_t(nruns);
        if (!b0) goto done;
        PyList_SET_ITEM(bounds, s, b0);
        st[s] = (double)c;
        if (c == 0) {
            st[nser + s] = st[2 * nser + s] = 0.0;
            st[3 * nser + s] = st[4 * nser + s] = st[5 * nser + s] = st[6 * nser + s] = NAN;
            continue;
        }
        double sum = 0.0, sumsq = 0.0, lo = v[0], hi = v[0];
        int64_t bmin = nbuckets, bmax = -1;
        for (Py_ssize_t i = 0; i < c; i++) {
            double x = v[i];
            sum += x;
            sumsq += x * x;
            if (x < lo) lo = x;
            if (x > hi) hi = x;
            int64_t b = bucket_fast(x);
            bk[i] = b;
            if (b < bmin) bmin = b;
            if (b > bmax) bmax = b;
        }
        st[nser + s] = sum;
        st[2 * nser + s] = sumsq;
        st[3 * nser + s] = lo;
        st[4 * nser + s] = hi;
        Py_ssize_t ranks[2] = {(Py_ssize_t)ceil(0.5 * (double)c) - 1, (Py_ssize_t)ceil(0.9 * (double)c) - 1};
        if (bmax - bmin < SPAN) {
            Py_ssize_t span = (Py_ssize_t)(bmax - bmin + 1);
            for (Py_ssize_t i = 0; i < c; i++) tally[bk[i] - bmin]++;
            for (int q = 0; q < 2; q++) {
                Py_ssize_t below = 0, j = 0;
                while (below + tally[j] <= ranks[q]) below += tally[j++];
                Py_ssize_t m = 0;
                for (Py_ssize_t i = 0; i < c; i++)
                    if (bk[i] == bmin + j) pick[m++] = v[i];
                sort_doubles(pick, m);
                st[(5 + q) * nser + s] = pick[ranks[q] - below];
            }
            for (Py_ssize_t j = 0; j < span; j++) {
                if (!tally[j]) continue;
                runs[nruns] = s;
                runs[nvals + nruns] = bmin + j;
                runs[2 * nvals + nruns] = tally[j];
                nruns++;
                tally[j] = 0;
            }
        } else {
            sort_doubles(v, c);
            for (Py_ssize_t i = 0; i < c; i++) bk[i] = bucket_fast(v[i]);
            st[5 * nser + s] = v[ranks[0]];
            st[6 * nser + s] = v[ranks[1]];
            int64_t last = -1;
            for (Py_ssize_t i = 0; i < c; i++) {
                int64_t b = bk[i];
                if (b != last) {
                    runs[nruns] = s;
                    runs[nvals + nruns] = b;
                    runs[2 * nvals + nruns] = 0;
                    nruns++;
                    last = b;
                }
                runs[2 * nvals + nruns - 1]++;
            }
        }
    }
    PyObject *b1 = PyLong_FromSsize_t(nruns);
    if (!b1) goto done;
    PyList_SET_ITEM(bounds, nser, b1);
    runs_b = PyBytes_FromStringAndSize(NULL, 3 * nruns * (Py_ssize_t)sizeof(int64_t));
    if (!runs_b) goto done;
    int64_t *rb = (int64_t *)PyBytes_AS_STRING(runs_b);
    memcpy(rb, runs, nruns * sizeof(int64_t));
    memcpy(rb + nruns, runs + nvals, nruns * sizeof(int64_t));
    memcpy(rb + 2 * nruns, runs + 2 * nvals, nruns * sizeof(int64_t));
    /* The per-series lists every reader takes (count as ints), then the buffers, bounds and totals. */
    out = PyTuple_New(11);
    if (!out) goto done;
    for (int k = 0; k < 7; k++) {
        PyObject *l = PyList_New(nser);
        if (!l) { Py_CLEAR(out); goto done; }
        PyTuple_SET_ITEM(out, k, l);
        for (Py_ssize_t s = 0; s < nser; s++) {
            double x = st[k * nser + s];
            PyObject *o = k ? PyFloat_FromDouble(x) : PyLong_FromSsize_t((Py_ssize_t)x);
            if (!o) { Py_CLEAR(out); goto done; }
            PyList_SET_ITEM(l, s, o);
        }
    }
    PyTuple_SET_ITEM(out, 7, Py_NewRef(stats));
    PyTuple_SET_ITEM(out, 8, Py_NewRef(runs_b));
    PyTuple_SET_ITEM(out, 9, Py_NewRef(bounds));
    PyTuple_SET_ITEM(out, 10, Py_NewRef(totals));
done:
    Py_XDECREF(stats);
    Py_XDECREF(runs_b);
    Py_XDECREF(bounds);
    Py_XDECREF(totals);
    if (gs)
        for (Py_ssize_t i = 0; i < ng; i++)
            if (gs[i].has_view) PyBuffer_Release(&gs[i].view);
    PyMem_Free(gs);
    PyMem_Free(count);
    PyMem_Free(fill);
    PyMem_Free(start);
    PyMem_Free(vals);
    PyMem_Free(runs);
    PyMem_Free(bucket);
    PyMem_Free(pick);
    return out;
}

/* ------------------------------------------------------------------------------------------------
 * Phase and Step: `with timer.phase(name):` and `with timer.step():` in C, the same logic as
 * steptimer/timer.py's _Phase and _Step (which stay as the fallback; tests run the engine's suite
 * through both). They read and write the StepTimer's per-step state in its __dict__ with interned
 * keys: each access is a dict lookup instead of a Python attribute access inside a Python frame,
 * which is most of a step's and a phase boundary's host cost. Step takes the timed CUDA step's
 * path (the common one, lag 0 included) and an untimed step's short path, and hands every other case
 * (errors, a stream switch's bookkeeping, a step with a trace capture) to the Python code, unchanged.
 */
typedef struct {
    PyObject_HEAD
    PyObject *timer, *dict, *clock;
    double share_s;
    int monotonic; /* clock is time.perf_counter, read here directly */
} Base;

typedef struct {
    Base b;
    PyObject *name;
    int active;
} Phase;

static PyObject *K_in_step, *K_timed, *K_gpu, *K_stack, *K_recs, *K_evs, *K_free, *K_last_t, *K_last_i,
    *K_record, *K_stream, *K_new_event, *K_slash, *K_cuda, *K_closed, *K_number, *K_next_timed,
    *K_get_stream_key, *K_stream_key, *K_switch_stream, *K_is_capturing, *K_t0, *K_first_number,
    *K_warmup_steps, *K_samples, *K_tokens, *K_pause_evs, *K_gap_start, *K_paused_s, *K_device, *K_pending,
    *K_pending_events, *K_lag, *K_wait, *K_wait_for, *K_resolve, *K_sample_every, *K_pick_timed, *K_trace,
    *K_offsets, *K_elapsed, *K_held_end, *K_rows, *K_add, *K_last_resolved, *K_log_every, *K_emit,
    *K_append, *K_popleft, *K_events, *K_i_end, *K_enter, *K_exit, *K_untimed, *K_phase_cms, *K_group, *K_flat,
    *K_unchecked, *K_streams_vary, *K_kw_samples, *K_kw_tokens;

static int intern_keys(void) {
    struct { PyObject **k; const char *s; } keys[] = {
        {&K_in_step, "_in_step"}, {&K_timed, "_timed"}, {&K_gpu, "_gpu"}, {&K_stack, "_stack"},
        {&K_recs, "_recs"}, {&K_evs, "_evs"}, {&K_free, "_free"}, {&K_last_t, "_last_t"},
        {&K_last_i, "_last_i"}, {&K_record, "_record"}, {&K_stream, "_stream"},
        {&K_new_event, "_new_event"}, {&K_slash, "/"}, {&K_cuda, "_cuda"}, {&K_closed, "_closed"},
        {&K_number, "_number"}, {&K_next_timed, "_next_timed"}, {&K_get_stream_key, "_get_stream_key"},
        {&K_stream_key, "_stream_key"}, {&K_switch_stream, "_switch_stream"},
        {&K_is_capturing, "_is_capturing"}, {&K_t0, "_t0"}, {&K_first_number, "_first_number"},
        {&K_warmup_steps, "warmup_steps"}, {&K_samples, "_samples"}, {&K_tokens, "_tokens"},
        {&K_pause_evs, "_pause_evs"}, {&K_gap_start, "_gap_start"}, {&K_paused_s, "_paused_s"},
        {&K_device, "_device"}, {&K_pending, "_pending"}, {&K_pending_events, "_pending_events"},
        {&K_lag, "lag"}, {&K_wait, "_wait"}, {&K_wait_for, "_wait_for"}, {&K_resolve, "_resolve"},
        {&K_sample_every, "sample_every"}, {&K_pick_timed, "_pick_timed"}, {&K_trace, "_trace"},
        {&K_offsets, "_offsets"}, {&K_elapsed, "_elapsed"}, {&K_held_end, "_held_end"}, {&K_rows, "_rows"},
        {&K_add, "add"}, {&K_last_resolved, "_last_resolved"}, {&K_log_every, "log_every_n_steps"},
        {&K_emit, "_emit"}, {&K_append, "append"}, {&K_popleft, "popleft"}, {&K_events, "events"},
        {&K_i_end, "i_end"}, {&K_enter, "__enter__"}, {&K_exit, "__exit__"}, {&K_untimed, "_untimed"}, {&K_group, "group"}, {&K_flat, "flat"},
        {&K_phase_cms, "_phase_cms"}, {&K_unchecked, "_unchecked"}, {&K_streams_vary, "_streams_vary"},
        {&K_kw_samples, "samples"}, {&K_kw_tokens, "tokens"},
    };
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (!(*keys[i].k = PyUnicode_InternFromString(keys[i].s))) return 0;
    return 1;
}

/* A borrowed value from the timer's __dict__; NULL with an exception if missing. */
static PyObject *get(Base *b, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(b->dict, key);
    if (!v && !PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, key);
    return v;
}

static int truthy(Base *b, PyObject *key) {
    PyObject *v = get(b, key);
    return v ? PyObject_IsTrue(v) : -1;
}

/* Set the timer's attribute to a new reference (stolen); -1 with an exception. */
static int put(Base *b, PyObject *key, PyObject *v) {
    if (!v) return -1;
    int err = PyDict_SetItem(b->dict, key, v);
    Py_DECREF(v);
    return err;
}

static int get_ll(Base *b, PyObject *key, long long *out) {
    PyObject *v = get(b, key);
    if (!v) return -1;
    *out = PyLong_AsLongLong(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static int get_double(Base *b, PyObject *key, double *out) {
    PyObject *v = get(b, key);
    if (!v) return -1;
    *out = PyFloat_AsDouble(v);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

static double now(Base *b) {
    if (b->monotonic) {
        /* time.perf_counter() on Linux: CLOCK_MONOTONIC in integer ns, then seconds as a double,
         * computed the way CPython does, so the values are the same as Python's. */
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        int64_t ns = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
        return ns % 1000000000 == 0 ? (double)(ns / 1000000000) : (double)ns / 1e9;
    }
    PyObject *t = PyObject_CallNoArgs(b->clock);
    if (!t) return -1.0;
    double x = PyFloat_AsDouble(t);
    Py_DECREF(t);
    return x;
}
#define NOW_FAILED(x) ((x) == -1.0 && PyErr_Occurred())

static int base_init(Base *b, PyObject *timer, PyObject *clock, double share_s) {
    PyObject *dict = PyObject_GenericGetDict(timer, NULL);
    if (!dict) return -1;
    Py_XSETREF(b->dict, dict);
    Py_XSETREF(b->timer, Py_NewRef(timer));
    Py_XSETREF(b->clock, Py_NewRef(clock));
    b->share_s = share_s;
    b->monotonic = 0;
#ifdef __linux__
    PyObject *time_mod = PyImport_ImportModule("time");
    if (!time_mod) return -1;
    PyObject *pc = PyObject_GetAttrString(time_mod, "perf_counter");
    Py_DECREF(time_mod);
    if (!pc) return -1;
    b->monotonic = pc == clock;
    Py_DECREF(pc);
#endif
    return 0;
}

static int base_traverse(Base *b, visitproc visit, void *arg) {
    Py_VISIT(b->timer);
    Py_VISIT(b->dict);
    Py_VISIT(b->clock);
    return 0;
}

static void base_clear(Base *b) {
    Py_CLEAR(b->timer);
    Py_CLEAR(b->dict);
    Py_CLEAR(b->clock);
}

/* An event from the pool (the timer's _free list) or a new one; a new reference. */
static PyObject *take_event(Base *b) {
    PyObject *free = get(b, K_free);
    if (!free) return NULL;
    Py_ssize_t nfree = PyList_GET_SIZE(free);
    if (nfree == 0) return PyObject_CallMethodNoArgs(b->timer, K_new_event);
    PyObject *ev = Py_NewRef(PyList_GET_ITEM(free, nfree - 1));
    if (PyList_SetSlice(free, nfree - 1, nfree, NULL) < 0) { Py_DECREF(ev); return NULL; }
    return ev;
}

static int record_event(Base *b, PyObject *ev) {
    PyObject *record = get(b, K_record), *stream = get(b, K_stream);
    if (!record || !stream) return -1;
    PyObject *args[2] = {ev, stream};
    PyObject *r = PyObject_Vectorcall(record, args, 2, NULL);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

/* The boundary event at host time t (shared with the last record when it is within share_s):
 * its index in _evs, or -2 with an exception. Updates _last_i; returns the new t in *t_out. The
 * caller sets _last_t when it returns (mark_last), so the gap compared with share_s is the time spent
 * outside steptimer's calls, where user code could have launched work. */
static Py_ssize_t boundary(Base *b, double t, double *t_out) {
    *t_out = t;
    double lt;
    if (get_double(b, K_last_t, &lt) < 0) return -2;
    if (t - lt < b->share_s) {
        PyObject *li = get(b, K_last_i);
        Py_ssize_t i = li ? PyLong_AsSsize_t(li) : -2;
        return i == -1 && PyErr_Occurred() ? -2 : i;
    }
    PyObject *evs = get(b, K_evs);
    if (!evs) return -2;
    PyObject *ev = take_event(b);
    if (!ev) return -2;
    if (record_event(b, ev) < 0) { Py_DECREF(ev); return -2; }
    Py_ssize_t i = PyList_GET_SIZE(evs);
    int err = PyList_Append(evs, ev);
    Py_DECREF(ev);
    if (err < 0 || put(b, K_last_i, PyLong_FromSsize_t(i)) < 0) return -2;
    double t2 = now(b);
    if (NOW_FAILED(t2)) return -2;
    *t_out = t2;
    return i;
}

/* _last_t = now, as the last thing a boundary-making call does before it returns to user code. */
static int mark_last(Base *b) {
    double t = now(b);
    if (NOW_FAILED(t)) return -1;
    return put(b, K_last_t, PyFloat_FromDouble(t));
}

static PyObject *phase_enter(Phase *ph, PyObject *unused) {
    Base *b = &ph->b;
    double t0 = now(b); /* first: the gap since the last boundary leaves out this call's own work */
    if (NOW_FAILED(t0)) return NULL;
    int in_step = truthy(b, K_in_step);
    if (in_step < 0) return NULL;
    if (!in_step) {
        PyErr_Format(PyExc_RuntimeError, "phase(%R) entered outside a step: put it inside `with timer.step():`",
                     ph->name);
        return NULL;
    }
    int timed = truthy(b, K_timed);
    if (timed <= 0) return timed < 0 ? NULL : Py_NewRefNone();
    if (ph->active) {
        PyErr_Format(PyExc_RuntimeError, "phase %R is already open: a phase cannot be reopened inside itself",
                     ph->name);
        return NULL;
    }
    PyObject *stack = get(b, K_stack);
    if (!stack) return NULL;
    Py_ssize_t i = -1;
    int gpu = truthy(b, K_gpu);
    if (gpu < 0) return NULL;
    if (gpu && (i = boundary(b, t0, &t0)) == -2) return NULL;
    PyObject *full;
    Py_ssize_t depth = PyList_GET_SIZE(stack);
    if (depth) {
        PyObject *outer = PyTuple_GET_ITEM(PyList_GET_ITEM(stack, depth - 1), 0);
        PyObject *a = PyUnicode_Concat(outer, K_slash);
        full = a ? PyUnicode_Concat(a, ph->name) : NULL;
        Py_XDECREF(a);
    } else {
        full = Py_NewRef(ph->name);
    }
    if (!full) return NULL;
    PyObject *entry = PyTuple_New(4), *pt0 = PyFloat_FromDouble(t0), *pi = PyLong_FromSsize_t(i);
    if (!entry || !pt0 || !pi) { Py_XDECREF(entry); Py_XDECREF(pt0); Py_XDECREF(pi); Py_DECREF(full); return NULL; }
    PyTuple_SET_ITEM(entry, 0, full);
    PyTuple_SET_ITEM(entry, 1, Py_NewRef(ph->name));
    PyTuple_SET_ITEM(entry, 2, pt0);
    PyTuple_SET_ITEM(entry, 3, pi);
    int err = PyList_Append(stack, entry);
    Py_DECREF(entry);
    if (err < 0 || (gpu && mark_last(b) < 0)) return NULL;
    ph->active = 1;
    Py_RETURN_NONE;
}

static PyObject *phase_exit(Phase *ph, PyObject *const *args, Py_ssize_t nargs) {
    Base *b = &ph->b;
    double t1 = now(b); /* first, as in phase_enter */
    if (NOW_FAILED(t1)) return NULL;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "__exit__(exc_type, exc, tb)");
        return NULL;
    }
    int in_step = truthy(b, K_in_step);
    if (in_step < 0) return NULL;
    int timed = in_step ? truthy(b, K_timed) : 0;
    if (timed < 0) return NULL;
    if (!timed) Py_RETURN_FALSE;
    PyObject *stack = get(b, K_stack);
    if (!stack) return NULL;
    Py_ssize_t depth = PyList_GET_SIZE(stack);
    PyObject *top = depth ? PyList_GET_ITEM(stack, depth - 1) : NULL;
    int same = 0;
    if (top) {
        same = PyUnicode_Compare(PyTuple_GET_ITEM(top, 1), ph->name) == 0;
        if (!same && PyErr_Occurred()) return NULL;
    }
    if (!same) {
        if (args[0] == Py_None) {
            PyErr_Format(PyExc_RuntimeError,
                         "phase %R exited while %R is open: phases must nest (exit the inner phase first)", ph->name,
                         top ? PyTuple_GET_ITEM(top, 0) : Py_None);
            return NULL;
        }
        Py_RETURN_FALSE;
    }
    Py_INCREF(top);
    if (PyList_SetSlice(stack, depth - 1, depth, NULL) < 0) { Py_DECREF(top); return NULL; }
    ph->active = 0;
    Py_ssize_t i_out = -1;
    int gpu = truthy(b, K_gpu);
    double t_after;
    if (gpu < 0 || (gpu && (i_out = boundary(b, t1, &t_after)) == -2)) { Py_DECREF(top); return NULL; }
    PyObject *recs = get(b, K_recs);
    if (!recs) { Py_DECREF(top); return NULL; }
    PyObject *rec = PyTuple_New(5), *pt1 = PyFloat_FromDouble(t1), *po = PyLong_FromSsize_t(i_out);
    if (!rec || !pt1 || !po) { Py_XDECREF(rec); Py_XDECREF(pt1); Py_XDECREF(po); Py_DECREF(top); return NULL; }
    PyTuple_SET_ITEM(rec, 0, Py_NewRef(PyTuple_GET_ITEM(top, 0)));
    PyTuple_SET_ITEM(rec, 1, Py_NewRef(PyTuple_GET_ITEM(top, 2)));
    PyTuple_SET_ITEM(rec, 2, pt1);
    PyTuple_SET_ITEM(rec, 3, Py_NewRef(PyTuple_GET_ITEM(top, 3)));
    PyTuple_SET_ITEM(rec, 4, po);
    Py_DECREF(top);
    int err = PyList_Append(recs, rec);
    Py_DECREF(rec);
    if (err < 0 || (gpu && mark_last(b) < 0)) return NULL;
    Py_RETURN_FALSE;
}

static int phase_init(Phase *ph, PyObject *args, PyObject *kw) {
    PyObject *timer, *name, *clock;
    double share_s;
    if (!PyArg_ParseTuple(args, "OUOd", &timer, &name, &clock, &share_s)) return -1;
    if (base_init(&ph->b, timer, clock, share_s) < 0) return -1;
    Py_XSETREF(ph->name, Py_NewRef(name));
    ph->active = 0;
    return 0;
}

static int phase_traverse(Phase *ph, visitproc visit, void *arg) { return base_traverse(&ph->b, visit, arg); }

static int phase_clear(Phase *ph) {
    base_clear(&ph->b);
    Py_CLEAR(ph->name);
    return 0;
}

static void phase_dealloc(Phase *ph) {
    PyObject_GC_UnTrack(ph);
    phase_clear(ph);
    Py_TYPE(ph)->tp_free((PyObject *)ph);
}

static PyObject *phase_get_active(Phase *ph, void *unused) { return PyBool_FromLong(ph->active); }
static int phase_set_active(Phase *ph, PyObject *v, void *unused) {
    int t = v ? PyObject_IsTrue(v) : 0;
    if (t < 0) return -1;
    ph->active = t;
    return 0;
}
static PyObject *phase_get_name(Phase *ph, void *unused) { return Py_NewRef(ph->name); }

static PyMethodDef phase_methods[] = {
    {"__enter__", (PyCFunction)phase_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))phase_exit, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef phase_getset[] = {
    {"_active", (getter)phase_get_active, (setter)phase_set_active, NULL, NULL},
    {"_name", (getter)phase_get_name, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PhaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_steptimer_cudart.Phase",
    .tp_basicsize = sizeof(Phase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Phase(timer, name, clock, share_s): `with timer.phase(name):` in C",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)phase_init,
    .tp_dealloc = (destructor)phase_dealloc,
    .tp_traverse = (traverseproc)phase_traverse,
    .tp_clear = (inquiry)phase_clear,
    .tp_methods = phase_methods,
    .tp_getset = phase_getset,
};

/* Pending: a finished step whose GPU events may not have completed yet; the twin of timer.py's
 * _Pending, with the same attributes, so the Python code reads either kind. */
typedef struct {
    PyObject_HEAD
    long long number;
    double t0, step_s, wait_s;
    PyObject *gap_s, *phases, *events, *pauses, *samples, *tokens;
    Py_ssize_t i_start, i_end;
    int device;
    char timed, warmup;
} Pending;

static PyMemberDef pending_members[] = {
    {"number", T_LONGLONG, offsetof(Pending, number), 0, NULL},
    {"t0", T_DOUBLE, offsetof(Pending, t0), 0, NULL},
    {"step_s", T_DOUBLE, offsetof(Pending, step_s), 0, NULL},
    {"wait_s", T_DOUBLE, offsetof(Pending, wait_s), 0, NULL},
    {"gap_s", T_OBJECT, offsetof(Pending, gap_s), 0, NULL},
    {"phases", T_OBJECT_EX, offsetof(Pending, phases), 0, NULL},
    {"events", T_OBJECT_EX, offsetof(Pending, events), 0, NULL},
    {"pauses", T_OBJECT_EX, offsetof(Pending, pauses), 0, NULL},
    {"samples", T_OBJECT, offsetof(Pending, samples), 0, NULL},
    {"tokens", T_OBJECT, offsetof(Pending, tokens), 0, NULL},
    {"i_start", T_PYSSIZET, offsetof(Pending, i_start), 0, NULL},
    {"i_end", T_PYSSIZET, offsetof(Pending, i_end), 0, NULL},
    {"device", T_INT, offsetof(Pending, device), 0, NULL},
    {"timed", T_BOOL, offsetof(Pending, timed), 0, NULL},
    {"warmup", T_BOOL, offsetof(Pending, warmup), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static int pending_traverse(Pending *p, visitproc visit, void *arg) {
    Py_VISIT(p->gap_s);
    Py_VISIT(p->phases);
    Py_VISIT(p->events);
    Py_VISIT(p->pauses);
    Py_VISIT(p->samples);
    Py_VISIT(p->tokens);
    return 0;
}

static int pending_clear(Pending *p) {
    Py_CLEAR(p->gap_s);
    Py_CLEAR(p->phases);
    Py_CLEAR(p->events);
    Py_CLEAR(p->pauses);
    Py_CLEAR(p->samples);
    Py_CLEAR(p->tokens);
    return 0;
}

static void pending_dealloc(Pending *p) {
    PyObject_GC_UnTrack(p);
    pending_clear(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyTypeObject PendingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_steptimer_cudart.Pending",
    .tp_basicsize = sizeof(Pending),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A finished step whose GPU events may not have completed yet (timer.py's _Pending)",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)pending_dealloc,
    .tp_traverse = (traverseproc)pending_traverse,
    .tp_clear = (inquiry)pending_clear,
    .tp_members = pending_members,
};

typedef struct { PyObject *rows, *names, *flat; int gpu, idle; Py_ssize_t m; } rowcache_t;

typedef struct {
    Base b;
    PyObject *fallback; /* timer.py's _Step for this timer: every case the C path does not take */
    PyObject *names;    /* the last step's phase names (a tuple), reused while they repeat */
    PyObject *untimed;  /* timer.py's _UNTIMED, the row layout of an untimed step */
    /* Where the last row went, per path (0 timed, 1 untimed): the window's StepRows, the layout, and
     * that group's `flat` bytearray, so the next row of the same layout in the same window is appended
     * to it directly (no row list, no key tuple, no Python call). */
    rowcache_t rc[2];
    vectorcallfunc vc; /* timer.step(samples=, tokens=) */
} Step;

static PyObject *call1(PyObject *f, PyObject *a) { return PyObject_Vectorcall(f, &a, 1, NULL); }

/* None as NaN, else the number as a double (-1.0 with an exception set if it is not one). */
static double nan_of(PyObject *v) { return v == Py_None ? NAN : PyFloat_AsDouble(v); }

/* Append a row of m doubles to the window's rows (`rows`, the timer's StepRows) in the group of layout
 * (names, gpu, idle): StepRows.add's work, with the group's bytearray found through st->rc[slot]. A
 * warm-up row goes through StepRows.add in Python (it counts warm-up rows); so does a group's first
 * row in a window (StepRows.group makes the group). */
static int append_row(Step *st, int slot, PyObject *rows, PyObject *names, int gpu, int idle, const double *v,
                      Py_ssize_t m, int warmup) {
    PyObject *key = NULL, *res = NULL;
    if (warmup) {
        PyObject *row = PyList_New(m);
        if (!row) return -1;
        for (Py_ssize_t k = 0; k < m; k++) {
            PyObject *f = PyFloat_FromDouble(v[k]);
            if (!f) { Py_DECREF(row); return -1; }
            PyList_SET_ITEM(row, k, f);
        }
        key = PyTuple_Pack(3, names, gpu ? Py_True : Py_False, idle ? Py_True : Py_False);
        if (key) {
            PyObject *args[4] = {rows, key, row, Py_True};
            res = PyObject_VectorcallMethod(K_add, args, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        }
        Py_DECREF(row);
        Py_XDECREF(key);
        if (!res) return -1;
        Py_DECREF(res);
        return 0;
    }
    rowcache_t *c = &st->rc[slot];
    if (c->rows != rows || c->names != names || c->gpu != gpu || c->idle != idle || c->m != m || !c->flat) {
        key = PyTuple_Pack(3, names, gpu ? Py_True : Py_False, idle ? Py_True : Py_False);
        PyObject *mm = PyLong_FromSsize_t(m);
        if (key && mm) {
            PyObject *args[3] = {rows, key, mm};
            res = PyObject_VectorcallMethod(K_group, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        }
        Py_XDECREF(key);
        Py_XDECREF(mm);
        if (!res) return -1;
        PyObject *flat = PyObject_GetAttr(res, K_flat);
        Py_DECREF(res);
        if (!flat) return -1;
        if (!PyByteArray_CheckExact(flat)) {
            Py_DECREF(flat);
            PyErr_SetString(PyExc_TypeError, "steptimer: a row group's flat must be a bytearray");
            return -1;
        }
        Py_XSETREF(c->flat, flat);
        Py_XSETREF(c->rows, Py_NewRef(rows));
        Py_XSETREF(c->names, Py_NewRef(names));
        c->gpu = gpu;
        c->idle = idle;
        c->m = m;
    }
    Py_ssize_t n0 = PyByteArray_GET_SIZE(c->flat);
    if (PyByteArray_Resize(c->flat, n0 + m * (Py_ssize_t)sizeof(double)) < 0) return -1;
    memcpy(PyByteArray_AS_STRING(c->flat) + n0, v, (size_t)m * sizeof(double));
    return 0;
}

/* Whether the timer's stream is capturing a CUDA graph: 1, 0, or -1 with an exception. */
static int stream_capturing(Base *b) {
    PyObject *is_cap = get(b, K_is_capturing), *stream = get(b, K_stream);
    if (!is_cap || !stream) return -1;
    PyObject *cap = call1(is_cap, stream);
    int capturing = cap ? PyObject_IsTrue(cap) : -1;
    Py_XDECREF(cap);
    return capturing;
}

static int step_enter_fast(Step *st) {
    /* The timed CUDA step (_begin_step's path when the stream key is unchanged; the caller checked
     * that this step is the one to time); 1 if taken, 0 if not, -1 with an exception. */
    Base *b = &st->b;
    PyObject *cuda = get(b, K_cuda), *in_step = get(b, K_in_step), *closed = get(b, K_closed);
    if (!cuda || !in_step || !closed) return -1;
    if (cuda != Py_True || in_step != Py_False || closed != Py_False) return 0;
    double t0 = now(b);
    if (NOW_FAILED(t0)) return -1;
    if (PyDict_SetItem(b->dict, K_timed, Py_True) < 0 || PyDict_SetItem(b->dict, K_in_step, Py_True) < 0 ||
        put(b, K_recs, PyList_New(0)) < 0 || put(b, K_last_t, PyFloat_FromDouble(-INFINITY)) < 0 ||
        PyDict_SetItem(b->dict, K_gpu, Py_True) < 0)
        return -1;
    PyObject *get_key = get(b, K_get_stream_key), *old_key = get(b, K_stream_key), *lagv = get(b, K_lag),
             *vary = get(b, K_streams_vary);
    if (!get_key || !old_key || !lagv || !vary) return -1;
    long long lag = PyLong_AsLongLong(lagv);
    if (lag == -1 && PyErr_Occurred()) return -1;
    if (lag == 0 && old_key != Py_None && vary == Py_False) {
        /* Strict mode: the checks move to the step's end (_begin_step, _check_stream_at_end). */
        if (PyDict_SetItem(b->dict, K_unchecked, Py_True) < 0) return -1;
    } else {
        PyObject *key = PyObject_CallNoArgs(get_key);
        if (!key) return -1;
        int same = PyObject_RichCompareBool(key, old_key, Py_EQ);
        if (same <= 0) {
            PyObject *r = same < 0 ? NULL : PyObject_CallMethodOneArg(b->timer, K_switch_stream, key);
            if (!r) { Py_DECREF(key); return -1; }
            Py_DECREF(r);
        }
        Py_DECREF(key);
        int capturing = stream_capturing(b);
        if (capturing < 0) return -1;
        if (capturing) {
            if (PyDict_SetItem(b->dict, K_in_step, Py_False) < 0) return -1;
            PyErr_SetString(PyExc_RuntimeError,
                            "step() inside CUDA graph capture: steptimer cannot record timing events into a graph. "
                            "Put `with timer.step():` around the graph replay, not inside the capture");
            return -1;
        }
    }
    PyObject *ev = take_event(b);
    if (!ev) return -1;
    if (record_event(b, ev) < 0) { Py_DECREF(ev); return -1; }
    PyObject *evs = PyList_New(1);
    if (!evs) { Py_DECREF(ev); return -1; }
    PyList_SET_ITEM(evs, 0, ev);
    if (put(b, K_evs, evs) < 0 || put(b, K_last_i, PyLong_FromLong(0)) < 0 || put(b, K_t0, PyFloat_FromDouble(t0)) < 0 ||
        mark_last(b) < 0)
        return -1;
    return 1;
}

/* An untimed step (sample_every) with nothing in flight (_Step.__enter__'s short path): 1 if taken, 0 if
 * not, -1 with an exception. */
static int step_enter_untimed(Step *st, long long number, long long next_timed) {
    Base *b = &st->b;
    PyObject *cuda = get(b, K_cuda), *in_step = get(b, K_in_step), *closed = get(b, K_closed),
             *pause_evs = get(b, K_pause_evs), *pending = get(b, K_pending);
    if (!cuda || !in_step || !closed || !pause_evs || !pending) return -1;
    if (cuda == Py_None || in_step != Py_False || closed != Py_False || !PyList_Check(pause_evs) ||
        PyList_GET_SIZE(pause_evs))
        return 0;
    if (number + 2 == next_timed) return 0; /* the step before a timed one marks its end: _begin_step */
    long long pe;
    if (get_ll(b, K_pending_events, &pe) < 0) return -1;
    Py_ssize_t np = PyObject_Size(pending);
    if (np < 0) return -1;
    if (pe || np) return 0;
    if (put(b, K_evs, PyList_New(0)) < 0 || PyDict_SetItem(b->dict, K_in_step, Py_True) < 0 ||
        PyDict_SetItem(b->dict, K_untimed, Py_True) < 0)
        return -1;
    double t0 = now(b);
    if (NOW_FAILED(t0) || put(b, K_t0, PyFloat_FromDouble(t0)) < 0) return -1;
    return 1;
}

static PyObject *step_enter(Step *st, PyObject *unused) {
    /* Which step this is decides the path: the timed one, or an untimed one (sample_every). */
    long long number, next_timed;
    if (get_ll(&st->b, K_number, &number) < 0 || get_ll(&st->b, K_next_timed, &next_timed) < 0) return NULL;
    int taken = number + 1 == next_timed ? step_enter_fast(st) : step_enter_untimed(st, number, next_timed);
    if (taken < 0) return NULL;
    if (taken) Py_RETURN_NONE;
    return PyObject_CallMethodNoArgs(st->fallback, K_enter);
}

/* The phase names of a step's records as a tuple; the last step's tuple when they are the same. */
static PyObject *names_of(Step *st, PyObject *recs) {
    Py_ssize_t r = PyList_GET_SIZE(recs);
    PyObject *last = st->names;
    if (last && PyTuple_GET_SIZE(last) == r) {
        Py_ssize_t k = 0;
        for (; k < r; k++) {
            PyObject *a = PyTuple_GET_ITEM(PyList_GET_ITEM(recs, k), 0), *c = PyTuple_GET_ITEM(last, k);
            if (a != c) {
                int eq = PyUnicode_Compare(a, c);
                if (eq == -1 && PyErr_Occurred()) return NULL;
                if (eq) break;
            }
        }
        if (k == r) return Py_NewRef(last);
    }
    PyObject *names = PyTuple_New(r);
    if (!names) return NULL;
    for (Py_ssize_t k = 0; k < r; k++)
        PyTuple_SET_ITEM(names, k, Py_NewRef(PyTuple_GET_ITEM(PyList_GET_ITEM(recs, k), 0)));
    Py_XSETREF(st->names, Py_NewRef(names));
    return names;
}

static double fdiff(PyObject *list, PyObject *i_hi, PyObject *i_lo) {
    /* list[i_hi] - list[i_lo] for a list of floats and int indices; NAN with an exception on error. */
    Py_ssize_t hi = PyLong_AsSsize_t(i_hi), lo = PyLong_AsSsize_t(i_lo), n = PyList_GET_SIZE(list);
    if (PyErr_Occurred()) return NAN;
    if (hi < 0) hi += n;
    if (lo < 0) lo += n;
    if (hi < 0 || hi >= n || lo < 0 || lo >= n) {
        PyErr_SetString(PyExc_IndexError, "steptimer: event index out of range");
        return NAN;
    }
    return PyFloat_AsDouble(PyList_GET_ITEM(list, hi)) - PyFloat_AsDouble(PyList_GET_ITEM(list, lo));
}

static double elapsed(PyObject *el, PyObject *a, PyObject *c) {
    PyObject *args[2] = {a, c};
    PyObject *r = PyObject_Vectorcall(el, args, 2, NULL);
    if (!r) return NAN;
    double x = PyFloat_AsDouble(r);
    Py_DECREF(r);
    return x;
}

/* timer._resolve(rec) for a timed CUDA step recorded by step_exit (no trace capture); any other
 * record goes to the Python method. 0, or -1 with an exception. */
static int resolve(Step *st, PyObject *obj) {
    Base *b = &st->b;
    PyObject *trace = get(b, K_trace);
    if (!trace) return -1;
    Pending *rec = (Pending *)obj;
    if (Py_TYPE(obj) != &PendingType || trace != Py_None || !rec->timed || !PyList_Check(rec->events) ||
        PyList_GET_SIZE(rec->events) == 0 || !PyList_Check(rec->pauses)) {
        PyObject *r = PyObject_CallMethodOneArg(b->timer, K_resolve, obj);
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    PyObject *recs = rec->phases, *evs = rec->events, *names = NULL, *offs = NULL;
    double stack[64], *row = stack; /* the row: LEAD values, host spans, GPU step and spans, idle */
    Py_ssize_t m = 0;
    int ok = -1;
    if (!PyList_Check(recs)) {
        PyErr_SetString(PyExc_TypeError, "steptimer: a step's phases must be a list");
        return -1;
    }
    Py_ssize_t r = PyList_GET_SIZE(recs), nev = PyList_GET_SIZE(evs);
    if (rec->i_start < 0 || rec->i_start >= nev || rec->i_end < 0 || rec->i_end >= nev) {
        PyErr_SetString(PyExc_IndexError, "steptimer: a step's event index is out of range");
        return -1;
    }
    if (8 + 2 * r > 64 && !(row = PyMem_Malloc((size_t)(8 + 2 * r) * sizeof(double)))) {
        row = stack;
        PyErr_NoMemory();
        return -1;
    }
    names = names_of(st, recs);
    if (!names) goto done;
    row[0] = (double)rec->number;
    row[1] = nan_of(rec->samples);
    row[2] = nan_of(rec->tokens);
    row[3] = rec->step_s;
    row[4] = nan_of(rec->gap_s);
    row[5] = rec->wait_s;
    m = 6;
    if (PyErr_Occurred()) goto done;
    for (Py_ssize_t k = 0; k < r; k++) {
        PyObject *p = PyList_GET_ITEM(recs, k);
        row[m++] = PyFloat_AsDouble(PyTuple_GET_ITEM(p, 2)) - PyFloat_AsDouble(PyTuple_GET_ITEM(p, 1));
        if (PyErr_Occurred()) goto done;
    }
    long long pe;
    if (get_ll(b, K_pending_events, &pe) < 0 || put(b, K_pending_events, PyLong_FromLongLong(pe - 1)) < 0) goto done;
    PyObject *offsets = get(b, K_offsets), *el = get(b, K_elapsed), *held = get(b, K_held_end);
    if (!offsets || !el || !held) goto done;
    Py_INCREF(held); /* _held_end is replaced below */
    offs = call1(offsets, evs);
    if (!offs || !PyList_Check(offs) || PyList_GET_SIZE(offs) != nev) {
        if (offs) PyErr_SetString(PyExc_TypeError, "steptimer: offsets_ms must return one float per event");
        Py_DECREF(held);
        goto done;
    }
    double step_gpu = PyFloat_AsDouble(PyList_GET_ITEM(offs, rec->i_end)) -
                      PyFloat_AsDouble(PyList_GET_ITEM(offs, rec->i_start));
    row[m++] = step_gpu;
    if (PyErr_Occurred()) { Py_DECREF(held); goto done; }
    for (Py_ssize_t k = 0; k < r; k++) {
        PyObject *p = PyList_GET_ITEM(recs, k);
        row[m++] = fdiff(offs, PyTuple_GET_ITEM(p, 4), PyTuple_GET_ITEM(p, 3));
        if (PyErr_Occurred()) { Py_DECREF(held); goto done; }
    }
    int has_idle = 0;
    PyObject *held_ev = NULL;
    if (held != Py_None) {
        if (!PyTuple_Check(held) || PyTuple_GET_SIZE(held) != 3) {
            PyErr_SetString(PyExc_TypeError, "steptimer: _held_end must be (number, device, event)");
            Py_DECREF(held);
            goto done;
        }
        held_ev = PyTuple_GET_ITEM(held, 2);
        long long hn = PyLong_AsLongLong(PyTuple_GET_ITEM(held, 0));
        long hd = PyLong_AsLong(PyTuple_GET_ITEM(held, 1));
        if (PyErr_Occurred()) { Py_DECREF(held); goto done; }
        if (hn == rec->number - 1 && hd == rec->device) {
            double idle = elapsed(el, held_ev, PyList_GET_ITEM(evs, rec->i_start));
            for (Py_ssize_t k = 0; k < PyList_GET_SIZE(rec->pauses) && !PyErr_Occurred(); k++) {
                PyObject *pr = PyList_GET_ITEM(rec->pauses, k);
                idle -= elapsed(el, PyTuple_GET_ITEM(pr, 0), PyTuple_GET_ITEM(pr, 1));
            }
            if (PyErr_Occurred()) { Py_DECREF(held); goto done; }
            row[m++] = idle;
            has_idle = 1;
        }
    }
    PyObject *free = get(b, K_free);
    if (!free) { Py_DECREF(held); goto done; }
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(rec->pauses); k++) {
        PyObject *pr = PyList_GET_ITEM(rec->pauses, k);
        if (PyList_Append(free, PyTuple_GET_ITEM(pr, 0)) < 0 || PyList_Append(free, PyTuple_GET_ITEM(pr, 1)) < 0) {
            Py_DECREF(held);
            goto done;
        }
    }
    if (held_ev && PyList_Append(free, held_ev) < 0) { Py_DECREF(held); goto done; }
    Py_DECREF(held);
    for (Py_ssize_t k = 0; k < nev; k++)
        if (k != rec->i_end && PyList_Append(free, PyList_GET_ITEM(evs, k)) < 0) goto done;
    PyObject *dev = PyLong_FromLong(rec->device), *num = PyLong_FromLongLong(rec->number);
    PyObject *new_held = dev && num ? PyTuple_Pack(3, num, dev, PyList_GET_ITEM(evs, rec->i_end)) : NULL;
    Py_XDECREF(dev);
    if (put(b, K_held_end, new_held) < 0) { Py_XDECREF(num); goto done; }
    PyObject *rows = get(b, K_rows);
    if (!rows || append_row(st, 0, rows, names, 1, has_idle, row, m, rec->warmup) < 0) { Py_XDECREF(num); goto done; }
    if (put(b, K_last_resolved, num) < 0) goto done;
    long long every;
    if (get_ll(b, K_log_every, &every) < 0) goto done;
    if (every > 0 && rec->number % every == 0) {
        PyObject *res = PyObject_CallMethodNoArgs(b->timer, K_emit);
        if (!res) goto done;
        Py_DECREF(res);
    }
    ok = 0;
done:
    if (row != stack) PyMem_Free(row);
    Py_XDECREF(names);
    Py_XDECREF(offs);
    return ok;
}

/* lag 0's wait: the step's own end event, then the next step's start, with the GPU idle from the one
 * to the first launch after the other. Blocked in cudaEventSynchronize for a whole step, the host comes
 * back with the engine's state and code out of its caches (on some hosts 20-40 us more GPU idle per step
 * than the same CUDA calls inside no-op with statements, docs/benchmarks.md "lag 0"). So this polls the
 * event instead (a core stays busy, as with CUDA's default spin-wait), and between polls reads what the
 * next step's start will use: the timer's attributes (every entry of its __dict__, through the dict's
 * own lookup), the phase objects, the engine's C code. It reads with the GIL held (nothing it reads can
 * change under it) and polls without it, so other Python threads run as during a blocking wait. 0, or
 * -1 with an exception. */
enum { WARM_POLLS = 16 }; /* polls (about 0.5 us each on an H100 host) between two warmings */
static PyObject *native_wait; /* this module's wait(): the backend whose waits can be made this way */
static volatile char warm_sink;
enum { WARM_NF = 13 }; /* the functions warm_code_init lists */
static const char *warm_code[WARM_NF];
static size_t warm_len[WARM_NF];

static void touch_lines(const char *p, size_t len) {
    char s = 0;
    for (size_t i = 0; i < len; i += 64) s += ((volatile const char *)p)[i];
    warm_sink += s;
}

static int step_enter_fast(Step *st);
static int step_exit_fast(Step *st, PyObject *et);
static PyObject *step_enter(Step *st, PyObject *unused);
static PyObject *step_exit(Step *st, PyObject *const *args, Py_ssize_t nargs);
static PyObject *phase_enter(Phase *ph, PyObject *unused);
static PyObject *step_vcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);
static PyObject *phase_of_vcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);

static void warm_engine(Base *b) {
    PyObject *key, *value, *k2, *v2;
    Py_ssize_t pos = 0;
    char s = 0;
    while (PyDict_Next(b->dict, &pos, &key, &value)) {
        PyObject *v = PyDict_GetItemWithError(b->dict, key); /* the lookup path, as the step uses it */
        if (v) s += *(volatile const char *)v;
        else PyErr_Clear(); /* a key that cannot be hashed again: nothing to warm, nothing to report */
        if (PyDict_CheckExact(value)) { /* _phase_cms: the Phase objects */
            Py_ssize_t p2 = 0;
            while (PyDict_Next(value, &p2, &k2, &v2)) s += *(volatile const char *)v2;
        }
    }
    warm_sink += s;
    for (size_t i = 0; i < WARM_NF; i++) touch_lines(warm_code[i], warm_len[i]);
}

/* The engine's code that runs from the wait's return to the next phase's entry, set once at import:
 * each function from its start to the next one's in address order (both inside this object's text),
 * at most 8 KB; the last one to the end of its page (mapped: it holds the function). */
static void warm_code_init(void) {
    const char *fns[] = {(const char *)step_enter_fast, (const char *)step_enter,
                                (const char *)step_exit_fast, (const char *)step_exit, (const char *)step_vcall,
                                (const char *)phase_of_vcall, (const char *)phase_enter, (const char *)boundary,
                                (const char *)mark_last, (const char *)take_event, (const char *)record_event,
                                (const char *)record, (const char *)now};
    _Static_assert(sizeof fns / sizeof fns[0] == WARM_NF, "WARM_NF is the number of functions listed");
    for (size_t i = 1; i < WARM_NF; i++) /* sort by address */
        for (size_t j = i; j > 0 && fns[j] < fns[j - 1]; j--) {
            const char *t = fns[j]; fns[j] = fns[j - 1]; fns[j - 1] = t;
        }
    for (size_t i = 0; i < WARM_NF; i++) {
        size_t n = i + 1 < WARM_NF ? (size_t)(fns[i + 1] - fns[i])
                                   : (size_t)((((uintptr_t)fns[i]) | 4095) + 1 - (uintptr_t)fns[i]);
        warm_code[i] = fns[i];
        warm_len[i] = n < 8192 ? n : 8192;
    }
}

static int warm_wait(Step *st, PyObject *evobj) {
    handle_t ev;
    if (!ready() || !as_handle(evobj, &ev)) return -1;
    err_t err = p_query(ev);
    while (err == 600) {
        warm_engine(&st->b); /* with the GIL: nothing it reads changes under it */
        Py_BEGIN_ALLOW_THREADS /* other threads run while it polls, as during a blocking wait */
        for (int i = 0; i < WARM_POLLS && (err = p_query(ev)) == 600; i++) {
        }
        Py_END_ALLOW_THREADS
    }
    if (err) { fail("cudaEventQuery", err); return -1; }
    p_last_error(); /* cudaErrorNotReady is not an error; don't leave it behind */
    return 0;
}

/* The timed CUDA step's end (_end_step's common path, any lag); 1 if taken, 0 if not, -1 with an
 * exception. */
static int step_exit_fast(Step *st, PyObject *et) {
    Base *b = &st->b;
    if (et != Py_None) return 0;
    double t1 = now(b); /* first: the step's end, and the gap since the last boundary */
    if (NOW_FAILED(t1)) return -1;
    PyObject *gpu = get(b, K_gpu), *in_step = get(b, K_in_step), *stack = get(b, K_stack), *lagv = get(b, K_lag);
    if (!gpu || !in_step || !stack || !lagv) return -1;
    if (gpu != Py_True || in_step != Py_True || !PyList_Check(stack) || PyList_GET_SIZE(stack)) return 0;
    long long lag = PyLong_AsLongLong(lagv);
    if (lag == -1 && PyErr_Occurred()) return -1;
    if (lag < 0) return 0;
    PyObject *unchecked = get(b, K_unchecked);
    if (!unchecked) return -1;
    if (unchecked == Py_True) {
        /* lag 0's checks of the step's start (_check_stream_at_end): the same stream, not capturing,
         * or the Python path handles it. */
        PyObject *get_key = get(b, K_get_stream_key), *old_key = get(b, K_stream_key);
        if (!get_key || !old_key) return -1;
        PyObject *key = PyObject_CallNoArgs(get_key);
        if (!key) return -1;
        int same = PyObject_RichCompareBool(key, old_key, Py_EQ);
        Py_DECREF(key);
        if (same <= 0) return same;
        int capturing = stream_capturing(b);
        if (capturing) return capturing < 0 ? -1 : 0;
        if (PyDict_SetItem(b->dict, K_unchecked, Py_False) < 0) return -1;
    }
    long long number, first, warm;
    double t0, last_t;
    if (get_ll(b, K_number, &number) < 0 || get_ll(b, K_first_number, &first) < 0 ||
        get_ll(b, K_warmup_steps, &warm) < 0 || get_double(b, K_t0, &t0) < 0 || get_double(b, K_last_t, &last_t) < 0)
        return -1;
    number += 1;
    PyObject *samples = get(b, K_samples), *tokens = get(b, K_tokens), *recs = get(b, K_recs),
             *pauses = get(b, K_pause_evs), *gs = get(b, K_gap_start), *dev = get(b, K_device), *evs = get(b, K_evs),
             *timed = get(b, K_timed);
    if (!samples || !tokens || !recs || !pauses || !gs || !dev || !evs || !timed) return -1;
    double paused;
    if (get_double(b, K_paused_s, &paused) < 0) return -1;
    int device = (int)PyLong_AsLong(dev);
    if (device == -1 && PyErr_Occurred()) return -1;
    double gap = 0.0;
    if (gs != Py_None) {
        gap = t0 - PyFloat_AsDouble(gs) - paused;
        if (PyErr_Occurred()) return -1;
        if (!(gap > 0.0)) gap = 0.0; /* max(gap, 0.0) */
    }
    Pending *rec = PyObject_GC_New(Pending, &PendingType);
    if (!rec) return -1;
    rec->number = number;
    rec->t0 = t0;
    rec->step_s = rec->wait_s = 0.0;
    rec->timed = (char)PyObject_IsTrue(timed);
    rec->warmup = number - first < warm;
    rec->samples = Py_NewRef(samples);
    rec->tokens = Py_NewRef(tokens);
    rec->phases = Py_NewRef(recs);
    rec->pauses = Py_NewRef(pauses);
    rec->gap_s = gs == Py_None ? Py_NewRefNone() : PyFloat_FromDouble(gap);
    rec->device = device;
    rec->events = Py_NewRef(evs);
    rec->i_start = 0;
    rec->i_end = 0;
    PyObject_GC_Track((PyObject *)rec);
    PyObject *obj = (PyObject *)rec;
    int ok = -1;
    if (!rec->gap_s || put(b, K_number, PyLong_FromLongLong(number)) < 0 || put(b, K_pause_evs, PyList_New(0)) < 0 ||
        put(b, K_paused_s, PyFloat_FromDouble(0.0)) < 0)
        goto done;
    if (t1 - last_t < b->share_s) {
        PyObject *li = get(b, K_last_i);
        if (!li) goto done;
        rec->i_end = PyLong_AsSsize_t(li);
        if (rec->i_end == -1 && PyErr_Occurred()) goto done;
    } else {
        PyObject *ev = take_event(b);
        if (!ev) goto done;
        if (record_event(b, ev) < 0) { Py_DECREF(ev); goto done; }
        rec->i_end = PyList_GET_SIZE(evs);
        int err = PyList_Append(evs, ev);
        Py_DECREF(ev);
        if (err < 0) goto done;
    }
    if (PyDict_SetItem(b->dict, K_in_step, Py_False) < 0) goto done;
    PyObject *pending = get(b, K_pending);
    if (!pending) goto done;
    PyObject *r = PyObject_CallMethodOneArg(pending, K_append, obj);
    if (!r) goto done;
    Py_DECREF(r);
    long long pe;
    if (get_ll(b, K_pending_events, &pe) < 0 || put(b, K_pending_events, PyLong_FromLongLong(pe + 1)) < 0) goto done;
    Py_ssize_t npending = PyObject_Size(pending);
    if (npending < 0) goto done;
    double t_end;
    if (lag == 0) {
        /* Strict: the steps before this one finished at their own waits; they are read first, while
         * the GPU still runs this step's work, then this step's end is waited for (_end_step). */
        for (; npending > 1; npending--) {
            PyObject *old = PyObject_CallMethodNoArgs(pending, K_popleft);
            if (!old) goto done;
            int err = resolve(st, old);
            Py_DECREF(old);
            if (err < 0) goto done;
        }
        double tw = now(b);
        if (NOW_FAILED(tw)) goto done;
        PyObject *w = get(b, K_wait);
        if (!w) goto done;
        if (w == native_wait) {
            if (warm_wait(st, PyList_GET_ITEM(evs, rec->i_end)) < 0) goto done;
        } else {
            PyObject *res = call1(w, PyList_GET_ITEM(evs, rec->i_end));
            if (!res) goto done;
            Py_DECREF(res);
        }
        t_end = now(b);
        if (NOW_FAILED(t_end) || get_double(b, K_t0, &t0) < 0) goto done;
        rec->wait_s = t_end - tw;
    } else if (npending > lag) {
        double tw = now(b);
        if (NOW_FAILED(tw)) goto done;
        Py_ssize_t n = npending - (Py_ssize_t)lag;
        if (n == 1) { /* the common case: wait on step N - lag's end event */
            PyObject *old = PySequence_GetItem(pending, 0);
            PyObject *oevs = old ? PyObject_GetAttr(old, K_events) : NULL;
            int has = oevs ? PyObject_IsTrue(oevs) : -1;
            PyObject *oi = has > 0 ? PyObject_GetAttr(old, K_i_end) : NULL;
            PyObject *oev = oi ? PyObject_GetItem(oevs, oi) : NULL;
            PyObject *w = has > 0 && oev ? get(b, K_wait) : NULL;
            PyObject *res = w ? call1(w, oev) : NULL;
            Py_XDECREF(old);
            Py_XDECREF(oevs);
            Py_XDECREF(oi);
            Py_XDECREF(oev);
            Py_XDECREF(res);
            if (has < 0 || (has && !res)) goto done;
        } else {
            PyObject *nn = PyLong_FromSsize_t(n);
            PyObject *res = nn ? PyObject_CallMethodOneArg(b->timer, K_wait_for, nn) : NULL;
            Py_XDECREF(nn);
            if (!res) goto done;
            Py_DECREF(res);
        }
        double tw2 = now(b);
        if (NOW_FAILED(tw2)) goto done;
        rec->wait_s = tw2 - tw;
        for (Py_ssize_t k = 0; k < n; k++) {
            PyObject *old = PyObject_CallMethodNoArgs(pending, K_popleft);
            if (!old) goto done;
            int err = resolve(st, old);
            Py_DECREF(old);
            if (err < 0) goto done;
        }
    }
    if (lag != 0) {
        t_end = now(b);
        if (NOW_FAILED(t_end) || get_double(b, K_t0, &t0) < 0) goto done;
    }
    rec->step_s = t_end - t0;
    if (put(b, K_gap_start, PyFloat_FromDouble(t_end)) < 0) goto done;
    long long next_timed, every;
    if (get_ll(b, K_next_timed, &next_timed) < 0) goto done;
    if (number == next_timed) {
        if (get_ll(b, K_sample_every, &every) < 0) goto done;
        if (every == 1) {
            if (put(b, K_next_timed, PyLong_FromLongLong(number + 1)) < 0) goto done;
        } else {
            PyObject *blk = PyLong_FromLongLong((number - first) / every + 1);
            PyObject *nt = blk ? PyObject_CallMethodOneArg(b->timer, K_pick_timed, blk) : NULL;
            Py_XDECREF(blk);
            if (put(b, K_next_timed, nt) < 0) goto done;
        }
    }
    ok = 1;
done:
    Py_DECREF(obj);
    return ok;
}

/* The end of an untimed step entered on the short path, without an exception (_Step.__exit__): 1 if
 * taken, 0 if not, -1 with an exception. */
static int step_exit_untimed(Step *st, PyObject *et) {
    Base *b = &st->b;
    PyObject *untimed = get(b, K_untimed);
    if (!untimed) return -1;
    if (untimed != Py_True || et != Py_None) return 0;
    double t_end = now(b);
    if (NOW_FAILED(t_end)) return -1;
    if (PyDict_SetItem(b->dict, K_in_step, Py_False) < 0 || PyDict_SetItem(b->dict, K_untimed, Py_False) < 0) return -1;
    long long number, first, warm, every;
    double t0, paused;
    PyObject *gs = get(b, K_gap_start), *samples = get(b, K_samples), *tokens = get(b, K_tokens),
             *cuda = get(b, K_cuda), *rows = get(b, K_rows);
    if (!gs || !samples || !tokens || !cuda || !rows || get_ll(b, K_number, &number) < 0 ||
        get_ll(b, K_first_number, &first) < 0 || get_ll(b, K_warmup_steps, &warm) < 0 ||
        get_ll(b, K_log_every, &every) < 0 || get_double(b, K_t0, &t0) < 0 || get_double(b, K_paused_s, &paused) < 0)
        return -1;
    number += 1;
    int is_cuda = PyObject_IsTrue(cuda);
    if (is_cuda < 0) return -1;
    double gap = NAN;
    if (gs != Py_None) {
        gap = t0 - PyFloat_AsDouble(gs) - paused;
        if (PyErr_Occurred()) return -1;
        if (!(gap > 0.0)) gap = 0.0;
    }
    if (put(b, K_number, PyLong_FromLongLong(number)) < 0) return -1;
    double row[6] = {(double)number, nan_of(samples), nan_of(tokens), t_end - t0, gap, is_cuda ? 0.0 : NAN};
    if (PyErr_Occurred()) return -1;
    PyObject *key = st->untimed;
    if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 3) {
        PyErr_SetString(PyExc_TypeError, "steptimer: the untimed row layout must be a 3-tuple");
        return -1;
    }
    if (append_row(st, 1, rows, PyTuple_GET_ITEM(key, 0), PyTuple_GET_ITEM(key, 1) == Py_True,
                   PyTuple_GET_ITEM(key, 2) == Py_True, row, 6, number - first < warm) < 0)
        return -1;
    if (put(b, K_paused_s, PyFloat_FromDouble(0.0)) < 0 || put(b, K_gap_start, PyFloat_FromDouble(t_end)) < 0 ||
        put(b, K_last_resolved, PyLong_FromLongLong(number)) < 0)
        return -1;
    if (every > 0 && number % every == 0) {
        PyObject *res = PyObject_CallMethodNoArgs(b->timer, K_emit);
        if (!res) return -1;
        Py_DECREF(res);
    }
    return 1;
}

static PyObject *step_exit(Step *st, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "__exit__(exc_type, exc, tb)");
        return NULL;
    }
    int taken = step_exit_untimed(st, args[0]);
    if (taken < 0) return NULL;
    if (taken) Py_RETURN_FALSE;
    taken = step_exit_fast(st, args[0]);
    if (taken < 0) return NULL;
    if (taken) Py_RETURN_FALSE;
    PyObject *all[4] = {st->fallback, args[0], args[1], args[2]};
    return PyObject_VectorcallMethod(K_exit, all, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* timer.step(*, samples=None, tokens=None) -> this Step (StepTimer.step without its Python frame). */
static PyObject *step_vcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Step *st = (Step *)self;
    if (PyVectorcall_NARGS(nargsf)) {
        PyErr_SetString(PyExc_TypeError, "step() takes no positional arguments (samples= and tokens= are keyword-only)");
        return NULL;
    }
    PyObject *samples = Py_None, *tokens = Py_None;
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nk; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        if (name == K_kw_samples || PyUnicode_Compare(name, K_kw_samples) == 0) {
            samples = args[k];
        } else if (name == K_kw_tokens || PyUnicode_Compare(name, K_kw_tokens) == 0) {
            tokens = args[k];
        } else {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "step() got an unexpected keyword argument %R", name);
            return NULL;
        }
    }
    if (PyDict_SetItem(st->b.dict, K_samples, samples) < 0 || PyDict_SetItem(st->b.dict, K_tokens, tokens) < 0)
        return NULL;
    return Py_NewRef(self);
}

static int step_init(Step *st, PyObject *args, PyObject *kw) {
    PyObject *timer, *clock, *fallback, *untimed;
    double share_s;
    if (!PyArg_ParseTuple(args, "OOdOO", &timer, &clock, &share_s, &fallback, &untimed)) return -1;
    if (base_init(&st->b, timer, clock, share_s) < 0) return -1;
    Py_XSETREF(st->fallback, Py_NewRef(fallback));
    Py_XSETREF(st->untimed, Py_NewRef(untimed));
    Py_CLEAR(st->names);
    st->vc = step_vcall;
    return 0;
}

static int step_traverse(Step *st, visitproc visit, void *arg) {
    Py_VISIT(st->fallback);
    for (int k = 0; k < 2; k++) {
        Py_VISIT(st->rc[k].rows);
        Py_VISIT(st->rc[k].flat);
    }
    return base_traverse(&st->b, visit, arg);
}

static int step_clear(Step *st) {
    base_clear(&st->b);
    Py_CLEAR(st->fallback);
    Py_CLEAR(st->untimed);
    Py_CLEAR(st->names);
    for (int k = 0; k < 2; k++) {
        Py_CLEAR(st->rc[k].rows);
        Py_CLEAR(st->rc[k].names);
        Py_CLEAR(st->rc[k].flat);
    }
    return 0;
}

static void step_dealloc(Step *st) {
    PyObject_GC_UnTrack(st);
    step_clear(st);
    Py_TYPE(st)->tp_free((PyObject *)st);
}

static PyMethodDef step_methods[] = {
    {"__enter__", (PyCFunction)step_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))step_exit, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StepType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_steptimer_cudart.Step",
    .tp_basicsize = sizeof(Step),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Step(timer, clock, share_s, fallback, untimed_key): `timer.step(...)` and `with timer.step():` in C",
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Step, vc),
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)step_init,
    .tp_dealloc = (destructor)step_dealloc,
    .tp_traverse = (traverseproc)step_traverse,
    .tp_clear = (inquiry)step_clear,
    .tp_methods = step_methods,
};


/* Null: a no-op context manager (timer.py's _Null), for the phases of an untimed step. */
typedef struct { PyObject_HEAD } Null;

static PyObject *null_enter(PyObject *self, PyObject *unused) { Py_RETURN_NONE; }
static PyObject *null_exit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) { Py_RETURN_FALSE; }

static PyMethodDef null_methods[] = {
    {"__enter__", (PyCFunction)null_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))null_exit, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject NullType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_steptimer_cudart.Null",
    .tp_basicsize = sizeof(Null),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A no-op context manager",
    .tp_new = PyType_GenericNew,
    .tp_methods = null_methods,
};

/* PhaseOf: timer.phase(name) in C (StepTimer.phase, which it calls for a name it has not seen). */
typedef struct {
    PyObject_HEAD
    PyObject *dict, *fallback, *null;
    vectorcallfunc vc;
} PhaseOf;

static PyObject *phase_of_call(PhaseOf *po, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 1 || (kwnames && PyTuple_GET_SIZE(kwnames)))
        return PyObject_Vectorcall(po->fallback, args, nargsf, kwnames); /* its error for bad arguments */
    PyObject *cms = PyDict_GetItemWithError(po->dict, K_phase_cms);
    PyObject *cm = cms && PyDict_Check(cms) ? PyDict_GetItemWithError(cms, args[0]) : NULL;
    if (!cm) return PyErr_Occurred() ? NULL : PyObject_Vectorcall(po->fallback, args, nargsf, NULL);
    PyObject *untimed = PyDict_GetItemWithError(po->dict, K_untimed);
    if (!untimed) return PyErr_Occurred() ? NULL : PyObject_Vectorcall(po->fallback, args, nargsf, NULL);
    return Py_NewRef(untimed == Py_True ? po->null : cm);
}

static PyObject *phase_of_vcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return phase_of_call((PhaseOf *)self, args, nargsf, kwnames);
}

static PyObject *phase_of_tp_call(PyObject *self, PyObject *args, PyObject *kw) {
    return PyVectorcall_Call(self, args, kw);
}

static int phase_of_init(PyObject *self, PyObject *args, PyObject *kw) {
    PyObject *timer, *fallback, *null;
    if (!PyArg_ParseTuple(args, "OOO", &timer, &fallback, &null)) return -1;
    PyObject *dict = PyObject_GenericGetDict(timer, NULL);
    if (!dict) return -1;
    PhaseOf *po = (PhaseOf *)self;
    Py_XSETREF(po->dict, dict);
    Py_XSETREF(po->fallback, Py_NewRef(fallback));
    Py_XSETREF(po->null, Py_NewRef(null));
    po->vc = phase_of_vcall;
    return 0;
}

static int phase_of_traverse(PyObject *self, visitproc visit, void *arg) {
    PhaseOf *po = (PhaseOf *)self;
    Py_VISIT(po->dict);
    Py_VISIT(po->fallback);
    Py_VISIT(po->null);
    return 0;
}

static int phase_of_clear(PyObject *self) {
    PhaseOf *po = (PhaseOf *)self;
    Py_CLEAR(po->dict);
    Py_CLEAR(po->fallback);
    Py_CLEAR(po->null);
    return 0;
}

static void phase_of_dealloc(PyObject *self) {
    PyObject_GC_UnTrack(self);
    phase_of_clear(self);
    Py_TYPE(self)->tp_free(self);
}

static PyTypeObject PhaseOfType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_steptimer_cudart.PhaseOf",
    .tp_basicsize = sizeof(PhaseOf),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "PhaseOf(timer, fallback, null): timer.phase(name) in C",
    .tp_new = PyType_GenericNew,
    .tp_init = phase_of_init,
    .tp_call = phase_of_tp_call,
    .tp_vectorcall_offset = offsetof(PhaseOf, vc),
    .tp_dealloc = phase_of_dealloc,
    .tp_traverse = phase_of_traverse,
    .tp_clear = phase_of_clear,
};

static PyMethodDef methods[] = {
    {"init", init, METH_O, "init(libcudart_path): bind the calls to the runtime torch loaded."},
    {"record", (PyCFunction)(void (*)(void))record, METH_FASTCALL, "record(event, stream)"},
    {"elapsed_ms", (PyCFunction)(void (*)(void))elapsed_ms, METH_FASTCALL, "elapsed_ms(start, end) -> float"},
    {"offsets_ms", offsets_ms, METH_O, "offsets_ms(events) -> list of ms from events[0]"},
    {"wait", wait, METH_O, "wait(event): block until it completed"},
    {"is_capturing", is_capturing, METH_O, "is_capturing(stream) -> bool"},
    {"encode_stats_scalars", encode_stats_scalars, METH_VARARGS,
     "encode_stats_scalars(order, heads, stats) -> bytes: the per-series mean/p90/max scalars, encoded"},
    {"window_stats", window_stats, METH_VARARGS,
     "window_stats(groups, nser, skip_warm, base, inv_log_ratio, nbuckets) -> (count, sum, sumsq, min, max, median, p90, stats, runs, bounds, totals)"},
    {"accumulate", accumulate, METH_VARARGS,
     "accumulate(counts, exact, rows, stats, runs, nbuckets): add a window to the run's histograms"},
    {"encode_scalars", encode_scalars, METH_VARARGS,
     "encode_scalars(tags, values) -> the scalars' serialized Summary.value entries"},
    {"encode_histograms", encode_histograms, METH_VARARGS,
     "encode_histograms(tags, limits, stats, runs) -> the histograms' serialized Summary.value entries"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_steptimer_cudart", NULL, -1, methods};

PyMODINIT_FUNC PyInit__steptimer_cudart(void) {
    if (!intern_keys() || PyType_Ready(&PhaseType) < 0 || PyType_Ready(&PendingType) < 0 ||
        PyType_Ready(&StepType) < 0 || PyType_Ready(&NullType) < 0 || PyType_Ready(&PhaseOfType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyTypeObject *types[] = {&PhaseType, &PendingType, &StepType, &NullType, &PhaseOfType};
    const char *names[] = {"Phase", "Pending", "Step", "Null", "PhaseOf"};
    warm_code_init();
    native_wait = PyObject_GetAttrString(m, "wait");
    if (!native_wait) {
        Py_DECREF(m);
        return NULL;
    }
    for (int i = 0; i < 5; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
