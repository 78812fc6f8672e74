"""Cost of one scheduler step: schedule() + update() for a decode step over N running sequences.

The simulator calls this pair millions of times, so it must stay well under a millisecond for a
full batch. The executor is timed apart (it is not the scheduler's cost): the script builds N
sequences, prefills them, then times decode steps only, and reports the median over many steps.
The headline is the simulator's call, `update(..., finished_only=True)` (nothing streams, so no
RequestOutput per token); the engine's call, which builds one output per sequence per step, is
timed too. A no-op peer loop (building the same number of small objects) is timed in the same
run, so the ratio says how far the scheduler is from the floor of "touch every sequence once".

    .venv/bin/python benchmarks/scheduler_step.py [--seqs 256] [--steps 2000] [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from servelab.core.config import SchedulerConfig
from servelab.core.plan import ScheduledSeq, StepPlan, StepResult
from servelab.core.scheduler import Scheduler
from servelab.core.sequence import SamplingParams, Sequence


class OneTokenExecutor:
    """Samples token 100 for every entry that samples, in 5 ms of virtual time (never timed)."""

    def execute(self, plan: StepPlan) -> StepResult:
        return StepResult([100 if s.samples else None for s in plan.scheduled], 0.005)


def build(num_seqs: int, prompt_len: int, max_tokens: int) -> tuple[Scheduler, OneTokenExecutor, float]:
    block_size = 16
    blocks_per_seq = -(-(prompt_len + max_tokens) // block_size)
    config = SchedulerConfig(
        num_blocks=num_seqs * blocks_per_seq + 16,
        block_size=block_size,
        max_num_batched_tokens=max(2048, num_seqs),
        max_num_seqs=num_seqs,
        max_model_len=prompt_len + max_tokens,
    )
    scheduler = Scheduler(config)
    executor = OneTokenExecutor()
    for i in range(num_seqs):
        prompt = [(i * 31 + j) % 30000 + 100 for j in range(prompt_len)]  # distinct: no prefix hits
        scheduler.add(Sequence(f"req-{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)), 0.0)
    now = 0.0
    while any(s.num_output_tokens == 0 for s in scheduler.running) or scheduler.num_waiting:
        plan = scheduler.schedule(now)
        result = executor.execute(plan)
        now += result.duration_s
        scheduler.update(plan, result, now)
    return scheduler, executor, now


def time_steps(num_seqs: int, steps: int, prompt_len: int, finished_only: bool) -> list[float]:
    # Sequences admitted early decode while later ones prefill: leave room for those tokens too.
    warmup_steps = num_seqs * prompt_len // max(2048, num_seqs) + 4
    scheduler, executor, now = build(num_seqs, prompt_len, max_tokens=steps + warmup_steps)
    samples: list[float] = []
    perf = time.perf_counter
    for _ in range(steps):
        t0 = perf()
        plan = scheduler.schedule(now)
        t1 = perf()
        result = executor.execute(plan)  # not timed
        now += result.duration_s
        t2 = perf()
        scheduler.update(plan, result, now, finished_only=finished_only)
        t3 = perf()
        assert len(plan.scheduled) == num_seqs and plan.num_batched_tokens == num_seqs, "not a full decode step"
        samples.append((t1 - t0) + (t3 - t2))
    return samples


def time_floor(num_seqs: int, steps: int) -> list[float]:
    """The peer: one small object per sequence per step, and nothing else."""
    seqs = [Sequence(f"req-{i}", [1], SamplingParams()) for i in range(num_seqs)]
    samples = []
    perf = time.perf_counter
    for _ in range(steps):
        t0 = perf()
        plan = [ScheduledSeq(s, 1, 0, True) for s in seqs]
        for ss in plan:
            ss.seq.num_computed_tokens += 1
        samples.append(perf() - t0)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256, help="running sequences (default 256)")
    parser.add_argument("--steps", type=int, default=2000, help="timed decode steps per repeat (default 2000)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats; the median of each is reported")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence (default 128)")
    parser.add_argument("--quick", action="store_true", help="16 sequences, 50 steps, one repeat (a smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seqs, args.steps, args.repeats, args.prompt_len = 16, 50, 1, 16
    if args.seqs < 1 or args.steps < 1 or args.repeats < 1 or args.prompt_len < 1:
        print("error: --seqs, --steps, --repeats and --prompt-len must be >= 1", file=sys.stderr)
        return 2

    step_medians, engine_medians, floor_medians = [], [], []
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    for _ in range(args.repeats):  # interleaved, so machine noise hits all three alike
        step_medians.append(statistics.median(time_steps(args.seqs, args.steps, args.prompt_len, True)))
        engine_medians.append(statistics.median(time_steps(args.seqs, args.steps, args.prompt_len, False)))
        floor_medians.append(statistics.median(time_floor(args.seqs, args.steps)))
    step_s = statistics.median(step_medians)
    engine_s = statistics.median(engine_medians)
    floor_s = statistics.median(floor_medians)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load average {load_start:.1f} -> {load:.1f}; "
        f"{args.seqs} decoding sequences, {args.steps} steps x {args.repeats} repeats"
    )
    print(
        f"schedule()+update(finished_only=True) per decode step (the simulator): median {step_s * 1e3:.3f} ms "
        f"(repeats: {', '.join(f'{m * 1e3:.3f}' for m in step_medians)} ms)"
    )
    print(f"  per sequence: {step_s / args.seqs * 1e6:.2f} us; quietest repeat {min(step_medians) * 1e3:.3f} ms")
    print(
        f"schedule()+update() with an output per sequence (the engine): median {engine_s * 1e3:.3f} ms "
        f"(repeats: {', '.join(f'{m * 1e3:.3f}' for m in engine_medians)} ms)"
    )
    print(f"floor (one object per sequence): median {floor_s * 1e3:.3f} ms; ratio {step_s / floor_s:.1f}x")
    print(f"target < 0.5 ms: {'met' if step_s < 0.5e-3 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
