/* A persistent thread pool for the native kernels, so that they use the cores torch is given.
 *
 * Why not OpenMP: torch ships its own OpenMP runtime, and a second one in the same process
 * would bring its own threads competing for the same cores. Why not a thread per call: a
 * decode step calls these kernels ~150 times, and creating threads costs more than a job. So
 * workers are created once, spin briefly after each job (the next call usually comes within
 * tens of microseconds) and then sleep on a condition variable, leaving the cores to torch's
 * own threads during its GEMMs.
 *
 * One job at a time: a caller that finds the pool busy (another Python thread) runs its job
 * inline. After fork() the child starts with no workers and builds its own.
 */
#include "parallel.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#ifdef __x86_64__
#include <immintrin.h>
#define SL_PAUSE() _mm_pause()
#else
#define SL_PAUSE() ((void)0)
#endif

#define SL_MAX_WORKERS 63
/* A worker spins this long for the next job before it sleeps. Short: after our attention
 * kernel come torch's GEMMs, whose OpenMP threads want the cores back (docs/benchmarks.md, "Our
 * own thread pool"). */
#define SL_SPIN_NS 20000
/* While a caller holds the pool (sl_parallel_hold), workers spin up to this long: the decode
 * stack dispatches a job every few microseconds for a whole step, and a worker that slept
 * through a gap (an imbalanced job) cost a futex call to wake and tens of microseconds before
 * it ran again, more than the job it then served (docs/benchmarks.md, "Workers that stay
 * awake through a step"). */
#ifndef SL_HOLD_SPIN_NS
#define SL_HOLD_SPIN_NS 2000000
#endif

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;  /* held by the dispatching caller */
static pthread_mutex_t wake_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cv = PTHREAD_COND_INITIALIZER;
static int n_workers;
static int atfork_registered;

static atomic_ullong job_gen;  /* bumped (release) once a job's fields are set */
static atomic_int pending;     /* workers yet to finish (or skip) the current job */
static sl_task job_task;
static const void *job_ctx;
static int64_t job_n, job_parts;
static int64_t job_chunk;     /* 0: one range a part; else ranges of job_chunk taken in turn (job_next) */
static atomic_llong job_next;
static atomic_int holds;       /* callers inside sl_parallel_hold(1) ... sl_parallel_hold(0) */
/* the job_gen each worker was created at: it must answer every job after that one, even one
 * posted before the thread got to run */
static unsigned long long start_gen[SL_MAX_WORKERS + 1];

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void run_part(int64_t part) {
    if (job_chunk) {
        for (;;) {
            const int64_t begin = atomic_fetch_add_explicit(&job_next, job_chunk, memory_order_relaxed);
            if (begin >= job_n) return;
            job_task(job_ctx, part, begin, begin + job_chunk < job_n ? begin + job_chunk : job_n);
        }
    }
    const int64_t begin = job_n * part / job_parts, end = job_n * (part + 1) / job_parts;
    if (begin < end) job_task(job_ctx, part, begin, end);
}

static void *worker_main(void *arg) {
    const int64_t part = (int64_t)(intptr_t)arg;  /* workers take parts 1, 2, ... */
    unsigned long long seen = start_gen[part];
    for (;;) {
        unsigned long long gen;
        const int64_t idle_since = now_ns();
        int spins = 0;
        while ((gen = atomic_load_explicit(&job_gen, memory_order_acquire)) == seen) {
            SL_PAUSE();
            if ((++spins & 255) == 0 &&
                now_ns() - idle_since > (atomic_load_explicit(&holds, memory_order_relaxed) ? SL_HOLD_SPIN_NS : SL_SPIN_NS)) {
                pthread_mutex_lock(&wake_mu);
                while ((gen = atomic_load_explicit(&job_gen, memory_order_acquire)) == seen)
                    pthread_cond_wait(&wake_cv, &wake_mu);
                pthread_mutex_unlock(&wake_mu);
                break;
            }
        }
        seen = gen;
        if (part < job_parts) run_part(part);
        /* every worker acknowledges every job, so none can still be reading this one's fields
         * when the next caller writes them */
        atomic_fetch_sub_explicit(&pending, 1, memory_order_release);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    /* the workers did not survive the fork; the child builds its own when it first needs them */
    pthread_mutex_init(&pool_mu, NULL);
    pthread_mutex_init(&wake_mu, NULL);
    pthread_cond_init(&wake_cv, NULL);
    n_workers = 0;
}

/* Called with pool_mu held. Returns the number of workers running (may be fewer if creation fails). */
static int ensure_workers(int wanted) {
    if (!atfork_registered) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        atfork_registered = 1;
    }
    while (n_workers < wanted && n_workers < SL_MAX_WORKERS) {
        pthread_t th;
        pthread_attr_t attr;
        start_gen[n_workers + 1] = atomic_load_explicit(&job_gen, memory_order_relaxed);
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&th, &attr, worker_main, (void *)(intptr_t)(n_workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        n_workers++;
    }
    return n_workers;
}

static void dispatch(sl_task task, const void *ctx, int64_t n, int64_t threads, int64_t chunk) {
    if (threads > n) threads = n;
    if (threads <= 1 || pthread_mutex_trylock(&pool_mu) != 0) {
        if (n > 0) task(ctx, 0, 0, n);
        return;
    }
    const int workers = ensure_workers((int)(threads - 1));
    if (workers == 0) {
        pthread_mutex_unlock(&pool_mu);
        task(ctx, 0, 0, n);
        return;
    }
    job_task = task;
    job_ctx = ctx;
    job_n = n;
    job_chunk = chunk;
    atomic_store_explicit(&job_next, 0, memory_order_relaxed);
    job_parts = threads < workers + 1 ? threads : workers + 1;
    atomic_store_explicit(&pending, workers, memory_order_relaxed);
    atomic_fetch_add_explicit(&job_gen, 1, memory_order_release);
    pthread_mutex_lock(&wake_mu);  /* wakes the sleepers; the spinners have already seen job_gen */
    pthread_cond_broadcast(&wake_cv);
    pthread_mutex_unlock(&wake_mu);
    run_part(0);
    int spins = 0;
    while (atomic_load_explicit(&pending, memory_order_acquire) > 0) {
        SL_PAUSE();
        if (++spins > 4096) { /* a worker was descheduled: don't burn the core it needs */
            sched_yield();
            spins = 0;
        }
    }
    pthread_mutex_unlock(&pool_mu);
}

void sl_parallel_hold(int on) { atomic_fetch_add_explicit(&holds, on ? 1 : -1, memory_order_relaxed); }

void sl_parallel_for(sl_task task, const void *ctx, int64_t n, int64_t threads) { dispatch(task, ctx, n, threads, 0); }

void sl_parallel_chunks(sl_task task, const void *ctx, int64_t n, int64_t chunk, int64_t threads) {
    dispatch(task, ctx, n, threads, chunk > 0 ? chunk : 1);
}
