"""What a small torch op costs right after a decode step's weights went through the caches: a
few ops of a batch-1 step's Python side (one embedding row, a gather + add, a small int tensor, an
empty tensor), timed warm and right after the packed-GGUF GEMV kernel streamed N MB of random
Q4_1 blocks (3072 x 576 matrices, as gate/up). The bundled model streams ~97 MB a step, which
leaves no cache level holding torch's code or data, so every op after it runs at memory latency
(docs/benchmarks.md, "Batch 1: cold caches after the weights' stream").

    python benchmarks/cold_ops.py [--mb 0 4 16 32 100] [--threads 2] [--reps 100]

Prints the median microseconds of each op per streamed size (0: the op timed twice in a row).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads
import torch

from servelab.engine import native
from servelab.engine.block_quant import GGML_TYPE_BY_NAME

OUT, IN = 3072, 576
MB_PER_MATRIX = OUT * IN // 32 * 20 / 1e6


def q4_1_blocks(gen: torch.Generator) -> torch.Tensor:
    """A random [OUT, IN / 32 * 20] Q4_1 weight: small fp16 scales and offsets, random nibbles."""
    nb = IN // 32
    raw = torch.randint(0, 256, (OUT, nb, 20), dtype=torch.uint8, generator=gen)
    raw[:, :, :4] = (torch.rand(OUT, nb, 2, generator=gen) * 0.01).half().view(torch.uint8).view(OUT, nb, 4)
    return raw.view(OUT, nb * 20).contiguous()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[0, 4, 16, 32, 100])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=100)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels = native.native_kernels()
    if kernels is None:
        raise SystemExit(f"native kernels unavailable: {native.load_error}")
    fmt = GGML_TYPE_BY_NAME["Q4_1"].kernel_code
    gen = torch.Generator().manual_seed(0)
    most = max(1, round(max(args.mb) / MB_PER_MATRIX))
    weights = [q4_1_blocks(gen) for _ in range(most)]
    x, y = torch.randn(1, IN), torch.empty(1, OUT)
    scratch = torch.empty(IN // 32 + args.threads * IN)
    embed, ids = torch.randn(49152, 576), torch.tensor([123])
    a, d, rows = torch.randn(1, 576), torch.randn(1, 576), torch.tensor([0])
    ops = {
        "index_select (1 row)": lambda: torch.index_select(embed, 0, ids),
        "x[rows] + d[rows]": lambda: a[rows] + d[rows],
        "torch.tensor([1, 2, 3])": lambda: torch.tensor([1, 2, 3]),
        "torch.empty(1, 576)": lambda: torch.empty(1, 576),
    }
    print(f"{args.threads} thread(s), {args.reps} reps, median us of each op after streaming N MB of Q4_1 weights")
    print(f"{'MB':>6s} " + " ".join(f"{name:>24s}" for name in ops))
    for mb in args.mb:
        n = round(mb / MB_PER_MATRIX)
        chosen = weights[:n]

        def stream() -> None:
            for w in chosen:
                kernels.block_quant_linear(fmt, w.data_ptr(), w.shape[1], IN, OUT, x.data_ptr(), 1, None,
                                           y.data_ptr(), OUT, scratch.data_ptr(), args.threads)

        times: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(args.reps):
            for name, op in ops.items():
                stream() if n else op()  # warm: the op itself just before
                t = time.perf_counter_ns()
                op()
                times[name].append((time.perf_counter_ns() - t) / 1e3)
        print(f"{n * MB_PER_MATRIX:6.1f} " + " ".join(f"{statistics.median(v):24.1f}" for v in times.values()))
    print("load average at the end (1/5/15 min): " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
