"""Simulator speed: simulated requests and steps per second of wall time.

Llama 3.1 8B on one H100 SXM, 1,024 tokens in and 256 out, Poisson arrivals at a fraction
(default 80%) of the capacity that this same simulator measures first in an overloaded run.
Then a shorter profiled run splits the wall time between the scheduler (schedule + update, in
core) and everything else (the SimExecutor and roofline, the event loop, token ids, metrics).

    .venv/bin/python benchmarks/sim_speed.py --num-requests 100000
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

from servelab.sim import SimConfig, simulate
from servelab.workload import WorkloadSpec


def capacity_req_per_s(config: SimConfig, n: int) -> float:
    # Everything at once: the steady state is the saturated throughput.
    wl = WorkloadSpec(n, rate=None, concurrency=None, input_len="1024", output_len="256", seed=0)
    return simulate(config, wl).summary.request_throughput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=100_000)
    parser.add_argument("--load", type=float, default=0.8, help="fraction of capacity (default 0.8)")
    parser.add_argument("--profile-requests", type=int, default=3000)
    args = parser.parse_args()
    config = SimConfig(model="llama-3.1-8b", hardware="h100-sxm")

    t0 = time.perf_counter()
    capacity = capacity_req_per_s(config, 4000)
    print(f"capacity (saturated, 4,000 requests): {capacity:.2f} req/s  [{time.perf_counter() - t0:.1f} s wall]")
    rate = args.load * capacity
    wl = WorkloadSpec(args.num_requests, rate=rate, input_len="1024", output_len="256", seed=0)

    load_start = os.getloadavg()[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    result = simulate(config, wl)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    s = result.summary
    print(f"run: {args.num_requests:,} requests at {rate:.2f} req/s ({args.load:.0%} of capacity)")
    print(f"  simulated {s.duration_s:,.0f} s: {s.completed:,} completed, {s.output_throughput:,.0f} output tok/s, "
          f"TTFT p50 {s.ttft_s.p50 * 1e3:.1f} ms, TPOT p50 {s.tpot_s.p50 * 1e3:.2f} ms")
    print(f"  wall {wall:.1f} s (loop {result.wall_s:.1f} s): {args.num_requests / wall:,.0f} simulated requests/s, "
          f"{result.num_steps:,} steps, {result.num_steps / wall:,.0f} steps/s, "
          f"{wall / result.num_steps * 1e6:.0f} us per step")
    # CPU time is what this process got; on a shared machine wall time also counts waiting for a core.
    print(f"  cpu {cpu:.1f} s ({cpu / result.num_steps * 1e6:.0f} us per step); "
          f"load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")

    prof = cProfile.Profile()
    small = WorkloadSpec(args.profile_requests, rate=rate, input_len="1024", output_len="256", seed=0)
    prof.enable()
    simulate(config, small)
    prof.disable()
    stats = pstats.Stats(prof)
    total = stats.total_tt  # type: ignore[attr-defined]
    sched = 0.0
    for (filename, _, name), (_, _, _, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        if filename.endswith("core/scheduler.py") and name in ("schedule", "update"):
            sched += cumtime
    print(f"profile ({args.profile_requests:,} requests, under cProfile): scheduler.schedule+update "
          f"{sched / total:.0%} of the time, the rest (executor, roofline, event loop, workload, metrics) "
          f"{1 - sched / total:.0%}")
    stats.sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main()
