"""Time the steps a served load makes past the packed kernels' 128 rows, interleaved, against the
single 128-token prefill of concurrency 1 (calibrate's own `measure` on a grid of just those
shapes; docs/fidelity.md, "The step-cost form").

    python benchmarks/served_steps.py --passes 7 [--model DIR] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from servelab.commands import calibrate
from servelab.engine.bundled import bundled_model_path
from servelab.engine.llm_engine import EngineArgs, LLMEngine


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="one pass of 2 prompts together (a smoke test)")
    args = ap.parse_args(argv)
    coarse = calibrate.GRIDS["coarse"]
    together, joined = ((2,), (1,)) if args.quick else (coarse.together, coarse.joined_batches)
    grid = calibrate.Grid(
        chunk=coarse.chunk,
        prefill_lens=(coarse.chunk,),
        decode_batches=(),
        decode_contexts=(min(coarse.decode_contexts),),
        decode_steps=coarse.decode_steps,
        repeats=1 if args.quick else args.passes,
        together=together,
        joined_batches=joined,
    )
    engine_args = EngineArgs.from_kwargs(
        model=args.model or str(bundled_model_path()),
        dtype="float32",
        max_num_batched_tokens=grid.chunk,
        enable_prefix_caching=False,
    )
    engine = LLMEngine.from_args(replace(engine_args, kv_cache_prefault=True))
    try:
        ms = calibrate.measure(engine, grid)
    finally:
        engine.close()
    base = next(m for m in ms if m["num_tokens"] == grid.chunk and m["num_seqs"] == 1)
    print(f"| step rows (sequences) | median pass | ratio to one {grid.chunk}-token prefill | ms a row |")
    print("|---|---:|---:|---:|")
    for m in sorted(ms, key=lambda m: (m["num_tokens"], m["num_seqs"])):
        if m["num_tokens"] >= grid.chunk:
            t = statistics.median(m["samples_s"])
            print(
                f"| {m['num_tokens']} ({m['num_seqs']}) | {t * 1e3:,.0f} ms | "
                f"{t / statistics.median(base['samples_s']):.2f} | {t * 1e3 / m['num_tokens']:.2f} |"
            )


if __name__ == "__main__":
    main()
