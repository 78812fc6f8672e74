"""Decode step times by position in validate's concurrency-16 wave, on the bundled model: 16
prompts of 128 tokens prefilled in one 2,048-token step, then 63 decode steps at batch 16, the
engine driven and timed the way `servelab calibrate` times its grid (docs/fidelity.md, "The
host's own spread"). The first wave is a warm-up.

    python benchmarks/decode_wave.py [--waves 4] [--batch 16] [--prompt-len 128] [--output-len 64]
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import replace

from servelab.commands import calibrate
from servelab.commands._engine_cli import add_engine_arguments, engine_args_from, set_threads
from servelab.engine.llm_engine import LLMEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(ap)
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    budget = args.batch * args.prompt_len
    engine_args = replace(engine_args_from(args, max_num_batched_tokens=budget, enable_prefix_caching=False),
                          kv_cache_prefault=True)
    set_threads(args)
    engine = LLMEngine.from_args(engine_args)
    log: list = []
    calibrate._timed(engine, log)
    rng = random.Random(0)
    wave = calibrate.Scenario(((args.prompt_len, args.output_len),) * args.batch, budget=budget)
    for i in range(args.waves):
        log.clear()
        calibrate._scenario(engine, wave, rng, budget)
        if i == 0:
            continue  # warm-up
        decode = [t * 1e3 for (tokens, seqs, *_), t in log if tokens == seqs == args.batch]
        prefill = [t * 1e3 for (tokens, seqs, *_), t in log if tokens > seqs]
        print(f"wave {i}: prefill {sum(prefill):.0f} ms; decode at batch {args.batch}: first 3 "
              f"{', '.join(f'{x:.1f}' for x in decode[:3])} ms, steps 4-10 median {statistics.median(decode[3:10]):.1f}, "
              f"11+ median {statistics.median(decode[10:]):.1f}, all median {statistics.median(decode):.1f} ms "
              f"({len(decode)} steps)")


if __name__ == "__main__":
    main()
