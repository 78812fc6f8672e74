"""Where a decode step goes: time inside the native kernels against everything else (Python,
torch dispatch, ctypes), with the layers in one native call and op by op, interleaved; with
`--by-kernel`, the op-by-op step's kernel time per entry point (linears by their shape).

Each native entry point is wrapped in a timer (~0.2 us a call, counted as kernel time, so the
"else" share is if anything understated for the per-op path, which makes ~270 calls a step). A
step is `LLMEngine.step()` whole: scheduling, metadata, forward, sampling, detokenizing.

    python benchmarks/decode_step_split.py [--threads 2] [--rounds 6] [--steps 30] [--dtype float32]
        [--quantization int8] [--batch 32] [--by-kernel] [--model DIR] [--quick]

The engine's default path (int8 dot products from 2 rows, an fp16 KV cache) unless `--dtype
float32` asks for the exact one (fp32 linears and KV cache). The bundled model unless `--model`
names an HF directory; `--quick`: two rounds of 4 steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import fields
from pathlib import Path

import servelab  # noqa: F401 - first: it sets OMP_WAIT_POLICY before torch loads
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_cpu import Servelab  # noqa: E402

from servelab.core.sequence import SamplingParams  # noqa: E402
from servelab.runtime import native  # noqa: E402
from servelab.engine.args import QUANTIZATIONS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30, help="decode steps a round and mode")
    parser.add_argument(
        "--dtype", choices=["auto", "float32"], default="auto", help="auto: the default path; float32: the exact one"
    )
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    parser.add_argument("--by-kernel", action="store_true", help="split the op-by-op kernel time by entry point")
    parser.add_argument("--model", default=None, help="an HF model directory (default: the bundled GGUF)")
    parser.add_argument("--quick", action="store_true", help="two rounds of 4 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 4
    torch.set_num_threads(args.threads)

    runner = Servelab(args.dtype, args.quantization, model=args.model)
    engine = runner.engine
    model = engine.executor.model
    kernel_ns = [0]
    by_kernel: dict[str, int] = {}  # entry point (a linear: with its out x in) -> ns, op by op
    recording = [False]

    def timed(name, f):
        def call(*a):
            t = time.perf_counter_ns()
            try:
                return f(*a)
            finally:
                ns = time.perf_counter_ns() - t
                kernel_ns[0] += ns
                if recording[0]:
                    label = f"{name} {a[4]}x{a[3]}" if name.startswith("block_quant") else name
                    by_kernel[label] = by_kernel.get(label, 0) + ns

        return call

    k = model.ops.kernels
    if k is None:
        raise SystemExit(f"no native kernels here: {native.load_error}")
    model.ops.kernels = native.NativeKernels(
        **{
            f.name: timed(f.name, getattr(k, f.name)) if callable(getattr(k, f.name)) else getattr(k, f.name)
            for f in fields(k)
        }
    )
    model.use_ops(model.ops)  # the linears and the stack on the timed entry points
    stack = model.decode_stack
    modes = {"one call": stack, "op by op": None} if stack is not None else {"op by op": None}

    params = SamplingParams(max_tokens=args.rounds * len(modes) * args.steps + 10, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"split{i}", runner.prompt_ids(32, 1 + i), params, arrival_s=time.perf_counter())
    for _ in range(5):  # the prefill and a few warm decodes
        engine.step()
    step_ms: dict[str, list[float]] = {m: [] for m in modes}
    kernel_ms: dict[str, list[float]] = {m: [] for m in modes}
    names = list(modes)
    for r in range(args.rounds):
        for mode in names if r % 2 == 0 else names[::-1]:
            model.decode_stack = modes[mode]
            kernel_ns[0] = 0
            recording[0] = mode == "op by op"
            if recording[0]:
                by_kernel.clear()
            t = time.perf_counter_ns()
            for _ in range(args.steps):
                engine.step()
            step_ms[mode].append((time.perf_counter_ns() - t) / args.steps / 1e6)
            kernel_ms[mode].append(kernel_ns[0] / args.steps / 1e6)
            recording[0] = False
    model.decode_stack = stack
    print(
        f"batch-{args.batch} decode step, {args.model or 'bundled SmolLM2-135M'}, "
        f"{args.quantization or ('exact fp32' if args.dtype == 'float32' else 'default path')}, "
        f"{args.threads} threads, {args.rounds} interleaved rounds of {args.steps} steps (medians)"
    )
    print(f"{'mode':10s} {'step ms':>8s} {'tok/s':>7s} {'kernels ms':>10s} {'else ms':>8s} {'else %':>7s}")
    for mode in names:
        step, kern = statistics.median(step_ms[mode]), statistics.median(kernel_ms[mode])
        other = statistics.median([s - k for s, k in zip(step_ms[mode], kernel_ms[mode])])
        share = statistics.median([(s - k) / s for s, k in zip(step_ms[mode], kernel_ms[mode])])
        print(f"{mode:10s} {step:8.2f} {args.batch * 1e3 / step:7.1f} {kern:10.2f} {other:8.2f} {100 * share:6.1f}%")
    if args.by_kernel:  # the last op-by-op round's split
        print("op by op, ms a step per kernel (last round):")
        for label, ns in sorted(by_kernel.items(), key=lambda kv: -kv[1]):
            print(f"  {label:34s} {ns / args.steps / 1e6:8.2f}")
    print("load average at the end (1/5/15 min): " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
