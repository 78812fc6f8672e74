"""servelab's int8 linear (csrc/int8_linear.c) against fbgemm's dynamic int8 linear and fp32 F.linear
(MKL), on every matrix of the bundled SmolLM2-135M (30 layers x 4 fused linears + the LM head),
in one process, the three timed in turn each round. Also the accuracy of each int8 path against
fp32 on the same random activations (relative Frobenius error of the outputs).

    .venv/bin/python benchmarks/int8_linear.py --rows 1 2 8 32 256 --threads 1 [--quick]

Prints, per row count, the median time for all 121 matrices and the ratios fbgemm / servelab and
fp32 / servelab (above 1: servelab faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from servelab.engine.bundled import bundled_model_path
from servelab.runtime.loader import load_model
from servelab.runtime.quantization import Int8Linear


def fbgemm_linear(w: torch.Tensor):
    """fbgemm's dynamic int8 linear: int8 weights with a scale per output channel, activations
    quantized per tensor to 7 bits on the fly (what servelab used before its own kernel)."""
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scales, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(q, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 32, 256])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="the first 2 layers and the head, rows 1 and 8, one round")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.rounds = [1, 8], 1
    torch.set_num_threads(args.threads)

    model = load_model(str(bundled_model_path()), dtype=torch.float32).model
    layers = model.layers[:2] if args.quick else model.layers
    dense = [w.dequantize() for layer in layers for w in layer.linears()]
    dense.append(model.lm_head.dequantize())
    engines = {
        "servelab": [Int8Linear.from_weight(w) for w in dense],
        "fbgemm": [fbgemm_linear(w) for w in dense],
        "fp32": [lambda x, w=w: F.linear(x, w) for w in dense],
    }
    print(f"{len(dense)} matrices, {sum(w.numel() for w in dense) / 1e6:.0f}M weights, {args.threads} thread(s)")
    print(
        f"{'rows':>5} {'servelab':>10} {'fbgemm':>10} {'fp32':>10} {'fbgemm/us':>10} {'fp32/us':>8} {'err us':>7} {'err fbgemm':>10}"
    )
    g = torch.Generator().manual_seed(0)
    for rows in args.rows:
        xs = [torch.randn(rows, w.shape[1], generator=g) for w in dense]
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, fns in engines.items():
                t = time.perf_counter()
                for fn, x in zip(fns, xs):
                    fn(x)
                times[name].append(time.perf_counter() - t)
        med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        err = {}
        for name in ("servelab", "fbgemm"):
            num = den = 0.0
            for fn, w, x in zip(engines[name], dense, xs):
                ref = F.linear(x, w)
                num += float((fn(x) - ref).square().sum())
                den += float(ref.square().sum())
            err[name] = (num / den) ** 0.5
        print(
            f"{rows:>5} {med['servelab']:>8.1f}ms {med['fbgemm']:>8.1f}ms {med['fp32']:>8.1f}ms "
            f"{med['fbgemm'] / med['servelab']:>9.2f}x {med['fp32'] / med['servelab']:>7.2f}x "
            f"{err['servelab']:>7.4f} {err['fbgemm']:>10.4f}"
        )


if __name__ == "__main__":
    main()
