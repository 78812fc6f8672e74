"""Time the kernels a transformer step is made of on one device, as the cost model's ground truth:
GEMMs by tokens in the step and matrix shape (BF16 and FP8), prefill and decode attention by
length and batch, the memory bandwidth, and the cost of a kernel launch, eager and in a graph.

    python benchmarks/gpu_kernels.py --out gpu_kernels.json           # on a CUDA device
    python benchmarks/gpu_kernels.py --device cpu --quick --out x.json  # the same code on a CPU

Each timing is the median of --repeats replays of a CUDA graph holding enough calls to run
~20 ms, so launch gaps are not counted (`launch` measures them apart). Weights rotate over copies
whose total is several times the L2 cache, as a model's distinct layers do, so no call is served
from cache. The JSON records the device, torch's version and every point's FLOPs and bytes;
`benchmarks/gpu_kernels_fit.py` fits the cost model's shape-aware efficiencies to it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# (name, N, K) of each linear layer: out features x in features.
SHAPES: dict[str, list[tuple[str, int, int]]] = {
    "llama-3.1-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
    "llama-3.1-70b": [("qkv", 10240, 8192), ("o", 8192, 8192), ("gate_up", 57344, 8192), ("down", 8192, 28672)],
    "llama-3.1-70b-tp4": [("qkv", 2560, 8192), ("o", 8192, 2048), ("gate_up", 14336, 8192), ("down", 8192, 7168)],
}
TOKENS = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
PREFILL_LENS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
DECODE_BATCHES = [1, 4, 16, 32, 64, 128, 256]
DECODE_CONTEXTS = [256, 1024, 4096, 16384]
ATTN = (32, 8, 128)  # Llama 3.1 8B's query heads, KV heads, head dim
ROTATE_BYTES = 512 << 20  # weights in rotation per GEMM point: ~8x an H100/H200's 50-60 MB L2

QUICK_SHAPES = {"tiny": [("qkv", 384, 256), ("gate_up", 1024, 256)]}
QUICK_TOKENS = [1, 16, 128]
QUICK = dict(prefill=[64, 128], batches=[1, 4], contexts=[128], attn=(4, 2, 32), rotate=8 << 20)


@dataclass
class Timer:
    device: torch.device
    repeats: int
    target_s: float = 0.02

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def median_s(self, calls: list[Callable[[], object]]) -> float:
        """Median time of one call, `calls` taken in turn (each may touch different memory)."""
        for c in calls:  # warm-up: first-call allocations, autotuning, lazy inits
            c()
        self.sync()
        t0 = time.perf_counter()
        calls[0]()
        self.sync()
        est = max(time.perf_counter() - t0, 1e-6)
        n = max(len(calls), min(2000, math.ceil(self.target_s / est)))
        seq = [calls[i % len(calls)] for i in range(n)]
        if self.device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for c in seq[: len(calls)]:
                    c()
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                for c in seq:
                    c()
            run = graph.replay
        else:

            def run() -> None:
                for c in seq:
                    c()

        run()
        self.sync()
        times = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            run()
            self.sync()
            times.append((time.perf_counter() - t0) / n)
        return statistics.median(times)


def measure_bandwidth(device: torch.device, nbytes: int) -> dict[str, float]:
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out: dict[str, float] = {}
    for name, fn, moved in (("read", lambda: x.sum(dtype=torch.float32), nbytes),
                            ("copy", lambda: y.copy_(x), 2 * nbytes)):  # fmt: skip
        fn()
        sync()
        best = math.inf
        for _ in range(10):
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        out[f"{name}_bytes_per_s"] = moved / best
    return out


FP8_DTYPES = ("fp8", "fp8_tensor")  # row-wise scales (per token and channel); one scale per tensor


def _fp8_weights(
    device: torch.device, n: int, k: int, copies: int, row_wise: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Column-major (K, N) codes, as cuBLASLt's FP8 GEMM takes them, with per-channel or one scale.
    return [(torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t(),
             torch.ones(1, n, device=device) if row_wise else torch.ones((), device=device))
            for _ in range(copies)]  # fmt: skip


def _fp8_calls(a16: torch.Tensor, ws: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Callable[[], object]]:
    a = a16.to(torch.float8_e4m3fn)
    row_wise = ws[0][1].dim() > 0
    sa = torch.ones(a.shape[0], 1, device=a.device) if row_wise else torch.ones((), device=a.device)
    return [lambda w=w, sb=sb: torch._scaled_mm(a, w, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            for w, sb in ws]  # fmt: skip


INT4_GROUP = 128  # weight-only int4 (tinygemm, as gpt-fast and torchao run it): one scale and zero per 128 weights


def _int4_weights(device: torch.device, n: int, k: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Packed int4 codes ([n][k/2] uint8 packed by torch for the CUDA kernel) and their bf16 scales and zeros."""
    return [(torch._convert_weight_to_int4pack(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device), 8),
             torch.rand(k // INT4_GROUP, n, 2, device=device, dtype=torch.bfloat16))
            for _ in range(copies)]  # fmt: skip


def measure_gemms(timer: Timer, shapes: dict, tokens: list[int], dtypes: list[str], rotate: int) -> list[dict]:
    rows = []
    dev = timer.device
    for model, layers in shapes.items():
        for layer, n, k in layers:
            for dtype in dtypes:
                fp8, int4 = dtype in FP8_DTYPES, dtype == "int4"
                wbytes = (n * k // 2 + k // INT4_GROUP * n * 4 if int4
                          else n * k * (1 if fp8 else torch.finfo(_torch_dtype(dtype)).bits // 8))  # fmt: skip
                copies = max(2, math.ceil(rotate / wbytes))
                try:
                    ws = (_fp8_weights(dev, n, k, copies, row_wise=dtype == "fp8") if fp8
                          else _int4_weights(dev, n, k, copies) if int4
                          else [torch.randn(n, k, device=dev, dtype=_torch_dtype(dtype)) for _ in range(copies)])  # fmt: skip
                except (RuntimeError, AttributeError) as e:  # a format this torch build cannot pack
                    rows.append(
                        dict(model=model, layer=layer, dtype=dtype, n=n, k=k, error=str(e).splitlines()[0][:200])
                    )
                    continue
                for m in tokens:
                    row = dict(model=model, layer=layer, dtype=dtype, m=m, n=n, k=k)
                    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16 if fp8 or int4 else _torch_dtype(dtype))
                    calls = (_fp8_calls(a, ws) if fp8
                             else [lambda w=w, a=a: torch._weight_int4pack_mm(a, w[0], INT4_GROUP, w[1]) for w in ws] if int4
                             else [lambda w=w, a=a: F.linear(a, w) for w in ws])  # fmt: skip
                    try:
                        t = timer.median_s(calls)
                    except (RuntimeError, TypeError) as e:  # e.g. an fp8 shape cuBLASLt refuses
                        row["error"] = str(e).splitlines()[0][:200]
                        rows.append(row)
                        continue
                    act = 2  # activations in and out in 16-bit
                    row.update(time_s=t, flops=2 * m * n * k, bytes=wbytes + act * m * (n + k))
                    rows.append(row)
                    print(f"gemm {model:18s} {layer:8s} {dtype:9s} m={m:5d} {t * 1e6:9.1f} us "
                          f"{row['flops'] / t / 1e12:7.1f} TFLOP/s {row['bytes'] / t / 1e9:7.0f} GB/s", flush=True)  # fmt: skip
                del ws
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _torch_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _backends() -> list[tuple[str, object]]:
    from torch.nn.attention import SDPBackend

    names = ["FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    return [(n.lower(), getattr(SDPBackend, n)) for n in names if hasattr(SDPBackend, n)]


def _best_backend(timer: Timer, calls_for: Callable[[], list[Callable[[], object]]]) -> tuple[float, str, dict]:
    from torch.nn.attention import sdpa_kernel

    per: dict[str, float] = {}
    for name, backend in _backends():
        if timer.device.type == "cuda" and name == "math":
            continue
        try:
            with sdpa_kernel([backend]):
                calls = calls_for()
                per[name] = timer.median_s(calls)
        except RuntimeError:
            continue
    best = min(per, key=per.get)
    return per[best], best, per


def measure_prefill_attention(
    timer: Timer, lens: list[int], attn: tuple[int, int, int], dtype: torch.dtype
) -> list[dict]:
    heads, kv_heads, dim = attn
    rows = []
    for seq_len in lens:
        q = torch.randn(1, heads, seq_len, dim, device=timer.device, dtype=dtype)
        # KV expanded to the query heads: every backend takes it; the FLOPs are the same.
        k = torch.randn(1, kv_heads, seq_len, dim, device=timer.device, dtype=dtype).repeat_interleave(
            heads // kv_heads, 1
        )
        v = torch.randn_like(k)
        t, backend, per = _best_backend(
            timer, lambda: [lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)]
        )
        flops = 4 * heads * dim * seq_len * (seq_len + 1) // 2
        rows.append(dict(seq_len=seq_len, heads=heads, kv_heads=kv_heads, head_dim=dim, time_s=t, flops=flops,
                         backend=backend, per_backend_s=per))  # fmt: skip
        print(f"prefill attn L={seq_len:6d} {t * 1e6:9.1f} us {flops / t / 1e12:7.1f} TFLOP/s ({backend})", flush=True)
    return rows


def measure_decode_attention(timer: Timer, batches: list[int], contexts: list[int], attn: tuple[int, int, int],
                             dtype: torch.dtype, rotate: int, max_kv_bytes: int) -> list[dict]:  # fmt: skip
    """One query token per sequence; GQA packed as the flash-decoding kernels do: each KV head's
    query heads are its query rows, so the KV cache is read once."""
    heads, kv_heads, dim = attn
    group = heads // kv_heads
    rows = []
    for batch in batches:
        for ctx in contexts:
            kv_bytes = 2 * batch * kv_heads * ctx * dim * dtype.itemsize
            if kv_bytes > max_kv_bytes:
                continue
            copies = max(1, math.ceil(rotate / kv_bytes))
            q = torch.randn(batch, kv_heads, group, dim, device=timer.device, dtype=dtype)
            kvs = [(torch.randn(batch, kv_heads, ctx, dim, device=timer.device, dtype=dtype),
                    torch.randn(batch, kv_heads, ctx, dim, device=timer.device, dtype=dtype)) for _ in range(copies)]  # fmt: skip
            t, backend, per = _best_backend(
                timer, lambda kvs=kvs: [lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v) for k, v in kvs]
            )
            rows.append(dict(batch=batch, context=ctx, heads=heads, kv_heads=kv_heads, head_dim=dim, time_s=t,
                             bytes=kv_bytes, flops=4 * batch * heads * dim * ctx, backend=backend, per_backend_s=per))  # fmt: skip
            print(f"decode attn B={batch:4d} ctx={ctx:6d} {t * 1e6:9.1f} us {kv_bytes / t / 1e9:7.0f} GB/s ({backend})",
                  flush=True)  # fmt: skip
            del kvs
            if timer.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def measure_launch(device: torch.device, kernels: int = 2000) -> dict[str, float]:
    """Seconds per tiny kernel: launched eagerly from Python, and replayed inside one graph."""
    x = torch.zeros(1, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(100):
        x.add_(1)
    sync()
    t0 = time.perf_counter()
    for _ in range(kernels):
        x.add_(1)
    sync()
    out = {"eager_s_per_kernel": (time.perf_counter() - t0) / kernels}
    if device.type == "cuda":
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            x.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(kernels):
                x.add_(1)
        g.replay()
        sync()
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            g.replay()
            sync()
            best = min(best, time.perf_counter() - t0)
        out["graph_s_per_kernel"] = best / kernels
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few points (a smoke test)")
    ap.add_argument("--repeats", type=int, default=7, help="timed graph replays per point (median)")
    ap.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: gemm, fp8, prefill, decode")
    ap.add_argument(
        "--dtypes",
        default=None,
        help="GEMM formats, comma-separated, of the device's 16-bit type (bfloat16 on CUDA, float32 on a "
        "CPU), fp8 (row-wise scales), fp8_tensor (one scale a tensor) and int4 (weight-only, "
        "groups of 128); default: 16-bit and fp8",
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_kernels: --device cuda but torch sees no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    skip = {s for s in args.skip.split(",") if s}
    timer = Timer(dev, args.repeats, target_s=0.002 if args.quick else 0.02)
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    dtypes = [dtype] + (["fp8"] if dev.type == "cuda" and "fp8" not in skip else [])
    if args.dtypes:
        dtypes = [d for d in args.dtypes.split(",") if d]
        cuda_only = (*FP8_DTYPES, "int4")
        bad = [d for d in dtypes if d not in (dtype, *cuda_only) or (d in cuda_only and dev.type != "cuda")]
        if bad:
            print(
                f"gpu_kernels: --dtypes {','.join(bad)}: not timed on {dev.type} (take {dtype}"
                f"{', fp8, fp8_tensor, int4' if dev.type == 'cuda' else ''})",
                file=sys.stderr,
            )
            return 2
    cfg = QUICK if args.quick else dict(prefill=PREFILL_LENS, batches=DECODE_BATCHES, contexts=DECODE_CONTEXTS,
                                         attn=ATTN, rotate=ROTATE_BYTES)  # fmt: skip
    result: dict = dict(torch=torch.__version__, device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                        quick=args.quick, repeats=args.repeats, rotate_bytes=cfg["rotate"])  # fmt: skip
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        result.update(
            sm_count=p.multi_processor_count, memory_bytes=p.total_memory, l2_bytes=getattr(p, "L2_cache_size", None)
        )
    started = time.perf_counter()
    result["bandwidth"] = measure_bandwidth(dev, (8 << 20) if args.quick else (4 << 30))
    print("bandwidth", {k: f"{v / 1e12:.2f} TB/s" for k, v in result["bandwidth"].items()}, flush=True)
    result["launch"] = measure_launch(dev, 200 if args.quick else 2000)
    print("launch", {k: f"{v * 1e6:.2f} us" for k, v in result["launch"].items()}, flush=True)
    tdt = _torch_dtype(dtype)
    shapes, tokens = (QUICK_SHAPES, QUICK_TOKENS) if args.quick else (SHAPES, TOKENS)
    parts = {
        "prefill_attention": lambda: measure_prefill_attention(timer, cfg["prefill"], cfg["attn"], tdt),
        "decode_attention": lambda: measure_decode_attention(
            timer, cfg["batches"], cfg["contexts"], cfg["attn"], tdt, cfg["rotate"], 32 << 30
        ),  # fmt: skip
        "gemm": lambda: measure_gemms(timer, shapes, tokens, dtypes, cfg["rotate"]),
    }
    for name, measure in parts.items():
        if name.split("_")[0] in skip:
            continue
        result[name] = measure()
        result["wall_s"] = time.perf_counter() - started
        args.out.write_text(json.dumps(result, indent=1))  # after each part: a run cut short keeps what it had
    print(f"wrote {args.out} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
