"""Measure this host as the cost model sees an accelerator: memory capacity, streaming bandwidth
and the dense matmul rate per compute dtype, written as a hardware file (spec/hardware_file.py)."""

from __future__ import annotations

import os
import time
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


def memory_bandwidth_bytes_per_s(size_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Streaming copy of a buffer larger than any cache: bytes read + bytes written per second."""
    src = torch.ones(size_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * size_bytes / _best_s(lambda: dst.copy_(src), repeats)


def matmul_flops_per_s(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_s(lambda: torch.mm(a, b), repeats)


def memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def probe_hardware(name: str, description: str, *, size_bytes: int = 256 << 20, n: int = 1024,
                   repeats: int = 5) -> dict[str, Any]:
    """A hardware file's fields for this host. bf16 is the cost model's 16-bit rate: where the CPU
    has no native bf16 matmul (slower than fp32), its fp32 rate stands in, as the format asks."""
    fp32 = matmul_flops_per_s(torch.float32, n, repeats)
    bf16 = matmul_flops_per_s(torch.bfloat16, n, repeats)
    return {
        "name": name,
        "description": description,
        "memory_bytes": memory_bytes(),
        "bandwidth_bytes_per_s": memory_bandwidth_bytes_per_s(size_bytes, repeats),
        "peak_flops": {"fp32": fp32, "bf16": max(bf16, fp32)},
    }
