"""The default's int8 dot products over GGUF blocks (csrc/q8_block_linear.c) against the exact fp32
kernels, on the bundled model, where the threshold `block_quant.Q8_MIN_ROWS` comes from.

    python benchmarks/q8_linears.py [--threads 2] [--rows 1 2 4 8 32 512]
    python benchmarks/q8_linears.py --decode 1 2 3 4 8 [--rounds 5]
    python benchmarks/q8_linears.py --quick [--decode 2]   # 2 rows, one round: a smoke test

Without --decode: one layer's four linears and the LM head at each row count, exact / one int8
pass / two passes (the default), medians of interleaved calls, and the ratio of their sum over the
model's 30 layers and head. With --decode: engine decode tok/s at B sequences (24 new tokens
after a 32-token prompt), `--exact` against the int8 path from 1 and from 2 rows, interleaved
rounds, medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

try:
    import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads
except ModuleNotFoundError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch

from servelab.core.sequence import SamplingParams
from servelab.engine.llm_engine import EngineArgs, LLMEngine
from servelab.runtime import block_quant


def _median_s(fn: Callable[[], object], calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def linears(rows_list: list[int], quick: bool = False) -> None:
    model = LLMEngine.from_args(EngineArgs.from_kwargs(exact=True)).executor.model
    layer = model.layers[len(model.layers) // 2]
    named = {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down, "head": model.lm_head}
    for rows in rows_list:
        totals = [0.0, 0.0, 0.0]
        parts = []
        for name, lin in named.items():
            if name == "head" and rows > 64:  # a prefill samples one row
                continue
            paths = (lin, block_quant.with_q8(lin, 1, 1), block_quant.with_q8(lin, 1, 2))
            x = torch.randn(rows, lin.shape[1])
            calls = 3 if quick else 30 if rows < 100 else 7
            times = [_median_s(lambda p=p: p(x), calls) for p in paths]
            weight = 1 if name == "head" else len(model.layers)
            totals = [t + weight * s for t, s in zip(totals, times)]
            parts.append(f"{name} " + "/".join(f"{s * 1e3:.3f}" for s in times))
        print(
            f"rows {rows:4d}: exact/one pass/two passes ms: {'  '.join(parts)}; model: exact / one pass "
            f"{totals[0] / totals[1]:.2f}x, exact / two passes {totals[0] / totals[2]:.2f}x",
            flush=True,
        )


def decode(batches: list[int], rounds: int) -> None:
    def engine(**kwargs) -> LLMEngine:
        return LLMEngine.from_args(EngineArgs.from_kwargs(enable_prefix_caching=False, max_num_seqs=64, **kwargs))

    engines = {"exact": engine(exact=True), "int8 from 1 row": engine(), "int8 from 2 rows": engine()}
    engines["int8 from 1 row"].executor.model.use_q8(1)
    engines["int8 from 2 rows"].executor.model.use_q8(2)
    count = 0

    def run(e: LLMEngine, batch: int, new: int = 24) -> float:
        nonlocal count
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        seqs = []
        for i in range(batch):
            count += 1
            seqs.append(e.add_request(f"r{count}", list(range(300 + i, 332 + i)), params))
        while e.has_unfinished():
            e.step()
        start, end = max(s.first_token_s for s in seqs), max(s.token_times_s[-1] for s in seqs)
        return batch * (new - 1) / (end - start)

    for batch in batches:
        results: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(rounds):
            order = list(engines.items())
            for name, e in order if r % 2 == 0 else reversed(order):
                results[name].append(run(e, batch))
        print(
            f"B={batch}: " + "  ".join(f"{k} {statistics.median(v):.1f} tok/s" for k, v in results.items()), flush=True
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32, 512])
    ap.add_argument("--decode", type=int, nargs="+", default=None, help="engine decode at these batch sizes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 rows (or the --decode sizes) and one round")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.rounds = [2], 1
    torch.set_num_threads(args.threads)
    if args.decode:
        decode(args.decode, args.rounds)
    else:
        linears(args.rows, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
