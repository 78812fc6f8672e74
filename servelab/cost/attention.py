"""Time of one layer's attention kernel (FlashAttention-style) on a GPU.

A prefill call multiplies every query by every key it attends to: 4 FLOPs per (query, key, head,
head_dim) element (QK^T and PV), compute-bound once the prompt is a few hundred tokens. A decode
call does 4 FLOPs per byte-pair it reads and reads every sequence's K and V once: bound by the KV
bytes. Either way the kernel is a roofline of its own, plus a fixed cost per call (launch, the
softmax epilogue, the partial last wave):

    time = max(flops / (peak × compute_fraction), kv_bytes / (bandwidth × bandwidth_fraction))
           + (prefill_overhead_s if the call has prompt tokens else decode_overhead_s)
"""

from __future__ import annotations

from servelab.spec.kernels import AttentionEfficiency


def attention_time_s(
    eff: AttentionEfficiency,
    flops: float,
    kv_bytes: float,
    prefill: bool,
    peak_flops_per_s: float,
    bandwidth_bytes_per_s: float,
) -> float:
    """Seconds for one attention call of `flops` over `kv_bytes` of K and V."""
    compute_s = flops / (peak_flops_per_s * eff.compute_fraction)
    memory_s = kv_bytes / (bandwidth_bytes_per_s * eff.bandwidth_fraction)
    return (compute_s if compute_s > memory_s else memory_s) + (
        eff.prefill_overhead_s if prefill else eff.decode_overhead_s
    )
