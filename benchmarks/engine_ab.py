"""Two servelab checkouts on the bundled model, interleaved round by round: did a change cost speed?

One warm worker process per checkout runs that checkout's own `benchmarks/engine_cpu.py`
measurements (decode_b1, decode_b32, prefill_512, as engine_cpu.py defines them; the default
path, `--dtype float32` for the exact one, or `--quantization int8|bf16`); the
rounds alternate who goes first, and only one worker runs at a time. Besides the wall-clock
rates it reports each rate over the worker's CPU time, which a loaded machine disturbs less.
A checkout against itself measures the noise of the comparison; `--quick` (one round) with a tiny
`--model` checks that it runs.

    git archive <old-rev> | tar -x -C /tmp/servelab-old
    python benchmarks/engine_ab.py /tmp/servelab-old . [--rounds 5] [--threads 1] [--dtype float32]
        [--quantization int8] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

METRICS = ("decode_b1", "decode_b32", "prefill_512")

WORKER = r"""
import json, sys, time
sys.path.insert(0, "benchmarks")
import servelab  # noqa: F401 - before torch, as engine_cpu.py does
import torch
torch.set_num_threads(int(sys.argv[1]))
from engine_cpu import Servelab
s = Servelab(sys.argv[4], quantization=sys.argv[2] or None, model=sys.argv[3] or None)
s.decode_b1(); s.prefill_512()  # warm-up
print("ready", flush=True)
for line in sys.stdin:
    cpu, wall = time.process_time(), time.perf_counter()
    rate = getattr(s, line.strip())()
    print(json.dumps([rate, (time.perf_counter() - wall) / max(time.process_time() - cpu, 1e-9)]), flush=True)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="the checkout to compare against (its root)")
    parser.add_argument("new", help="the checkout under test (its root)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--dtype", choices=["auto", "float32"], default="auto", help="auto: the default path; float32: the exact one"
    )
    parser.add_argument("--quantization", choices=["int8", "bf16"], default=None, help="both engines' opt-in linears")
    parser.add_argument("--model", default=None, help="an HF model directory (default: the bundled GGUF)")
    parser.add_argument("--quick", action="store_true", help="one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 1
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    model = os.path.abspath(args.model) if args.model else ""
    # by position, not by path: a checkout against itself runs two workers
    trees = [os.path.abspath(args.old), os.path.abspath(args.new)]
    workers = []
    for tree in trees:
        workers.append(subprocess.Popen(
            [sys.executable, "-c", WORKER, str(args.threads), args.quantization or "", model, args.dtype],
            cwd=tree,
            env=dict(os.environ, PYTHONPATH=tree),
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        ))  # fmt: skip
    for tree, worker in zip(trees, workers):
        if worker.stdout.readline().strip() != "ready":
            raise SystemExit(f"the worker for {tree} did not start (run engine_cpu.py there to see why)")
    wall = [{m: [] for m in METRICS} for _ in trees]
    cpu = [{m: [] for m in METRICS} for _ in trees]
    for r in range(args.rounds):
        for m in METRICS:
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                workers[i].stdin.write(m + "\n")
                workers[i].stdin.flush()
                rate, wall_per_cpu = json.loads(workers[i].stdout.readline())
                wall[i][m].append(rate)
                cpu[i][m].append(rate * wall_per_cpu)
        print(f"round {r + 1}: " + "; ".join(f"{m} {wall[0][m][-1]:.1f} / {wall[1][m][-1]:.1f}" for m in METRICS))
    for worker in workers:
        worker.stdin.close()
        worker.wait()
    for label, rates in (("wall clock", wall), ("CPU time", cpu)):
        old = {m: statistics.median(rates[0][m]) for m in METRICS}
        new = {m: statistics.median(rates[1][m]) for m in METRICS}
        print(
            f"{label:10s} medians, old / new (tok/s): "
            + "; ".join(f"{m} {old[m]:.1f} / {new[m]:.1f} = {new[m] / old[m]:.3f}x" for m in METRICS)
        )
    print(
        f"{args.quantization or ('exact' if args.dtype == 'float32' else 'default')} linears, {args.threads} thread(s), {args.rounds} rounds; load average at the end: "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
