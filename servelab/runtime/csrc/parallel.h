/* A small persistent thread pool for the native kernels (parallel.c). */
#pragma once
#include <stdint.h>

/* task(ctx, part, begin, end) runs a contiguous range of [0, n); `part` < parts numbers it (for
 * scratch of its own: one thread at a time runs a part, though a thread may run several). */
typedef void (*sl_task)(const void *ctx, int64_t part, int64_t begin, int64_t end);

/* Runs task over [0, n) in up to `threads` parts and returns when all are done. Each thread
 * claims parts in turn: the calling thread runs every part no worker has claimed by the time it
 * is free, so a job never waits for a sleeping worker to wake. One part (inline, no pool) when
 * threads <= 1, n <= 1, or another caller holds the pool. */
void sl_parallel_for(sl_task task, const void *ctx, int64_t n, int64_t threads);

/* The same, but the threads take ranges of `chunk` from [0, n) in turn until none is left, so
 * that a thread that runs slower (its core shared with another job, a late wake) does less of
 * the work. `part` names the thread running a range (for per-thread scratch). */
void sl_parallel_chunks(sl_task task, const void *ctx, int64_t n, int64_t chunk, int64_t threads);
