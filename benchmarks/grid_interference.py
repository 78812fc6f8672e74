"""Batch-16 decode steps timed inside calibrate's whole grid and alone, alternated on one engine
(docs/fidelity.md, "The host's own spread"): does the rest of the grid slow these steps?

    python benchmarks/grid_interference.py [--rounds 2] [--grid coarse]

Blocks run B A B A B ... (B: the grid's batch-16 decode scenarios alone; A: the whole grid), each
measured as calibrate measures (shuffled interleaved passes, median of passes per shape). It
prints, per block, the median over the batch-16 decode-only shapes of their per-shape statistic.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

from servelab.commands import calibrate
from servelab.commands._engine_cli import add_engine_arguments, engine_args_from, set_threads
from servelab.engine.llm_engine import LLMEngine


def b16_decode_ms(measurements: list[dict], batch: int) -> tuple[float, float, int]:
    rows = [m for m in measurements if m["num_seqs"] == batch and m["num_tokens"] == batch]
    med = statistics.median(statistics.median(m["samples_s"]) for m in rows) * 1e3
    fast = statistics.median(min(m["samples_s"]) for m in rows) * 1e3
    return med, fast, len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(ap)
    ap.add_argument("--rounds", type=int, default=2, help="A blocks (the whole grid); B blocks are rounds + 1")
    ap.add_argument("--grid", choices=list(calibrate.GRIDS), default="coarse")
    args = ap.parse_args()
    grid = calibrate.GRIDS[args.grid]
    batch = max(grid.decode_batches)
    alone = replace(grid, prefill_lens=(), decode_batches=(batch,), together=(), joined_batches=())
    engine_args = replace(engine_args_from(args, max_num_batched_tokens=grid.chunk, enable_prefix_caching=False),
                          kv_cache_prefault=True)
    set_threads(args)
    engine = LLMEngine.from_args(engine_args)
    print(f"{'block':<12} {'shapes':>6} {'median ms':>10} {'fastest ms':>11} {'wall s':>7} {'load':>5}")
    blocks = ["B"] + ["A", "B"] * args.rounds
    for i, kind in enumerate(blocks):
        t0 = time.perf_counter()
        ms = calibrate.measure(engine, grid if kind == "A" else alone, seed=i)
        med, fast, n = b16_decode_ms(ms, batch)
        name = "whole grid" if kind == "A" else f"b{batch} alone"
        print(f"{name:<12} {n:>6} {med:>10.1f} {fast:>11.1f} {time.perf_counter() - t0:>7.0f} "
              f"{os.getloadavg()[0]:>5.2f}", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
