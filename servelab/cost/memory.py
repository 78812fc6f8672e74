"""Device memory plan: what the weights take, what is left for the KV cache, and how many
sequences of a given context fit in it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from servelab.errors import DoesNotFit, InvalidArgument
from servelab.spec.dtypes import DEFAULT_DTYPE
from servelab.spec.dtypes import kv_dtype as _kv_dtype
from servelab.spec.dtypes import kv_dtype_alias
from servelab.spec.dtypes import weight_dtype as _weight_dtype
from servelab.spec.hardware import HardwareSpec
from servelab.spec.model import ModelSpec

DEFAULT_MEMORY_FRACTION = 0.9  # vLLM's default gpu_memory_utilization


def check_tp(model: ModelSpec, tp: int) -> None:
    """Tensor parallelism splits attention heads across devices, so it must divide them."""
    if not isinstance(tp, int) or tp < 1:
        raise InvalidArgument(f"tp must be a positive integer, got {tp!r}", param="tp")
    if model.num_heads % tp:
        raise InvalidArgument(f"tp={tp} does not divide {model.name}'s {model.num_heads} attention heads", param="tp")
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise InvalidArgument(
            f"tp={tp} neither divides nor is a multiple of {model.name}'s {model.num_kv_heads} KV heads",
            param="tp",
        )


def kv_heads_per_device(model: ModelSpec, tp: int) -> int:
    # With more devices than KV heads each device keeps a replica of one KV head.
    return math.ceil(model.num_kv_heads / tp)


def _gb(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.1f} GB"


@kv_dtype_alias  # the old name of kv_cache_dtype
@dataclass(frozen=True, slots=True)
class MemoryPlan:
    model: ModelSpec
    hardware: HardwareSpec
    weight_dtype: str = DEFAULT_DTYPE
    kv_cache_dtype: str = DEFAULT_DTYPE
    tp: int = 1
    memory_fraction: float = DEFAULT_MEMORY_FRACTION

    def __post_init__(self) -> None:
        check_tp(self.model, self.tp)
        if self.tp > 1 and self.hardware.interconnect_bytes_per_s is None:
            raise InvalidArgument(
                f"tp={self.tp} needs a device-to-device link, and {self.hardware.name} has no "
                "interconnect_bytes_per_s; use tp=1",
                param="tp",
            )
        # validated, and named in the canonical spelling ("bf16" -> "bfloat16")
        object.__setattr__(self, "weight_dtype", _weight_dtype(self.weight_dtype).name)
        object.__setattr__(self, "kv_cache_dtype", _kv_dtype(self.kv_cache_dtype).name)
        if not 0.0 < self.memory_fraction <= 1.0:
            raise InvalidArgument(
                f"memory fraction must be in (0, 1], got {self.memory_fraction}", param="memory_fraction"
            )

    @property
    def weight_bytes_per_device(self) -> float:
        # Norm weights are replicated rather than split; they are ~0.01% of the model.
        return self.model.weight_bytes(self.weight_dtype) / self.tp

    @property
    def kv_bytes_per_token_per_device(self) -> float:
        m = self.model
        return (
            2
            * m.num_layers
            * kv_heads_per_device(m, self.tp)
            * m.head_dim
            * _kv_dtype(self.kv_cache_dtype).bytes_per_element
        )

    @property
    def usable_bytes(self) -> float:
        return self.hardware.memory_bytes * self.memory_fraction

    @property
    def weights_fit(self) -> bool:
        return self.weight_bytes_per_device < self.usable_bytes

    @property
    def kv_capacity_bytes(self) -> float:
        return max(0.0, self.usable_bytes - self.weight_bytes_per_device)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of every layer's KV that fit: a windowed model's sequences hold more (max_batch)."""
        return int(self.kv_capacity_bytes // self.kv_bytes_per_token_per_device)

    def kv_bytes_per_sequence(self, context_len: int) -> float:
        """KV bytes one sequence of `context_len` tokens holds per device: every layer's whole
        context, but a sliding-window layer's last `window` tokens only (the engine frees the
        blocks that leave the window)."""
        m = self.model
        if m.sliding_window is None:
            return context_len * self.kv_bytes_per_token_per_device
        windows = [m.layer_window(i) for i in range(m.num_layers)]
        layer_tokens = sum(context_len if w is None else min(context_len, w) for w in windows)
        return layer_tokens * self.kv_bytes_per_token_per_device / m.num_layers

    def max_batch(self, context_len: int) -> int:
        """Most sequences of `context_len` tokens whose KV fits at once (0 if not even one)."""
        if context_len <= 0:
            raise InvalidArgument(f"context length must be positive, got {context_len}", param="context")
        if self.model.sliding_window is not None:
            return int(self.kv_capacity_bytes // self.kv_bytes_per_sequence(context_len))
        return self.kv_capacity_tokens // context_len

    def kv_bytes(self, batch: int, context_len: int) -> float:
        return batch * self.kv_bytes_per_sequence(context_len)

    def fits(self, batch: int, context_len: int) -> bool:
        if self.model.sliding_window is not None:
            return self.weights_fit and self.kv_bytes(batch, context_len) <= self.kv_capacity_bytes
        return self.weights_fit and batch * context_len <= self.kv_capacity_tokens

    def describe(self) -> str:
        return (
            f"{self.model.name} on {self.hardware.name} ({self.weight_dtype} weights, "
            f"{self.kv_cache_dtype} KV, tp={self.tp})"
        )

    def require_weights_fit(self) -> None:
        if not self.weights_fit:
            raise DoesNotFit(
                f"{self.describe()}: the weights take {_gb(self.weight_bytes_per_device)} per device but only "
                f"{_gb(self.usable_bytes)} is usable ({self.memory_fraction:.0%} of "
                f"{_gb(self.hardware.memory_bytes)}); raise tp or use a smaller dtype"
            )

    def require_fit(self, batch: int, context_len: int) -> None:
        self.require_weights_fit()
        if not self.fits(batch, context_len):
            raise DoesNotFit(
                f"{self.describe()}: batch {batch} at context {context_len} needs "
                f"{_gb(self.kv_bytes(batch, context_len))} of KV cache but "
                f"{_gb(self.kv_capacity_bytes)} is left after the weights "
                f"({self.kv_capacity_tokens:,} tokens); the limit at this context is batch "
                f"{self.max_batch(context_len)}"
            )
