/* A small persistent thread pool for the native kernels (parallel.c). */
#pragma once
#include <stdint.h>

/* task(ctx, part, begin, end) runs a contiguous range of [0, n); `part` < parts numbers it
 * (for per-thread scratch). */
typedef void (*sl_task)(const void *ctx, int64_t part, int64_t begin, int64_t end);

/* Runs task over [0, n) in up to `threads` parts, the calling thread taking part 0, and returns
 * when all are done. One part (inline, no pool) when threads <= 1, n <= 1, or another caller
 * holds the pool. */
void sl_parallel_for(sl_task task, const void *ctx, int64_t n, int64_t threads);

/* The same, but the threads take ranges of `chunk` from [0, n) in turn until none is left, so
 * that a thread that runs slower (its core shared with another job, a late wake) does less of
 * the work. `part` names the thread running a range (for per-thread scratch). */
void sl_parallel_chunks(sl_task task, const void *ctx, int64_t n, int64_t chunk, int64_t threads);

/* hold(1) ... hold(0) brackets a run of calls that follow each other within microseconds (a
 * decode step): in between, idle workers spin rather than sleep. Holds nest and may overlap
 * across threads. */
void sl_parallel_hold(int on);
