"""Simulator speed: simulated requests and steps per second of wall time.

Llama 3.1 8B on one H100 SXM, 1,024 tokens in and 256 out, Poisson arrivals at a fraction
(default 80%) of the capacity that this same simulator measures first in an overloaded run.
Then a shorter run splits the wall time between the scheduler (schedule + update, in core; the
KV-block and prefix-cache work inside them shown apart), the SimExecutor with the roofline, the
workload's stand-in prompts and the rest (event loop, requests, records, metrics).

    .venv/bin/python benchmarks/sim_speed.py --num-requests 100000 [--core-scheduler] [--quick]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from servelab.core.block_manager import BlockManager
from servelab.core.scheduler import Scheduler
from servelab.sim import SimConfig, cluster, simulate
from servelab.sim.runner import build_cost_model
from servelab.sim.executor import SimExecutor
from servelab.workload import WorkloadSpec


class ShapeOnly:
    """The roofline without `time_from_totals`: ClusterSim then runs the core Scheduler (the same
    decisions, every running sequence in every step) and the executor prices each step's shape."""

    def __init__(self, cost_model: Any) -> None:
        self.cost_model = cost_model

    def step_time_s(self, shape: Any) -> float:
        return self.cost_model.step_time_s(shape)

    def step(self, shape: Any) -> Any:
        return self.cost_model.step(shape)


def capacity_req_per_s(config: SimConfig, n: int) -> float:
    # Everything at once: the steady state is the saturated throughput.
    wl = WorkloadSpec(n, rate=None, concurrency=None, input_len="1024", output_len="256", seed=0)
    return simulate(config, wl).summary.request_throughput


def time_split(config: SimConfig, workload: WorkloadSpec) -> tuple[dict[str, float], float]:
    """Where a run's wall time goes, from perf_counter wrappers around the calls of interest.

    Not cProfile: its hook fires on every call, C calls included, and so inflates code made of
    many small calls (the scheduler) several times over. A wrapper costs about a microsecond per
    call, a few per step. The prefix-cache and KV-block work is part of schedule/update and is
    also shown on its own."""
    spent = dict.fromkeys(("schedule", "update", "executor", "prompts (workload)", "block manager"), 0.0)
    targets = [
        (Scheduler, "schedule", "schedule"),
        (Scheduler, "update", "update"),
        (SimExecutor, "execute", "executor"),
        (cluster, "simulated_prompt", "prompts (workload)"),
    ] + [
        (BlockManager, name, "block manager")
        for name in (
            "find_cached_prefix",
            "allocate",
            "append_slots",
            "append_block_each",
            "commit_computed_blocks",
            "commit_next_block",
            "commit_unreachable_blocks",
            "free",
        )
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]

    def timed(fn: Callable, label: str) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t0

        return wrapper

    for (owner, name, label), (_, _, fn) in zip(targets, originals):
        setattr(owner, name, timed(fn, label))
    try:
        start = time.perf_counter()
        simulate(config, workload)
        total = time.perf_counter() - start
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    blocks = spent.pop("block manager")
    spent["rest (event loop, requests, records, metrics)"] = total - sum(spent.values())
    spent["of which KV blocks and prefix cache (inside schedule/update)"] = blocks
    return spent, total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=100_000)
    parser.add_argument("--load", type=float, default=0.8, help="fraction of capacity (default 0.8)")
    parser.add_argument("--profile-requests", type=int, default=3000)
    parser.add_argument(
        "--core-scheduler",
        action="store_true",
        help="time the core Scheduler, without the simulator's implicit decodes",
    )
    parser.add_argument("--quick", action="store_true", help="a few hundred requests in each run (a smoke test)")
    args = parser.parse_args(argv)
    capacity_requests = 4000
    if args.quick:
        args.num_requests, args.profile_requests, capacity_requests = 300, 100, 300
    config = SimConfig(model="llama-3.1-8b", hardware="h100-sxm")

    t0 = time.perf_counter()
    capacity = capacity_req_per_s(config, capacity_requests)
    print(
        f"capacity (saturated, {capacity_requests:,} requests): {capacity:.2f} req/s  [{time.perf_counter() - t0:.1f} s wall]"
    )
    if args.core_scheduler:
        config = replace(config, cost_model=ShapeOnly(build_cost_model(config)))
    rate = args.load * capacity
    wl = WorkloadSpec(args.num_requests, rate=rate, input_len="1024", output_len="256", seed=0)

    load_start = os.getloadavg()[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    result = simulate(config, wl)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    s = result.summary
    print(f"run: {args.num_requests:,} requests at {rate:.2f} req/s ({args.load:.0%} of capacity)")
    print(
        f"  simulated {s.duration_s:,.0f} s: {s.completed:,} completed, {s.output_throughput:,.0f} output tok/s, "
        f"TTFT p50 {s.ttft_s.p50 * 1e3:.1f} ms, TPOT p50 {s.tpot_s.p50 * 1e3:.2f} ms"
    )
    print(
        f"  wall {wall:.1f} s (loop {result.wall_s:.1f} s): {args.num_requests / wall:,.0f} simulated requests/s, "
        f"{result.num_steps:,} steps, {result.num_steps / wall:,.0f} steps/s, "
        f"{wall / result.num_steps * 1e6:.0f} us per step"
    )
    # CPU time is what this process got; on a shared machine wall time also counts waiting for a core.
    print(
        f"  cpu {cpu:.1f} s ({cpu / result.num_steps * 1e6:.0f} us per step); "
        f"load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    )

    small = WorkloadSpec(args.profile_requests, rate=rate, input_len="1024", output_len="256", seed=0)
    shares, total = time_split(config, small)
    print(
        f"split of a {args.profile_requests:,}-request run ({total:.1f} s, perf_counter around the calls): "
        + ", ".join(f"{name} {t / total:.0%}" for name, t in shares.items())
    )


if __name__ == "__main__":
    main()
