"""The canonical capacity chart: output tokens/s per GPU against tokens/s per user, a Pareto curve
per accelerator, with the TPOT target drawn across them.

Each curve is `servelab plan`'s own: the lesson builds the `plan --plot` command it shows, parses
it with plan's parser, runs plan's jobs (`bench.planner.plan_one`, the capacity search on the
simulator, then levels past the first failing one) and draws `bench.pareto.frontier_curves`, the
function `plan --plot` draws. Capacity at the TPOT target is read off the line: it is plan's.

Sized for a simulator lesson's 2 s answer: the engine profile's own sequence cap (256 for
servelab), not the capacity lesson's 4,096, at most MAX_ACCELERATORS accelerators, and defaults
(two accelerators, 1,024 + 128 tokens, TPOT 30 ms) whose plans cost about 0.9 CPU-seconds
together (docs/lab.md). Each accelerator's plan is cached, so changing one re-plans only it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import shlex
import time
from typing import TYPE_CHECKING, Any

from servelab.lab.capacity_lesson import PLAN_PERCENTILE, memory_cap_argv
from servelab.lab.common import fmt, setup_from, stat
from servelab.lab.limits import bounds
from servelab.lab.params import Params
from servelab.lab.simulations import Budget
from servelab.spec import HARDWARE

if TYPE_CHECKING:
    from servelab.bench.pareto import ParetoCurve
    from servelab.bench.planner import PlanRow

MAX_ACCELERATORS = 4
DEFAULT_ACCELERATORS = ("h100-sxm", "a100-80gb")
ROW_BYTES = 4096  # a PlanRow's levels and summaries, for the lab's result cache


def accelerators_from(p: Params) -> list[str]:
    # Each accelerator is a plan of up to 2 CPU-seconds: at most MAX_ACCELERATORS.
    return p.choices("accelerators", DEFAULT_ACCELERATORS, list(HARDWARE), most=MAX_ACCELERATORS)


def plan_argv(setup: Any, accelerators: list[str], ttft_ms: float, tpot_ms: float, prompt_len: int,
              output_len: int) -> list[str]:  # fmt: skip
    """The `servelab plan` arguments whose --plot draws this lesson's chart."""
    return [
        "plan", "--model", setup.model.name, "--hardware", ",".join(accelerators), "--tp", str(setup.tp),
        "--dtype", setup.weight_dtype, "--kv-cache-dtype", setup.kv_dtype, "--engine-profile", setup.engine_profile,
        "--slo-ttft", f"{ttft_ms:g}ms", "--slo-tpot", f"{tpot_ms:g}ms", "--percentile", str(PLAN_PERCENTILE),
        "--input-len", str(prompt_len), "--output-len", str(output_len),
        *memory_cap_argv(setup, accelerators, prompt_len, output_len), "--plot", "frontier.png",
    ]  # fmt: skip


def capacity_pareto(p: Params, budget: Budget) -> dict[str, Any]:
    from servelab.bench.pareto import frontier_curves
    from servelab.bench.planner import DEFAULT_SLO_TTFT_S, plan_one
    from servelab.commands.plan import add_arguments, plan_inputs

    s = setup_from(p)
    accelerators = accelerators_from(p)
    tpot_ms = p.float("tpot_ms", 30.0, **bounds("capacity-pareto", "tpot_ms"))
    ttft_ms = p.float("ttft_ms", DEFAULT_SLO_TTFT_S * 1e3, **bounds("capacity-pareto", "ttft_ms"))
    prompt_len = p.int("prompt_len", 1024, **bounds("capacity-pareto", "prompt_len"))
    output_len = p.int("output_len", 128, **bounds("capacity-pareto", "output_len"))
    s.roofline()._check_context(prompt_len + output_len, "prompt_len + output_len")  # noqa: SLF001
    argv = plan_argv(s, accelerators, ttft_ms, tpot_ms, prompt_len, output_len)
    parser = argparse.ArgumentParser(prog="servelab plan")
    add_arguments(parser)
    jobs = plan_inputs(parser.parse_args(argv[1:])).jobs

    def run(job: Any) -> Any:
        # no plan runs past the lesson's time budget, and one cut short is not cached
        row = plan_one(dataclasses.replace(job, time_limit_s=max(0.0, budget.deadline - time.monotonic())))
        if row.timed_out:
            budget.check()
        return row

    rows = []
    for job in jobs:
        # One accelerator's plan at a time: a stopping server waits for at most the one running.
        budget.check()
        rows.append(budget.cached(("capacity-pareto", repr(job)), functools.partial(run, job), _row_bytes))
    curves = frontier_curves(rows)
    by_hw = {r.hardware: r for r in rows}
    line = 1e3 / tpot_ms
    targets = f"p{PLAN_PERCENTILE} TPOT ≤ {fmt(tpot_ms)} ms ({fmt(line)} tok/s per user) and TTFT ≤ {fmt(ttft_ms)} ms"
    verdicts = {c.hardware: _verdict(c, by_hw[c.hardware]) for c in curves}
    read = [c.capacity for c in curves if c.capacity is not None]
    no_fit = [hw for hw, r in by_hw.items() if not r.fits]
    misses = [hw for hw, r in by_hw.items() if r.fits and all(c.capacity is None for c in curves if c.hardware == hw)]
    if read:
        best = max(read, key=lambda cap: cap.level.tokens_per_s_per_device)
        priced = [cap for cap in read if cap.usd_per_million_tokens is not None]
        cheapest = min(priced, key=lambda cap: cap.usd_per_million_tokens or 0.0, default=None)
        notice = (
            f"At {targets}, {best.hardware} serves the most: {fmt(best.level.tokens_per_s_per_device)} tokens/s per "
            f"GPU at {best.level.concurrency} users"
        )
        if cheapest is not None:
            notice += (
                f"; {cheapest.hardware} is cheapest, ${fmt(cheapest.usd_per_million_tokens)} per million output tokens"
            )
        notice += (
            ". Left of the line, slower users buy more tokens/s per GPU; right of it, each faster user costs GPU "
            "throughput."
        )
    else:
        notice = f"No accelerator here serves {s.model.name} at {targets}."
    if misses:
        notice += f" {', '.join(misses)} miss{'es' if len(misses) == 1 else ''} the targets at every concurrency."
    warning = None
    if no_fit:
        warning = "; ".join(f"{hw}: does not fit: {by_hw[hw].reason}" for hw in no_fit)
        notice += f" {'; '.join(f'{hw}: does not fit' for hw in no_fit)} (the warning says what to change)."
    return {
        "config": {
            **s.to_dict(),
            "accelerators": accelerators,
            "tpot_ms": tpot_ms,
            "ttft_ms": ttft_ms,
            "prompt_len": prompt_len,
            "output_len": output_len,
            "percentile": PLAN_PERCENTILE,
        },
        "tpot_line_tokens_per_s_per_user": line,
        "curves": [c.to_dict() for c in curves],
        "verdicts": verdicts,
        "reasons": {c.hardware: by_hw[c.hardware].reason or None for c in curves},
        "warning": warning,
        "commands": ["servelab " + shlex.join(argv)],
        "stats": [stat("targets", targets), *(stat(hw, text) for hw, text in verdicts.items())],
        "notice": notice,
    }


def _row_bytes(_: object) -> int:
    return ROW_BYTES


def _verdict(curve: ParetoCurve, row: PlanRow) -> str:
    if not row.fits:
        return "does not fit"
    cap = curve.capacity
    if cap is None:
        return "misses the targets at every concurrency"
    cost = "" if cap.usd_per_million_tokens is None else f", ${fmt(cap.usd_per_million_tokens)}/M tok"
    return f"{fmt(cap.level.tokens_per_s_per_device)} tok/s/GPU at {cap.level.concurrency} users{cost}"
