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
 * This file is a shim and nothing more: each function makes one runtime call (offsets_ms one per event)
 * and returns plain numbers. It defines no Python types, reads no Python object's attributes and holds
 * no state but the function pointers. Every behaviour lives in Python (steptimer/_engine.py).
 *
 * Built at first use by steptimer/_native.py with the system C compiler, like Triton's launcher
 * stubs; when that is impossible, steptimer uses torch's API instead (same numbers, higher host cost).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>

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

/* query(event) -> bool: has the event completed? Never blocks. */
static PyObject *query(PyObject *self, PyObject *arg) {
    handle_t ev;
    if (!ready() || !as_handle(arg, &ev)) return NULL;
    err_t err = p_query(ev);
    if (err == 0) Py_RETURN_TRUE;
    if (err != 600) return fail("cudaEventQuery", err);
    p_last_error(); /* cudaErrorNotReady is not an error; don't leave it behind */
    Py_RETURN_FALSE;
}

/* wait(event): block until the event has completed (cudaEventSynchronize, with the GIL released so
 * other Python threads run, as torch's Event.synchronize does). */
static PyObject *wait(PyObject *self, PyObject *arg) {
    handle_t ev;
    err_t err;
    if (!ready() || !as_handle(arg, &ev)) return NULL;
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
static PyMethodDef methods[] = {
    {"init", init, METH_O, "init(libcudart_path): bind the calls to the runtime torch loaded."},
    {"record", (PyCFunction)(void (*)(void))record, METH_FASTCALL, "record(event, stream)"},
    {"elapsed_ms", (PyCFunction)(void (*)(void))elapsed_ms, METH_FASTCALL, "elapsed_ms(start, end) -> float"},
    {"offsets_ms", offsets_ms, METH_O, "offsets_ms(events) -> list of ms from events[0]"},
    {"query", query, METH_O, "query(event) -> bool: has it completed? (never blocks)"},
    {"wait", wait, METH_O, "wait(event): block until it completed"},
    {"is_capturing", is_capturing, METH_O, "is_capturing(stream) -> bool"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_steptimer_cudart", NULL, -1, methods};

PyMODINIT_FUNC PyInit__steptimer_cudart(void) { return PyModule_Create(&module); }
