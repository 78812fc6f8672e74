"""Measure this host as the cost model sees an accelerator: memory capacity, streaming bandwidth
and the dense matmul rate per compute dtype, written as a hardware file (spec/hardware_file.py)."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch


def _best_s(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm: page in, spin up the thread pool
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth_bytes_per_s(size_bytes: int = 1 << 30, repeats: int = 5, device: str = "cpu") -> float:
    """Streaming read (a sum over a buffer larger than any cache): what a decode step's weight
    stream can reach at best, where the copy above also pays for its writes. `.item()` waits for
    the sum on an asynchronous device (a GPU's memory, for benchmarks/engine_cuda.py)."""
    x = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    return size_bytes / _best_s(lambda: x.sum().item(), repeats)


def matmul_flops_per_s(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_s(lambda: torch.mm(a, b), repeats)


def linear_flops_per_s(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    """The same multiply as a linear layer (x @ W^T): oneDNN's emulated bf16 takes a path there
    ~10x faster than torch.mm's on an AVX2 core, and a peak is the best torch reaches."""
    x = torch.randn(n, n).to(dtype)
    w = torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_s(lambda: torch.nn.functional.linear(x, w), repeats)


def native_gemm_flops_per_s(n: int = 1024, repeats: int = 5) -> float | None:
    """servelab's own fp32 GEMM (csrc/block_quant_linear.c's panel kernel over a plain fp32
    weight, as deterministic mode runs it), or None without the native kernels. It outruns MKL's
    sgemm where MKL does not use the CPU's widest vectors (AVX-512 on AMD)."""
    from servelab.runtime import block_quant, native
    from servelab.runtime.linear import DenseLinear

    kernels = native.native_kernels()
    if kernels is None:
        return None
    x = torch.randn(n, n)
    linear = block_quant.batch_invariant(DenseLinear(torch.randn(n, n), None), kernels)
    return 2 * n**3 / _best_s(lambda: linear(x), repeats)


def int_mm_ops_per_s(n: int = 1024, repeats: int = 5) -> float | None:
    """torch._int_mm (int8 x int8 -> int32), or None where it has no CPU kernel. Some builds run a
    slow fallback, hence fbgemm's rate below as well."""
    a = torch.randint(-128, 128, (n, n), dtype=torch.int8)
    b = torch.randint(-128, 128, (n, n), dtype=torch.int8)
    try:
        torch._int_mm(a, b)
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return 2 * n**3 / _best_s(lambda: torch._int_mm(a, b), repeats)


def fbgemm_int8_ops_per_s(n: int = 1024, repeats: int = 5) -> float | None:
    """fbgemm's dynamic int8 linear (activations quantized on the fly, u8 x s8 integer dot
    products), or None where this torch has no fbgemm."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return None
    x = torch.randn(n, n)
    with warnings.catch_warnings():  # quantize_per_tensor is deprecated; it is the only way in
        warnings.simplefilter("ignore")
        weight = torch.quantize_per_tensor(torch.randn(n, n), 0.05, 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(weight, None)
    return 2 * n**3 / _best_s(lambda: torch.ops.quantized.linear_dynamic(x, packed, True), repeats)


def peak_rate(
    rate_at: Callable[[int], float | None], sizes: tuple[int, ...] = (256, 512, 1024, 2048), budget_s: float = 0.2
) -> float | None:
    """The best rate over growing square sizes, stopping once one multiply takes budget_s: a
    slow dtype (bf16 emulated on an AVX2 core runs at ~1 GFLOP/s) must not take a minute."""
    best: float | None = None
    for n in sizes:
        rate = rate_at(n)
        if rate is None:
            return None
        best = rate if best is None else max(best, rate)
        if 2 * n**3 / rate > budget_s:
            break
    return best


def memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def peak_float_flops_per_s(
    dtype: torch.dtype, sizes: tuple[int, ...] = (256, 512, 1024, 2048), repeats: int = 3
) -> float | None:
    """The faster of torch.mm and a linear layer at the best size (fp32: and servelab's own GEMM),
    the best rate this host reaches in that dtype."""
    rates = [
        peak_rate(lambda n: rate(dtype, n, repeats=repeats), sizes) for rate in (matmul_flops_per_s, linear_flops_per_s)
    ]
    if dtype == torch.float32:
        rates.append(peak_rate(lambda n: native_gemm_flops_per_s(n, repeats=repeats), sizes))
    return max((r for r in rates if r is not None), default=None)


def probe_hardware(
    name: str,
    description: str,
    *,
    size_bytes: int = 1 << 30,
    sizes: tuple[int, ...] = (256, 512, 1024, 2048),
    repeats: int = 3,
) -> dict[str, Any]:
    """A hardware file's fields for this host: streaming read bandwidth (what a decode step's
    weights are priced at) and the peak matmul rates. bf16 is the cost model's 16-bit rate: where
    the CPU has no native bf16 matmul (slower than fp32), its fp32 rate stands in, as the format asks."""
    fp32 = peak_float_flops_per_s(torch.float32, sizes, repeats) or 0.0
    bf16 = peak_float_flops_per_s(torch.bfloat16, sizes, repeats) or 0.0
    return {
        "name": name,
        "description": description,
        "memory_bytes": memory_bytes(),
        "bandwidth_bytes_per_s": read_bandwidth_bytes_per_s(size_bytes, repeats),
        "peak_flops": {"fp32": fp32, "bf16": max(bf16, fp32)},
    }


def _proc_tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by a process and its live descendants (tensor-parallel ranks)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children", encoding="ascii") as f:
                    stack += [int(c) for c in f.read().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total


def _host_cpu_s() -> tuple[float, float] | None:
    """The host's busy CPU seconds so far, and the part of them the hypervisor stole (/proc/stat)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    steal = values[7] if len(values) > 7 else 0
    return (sum(values[:8]) - idle) / tick, steal / tick  # guest time is already in user


class OtherLoadMeter:
    """How many CPUs *other* processes kept busy since it was made: the host's busy time
    (/proc/stat) less this process tree's, the hypervisor's steal included; and the steal alone
    (CPU time a virtual machine's neighbours took). None where /proc is not there (not Linux)."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._host0 = _host_cpu_s()
        self._own0 = _proc_tree_cpu_s(os.getpid())

    def _per_wall(self, index: int, own_s: float = 0.0) -> float | None:
        host = _host_cpu_s()
        wall = time.perf_counter() - self._t0
        if host is None or self._host0 is None or wall <= 0:
            return None
        return max(0.0, (host[index] - self._host0[index] - own_s) / wall)

    def other_cpus(self) -> float | None:
        return self._per_wall(0, _proc_tree_cpu_s(os.getpid()) - self._own0)

    def steal_cpus(self) -> float | None:
        return self._per_wall(1)


# The engine's all-reduce messages: fp32 [tokens, hidden] for a step of that many tokens.
ALLREDUCE_TOKENS = (1, 8, 32, 128, 512)


def _allreduce_rank(
    rank: int, ranks: int, port: int, hidden: int, tokens: tuple[int, ...], iters: int, out: str
) -> None:
    import json
    import statistics

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    try:
        rows = []
        for n in tokens:
            x = torch.randn(n, hidden)
            for _ in range(5):
                dist.all_reduce(x)
            times = []
            for _ in range(iters):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - t0)
            rows.append(
                {"tokens": n, "bytes": x.numel() * 4, "median_s": statistics.median(times), "fastest_s": min(times)}
            )
        if rank == 0:
            with open(out, "w", encoding="utf-8") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def allreduce_times(
    ranks: int, hidden: int, tokens: tuple[int, ...] = ALLREDUCE_TOKENS, iters: int = 50
) -> list[dict[str, float]]:
    """Times a gloo all-reduce among `ranks` processes on 127.0.0.1 (as the engine's ranks join)
    at each message size: per size, the median and fastest of `iters`, after a barrier each."""
    import json
    import tempfile

    import torch.multiprocessing as mp

    from servelab.runtime.parallel.group import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "allreduce.json")
        mp.spawn(_allreduce_rank, args=(ranks, free_port(), hidden, tuple(tokens), iters, out), nprocs=ranks, join=True)
        with open(out, encoding="utf-8") as f:
            return json.load(f)
