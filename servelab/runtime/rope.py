"""RoPE for every scaling the engine runs, in one place: the inverse frequencies of HF's
`modeling_rope_utils` (default, linear, llama3, longrope) and the cos/sin tables that the per-op
path and the native decode stack both read by row, so a scaling changes the tables and nothing else.

LongRoPE (Phi-3, Phi-4-mini) has two frequency sets. HF runs a forward on the long set when its
sequence is longer than `original_max_position_embeddings`, else on the short one. Here the tables
hold the short set in rows [0, n) and the long one in rows [n, 2n), and `table_rows` sends each
token to the set its own sequence's length in this step calls for: HF's rule, one sequence at a
time, so it does not depend on what else is in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from servelab.errors import InvalidArgument
from servelab.spec.model import ModelSpec

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True, slots=True)
class Rope:
    inv_freq: torch.Tensor  # [head_dim / 2] fp32; LongRoPE's short set
    long_inv_freq: torch.Tensor | None = None  # LongRoPE's set for sequences past original_max_positions
    original_max_positions: int = 0
    attention_factor: float = 1.0  # cos and sin are scaled by it (LongRoPE's magnitude correction)

    @classmethod
    def from_spec(cls, spec: ModelSpec, freq_divisors: torch.Tensor | None = None) -> Rope:
        """The model's RoPE; `freq_divisors`: a llama.cpp file's `rope_freqs.weight` (llama3's
        scaling as per-dimension divisors). InvalidArgument naming what is not implemented."""
        if spec.rotary_dim is not None and spec.rotary_dim != spec.head_dim:
            raise InvalidArgument(
                f"model {spec.name!r}: partial rotary embeddings (RoPE over {spec.rotary_dim} of {spec.head_dim} "
                "dimensions per head, partial_rotary_factor < 1) are not supported", param="model")  # fmt: skip
        dim = spec.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq = 1.0 / (spec.rope_theta**exponents)
        if freq_divisors is not None:
            if freq_divisors.numel() != dim // 2:
                raise InvalidArgument(
                    f"GGUF rope_freqs.weight has {freq_divisors.numel()} values; head_dim {dim} needs {dim // 2}",
                    param="model",
                )
            return cls(inv_freq / freq_divisors.float().reshape(-1))
        scaling = spec.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return cls(inv_freq)
        if kind == "linear":
            return cls(inv_freq / _number(scaling, kind, "factor"))
        if kind == "llama3":
            return cls(_llama3(inv_freq, scaling))
        if kind in ("longrope", "su"):
            return _longrope(spec, scaling, exponents)
        raise InvalidArgument(
            f"model {spec.name!r}: rope scaling type {kind!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)})", param="model")  # fmt: skip

    @property
    def sets(self) -> int:
        """Frequency sets the tables hold: 2 for LongRoPE, else 1."""
        return 1 if self.long_inv_freq is None else 2

    def tables(self, n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [sets * n, head_dim] for positions 0..n-1 of each set, in HF's rotate-half
        layout and its fp32 arithmetic, so far positions agree with transformers bit for bit."""
        freqs = [self.inv_freq] if self.long_inv_freq is None else [self.inv_freq, self.long_inv_freq]
        cos, sin = [], []
        for inv_freq in freqs:
            angles = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv_freq.to(device)[None, :]
            emb = torch.cat((angles, angles), dim=-1)
            cos.append((emb.cos() * self.attention_factor).to(dtype))
            sin.append((emb.sin() * self.attention_factor).to(dtype))
        return torch.cat(cos), torch.cat(sin)

    def table_rows(self, meta: Any, n: int) -> torch.Tensor:
        """Each token's row in tables of n positions per set: its position, plus n for a token of
        a sequence that is longer than original_max_positions in this step (LongRoPE's long set).
        `meta`: model.AttentionMetadata."""
        if self.long_inv_freq is None:
            return meta.positions
        long = torch.zeros_like(meta.positions)
        if meta.num_decodes:
            long[: meta.num_decodes] = meta.decode_ctx_lens > self.original_max_positions
        for offset, count, start_pos, _ in meta.prefills:
            if start_pos + count > self.original_max_positions:
                long[offset : offset + count] = 1
        return meta.positions + n * long


def _number(scaling: Mapping[str, Any], kind: str, key: str) -> float:
    value = scaling.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidArgument(f"rope_scaling ({kind}) needs a positive number {key!r}, got {value!r}", param="model")
    return float(value)


def _llama3(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1's scaling: low frequencies divided by `factor`, high ones kept, a smooth blend between."""
    factor = _number(scaling, "llama3", "factor")
    low_freq_factor = _number(scaling, "llama3", "low_freq_factor")
    high_freq_factor = _number(scaling, "llama3", "high_freq_factor")
    old_len = _number(scaling, "llama3", "original_max_position_embeddings")
    if high_freq_factor <= low_freq_factor:
        raise InvalidArgument(
            f"rope_scaling (llama3): high_freq_factor ({high_freq_factor}) must exceed low_freq_factor "
            f"({low_freq_factor})", param="model")  # fmt: skip
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope(spec: ModelSpec, scaling: Mapping[str, Any], exponents: torch.Tensor) -> Rope:
    """LongRoPE: per-dimension factors for short and for long sequences, and the attention factor
    HF derives from the context extension where the config gives none."""
    original = int(_number(scaling, "longrope", "original_max_position_embeddings"))
    sets = [_factors(scaling, key, spec.head_dim // 2) for key in ("short_factor", "long_factor")]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = scaling.get("factor") or spec.max_context / original
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    elif isinstance(attention_factor, bool) or not isinstance(attention_factor, (int, float)) or attention_factor <= 0:
        raise InvalidArgument(
            f"rope_scaling (longrope): attention_factor must be a positive number, got {attention_factor!r}",
            param="model",
        )
    short, long = (1.0 / (factors * spec.rope_theta**exponents) for factors in sets)
    return Rope(short, long, original, float(attention_factor))


def _factors(scaling: Mapping[str, Any], key: str, count: int) -> torch.Tensor:
    values = scaling.get(key)
    if not isinstance(values, (Sequence, torch.Tensor)) or isinstance(values, str) or len(values) != count:
        got = len(values) if isinstance(values, (Sequence, torch.Tensor)) and not isinstance(values, str) else values
        raise InvalidArgument(
            f"rope_scaling (longrope) needs {key!r}: {count} numbers (head_dim / 2), got {got!r}", param="model"
        )
    return torch.as_tensor(values, dtype=torch.float32).reshape(-1)
