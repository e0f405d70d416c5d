/* A stand-in CUDA runtime with the calls steptimer/_cudart.c binds, for CPU tests of that glue
 * (argument handling, error paths, the not-ready query, lag 0's one synchronize per step). The real runtime is
 * tested on the GPU.
 * Handles are small integers: event h has a time (ms) and a "done" flag set by the test. */
#include <stddef.h>

#define N 64
static double t_ms[N];
static int done[N];
static int last_error;
int fake_syncs, fake_records, fake_capturing;
int fake_fail_record; /* when set, cudaEventRecord returns this error */
/* A simulated GPU for the engine's tests, off (-1) by default: when >= 0, cudaEventRecord gives the event
 * the next time on a clock that moves 1 ms per record, and the event completes after this many
 * cudaEventQuery calls on it (cudaEventSynchronize completes it). */
int fake_record_queries = -1;
static int pending[N], seq[N], next_seq;
static double clock_ms;

/* Event h completed: so did every event recorded before it (one stream, in order). */
static void complete(size_t h) {
    for (size_t i = 0; i < N; i++)
        if (seq[i] && seq[i] <= seq[h]) { done[i] = 1; pending[i] = 0; }
    done[h] = 1;
    pending[h] = 0;
}

void fake_set(int h, double t, int d) { t_ms[h] = t; done[h] = d; pending[h] = 0; seq[h] = 0; }
int fake_last_error(void) { return last_error; }

static int bad(void *h) { return (size_t)h == 0 || (size_t)h >= N; }
static int err(int e) { last_error = e; return e; }

int cudaEventRecord(void *ev, void *stream) {
    (void)stream;
    if (fake_fail_record) return err(fake_fail_record);
    if (bad(ev)) return err(400); /* cudaErrorInvalidResourceHandle */
    fake_records++;
    if (fake_record_queries >= 0) {
        clock_ms += 1.0;
        t_ms[(size_t)ev] = clock_ms;
        seq[(size_t)ev] = ++next_seq;
        pending[(size_t)ev] = fake_record_queries;
        done[(size_t)ev] = 0;
        if (fake_record_queries == 0) complete((size_t)ev);
    }
    return 0;
}
int cudaEventElapsedTime(float *ms, void *a, void *b) {
    if (bad(a) || bad(b)) return err(400);
    if (!done[(size_t)a] || !done[(size_t)b]) return err(600); /* cudaErrorNotReady */
    *ms = (float)(t_ms[(size_t)b] - t_ms[(size_t)a]);
    return 0;
}
int cudaEventQuery(void *ev) {
    if (bad(ev)) return err(400);
    if (!done[(size_t)ev] && pending[(size_t)ev] > 0 && --pending[(size_t)ev] == 0) complete((size_t)ev);
    return done[(size_t)ev] ? 0 : err(600);
}
int cudaEventSynchronize(void *ev) {
    if (bad(ev)) return err(400);
    fake_syncs++;
    complete((size_t)ev);
    return 0;
}
int cudaStreamIsCapturing(void *stream, int *status) {
    (void)stream;
    *status = fake_capturing;
    return 0;
}
int cudaGetLastError(void) { int e = last_error; last_error = 0; return e; }
const char *cudaGetErrorString(int e) { return e == 600 ? "not ready" : e == 400 ? "invalid handle" : "other"; }
