"""Roofline cost model of one engine step.

A step moves bytes (the weights once, every sequence's KV cache, the new KV, activations) and
does FLOPs (2 per active parameter per token, plus attention). Its time is whichever of the two
takes longer at achievable rates, plus tensor-parallel all-reduces and fixed overheads:

    time = max(flops / (peak_flops × compute_fraction), bytes / (bandwidth × bandwidth_fraction))
           + all-reduce time + step_overhead_s + num_layers × per_layer_overhead_s

The simulator prices millions of steps, so everything that depends only on (model, hardware,
dtypes, tp) is folded into a handful of per-token and per-step constants at construction, and a
step reduces to four sums over its shape. See docs/cost-model.md for the formulas.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import mul

from servelab.cost.memory import DEFAULT_MEMORY_FRACTION, MemoryPlan, kv_heads_per_device
from servelab.cost.step_cost import Shape, StepCost
from servelab.errors import InvalidArgument
from servelab.spec.dtypes import ACTIVATION_BYTES, DEFAULT_DTYPE
from servelab.spec.dtypes import weight_dtype as _weight_dtype
from servelab.spec.hardware import HardwareSpec
from servelab.spec.model import ModelSpec


@dataclass(frozen=True, slots=True)
class Efficiency:
    """How far below the datasheet a real engine runs. The defaults are fitted to the seed's
    measured figures for Llama 3.1 8B (BF16, H100 SXM):

    - bandwidth_fraction 0.70, step_overhead_s 0.15 ms: a batch-1 decode step moves ~15.2 GB (the
      weights less the input-embedding table, which is gathered row by row rather than streamed,
      plus a little KV and activation traffic) and a batch-64 step at 2K contexts 32.7 GB (17.2 GB
      of it KV). The seed's measured 150 tok/s (6.67 ms per step) and 4,500 tok/s in total
      (14.2 ms per step) are two equations in two unknowns; they solve to 70% of 3.35 TB/s plus
      ~0.15 ms per step. (Counting all 16 GB at batch 1 and no overhead, as the seed's
      back-of-envelope does, the same 150 tok/s against a 208 tok/s bound reads as 72%.)
    - compute_fraction 0.6: the seed has no compute-bound figure; 55-65% of the dense peak is
      what large BF16 GEMMs in prefill typically reach on Hopper.
    - per_layer_overhead_s 0: per-layer launch gaps are folded into the per-step overhead
      (CUDA graphs); calibration can split them for deep, small models.
    - interconnect_fraction 0.7 and allreduce_latency_s 5 µs: NCCL ring all-reduce bus bandwidth
      on NVLink is ~70% of the link rate, and a small all-reduce costs a few microseconds.
    """

    bandwidth_fraction: float = 0.70
    compute_fraction: float = 0.6
    step_overhead_s: float = 1.5e-4
    per_layer_overhead_s: float = 0.0
    interconnect_fraction: float = 0.7
    allreduce_latency_s: float = 5e-6

    def __post_init__(self) -> None:
        for name in ("bandwidth_fraction", "compute_fraction", "interconnect_fraction"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise InvalidArgument(f"efficiency {name} must be in (0, 1], got {value}", param=name)
        for name in ("step_overhead_s", "per_layer_overhead_s", "allreduce_latency_s"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"efficiency {name} must be >= 0, got {getattr(self, name)}", param=name)


class Roofline:
    """Prices a step of `model` on `tp` devices of `hardware`. Bytes and FLOPs are per device."""

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, weight_dtype: str = DEFAULT_DTYPE,
                 kv_dtype: str = DEFAULT_DTYPE, tp: int = 1, efficiency: Efficiency | None = None,
                 memory_fraction: float = DEFAULT_MEMORY_FRACTION) -> None:
        self.model = model
        self.hardware = hardware
        self.tp = tp
        self.efficiency = eff = efficiency or Efficiency()
        self.memory = MemoryPlan(model, hardware, weight_dtype, kv_dtype, tp, memory_fraction)  # validates
        self.weight_dtype, self.kv_dtype = self.memory.weight_dtype, self.memory.kv_dtype  # canonical names
        wdt = _weight_dtype(weight_dtype)
        m = model

        self.peak_flops_per_s = hardware.peak_flops_per_s(wdt.compute_dtype)
        self.peak_bandwidth_bytes_per_s = hardware.bandwidth_bytes_per_s
        self.ridge_flops_per_byte = self.peak_flops_per_s / self.peak_bandwidth_bytes_per_s
        self._flops_per_s = self.peak_flops_per_s * eff.compute_fraction
        self._bytes_per_s = self.peak_bandwidth_bytes_per_s * eff.bandwidth_fraction

        # FLOPs: 2 per matmul parameter per token; the LM head runs once per sequence (only the
        # last position of a step produces logits); attention does QK^T and PV, 2 FLOPs each per
        # (query, key, head, head_dim) element.
        self._flops_per_token = 2.0 * m.matmul_params_per_token / tp
        self._flops_per_seq = 2.0 * m.lm_head_params / tp
        self._flops_per_attention_pair = 4.0 * m.num_layers * m.num_heads * m.head_dim / tp

        # Bytes: dense weights stream once per step. The input embedding is gathered by token, so
        # only the LM head's copy of the vocabulary matrix streams (tied or not). MoE experts
        # stream only if some token in the step was routed to them.
        bpe = wdt.bytes_per_element
        expert_bytes_per_layer = m.expert_params_per_layer * bpe / tp
        dense_params = (m.num_layers * (m.attention_params_per_layer + m.router_params_per_layer
                                        + m.norm_params_per_layer) + m.lm_head_params + m.hidden_size)
        if not m.is_moe:
            dense_params += m.num_layers * m.expert_params_per_layer
        self._dense_weight_bytes = dense_params * bpe / tp
        self._expert_bytes_all_layers = m.num_layers * expert_bytes_per_layer * m.num_experts if m.is_moe else 0.0
        self._num_experts = m.num_experts
        self._expert_miss_prob = 1.0 - m.num_active_experts / m.num_experts  # per token, per expert
        self.kv_bytes_per_token = self.memory.kv_bytes_per_token_per_device
        # Activations round-trip HBM between kernels: hidden-wide tensors (norm outputs, residual
        # adds, o_proj and down_proj outputs: ~8 reads+writes, replicated under TP) plus the
        # sharded q/k/v and SwiGLU intermediates (gate+up written and read, product written and read).
        q_kv_width = (m.num_heads + 2 * kv_heads_per_device(m, 1)) * m.head_dim
        sharded = 2 * q_kv_width + 6 * m.ffn_size * m.num_active_experts
        self._activation_bytes_per_token = m.num_layers * (8 * m.hidden_size + sharded / tp) * ACTIVATION_BYTES

        # Tensor parallelism: two all-reduces of the hidden state per layer (after attention and
        # after the MLP). A ring all-reduce sends 2(tp-1)/tp of the buffer over each link.
        if tp > 1:
            assert hardware.interconnect_bytes_per_s is not None  # MemoryPlan refuses tp > 1 without one
            ring_bytes_per_token = 2 * m.num_layers * m.hidden_size * ACTIVATION_BYTES * 2 * (tp - 1) / tp
            self._comm_s_per_token = ring_bytes_per_token / (hardware.interconnect_bytes_per_s * eff.interconnect_fraction)
            self._comm_s_per_step = 2 * m.num_layers * eff.allreduce_latency_s
        else:
            self._comm_s_per_token = 0.0
            self._comm_s_per_step = 0.0
        self._overhead_s = eff.step_overhead_s + m.num_layers * eff.per_layer_overhead_s

    # ---- the seed's headline figures --------------------------------------------------------
    @property
    def weight_stream_time_s(self) -> float:
        """All resident weights read once at the datasheet bandwidth (the seed's 4.8 ms)."""
        return self.memory.weight_bytes_per_device / self.peak_bandwidth_bytes_per_s

    @property
    def token_compute_time_s(self) -> float:
        """One token through every active parameter at the datasheet peak (the seed's 0.016 ms)."""
        return (self._flops_per_token + self._flops_per_seq) / self.peak_flops_per_s

    @property
    def achievable_ridge_flops_per_byte(self) -> float:
        """The intensity at which a step turns compute-bound at the achievable rates, which is
        where `StepCost.bound` flips (below the datasheet ridge when compute falls short more)."""
        return self._flops_per_s / self._bytes_per_s

    # ---- pricing a step ---------------------------------------------------------------------
    def _weight_bytes(self, num_tokens: int) -> float:
        if self._num_experts == 1:
            return self._dense_weight_bytes
        # Expected fraction of experts hit by at least one of the step's tokens (per layer).
        hit = 1.0 - self._expert_miss_prob ** num_tokens
        return self._dense_weight_bytes + self._expert_bytes_all_layers * hit

    @staticmethod
    def totals(shape: Shape) -> tuple[int, int, int, int]:
        """(query tokens, sequences, Σ context, Σ attended (query, key) pairs) of a shape.

        Causal attention: query i of a q-token chunk with context c sees (c - q) cached keys plus
        i + 1 of its own, so a sequence contributes q·c - q(q-1)/2 pairs (c for a decode token).
        The sums run in C (zip/map) because this is the simulator's inner loop."""
        if not shape:
            return 0, 0, 0, 0
        qs, cs = zip(*shape)
        num_tokens = sum(qs)
        context_tokens = sum(cs)
        num_seqs = len(qs)
        if num_tokens == num_seqs:  # pure decode: one query token per sequence
            return num_tokens, num_seqs, context_tokens, context_tokens
        pairs = sum(map(mul, qs, cs)) - ((sum(map(mul, qs, qs)) - num_tokens) >> 1)
        return num_tokens, num_seqs, context_tokens, pairs

    def step_time_s(self, shape: Shape) -> float:
        return self.time_from_totals(*self.totals(shape))

    def time_from_totals(self, num_tokens: int, num_seqs: int, context_tokens: int, pairs: int) -> float:
        """The hot path: a step's time from its four sums (a simulator can keep them running)."""
        if num_tokens == 0:
            return 0.0
        flops = (num_tokens * self._flops_per_token + num_seqs * self._flops_per_seq
                 + pairs * self._flops_per_attention_pair)
        total_bytes = (self._weight_bytes(num_tokens) + (context_tokens + num_tokens) * self.kv_bytes_per_token
                       + num_tokens * self._activation_bytes_per_token)
        compute_s = flops / self._flops_per_s
        memory_s = total_bytes / self._bytes_per_s
        # a conditional, not max(): this line runs millions of times per simulation
        return ((compute_s if compute_s > memory_s else memory_s) + num_tokens * self._comm_s_per_token
                + self._comm_s_per_step + self._overhead_s)

    def step(self, shape: Shape) -> StepCost:
        return self.cost_from_totals(*self.totals(shape))

    def cost_from_totals(self, num_tokens: int, num_seqs: int, context_tokens: int, pairs: int) -> StepCost:
        flops = (num_tokens * self._flops_per_token + num_seqs * self._flops_per_seq
                 + pairs * self._flops_per_attention_pair)
        weight_bytes = self._weight_bytes(num_tokens) if num_tokens else 0.0
        kv_read = context_tokens * self.kv_bytes_per_token
        kv_write = num_tokens * self.kv_bytes_per_token
        activation = num_tokens * self._activation_bytes_per_token
        total_bytes = weight_bytes + kv_read + kv_write + activation
        compute_s = flops / self._flops_per_s
        memory_s = total_bytes / self._bytes_per_s
        if num_tokens:
            comm_s = num_tokens * self._comm_s_per_token + self._comm_s_per_step
            overhead_s = self._overhead_s
        else:
            comm_s = overhead_s = 0.0
        return StepCost(
            time_s=max(compute_s, memory_s) + comm_s + overhead_s,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            flops=flops,
            weight_bytes=weight_bytes,
            kv_read_bytes=kv_read,
            kv_write_bytes=kv_write,
            activation_bytes=activation,
            total_bytes=total_bytes,
            compute_time_s=compute_s,
            memory_time_s=memory_s,
            comm_time_s=comm_s,
            overhead_s=overhead_s,
            peak_compute_time_s=flops / self.peak_flops_per_s,
            peak_memory_time_s=total_bytes / self.peak_bandwidth_bytes_per_s,
            bound="compute" if compute_s > memory_s else "memory",
            arithmetic_intensity=flops / total_bytes if total_bytes else 0.0,
            ridge_flops_per_byte=self.ridge_flops_per_byte,
        )

    # ---- conveniences -----------------------------------------------------------------------
    def _check_context(self, context_len: int, what: str) -> None:
        if context_len < 1:
            raise InvalidArgument(f"{what} must be at least 1 token, got {context_len}", param="context")
        if context_len > self.model.max_context:
            raise InvalidArgument(
                f"{what} {context_len} exceeds {self.model.name}'s maximum context of {self.model.max_context} tokens",
                param="context",
            )

    def decode(self, batch: int, context_len: int) -> StepCost:
        """One decode step of `batch` sequences, each attending to `context_len` tokens."""
        if batch < 1:
            raise InvalidArgument(f"batch must be at least 1, got {batch}", param="batch")
        self._check_context(context_len, "context")
        return self.cost_from_totals(batch, batch, batch * context_len, batch * context_len)

    def prefill(self, prompt_len: int, batch: int = 1) -> StepCost:
        """Prefill of `batch` fresh prompts of `prompt_len` tokens in one step (TTFT at idle)."""
        if batch < 1:
            raise InvalidArgument(f"batch must be at least 1, got {batch}", param="batch")
        self._check_context(prompt_len, "prompt length")
        return self.step([(prompt_len, prompt_len)] * batch)

    def compute_bound_batch(self, context_len: int, limit: int = 1 << 24) -> int | None:
        """Smallest decode batch at `context_len` whose step is compute-bound (memory capacity
        ignored), or None: when each sequence adds more bytes (its KV) than FLOPs can cover, no
        batch ever gets there."""
        def compute_bound(batch: int) -> bool:
            return self.decode(batch, context_len).bound == "compute"

        if not compute_bound(limit):
            return None
        low, high = 0, 1  # invariant: low is memory-bound (or 0), high is compute-bound
        while not compute_bound(high):
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            if compute_bound(mid):
                high = mid
            else:
                low = mid
        return high
