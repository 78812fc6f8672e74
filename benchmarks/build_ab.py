"""The engine on this CPU's kernel build against the same sources built with extra compiler flags
(a knob such as -DSL_SPIN_NS=200000, how long an idle worker spins), in one process: two engines on the bundled model, the
same in all but their kernels, decoding in interleaved rounds. One process and alternating rounds
keep the host's swings (2x within minutes here) out of the ratio.

    python benchmarks/build_ab.py --cflags="-DSL_SPIN_NS=200000" [--rows 1] [--threads 2]
        [--rounds 12] [--steps 90] [--model DIR] [--quick]

Prints each round's ms a decode step for both, and the median of the per-round ratios
(flagged build's step time over the default's: above 1, the default build is faster). The
bundled model unless `--model` names an HF directory; `--quick`: two rounds of 5 steps.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_cpu import Servelab  # noqa: E402

from servelab.core.sequence import SamplingParams  # noqa: E402
from servelab.runtime import native  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cflags", required=True, help="extra compiler flags for the second build")
    parser.add_argument("--rows", type=int, default=1, help="sequences decoding together")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=90, help="timed decode steps a round")
    parser.add_argument("--model", default=None, help="an HF model directory (default: the bundled GGUF)")
    parser.add_argument("--quick", action="store_true", help="two rounds of 5 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 5
    torch.set_num_threads(args.threads)
    level = native.best_level()
    flagged = native.build(level, shlex.split(args.cflags))
    runners = {"default": Servelab("float32", model=args.model), "flagged": Servelab("float32", model=args.model)}
    engines = {name: runner.engine for name, runner in runners.items()}
    model = engines["flagged"].executor.model
    if model.ops.kernels is None:
        raise SystemExit("no native kernels on this host")
    model.ops.kernels = flagged
    model.use_ops(model.ops)  # the linears and the decode stack on the flagged build

    params = SamplingParams(max_tokens=args.steps + 10, temperature=0, ignore_eos=True)
    count = [0]

    def round_ms(engine) -> float:
        for _ in range(args.rows):
            count[0] += 1  # a new prompt each time: nothing served from the prefix cache
            engine.add_request(
                f"ab{count[0]}", runners["default"].prompt_ids(32, count[0]), params, arrival_s=time.perf_counter()
            )
        for _ in range(3):  # the prefill and a few decodes
            engine.step()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        ms = (time.perf_counter() - t) / args.steps * 1e3
        while engine.has_unfinished():
            engine.step()
        return ms

    for engine in engines.values():  # warm-up
        round_ms(engine)
    ms: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            ms[name].append(round_ms(engines[name]))
    print(
        f"{level} vs {level} {args.cflags}: {args.rows} row(s), {args.threads} thread(s), "
        f"{args.rounds} interleaved rounds of {args.steps} decode steps"
    )
    for name in names:
        print(
            f"{name:8s} ms a step: median {statistics.median(ms[name]):6.2f}  rounds "
            + " ".join(f"{x:.2f}" for x in ms[name])
        )
    ratios = [f / d for f, d in zip(ms["flagged"], ms["default"])]
    print(
        f"flagged / default step time, median of rounds: {statistics.median(ratios):.3f}x "
        f"(rounds {min(ratios):.2f}-{max(ratios):.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
