"""Where a prefill step goes, by kind of work: the engine's default (int8 dot products over the
GGUF blocks) and the exact path, whose linears of big chunks run on MKL (over the dense fp32
weights, above block_quant.MAX_ROWS) or on the panel kernel (over the packed blocks, up to
--panel-rows), interleaved round by round.

Two steps, as benchmarks/engine_cpu.py runs them: `prefill_512` (one 512-token prompt) and
`prefill_32x32` (decode_b32's first step: 32 prompts of 32 tokens, 1024 rows). Each step is
`LLMEngine.step()` whole; every linear (by kind), the LM head, the embedding and each op of the
layer loop are wrapped in a timer (~0.3 us a call), and "else" is the step minus what they
account for (scheduling, metadata, sampling, the final gather and add, Python).

    python benchmarks/prefill_step_split.py [--threads 2] [--rounds 5] [--steps 512,32x32]
        [--modes default,mkl,panel] [--panel-rows 4096] [--model DIR] [--quick]

The bundled model unless `--model` names an HF directory (whose dense linears every mode runs on
MKL alike); `--quick`: one round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_cpu import Servelab  # noqa: E402

from servelab.core.sequence import SamplingParams  # noqa: E402
from servelab.runtime import block_quant  # noqa: E402

KINDS = ("qkv", "o", "gate_up", "down", "lm_head", "attention", "rope_kv", "norms", "silu_mul", "embed", "else")


class Timed:
    """Calls `fn` and adds its time to `totals[label]`."""

    def __init__(self, fn, label: str, totals: dict[str, int]):
        self.fn, self.label, self.totals = fn, label, totals

    def __call__(self, *args, **kwargs):
        t = time.perf_counter_ns()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.totals[self.label] = self.totals.get(self.label, 0) + time.perf_counter_ns() - t

    def __getattr__(self, name):  # shape, bias, ... of a wrapped linear
        return getattr(self.fn, name)


_UNSET = object()


def instrument(model, totals: dict[str, int]) -> Callable[[], None]:
    """Wrap the model's linears and its ops' kernels in timers; returns what undoes the ops' part
    (the ops object can be shared by every model of a dtype in this process)."""
    for layer in model.layers:
        for kind in ("qkv", "o", "gate_up", "down"):
            setattr(layer, kind, Timed(getattr(layer, kind), kind, totals))
    model.lm_head = Timed(model.lm_head, "lm_head", totals)
    model.embedding = Timed(model.embedding, "embed", totals)
    ops = model.ops
    saved: dict[str, object] = {}
    # attention includes the prefill attention kernel it calls; rms_norm is the final norm
    for name, label in (
        ("attention", "attention"),
        ("rope_store_kv", "rope_kv"),
        ("add_rms_norm", "norms"),
        ("rms_norm", "norms"),
        ("silu_mul", "silu_mul"),
    ):
        saved[name] = ops.__dict__.get(name, _UNSET)
        setattr(ops, name, Timed(getattr(ops, name), label, totals))

    def undo() -> None:
        for name, value in saved.items():
            if value is _UNSET:
                delattr(ops, name)
            else:
                setattr(ops, name, value)

    return undo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", default="512,32x32", help="comma-separated: 512 (one prompt), 32x32 (32 prompts)")
    parser.add_argument("--panel-rows", type=int, default=4096, help="MAX_ROWS in the panel mode")
    parser.add_argument(
        "--modes",
        default="default,mkl",
        help="default: the engine's default path; mkl: the exact path, MAX_ROWS as committed; panel: the exact "
        "path with MAX_ROWS=--panel-rows",
    )
    parser.add_argument("--model", default=None, help="an HF model directory (default: the bundled GGUF)")
    parser.add_argument("--quick", action="store_true", help="one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 1
    torch.set_num_threads(args.threads)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - {"default", "mkl", "panel"})
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)} (default, mkl, panel)")
    # the default path on an engine of its own; mkl and panel share the exact one
    runners = {path: Servelab(dtype, model=args.model) for path, dtype in (("default", "auto"), ("exact", "float32"))
               if any(_path(m) == path for m in modes)}  # fmt: skip
    totals: dict[str, int] = {}
    committed = block_quant.MAX_ROWS, block_quant.PANEL_ONLY_LEVELS
    undo = [instrument(r.engine.executor.model, totals) for r in runners.values()]
    try:
        return _run(args, modes, runners, totals, committed[0])
    finally:  # the process may go on (a test): leave the kernels' switches and ops as they were
        for u in reversed(undo):
            u()
        block_quant.MAX_ROWS, block_quant.PANEL_ONLY_LEVELS = committed


def _path(mode: str) -> str:
    return "default" if mode == "default" else "exact"


def _run(args: argparse.Namespace, modes: list[str], runners: dict[str, Servelab], totals: dict[str, int],
         mkl_rows: int) -> int:  # fmt: skip
    max_rows = {"default": mkl_rows, "mkl": mkl_rows, "panel": args.panel_rows}
    block_quant.PANEL_ONLY_LEVELS = frozenset()  # MAX_ROWS decides at every level, as each mode sets it
    shapes = {"512": [(512, 7)], "32x32": [(32, 100 + i) for i in range(32)]}
    steps = [s for s in args.steps.split(",") if s]
    n = [0]

    def one_step(step: str, mode: str) -> tuple[float, dict[str, int]]:
        runner = runners[_path(mode)]
        engine = runner.engine
        block_quant.MAX_ROWS = max_rows[mode]
        for length, seed in shapes[step]:
            n[0] += 1
            engine.add_request(
                f"p{n[0]}",
                runner.prompt_ids(length, seed),
                SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
            )
        totals.clear()
        t = time.perf_counter_ns()
        engine.step()  # the whole prefill; max_tokens=1 finishes every request in it
        wall = time.perf_counter_ns() - t
        if engine.has_unfinished():
            raise SystemExit(f"step {step}: the prefill did not finish in one step")
        return wall, dict(totals)

    results: dict[tuple[str, str], list[tuple[float, dict[str, int]]]] = {}
    for mode in modes:  # warm-up, each mode once
        for step in steps:
            one_step(step, mode)
    for r in range(args.rounds):
        for step in steps:
            for mode in modes if r % 2 == 0 else modes[::-1]:
                results.setdefault((step, mode), []).append(one_step(step, mode))
    weights = "HF weights" if args.model else "Q4_1 layers, Q8_0 head"
    print(
        f"prefill steps, {args.model or 'bundled SmolLM2-135M'}, {weights}, {args.threads} threads, "
        f"{args.rounds} interleaved rounds, medians in ms; default: int8 dot products over the blocks; "
        f"mkl: exact, MAX_ROWS={max_rows['mkl']}; panel: exact, MAX_ROWS={args.panel_rows}"
    )
    for step in steps:
        rows = sum(length for length, _ in shapes[step])
        print(f"step {step} ({rows} rows)")
        print(f"  {'kind':10s} " + " ".join(f"{m:>9s}" for m in modes))
        for kind in ("step", *KINDS):
            cells = []
            for mode in modes:
                vals = []
                for wall, t in results[(step, mode)]:
                    if kind == "step":
                        vals.append(wall)
                    elif kind == "else":
                        vals.append(wall - sum(t.values()))
                    else:
                        vals.append(t.get(kind, 0))
                cells.append(f"{statistics.median(vals) / 1e6:9.1f}")
            print(f"  {kind:10s} " + " ".join(cells))
        for mode in modes:
            wall = statistics.median(w for w, _ in results[(step, mode)])
            print(f"  {mode}: {rows / (wall / 1e9):.0f} prompt tok/s")
    print("load average at the end (1/5/15 min): " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
