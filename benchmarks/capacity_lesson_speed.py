"""The capacity lesson's full answer on fresh inputs: every accelerator's `servelab plan` row.

Draws N parameter sets the way tests/lab/test_lab_latency.py does (log-uniform inside the form's
limits), runs each set's plan jobs in this process one after another, and reports per set the CPU
seconds of every job (`PlanRow.cpu_s`), their sum, and the wall time the lab's pool of W worker
processes would take on W quiet cores: the jobs handed out in the planner's order to whichever
worker is free first. The p90s over the sets are the figures in docs/lab.md and docs/benchmarks.md.
CPU time, not wall time, because the host is shared; worker start-up (~0.5 CPU-s each) is left out.

    PYTHONPATH=. python benchmarks/capacity_lesson_speed.py [--sets 10] [--workers 2] [--seed 44]
        [--defaults | --quick]

`--quick`: one tight set (TPOT 6 ms, 128 + 16 tokens) whose every plan is small (a smoke test).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import time

import numpy as np

from servelab.bench.planner import plan_one
from servelab.lab.capacity_lesson import PlanKey, job_order
from servelab.lab.limits import LESSON_DEFAULTS, LIMITS


QUICK = {"tpot_ms": 6.0, "ttft_ms": 200.0, "prompt_len": 128, "output_len": 16}


def draw(rng: random.Random) -> dict[str, float]:
    ranges = {"tpot_ms": (5, 200), "ttft_ms": (100, 10000), "prompt_len": (16, 32768), "output_len": (16, 4096)}
    out: dict[str, float] = {}
    for name, (lo, hi) in ranges.items():
        form_lo, form_hi = LIMITS["capacity"][name]
        value = math.exp(rng.uniform(math.log(max(lo, form_lo)), math.log(min(hi, form_hi))))
        out[name] = float(f"{value:.3g}") if name.endswith("_ms") else round(value)
    return out


def makespan(times_s: list[float], workers: int) -> float:
    """When the last job ends if each, in order, goes to the first worker free."""
    free_at = [0.0] * workers
    for t in times_s:
        heapq.heappush(free_at, heapq.heappop(free_at) + t)
    return max(free_at)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", type=int, default=10, help="fresh parameter sets (default 10)")
    ap.add_argument("--workers", type=int, default=2, help="the lab's worker processes (default 2)")
    ap.add_argument("--seed", type=int, default=44)
    ap.add_argument("--defaults", action="store_true", help="the lesson's default inputs only")
    ap.add_argument("--quick", action="store_true", help="one small set (a smoke test)")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    if args.quick:
        sets: list[dict[str, float]] = [QUICK]
    else:
        sets = [LESSON_DEFAULTS["capacity"]] if args.defaults else [draw(rng) for _ in range(args.sets)]
    totals, walls = [], []
    for params in sets:
        key = PlanKey("llama-3.1-8b", "bfloat16", "bfloat16", 1, "servelab", float(params["tpot_ms"]),
                      float(params["ttft_ms"]), int(params["prompt_len"]), int(params["output_len"]))  # fmt: skip
        cpu: dict[str, float] = {}
        start = time.process_time()
        for name, fn, job in job_order(key.jobs(), first="h100-sxm"):
            row = fn(job)
            assert fn is plan_one
            cpu[name] = row.cpu_s
        total = time.process_time() - start
        wall = makespan(list(cpu.values()), args.workers)
        totals.append(total)
        walls.append(wall)
        print(f"{params}: CPU {total:.2f} s, on {args.workers} workers {wall:.2f} s  ("
              + ", ".join(f"{n} {t:.2f}" for n, t in cpu.items()) + ")", flush=True)  # fmt: skip
    if len(sets) > 1:
        print(f"p90 over {len(sets)} sets: CPU {np.percentile(totals, 90):.2f} s, on {args.workers} workers "
              f"{np.percentile(walls, 90):.2f} s (median {np.median(walls):.2f} s, max {max(walls):.2f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
