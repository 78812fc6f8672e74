"""What tensor parallelism adds to a disaggregated KV transfer: rank 0 gathering its ranks' heads
into each piece (export) and scattering them (import), against one engine's cache, on the
bundled model (SmolLM2-135M: 3 KV heads, so TP=3 gives each rank one). The wire itself is
benchmarks/kv_transfer.py's; this times only the part inside a worker. Interleaved, medians.
`--quick` (TP=2, 3 rounds) with a tiny `--model` checks that it runs.

    python benchmarks/tp_kv_gather.py [--tp 3] [--iters 30] [--model DIR] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads (servelab/__init__.py)
from servelab.core.sequence import SamplingParams
from servelab.engine.bundled import bundled_model_path
from servelab.engine.llm_engine import EngineArgs, LLMEngine
from servelab.runtime.parallel.kv_shards import TensorParallelKV
from servelab.spec.model import resolve_model


def _prefilled(model: str | None, tp: int, prompt: list[int]) -> tuple[LLMEngine, list[int]]:
    engine = LLMEngine.from_args(
        EngineArgs.from_kwargs(model=model, dtype="float32", tensor_parallel_size=tp, num_blocks=64)
    )
    engine.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()
    return engine, engine.detach_prefilled("r")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--model", default=None, help="an HF model directory or GGUF file (default: the bundled GGUF)")
    ap.add_argument("--quick", action="store_true", help="TP=2, 3 rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.tp, args.iters = 2, 3
    if args.tp < 2 or args.iters < 1:
        ap.error(f"--tp must be >= 2 and --iters >= 1, got {args.tp} and {args.iters}")
    vocab = min(5000, resolve_model(args.model or str(bundled_model_path())).vocab_size - 1)
    prompt = [1 + (7 * i) % vocab for i in range(128)]  # 8 blocks of 16 tokens
    one, one_blocks = _prefilled(args.model, 1, prompt)
    many, many_blocks = _prefilled(args.model, args.tp, prompt)
    try:
        whole, tp = one.executor.kv_cache, TensorParallelKV(many.executor.kv_cache, many.executor.model.group)
        piece = whole.export_block(one_blocks[0])
        cases = {
            "export_block TP=1": lambda: whole.export_block(one_blocks[0]),
            f"export_block TP={args.tp} (gather)": lambda: tp.export_block(many_blocks[0]),
            "import_block TP=1": lambda: whole.import_block(one_blocks[1], piece),
            f"import_block TP={args.tp} (scatter)": lambda: tp.import_block(many_blocks[1], piece),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.iters):
            for name, fn in cases.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        print(f"one block = {piece.nbytes / 1024:.0f} KiB ({tuple(piece.shape)}), {args.iters} interleaved rounds")
        for name, ts in times.items():
            print(
                f"{name:32s} median {statistics.median(ts) * 1e3:7.3f} ms  p90 {sorted(ts)[int(0.9 * len(ts))] * 1e3:7.3f} ms"
            )
    finally:
        one.close()
        many.close()


if __name__ == "__main__":
    main()
