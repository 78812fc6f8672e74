"""Decode-step weight streaming: the bundled SmolLM2-135M's 120 Q4_1 layer matrices in the layer
order a decode step reads them, with Q4_1 kept as GGUF rows and regrouped sixteen outputs a lane
(block_quant.Q4_1_G16, what the AVX-512 levels keep), each through the kernel the engine picks for
it at that many rows (up to 4: the in-register kernel; then GGUF rows take the dot-product panel
below KMAJOR_MIN_ROWS, Q4_1_G16 the k-major panel), interleaved in one process; then one matrix
hot in cache. The kernels are called as the decode stack calls them, into buffers allocated once.

    python benchmarks/gemv_layouts.py [--threads 2] [--rows 1] [--rounds 5] [--quick]

Prints GB/s of packed weights streamed per layout, its share of the host's read bandwidth
(host_probe, measured after the rounds), and each round's figure. Needs an AVX-512 level (native
or SIMDe: there the kernels are emulated, and only the bits mean anything). `--quick`: the first
2 layers, one round, a short bandwidth probe.
"""

from __future__ import annotations

import argparse
import statistics
import time

import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads
import torch

from servelab.runtime import block_quant, host_probe
from servelab.engine.bundled import bundled_model_path
from servelab.runtime.loader import load_model


def as_rows(linear: block_quant.BlockQuantLinear) -> block_quant.BlockQuantLinear:
    """The same weight with its Q4_1 as GGUF rows (set after construction, which would regroup it)."""
    rows = block_quant.BlockQuantLinear(linear.segments, linear.kernels, None, linear.shape)
    rows.segments = tuple(block_quant.regrouped(seg, False) for seg in linear.segments)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1, help="activation rows (1-4: the in-register kernel)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 layers, one round, a short bandwidth probe")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 1
    torch.set_num_threads(args.threads)
    model = load_model(bundled_model_path(), dtype=torch.float32).model
    grouped = [lin for layer in (model.layers[:2] if args.quick else model.layers) for lin in layer.linears()]
    if not all(isinstance(lin, block_quant.BlockQuantLinear) for lin in grouped):
        raise SystemExit("the layers are not packed GGUF blocks here (no native kernels?)")
    if not block_quant.grouped_q4_1(grouped[0].kernels):
        raise SystemExit(f"ISA level {grouped[0].kernels.level} keeps Q4_1 as GGUF rows: nothing to compare")
    layouts = {"Q4_1_G16": grouped, "GGUF rows": [as_rows(lin) for lin in grouped]}
    kernels = grouped[0].kernels
    buffers = []  # alive while the calls run

    # as BlockQuantLinear picks (Q4_1_G16 takes the k-major panel through either panel entry point)
    if args.rows <= block_quant.FUSED_MAX_ROWS:
        kernel = kernels.block_quant_linear
    elif args.rows > block_quant.same_order_max_rows(kernels):
        kernel = kernels.block_quant_gemm_kmajor
    else:
        kernel = kernels.block_quant_gemm

    def calls(linears):
        out = []
        for lin in linears:
            o, i = lin.shape
            x, y = torch.randn(args.rows, i), torch.empty(args.rows, o)
            scratch = torch.empty(args.rows * i // 32 + args.threads * max(i, block_quant.PANEL_OUTPUTS * i))
            buffers.append((x, y, scratch))
            out += [
                (
                    seg.fmt,
                    seg.data.data_ptr(),
                    seg.data.shape[1],
                    i,
                    seg.data.shape[0],
                    x.data_ptr(),
                    args.rows,
                    None,
                    y.data_ptr() + 4 * seg.start,
                    o,
                    scratch.data_ptr(),
                    args.threads,
                )
                for seg in lin.segments
            ]
        return out

    def run(cs, repeat=1):
        t = time.perf_counter()
        for _ in range(repeat):
            for c in cs:
                kernel(*c)
        return (time.perf_counter() - t) / repeat

    streams = {name: calls(lins) for name, lins in layouts.items()}
    gate_up = {name: calls([lins[2]]) for name, lins in layouts.items()}  # one matrix, hot
    nbytes, hot_bytes = sum(lin.nbytes for lin in grouped), grouped[2].nbytes
    rates = {name: [] for name in layouts}
    hot = {name: [] for name in layouts}
    for _ in range(args.rounds):
        for name in layouts:
            run(streams[name])
            rates[name].append(nbytes / statistics.median(run(streams[name]) for _ in range(9)))
            hot[name].append(hot_bytes / run(gate_up[name], max(10, 200 // args.rows)))
    bandwidth = host_probe.read_bandwidth_bytes_per_s(1 << 28, 2 if args.quick else 5)
    print(
        f"{len(grouped)} Q4_1 matrices, {nbytes / 1e6:.1f} MB, {args.rows} row(s), {args.threads} thread(s), "
        f"{args.rounds} interleaved rounds; host read bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    for name in layouts:
        med = statistics.median(rates[name])
        print(
            f"{name:10s} stream {med / 1e9:5.1f} GB/s ({med / bandwidth:4.0%})  hot {grouped[2].shape[0]}x"
            f"{grouped[2].shape[1]} {statistics.median(hot[name]) / 1e9:5.1f} GB/s  rounds "
            + " ".join(f"{r / 1e9:.1f}" for r in rates[name])
        )
    first, second = layouts
    print(
        f"{first} / {second}: stream {statistics.median(rates[first]) / statistics.median(rates[second]):.2f}x, "
        f"hot {statistics.median(hot[first]) / statistics.median(hot[second]):.2f}x"
    )


if __name__ == "__main__":
    main()
