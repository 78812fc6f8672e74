"""Where a decode step's linear time goes at 4-128 rows, and how close each linear runs to the
host's fp32 peak: the bundled SmolLM2-135M's matrices by kind (QKV, O, gate/up, down: summed
over the 30 layers; the Q8_0 LM head once), through the packed-GGUF kernel block_quant.py picks
for that many rows, against MKL's sgemm on the same fp32 weights (F.linear on the dequantized
copy), interleaved. The packed kernels are called as the one-call decode stack calls them, into
buffers allocated once (BlockQuantLinear's own call allocates its output and scratch each time,
and fresh pages cost page faults that the stack's arena never pays). Optionally another tree's kernels too (`--base TREE`, built as isa_levels.py
does) for before/after.

    python benchmarks/panel_linears.py [--rows 4 16 32 64 128] [--threads 2] [--base /tmp/old-tree] [--quick]

Prints per (kind, rows) the median ms a step spends in that kind and its GFLOP/s. `--quick`: the
first 2 layers, rows 4 and 16, one round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from isa_levels import build_from  # noqa: E402

from servelab.runtime import block_quant, native  # noqa: E402
from servelab.runtime.block_quant import BlockQuantLinear  # noqa: E402
from servelab.engine.bundled import bundled_model_path  # noqa: E402
from servelab.runtime.loader import load_model  # noqa: E402

KINDS = ("qkv", "o", "gate_up", "down")


def arena_call(
    w: BlockQuantLinear,
    kernels: native.NativeKernels,
    x: torch.Tensor,
    y: torch.Tensor,
    scratch: torch.Tensor,
    threads: int,
) -> None:
    """BlockQuantLinear.__call__'s kernel choice for x's rows, into y and scratch given."""
    rows, (out_features, in_features) = x.shape[0], w.shape
    fused = rows <= block_quant.FUSED_MAX_ROWS and block_quant.fused_formats(w)
    kernel = kernels.block_quant_linear if fused else kernels.block_quant_gemm
    for seg in w.segments:
        kernel(
            seg.fmt,
            seg.data.data_ptr(),
            seg.data.shape[1],
            in_features,
            seg.data.shape[0],
            x.data_ptr(),
            rows,
            None,
            y.data_ptr() + 4 * seg.start,
            out_features,
            scratch.data_ptr(),
            threads,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 16, 32, 64, 128])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--level", default="avx2")
    parser.add_argument("--base", type=Path, default=None, help="another tree's kernels at the same level")
    parser.add_argument("--quick", action="store_true", help="2 layers, rows 4 and 16, one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.rounds = [4, 16], 1
    torch.set_num_threads(args.threads)
    builds = {"ours": native.native_kernels(args.level)}
    if builds["ours"] is None:
        parser.error(f"level {args.level}: {native.kernels_unavailable(args.level)}")
    if args.base is not None:
        builds["base"] = build_from(args.base, args.level)
    model = load_model(bundled_model_path(), dtype=torch.float32).model
    layers = model.layers[:2] if args.quick else model.layers
    groups = {kind: [getattr(layer, kind) for layer in layers] for kind in KINDS}
    groups["lm_head"] = [model.lm_head]
    times: dict[tuple[str, int, str], list[float]] = {}
    flops: dict[tuple[str, int], float] = {}
    for kind, linears in groups.items():
        for rows in args.rows:
            x = torch.randn(rows, linears[0].shape[1])
            flops[(kind, rows)] = sum(2.0 * rows * w.shape[0] * w.shape[1] for w in linears)
            y = torch.empty(rows, linears[0].shape[0])
            scratch = torch.empty(args.threads * block_quant.PANEL_OUTPUTS * x.shape[1] + rows * x.shape[1])
            cases = {
                name: (lambda k=k: [arena_call(w, k, x, y, scratch, args.threads) for w in linears])
                for name, k in builds.items()
            }
            dense = [w.dequantize() for w in linears]  # the fp32 copy (AVX-512 levels keep none)
            cases["mkl"] = lambda: [F.linear(x, d) for d in dense]
            for r in range(args.rounds):
                for name in list(cases) if r % 2 == 0 else list(reversed(cases)):
                    start = time.perf_counter()
                    cases[name]()
                    times.setdefault((kind, rows, name), []).append(time.perf_counter() - start)
    names = [*builds, "mkl"]
    print(f"{args.threads} thread(s), level {args.level}, {args.rounds} rounds; median ms a step (GFLOP/s)")
    for rows in args.rows:
        total = dict.fromkeys(names, 0.0)
        for kind in groups:
            cells = []
            for name in names:
                s = statistics.median(times[(kind, rows, name)])
                total[name] += s
                cells.append(f"{name} {s * 1e3:7.2f} ({flops[(kind, rows)] / s / 1e9:5.1f})")
            print(f"rows {rows:3d} {kind:8s} " + "  ".join(cells))
        all_flops = sum(flops[(kind, rows)] for kind in groups)
        print(
            f"rows {rows:3d} {'all':8s} "
            + "  ".join(f"{name} {total[name] * 1e3:7.2f} ({all_flops / total[name] / 1e9:5.1f})" for name in names)
        )
    print("load average at the end (1/5/15 min): " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
