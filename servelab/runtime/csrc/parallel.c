/* A persistent thread pool for the native kernels, so that they use the cores torch is given.
 *
 * Why not OpenMP: torch ships its own OpenMP runtime, and a second one in the same process
 * would bring its own threads competing for the same cores. Why not a thread per call: a
 * decode step calls these kernels ~150 times, and creating threads costs more than a job. So
 * workers are created once, spin briefly after each job (the next call usually comes within
 * tens of microseconds) and then sleep on a condition variable, leaving the cores to torch's
 * own threads during its GEMMs. A job's parts are claimed, not assigned: the caller runs any
 * part no worker has claimed by the time its own is done, so a job never waits for a worker's
 * wake-up (a futex call and tens of microseconds in a VM), and a worker that wakes late finds
 * nothing left to do.
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
#ifndef SL_SPIN_NS
#define SL_SPIN_NS 20000
#endif

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;  /* held by the dispatching caller */
static pthread_mutex_t wake_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cv = PTHREAD_COND_INITIALIZER;
static int n_workers;
static int atfork_registered;

static atomic_ullong job_gen;  /* bumped (release) once a job's fields are set */
/* The current job's parts are claimed from here: ((job_gen & GEN_BITS) << 16) | (parts << 8) |
 * next part. The caller claims its own part and then every part no worker has taken yet, so a
 * job never waits for a worker to wake up (a sleeping or descheduled worker's part is the
 * caller's). A worker reads the job's fields only after claiming a part of it, and the caller
 * writes the next job's fields only once every claimed part is done. */
static atomic_ullong claim;
static atomic_int done;        /* parts of the current job finished */
static sl_task job_task;
static const void *job_ctx;
static int64_t job_n, job_parts;
static int64_t job_chunk;     /* 0: one range a part; else ranges of job_chunk taken in turn (job_next) */
static atomic_llong job_next;
/* the job_gen each worker was created at: it looks for parts of every job after that one */
static unsigned long long start_gen[SL_MAX_WORKERS + 1];
#define GEN_BITS 0xffffffffffffull  /* the job_gen bits in `claim` */
_Static_assert(SL_MAX_WORKERS + 1 < 256, "a job's parts and its next part must fit claim's 8-bit fields");

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

/* Claims and runs parts of job `gen` until none is left (or that job is over). */
static void run_parts(unsigned long long gen) {
    unsigned long long c = atomic_load_explicit(&claim, memory_order_acquire);
    for (;;) {
        if ((c >> 16) != (gen & GEN_BITS) || (c & 0xff) >= ((c >> 8) & 0xff)) return;
        if (atomic_compare_exchange_weak_explicit(&claim, &c, c + 1, memory_order_acq_rel, memory_order_acquire)) {
            run_part((int64_t)(c & 0xff));
            atomic_fetch_add_explicit(&done, 1, memory_order_release);
            c = atomic_load_explicit(&claim, memory_order_acquire);
        }
    }
}

static void *worker_main(void *arg) {
    const int64_t worker = (int64_t)(intptr_t)arg;  /* 1, 2, ... */
    unsigned long long seen = start_gen[worker];
    for (;;) {
        unsigned long long gen;
        const int64_t idle_since = now_ns();
        int spins = 0;
        while ((gen = atomic_load_explicit(&job_gen, memory_order_acquire)) == seen) {
            SL_PAUSE();
            if ((++spins & 255) == 0 && now_ns() - idle_since > SL_SPIN_NS) {
                pthread_mutex_lock(&wake_mu);
                while ((gen = atomic_load_explicit(&job_gen, memory_order_acquire)) == seen)
                    pthread_cond_wait(&wake_cv, &wake_mu);
                pthread_mutex_unlock(&wake_mu);
                break;
            }
        }
        seen = gen;
        run_parts(gen);
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
    atomic_store_explicit(&done, 0, memory_order_relaxed);
    const unsigned long long gen = atomic_load_explicit(&job_gen, memory_order_relaxed) + 1;
    atomic_store_explicit(&claim, ((gen & GEN_BITS) << 16) | ((unsigned long long)job_parts << 8), memory_order_release);
    atomic_store_explicit(&job_gen, gen, memory_order_release);
    pthread_mutex_lock(&wake_mu);  /* wakes the sleepers; the spinners have already seen job_gen */
    pthread_cond_broadcast(&wake_cv);
    pthread_mutex_unlock(&wake_mu);
    run_parts(gen);
    int spins = 0;
    while (atomic_load_explicit(&done, memory_order_acquire) < job_parts) {  /* parts workers took */
        SL_PAUSE();
        if (++spins > 4096) { /* a worker was descheduled: don't burn the core it needs */
            sched_yield();
            spins = 0;
        }
    }
    pthread_mutex_unlock(&pool_mu);
}

void sl_parallel_for(sl_task task, const void *ctx, int64_t n, int64_t threads) { dispatch(task, ctx, n, threads, 0); }

void sl_parallel_chunks(sl_task task, const void *ctx, int64_t n, int64_t chunk, int64_t threads) {
    dispatch(task, ctx, n, threads, chunk > 0 ? chunk : 1);
}
