"""Shape-aware time of one linear layer (a GEMM of M tokens by an N x K weight) on a GPU.

At few tokens a GEMM streams its weights; at many it is bound by tensor-core FLOPs. Measured,
neither the crossover nor the compute side is a clean max():
- the FLOPs run in tiles of `tile_tokens` rows, so M is padded up to a whole tile (Vidur's A100
  profiles step at M = 129: a 128-row tile half empty costs as much as a full one);
- near the crossover neither the loads nor the math hide behind the other (8B qkv on H200: 17 us
  at M = 128 where max(compute, memory) says 12 us), which a p-norm of the two times expresses:
  (memory^p + compute^p)^(1/p), tending to max() as p grows;
- every kernel pays a fixed cost (launch tail, epilogue, the wave that is not full).

    time = (memory_s^p + compute_s^p)^(1/p) + kernel_overhead_s
    memory_s  = (N·K·weight bytes + M·(N + K)·2) / (bandwidth × bandwidth_fraction)
    compute_s = 2 · ceil(M / tile) · tile · N · K / (peak × compute_fraction)
"""

from __future__ import annotations

from servelab.spec.dtypes import ACTIVATION_BYTES
from servelab.spec.kernels import GemmEfficiency


def padded_tokens(m: float, tile_tokens: int) -> float:
    """M rounded up to whole tiles (a fractional M, an expected count, rounds the same way)."""
    tiles = -(-m // tile_tokens)
    return tiles * tile_tokens


def gemm_time_s(
    eff: GemmEfficiency,
    m: float,
    n: int,
    k: int,
    weight_bytes_per_element: float,
    peak_flops_per_s: float,
    bandwidth_bytes_per_s: float,
) -> float:
    """Seconds for an (M x K) @ (K x N) linear layer; 0 for no tokens."""
    if m <= 0:
        return 0.0
    memory_s = (n * k * weight_bytes_per_element + m * (n + k) * ACTIVATION_BYTES) / (
        bandwidth_bytes_per_s * eff.bandwidth_fraction
    )
    compute_s = 2.0 * padded_tokens(m, eff.tile_tokens) * n * k / (peak_flops_per_s * eff.compute_fraction)
    p = eff.sharpness
    return (memory_s**p + compute_s**p) ** (1.0 / p) + eff.kernel_overhead_s
