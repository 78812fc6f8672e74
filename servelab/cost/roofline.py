"""Roofline cost model of one engine step.

A step moves bytes (the weights once, every sequence's KV cache, the new KV, activations) and
does FLOPs (2 per active parameter per token, plus attention). Its time is the two sides at
achievable rates, combined as the part's measured steps or GEMMs combine them, plus tensor-parallel
all-reduces and fixed overheads:

    compute = flops / (peak_flops × compute_fraction[format])
    memory  = weight_bytes / (bandwidth × bandwidth_fraction[format]) + other_bytes / (bandwidth × bandwidth_fraction)
    time    = (compute^p + memory^p)^(1/p)
              + all-reduce time + step_overhead_s + num_layers × per_layer_overhead_s + num_seqs × per_seq_overhead_s

p is the overlap sharpness fitted on whole steps measured on the part (H100, H200 in BF16), else
that of the GEMMs measured on it or its architecture (`step_overlap`); inf, i.e. max(compute,
memory), where none was measured. The same GEMMs' tile sets the linear
layers' FLOPs: a GEMM of M rows runs whole tiles of `tile_tokens` rows (`step_overlap`), and a
MoE layer's expert GEMMs each see their share of the step's tokens, T·k / (experts hit), not T.

With `measured_kernels=True`, a part with measured kernels for the weight format (A100, H100,
H200: servelab/spec/kernel_fits.json) prices a step as the kernels it runs one after another: every
linear layer by the fitted GEMM model (cost/gemm.py), each layer's attention call (cost/attention.py)
and each tensor-parallel all-reduce (latency + bytes / bandwidth of the node's measurement); new KV,
activations and fixed costs keep end-to-end terms refitted on top (MEASURED_KERNELS_EFFICIENCY).

The simulator prices millions of steps, so everything that depends only on (model, hardware,
dtypes, tp) is folded into a handful of per-token and per-step constants at construction, and a
step reduces to four sums over its shape. See docs/cost-model.md for the formulas and
docs/fidelity.md for the published measurements the defaults are fitted to.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from operator import mul
from types import MappingProxyType
from typing import Any

from servelab.cost.gemm import gemm_time_s
from servelab.cost.memory import DEFAULT_MEMORY_FRACTION, MemoryPlan, kv_heads_per_device
from servelab.cost.step_cost import Shape, StepCost
from servelab.errors import InvalidArgument
from servelab.spec.dtypes import ACTIVATION_BYTES, DEFAULT_DTYPE
from servelab.spec.dtypes import kv_dtype as _kv_dtype
from servelab.spec.dtypes import weight_dtype as _weight_dtype
from servelab.spec.hardware import HardwareSpec, measured_part
from servelab.spec.kernels import AttentionEfficiency, CollectiveFit, GemmEfficiency
from servelab.spec.model import ModelSpec


def overlap(compute_s: float, memory_s: float, sharpness: float) -> float:
    """A step's time from its compute and memory sides: their p-norm, which tends to max() as the
    sharpness grows. Near the ridge neither the loads nor the math hide fully behind the other
    (measured steps and GEMMs: sharpness 1.65 to 6.14 on A100, H100 and H200,
    servelab/spec/kernel_fits.json)."""
    if sharpness == math.inf:
        return compute_s if compute_s > memory_s else memory_s
    if compute_s <= 0.0 or memory_s <= 0.0:
        return compute_s + memory_s
    return (compute_s**sharpness + memory_s**sharpness) ** (1.0 / sharpness)


@dataclass(frozen=True, slots=True)
class StepOverlap:
    """How a step's compute and memory sides combine on a part: the p-norm's sharpness (inf:
    max()), the linear layers' GEMM tile in rows, and what they were measured on ("" for max())."""

    sharpness: float
    tile_tokens: int
    source: str


def step_overlap(hardware: HardwareSpec, compute_dtype: str) -> StepOverlap:
    """The measured overlap for a step of this compute dtype: that dtype's GEMMs where measured on
    the part or its architecture, else the 16-bit ones (weight-only formats dequantize to 16-bit
    math); its sharpness fitted on whole steps measured there where they were (a step is many
    kernels, each bound on its own side, so it need not overlap as any one GEMM does), else the
    GEMMs' own; the tile is the GEMMs' (H200: 32 rows in BF16; 128 in FP8 on both Hoppers). Where
    nothing was measured, the plain roofline: max() and no tile."""
    for dtype in (compute_dtype, "bf16"):
        part = measured_part(hardware, dtype)
        if part is None or part.kernels is None:
            continue
        gemm = part.kernels.for_dtype(dtype)
        assert gemm is not None
        steps = None if part.kernels.steps is None else part.kernels.steps.for_dtype(dtype)
        where = "" if part.name == hardware.name else f" on {part.name}"
        if steps is not None:
            return StepOverlap(steps, gemm.tile_tokens, f"measured steps{where}")
        return StepOverlap(gemm.sharpness, gemm.tile_tokens, f"measured GEMMs{where}")
    return StepOverlap(math.inf, 1, "")


def tiled_rows(rows: float, tile_tokens: int) -> float:
    """The rows a GEMM of `rows` tokens computes: whole tiles (an expected, fractional count rounds
    up the same way); `rows` itself for a tile of 1."""
    return rows if tile_tokens == 1 else -(-rows // tile_tokens) * tile_tokens


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise InvalidArgument(f"efficiency {name} must be in (0, 1], got {value}", param=name)


@dataclass(frozen=True, slots=True)
class FormatEfficiency:
    """How well the kernels of one quantized weight format run, against the same datasheet
    peaks as BF16. A quantized GEMV/GEMM must unpack and rescale every weight (dequantization),
    and its kernels are younger than the BF16 ones, so a format's bytes and FLOPs are not simply
    cheaper: the part of the dequantization a memory-bound step cannot hide behind its loads shows
    up as a lower `bandwidth_fraction` for the weight stream; at large batch, as a lower
    `compute_fraction` (published batch-1 data cannot tell the two causes apart)."""

    bandwidth_fraction: float
    compute_fraction: float

    def __post_init__(self) -> None:
        _check_fraction("bandwidth_fraction", self.bandwidth_fraction)
        _check_fraction("compute_fraction", self.compute_fraction)


# Fitted with BF16's terms by benchmarks/fit_published.py (docs/fidelity.md, "Published measurements").
_DEFAULT_FORMATS: Mapping[str, FormatEfficiency] = MappingProxyType(
    {
        "int8": FormatEfficiency(bandwidth_fraction=0.71, compute_fraction=0.67),
        "int4": FormatEfficiency(bandwidth_fraction=0.49, compute_fraction=0.67),
        "fp8": FormatEfficiency(bandwidth_fraction=0.52, compute_fraction=0.45),
    }
)


@dataclass(frozen=True, slots=True)
class Efficiency:
    """How far below the datasheet a real engine runs. Every default is fitted by
    benchmarks/fit_published.py to the training half of benchmarks/published_measurements.json
    (the seed's figures included); docs/fidelity.md lists every point and its error.

    - bandwidth_fraction: achieved fraction of HBM bandwidth for BF16 weights, KV and activations.
    - compute_fraction: achieved fraction of the dense tensor-core peak for BF16 matmuls.
    - step_overhead_s: fixed cost of a step (launching the graph, sampling, scheduling).
    - per_layer_overhead_s: fixed cost per layer per step: its ~10 kernels' launch gaps and tails,
      which a deep model pays more of (kernel launches are not priced apart: with a fixed kernel
      count per layer the two are one parameter).
    - per_seq_overhead_s: CPU work per sequence per step (sampling, stop checks, detokenizing,
      batch bookkeeping), which grows with the batch.
    - interconnect_fraction, allreduce_latency_s: a ring all-reduce of the hidden state runs at this
      fraction of the link rate, after a fixed latency per all-reduce (two per layer).
    - formats: per quantized weight format (`int8`, `int4`, `fp8`), its kernels' own fractions;
      formats not listed (BF16, FP16, FP32, GGUF blocks) use the two above.

    How the compute and memory sides overlap is the part's, not the engine's: `step_overlap`.
    """

    bandwidth_fraction: float = 0.91
    compute_fraction: float = 0.67
    step_overhead_s: float = 0.0
    per_layer_overhead_s: float = 6.3e-5
    per_seq_overhead_s: float = 6.5e-6
    interconnect_fraction: float = 0.7
    allreduce_latency_s: float = 5.6e-6
    formats: Mapping[str, FormatEfficiency] = field(default_factory=lambda: dict(_DEFAULT_FORMATS), hash=False)

    def __post_init__(self) -> None:
        for name in ("bandwidth_fraction", "compute_fraction", "interconnect_fraction"):
            _check_fraction(name, getattr(self, name))
        for name in ("step_overhead_s", "per_layer_overhead_s", "per_seq_overhead_s", "allreduce_latency_s"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"efficiency {name} must be >= 0, got {getattr(self, name)}", param=name)
        for name, fmt in self.formats.items():
            if not isinstance(fmt, FormatEfficiency):
                raise InvalidArgument(
                    f"efficiency formats[{name!r}] must be a FormatEfficiency, got {fmt!r}", param="formats"
                )

    def for_format(self, weight_dtype: str) -> FormatEfficiency:
        """The (bandwidth, compute) fractions a weight format's kernels reach."""
        fmt = self.formats.get(weight_dtype.lower())
        return fmt if fmt is not None else FormatEfficiency(self.bandwidth_fraction, self.compute_fraction)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (an engine preset's `gpu.efficiency` in engine_profiles.json)."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "formats"}
        out["formats"] = {
            k: {"bandwidth_fraction": v.bandwidth_fraction, "compute_fraction": v.compute_fraction}
            for k, v in sorted(self.formats.items())
        }
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Efficiency:
        """The inverse of `to_dict`; a field left out keeps its default."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise InvalidArgument(f"unknown efficiency terms: {', '.join(sorted(unknown))}", param="efficiency")
        top: dict[str, Any] = {k: float(v) for k, v in data.items() if k != "formats"}
        if "formats" in data:
            top["formats"] = {k: FormatEfficiency(**v) for k, v in data["formats"].items()}
        return cls(**top)


# The end-to-end terms refitted on top of the measured kernels (benchmarks/fit_published.py
# --measured-kernels): what `Roofline(..., measured_kernels=True)` uses unless given its own. The
# fixed costs inside the measured kernels leave no per-layer term; docs/fidelity.md compares the two.
# Only the terms below differ from the end-to-end defaults (on this path the measured GEMMs carry the
# compute side, so FP8's compute fraction is left to follow the 16-bit one).
MEASURED_KERNELS_EFFICIENCY = replace(
    Efficiency(),
    bandwidth_fraction=1.0,
    per_layer_overhead_s=0.0,
    per_seq_overhead_s=3.9e-6,
    formats={**_DEFAULT_FORMATS, "fp8": FormatEfficiency(bandwidth_fraction=0.52, compute_fraction=0.67)},
)


def default_efficiency(measured_kernels: bool) -> Efficiency:
    """The Efficiency fitted for the measured-kernel path or for the end-to-end one."""
    return MEASURED_KERNELS_EFFICIENCY if measured_kernels else Efficiency()


def has_measured_kernels(hardware: HardwareSpec, weight_dtype: str) -> bool:
    """Whether `measured_kernels=True` prices this part and weight format with measured kernels
    (else it keeps the end-to-end pricing, and the end-to-end terms with it)."""
    wdt = _weight_dtype(weight_dtype)
    return _measured_gemm(hardware, wdt.compute_dtype, wdt.bytes_per_element) is not None


# Bytes per weight of the formats the measured GEMM parameters were fitted on.
_MEASURED_WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0}
# The name fit_published.py gives the measured kernels' seconds (linear layers, attention, measured
# collectives) in `time_terms`: held, not fitted.
MEASURED_KERNELS_TERM = "measured_kernels_s"
# A model's linear layers this many times larger or smaller than every measured GEMM are priced
# outside the measurements' range.
_SHAPE_SLACK = 4


def _measured_gemm(hardware: HardwareSpec, compute_dtype: str, bytes_per_weight: float) -> GemmEfficiency | None:
    """The part's measured GEMM parameters for this weight format, or None (weight-only formats
    such as int4 and GGUF blocks run other kernels than the ones measured)."""
    if hardware.kernels is None or _MEASURED_WEIGHT_BYTES.get(compute_dtype) != bytes_per_weight:
        return None
    return hardware.kernels.for_dtype(compute_dtype)


def parameter_source(hardware: HardwareSpec, measured: bool) -> str:
    """Where a Roofline's parameters come from, in one line for the CLI and --json."""
    if not measured or hardware.kernels is None:
        return "end-to-end Efficiency defaults fitted to published measurements (docs/fidelity.md)"
    return (
        f"{hardware.provenance}; new KV, activations and fixed costs from the end-to-end terms refitted on top of them"
    )


def extrapolation(
    model: ModelSpec, hardware: HardwareSpec, weight_dtype: str, kv_dtype: str, tp: int
) -> tuple[str, ...]:
    """Why a prediction for this deployment rests on no kernel measured for it (empty: it does)."""
    k = hardware.kernels
    wdt = _weight_dtype(weight_dtype)
    if k is None:
        fit = step_overlap(hardware, wdt.compute_dtype)
        combined = "by max()" if fit.sharpness == math.inf else f"as the p-norm of the {fit.source}"
        return (
            f"{hardware.name} has no measured kernels: its datasheet peaks at the fractions fitted on "
            f"A100 and H100 runs, compute and memory combined {combined}",
        )
    reasons = []
    if _measured_gemm(hardware, wdt.compute_dtype, wdt.bytes_per_element) is None:
        reasons.append(
            f"no measured {weight_dtype} kernels on {hardware.name} (measured: "
            f"{', '.join(k.gemm)}): priced by the end-to-end {weight_dtype} fractions"
        )
    if _kv_dtype(kv_dtype).bytes_per_element != 2:
        reasons.append(f"{kv_dtype} KV cache: attention measured on a 16-bit cache only")
    if model.head_dim not in k.attention.head_dims:
        reasons.append(
            f"head_dim {model.head_dim}: attention measured at head_dim "
            f"{', '.join(map(str, k.attention.head_dims))} only"
        )
    shapes = k.gemm_shapes
    sizes = [n * kk for n, kk in _linear_shapes(model, tp)]
    if max(sizes) > _SHAPE_SLACK * shapes.max_weight_elements or min(sizes) * _SHAPE_SLACK < shapes.min_weight_elements:
        reasons.append(
            f"{model.name}'s linear layers ({min(sizes) / 1e6:.3g}M to {max(sizes) / 1e6:.3g}M weights per "
            f"device) lie outside the measured GEMMs' {shapes.min_weight_elements / 1e6:.3g}M to "
            f"{shapes.max_weight_elements / 1e6:.3g}M"
        )
    if tp > 1 and (k.collectives is None or k.collectives.all_reduce(tp) is None):
        reasons.append(
            f"no measured all-reduce among {tp} {hardware.name}s: the link's datasheet rate at the end-to-end fraction"
        )
    return tuple(reasons)


def extrapolation_notice(reasons: tuple[str, ...] | list[str]) -> str:
    """The line the CLI prints first when a prediction extrapolates."""
    return "extrapolated: " + "; ".join(reasons)


def _linear_shapes(model: ModelSpec, tp: int, ffn_size: int | None = None) -> list[tuple[int, int]]:
    """(N, K) per device of each linear layer of a layer (the MLP's once, an expert's for MoE;
    `ffn_size`: another MLP's, a MoE's dense layers')."""
    m = model
    q_heads = max(1, m.num_heads // tp)
    ffn = max(1, (ffn_size or m.ffn_size) // tp)
    return [
        ((q_heads + 2 * kv_heads_per_device(m, tp)) * m.head_dim, m.hidden_size),
        (m.hidden_size, q_heads * m.head_dim),
        (2 * ffn, m.hidden_size),
        (m.hidden_size, ffn),
    ]


def _window_prefix_pairs(n: int, window: int) -> int:
    """(query, key) pairs of positions 0..n-1 when each attends to at most `window` keys
    (itself and the window - 1 before it): Σ_{j=1..n} min(j, window)."""
    if n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


class Roofline:
    """Prices a step of `model` on `tp` devices of `hardware`. Bytes and FLOPs are per device."""

    def __init__(
        self,
        model: ModelSpec,
        hardware: HardwareSpec,
        weight_dtype: str = DEFAULT_DTYPE,
        kv_dtype: str = DEFAULT_DTYPE,
        tp: int = 1,
        efficiency: Efficiency | None = None,
        memory_fraction: float = DEFAULT_MEMORY_FRACTION,
        measured_kernels: bool = False,
    ) -> None:
        self.model = model
        self.hardware = hardware
        self.tp = tp
        self.memory = MemoryPlan(model, hardware, weight_dtype, kv_dtype, tp, memory_fraction)  # validates
        self.weight_dtype, self.kv_dtype = self.memory.weight_dtype, self.memory.kv_cache_dtype  # canonical names
        wdt = _weight_dtype(weight_dtype)
        m = model
        # Measured kernels price the step where the part has them for this weight format; elsewhere
        # the end-to-end pricing runs with its own terms (those refitted on top of the kernels would
        # drop its per-layer costs and bandwidth fractions).
        self.gemm = _measured_gemm(hardware, wdt.compute_dtype, wdt.bytes_per_element) if measured_kernels else None
        self.efficiency = eff = efficiency or default_efficiency(self.gemm is not None)
        fmt = eff.for_format(weight_dtype)
        kernels = hardware.kernels if self.gemm is not None else None
        self.attention: AttentionEfficiency | None = kernels.attention if kernels is not None else None
        self.allreduce: CollectiveFit | None = (
            kernels.collectives.all_reduce(tp) if kernels is not None and kernels.collectives and tp > 1 else None
        )
        self.parameter_source = parameter_source(hardware, self.gemm is not None)
        self.extrapolation = extrapolation(model, hardware, self.weight_dtype, self.kv_dtype, tp)

        self.peak_flops_per_s = hardware.peak_flops_per_s(wdt.compute_dtype)
        self.peak_bandwidth_bytes_per_s = hardware.bandwidth_bytes_per_s
        self.ridge_flops_per_byte = self.peak_flops_per_s / self.peak_bandwidth_bytes_per_s
        self._flops_per_s = self.peak_flops_per_s * fmt.compute_fraction
        self._bytes_per_s = self.peak_bandwidth_bytes_per_s * eff.bandwidth_fraction  # KV and activations
        self._weight_bytes_per_s = self.peak_bandwidth_bytes_per_s * fmt.bandwidth_fraction

        # FLOPs: 2 per matmul parameter per token; the LM head runs once per sequence (only the
        # last position of a step produces logits); attention does QK^T and PV, 2 FLOPs each per
        # (query, key, head, head_dim) element.
        self._flops_per_token = 2.0 * m.matmul_params_per_token / tp
        self._flops_per_seq = 2.0 * m.lm_head_params / tp
        # The linear layers' FLOPs as their GEMMs run them: every GEMM over whole tiles of rows, a
        # MoE layer's experts each over their share of the tokens (an expert at 32 of a 128-token
        # prompt's rows computes a whole 128-row tile). `_expert_flops_per_row`: one token through
        # one expert in every MoE layer; the rest of `_flops_per_token` sees every token.
        overlap_fit = step_overlap(hardware, wdt.compute_dtype)
        self.tile_tokens = overlap_fit.tile_tokens
        self._expert_flops_per_row = 2.0 * m.num_moe_layers * m.expert_params_per_layer / tp
        self._shared_flops_per_token = self._flops_per_token - m.num_active_experts * self._expert_flops_per_row
        self._tiled_flops_cache: dict[int, float] = {}
        self._flops_per_attention_pair = 4.0 * m.num_layers * m.num_heads * m.head_dim / tp
        # Sliding-window layers attend to (and read the KV of) at most `window` keys per query;
        # `step_totals` folds them into the context and pair sums as a layer average.
        self._window = m.sliding_window
        self._num_window_layers = sum(m.layer_window(i) is not None for i in range(m.num_layers))

        # Bytes: dense weights stream once per step. The input embedding is gathered by token, so
        # only the LM head's copy of the vocabulary matrix streams (tied or not). MoE experts
        # stream only if some token in the step was routed to them; a MoE's routers, shared experts
        # (Qwen2-MoE) and dense layers' MLPs (Qwen3-MoE's mlp_only_layers) stream every step.
        bpe = wdt.bytes_per_element
        expert_bytes_per_layer = m.expert_params_per_layer * bpe / tp
        dense_params = (
            m.num_layers * (m.attention_params_per_layer + m.norm_params_per_layer)
            + m.num_moe_layers * (m.router_params_per_layer + m.shared_expert_params_per_layer)
            + (m.num_layers - m.num_moe_layers) * m.dense_mlp_params
            + m.lm_head_params
            + m.hidden_size
        )
        self._dense_weight_bytes = dense_params * bpe / tp
        self._expert_bytes_all_layers = m.num_moe_layers * expert_bytes_per_layer * m.num_experts
        self._num_experts = m.num_experts
        self._expert_miss_prob = 1.0 - m.num_active_experts / m.num_experts  # per token, per expert
        self.kv_bytes_per_token = self.memory.kv_bytes_per_token_per_device
        # Activations round-trip HBM between kernels: hidden-wide tensors (norm outputs, residual
        # adds, o_proj and down_proj outputs: ~8 reads+writes, replicated under TP) plus the
        # sharded q/k/v and SwiGLU intermediates (gate+up written and read, product written and read).
        q_kv_width = (m.num_heads + 2 * kv_heads_per_device(m, 1)) * m.head_dim
        dense_layers = m.num_layers - m.num_moe_layers
        mlp_width = (
            m.num_moe_layers * (m.ffn_size * m.num_active_experts + m.shared_ffn_size)
            + dense_layers * (m.dense_ffn_size or m.ffn_size)
        ) / m.num_layers
        sharded = 2 * q_kv_width + 6 * mlp_width
        self._activation_bytes_per_token = m.num_layers * (8 * m.hidden_size + sharded / tp) * ACTIVATION_BYTES

        # Tensor parallelism: two all-reduces of the hidden state per layer (after attention and
        # after the MLP). A ring all-reduce sends 2(tp-1)/tp of the buffer over each link.
        # A measured all-reduce is its latency plus the message (a token's hidden state) at its bandwidth.
        if self.allreduce is not None:
            self._ring_bytes_per_token = 0.0
            self._allreduces_per_step = 0
            self._comm_s_per_token = (
                2 * m.num_layers * m.hidden_size * ACTIVATION_BYTES / self.allreduce.bandwidth_bytes_per_s
            )
            self._comm_s_per_step = 2 * m.num_layers * self.allreduce.latency_s
        elif tp > 1:
            assert hardware.interconnect_bytes_per_s is not None  # MemoryPlan refuses tp > 1 without one
            self._ring_bytes_per_token = 2 * m.num_layers * m.hidden_size * ACTIVATION_BYTES * 2 * (tp - 1) / tp
            self._allreduces_per_step = 2 * m.num_layers
            self._comm_s_per_token = self._ring_bytes_per_token / (
                hardware.interconnect_bytes_per_s * eff.interconnect_fraction
            )
            self._comm_s_per_step = self._allreduces_per_step * eff.allreduce_latency_s
        else:
            self._ring_bytes_per_token = 0.0
            self._allreduces_per_step = 0
            self._comm_s_per_token = self._comm_s_per_step = 0.0
        self._overhead_s = eff.step_overhead_s + m.num_layers * eff.per_layer_overhead_s
        self.overlap_sharpness = overlap_fit.sharpness
        self.overlap_source = overlap_fit.source
        self._per_seq_s = eff.per_seq_overhead_s

        if self.gemm is not None:
            self._init_linears(wdt.bytes_per_element)
        # Measured attention: a layer's kernel over the step's pairs (compute) or its KV (bytes).
        if self.attention is not None:
            a = self.attention
            self._attention_s_per_pair = self._flops_per_attention_pair / (
                hardware.peak_flops_per_s("bf16") * a.compute_fraction
            )
            self._attention_s_per_context_token = self.kv_bytes_per_token / (
                hardware.bandwidth_bytes_per_s * a.bandwidth_fraction
            )
            self._prefill_attention_overhead_s = m.num_layers * a.prefill_overhead_s
            self._decode_attention_overhead_s = m.num_layers * a.decode_overhead_s

        # The hot path's constants: seconds per unit of each of a step's four sums.
        self._compute_s_per_token = self._flops_per_token / self._flops_per_s
        self._compute_s_per_seq = self._flops_per_seq / self._flops_per_s
        self._compute_s_per_pair = self._flops_per_attention_pair / self._flops_per_s
        self._dense_weight_s = self._dense_weight_bytes / self._weight_bytes_per_s
        self._expert_s_all_layers = self._expert_bytes_all_layers / self._weight_bytes_per_s
        self._memory_s_per_context_token = self.kv_bytes_per_token / self._bytes_per_s
        self._memory_s_per_token = (self.kv_bytes_per_token + self._activation_bytes_per_token) / self._bytes_per_s
        # A window's keys depend on each sequence's context, which the plain sums a simulator
        # keeps running cannot tell: a windowed model is priced from the shape (`step_totals`).
        self.time_from_totals: Callable[..., float] | None = None if self._num_window_layers else self._time_from_totals

    def _init_linears(self, bytes_per_weight: float) -> None:
        """(N, K) per device of each linear layer, for the measured GEMM model."""
        m, tp, hw = self.model, self.tp, self.hardware
        qkv, o, gate_up, down = _linear_shapes(m, tp)
        self._attn_linears = (qkv, o)
        self._mlp_linears = (gate_up, down)
        self._dense_mlp_linears = tuple(_linear_shapes(m, tp, m.dense_ffn_size)[2:])  # a MoE's dense layers
        # a MoE layer's shared expert (Qwen2-MoE), over every token
        self._shared_linears = tuple(_linear_shapes(m, tp, m.shared_ffn_size)[2:]) if m.shared_ffn_size else ()
        self._lm_head = (max(1, m.vocab_size // tp), m.hidden_size)
        self._gemm_args = (bytes_per_weight, self.peak_flops_per_s, hw.bandwidth_bytes_per_s)
        self._layer_linear_cache: dict[int, float] = {}
        self._lm_head_cache: dict[int, float] = {}

    def _gemm_s(self, tokens: float, nk: tuple[int, int]) -> float:
        assert self.gemm is not None
        return gemm_time_s(self.gemm, tokens, nk[0], nk[1], *self._gemm_args)

    def _linear_s(self, num_tokens: int, logit_rows: int) -> float:
        """Every linear layer of the step by the measured GEMM model: each layer's projections and
        MLP over the step's tokens (a MoE layer runs each expert it expects to be hit over its
        share of them), and the LM head over the positions that compute logits. Cached by token count: a
        simulation sees few distinct ones."""
        layer_s = self._layer_linear_cache.get(num_tokens)
        if layer_s is None:
            m = self.model
            layer_s = m.num_layers * sum(self._gemm_s(num_tokens, nk) for nk in self._attn_linears)
            dense_layers = m.num_layers - m.num_moe_layers
            if dense_layers:
                layer_s += dense_layers * sum(self._gemm_s(num_tokens, nk) for nk in self._dense_mlp_linears)
            if m.num_moe_layers:
                hit = self._num_experts * self._expert_hit_fraction(num_tokens)
                per_expert = num_tokens * m.num_active_experts / hit
                moe_s = hit * sum(self._gemm_s(per_expert, nk) for nk in self._mlp_linears)
                moe_s += self._gemm_s(num_tokens, (self._num_experts, m.hidden_size))  # router
                moe_s += sum(self._gemm_s(num_tokens, nk) for nk in self._shared_linears)
                layer_s += m.num_moe_layers * moe_s
            self._layer_linear_cache[num_tokens] = layer_s
        head_s = self._lm_head_cache.get(logit_rows)
        if head_s is None:
            head_s = self._lm_head_cache[logit_rows] = self._gemm_s(logit_rows, self._lm_head)
        return layer_s + head_s

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
    def achievable_flops_per_s(self) -> float:
        """FLOP/s the weight format's matmuls reach on the end-to-end path."""
        return self._flops_per_s

    @property
    def achievable_weight_bytes_per_s(self) -> float:
        """Bytes/s at which the weight format streams its weights."""
        return self._weight_bytes_per_s

    @property
    def achievable_bytes_per_s(self) -> float:
        """Bytes/s for KV and activations."""
        return self._bytes_per_s

    @property
    def achievable_ridge_flops_per_byte(self) -> float:
        """The intensity at which a step turns compute-bound at the achievable rates, which is
        where `StepCost.bound` flips (below the datasheet ridge when compute falls short more)."""
        return self._flops_per_s / self._bytes_per_s

    # ---- pricing a step ---------------------------------------------------------------------
    def _expert_hit_fraction(self, num_tokens: int) -> float:
        # Expected fraction of experts hit by at least one of the step's tokens (per layer).
        return 1.0 - self._expert_miss_prob**num_tokens

    def experts_hit(self, num_tokens: int) -> float:
        """Expected distinct experts a MoE layer reads in a step of `num_tokens` tokens, each routed
        to k of E experts: E(1 - (1 - k/E)^tokens), k at one token, nearly all E at large batch."""
        return self._num_experts * self._expert_hit_fraction(num_tokens)

    def _linear_flops(self, num_tokens: int, logit_rows: int) -> float:
        """FLOPs the step's linear layers compute, tiles padded: `num_tokens` rows through the
        attention projections, routers and dense MLPs, each hit expert its expected share of the
        rows, the LM head `logit_rows`. Without a tile (1), the plain 2 x parameters x tokens."""
        tile = self.tile_tokens
        if tile == 1:
            return num_tokens * self._flops_per_token + logit_rows * self._flops_per_seq
        body = self._tiled_flops_cache.get(num_tokens)
        if body is None:
            body = tiled_rows(num_tokens, tile) * self._shared_flops_per_token
            if self._num_experts != 1 and num_tokens:
                hit = self.experts_hit(num_tokens)
                rows = num_tokens * self.model.num_active_experts / hit
                body += hit * tiled_rows(rows, tile) * self._expert_flops_per_row
            self._tiled_flops_cache[num_tokens] = body
        return body + tiled_rows(logit_rows, tile) * self._flops_per_seq

    def _weight_bytes(self, num_tokens: int) -> float:
        if self._num_experts == 1:
            return self._dense_weight_bytes
        return self._dense_weight_bytes + self._expert_bytes_all_layers * self._expert_hit_fraction(num_tokens)

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
        return self._time_from_totals(*self.step_totals(shape))

    def step_totals(self, shape: Shape) -> tuple[int, int, float, float]:
        """`totals(shape)` with each sliding-window layer's keys capped at its window: Σ context
        and Σ pairs averaged over the layers (what every layer-wide per-key constant multiplies).
        The same four sums as `totals` for a model without a window."""
        num_tokens, num_seqs, context_tokens, pairs = self.totals(shape)
        if not self._num_window_layers or not shape:
            return num_tokens, num_seqs, context_tokens, pairs
        w = self._window
        assert w is not None
        window_context = window_pairs = 0
        for q, c in shape:
            window_context += c if c < w else w
            window_pairs += _window_prefix_pairs(c, w) - _window_prefix_pairs(c - q, w)
        return num_tokens, num_seqs, *self._layer_average(context_tokens, pairs, window_context, window_pairs)

    def _layer_average(
        self, context_tokens: float, pairs: float, window_context: float, window_pairs: float
    ) -> tuple[float, float]:
        layers, local = self.model.num_layers, self._num_window_layers
        return (
            ((layers - local) * context_tokens + local * window_context) / layers,
            ((layers - local) * pairs + local * window_pairs) / layers,
        )

    def _time_from_totals(
        self, num_tokens: int, num_seqs: int, context_tokens: float, pairs: float, logit_rows: int | None = None
    ) -> float:
        """The hot path: a step's time from its four sums (a simulator can keep them running).
        `logit_rows`: positions that compute logits, when not one per sequence (a speculative
        verification scores every position of its chunk). Offered as `time_from_totals` only
        where the plain sums price the step (no sliding window): see `__init__`."""
        if num_tokens == 0:
            return 0.0
        if logit_rows is None:
            logit_rows = num_seqs
        if self.gemm is not None:  # measured kernels run one after another: their times add up
            compute_s = pairs * self._attention_s_per_pair
            memory_s = context_tokens * self._attention_s_per_context_token
            return (
                self._linear_s(num_tokens, logit_rows)
                + (compute_s if compute_s > memory_s else memory_s)
                + (self._prefill_attention_overhead_s if num_tokens > num_seqs else self._decode_attention_overhead_s)
                + num_tokens * (self._memory_s_per_token + self._comm_s_per_token)
                + self._comm_s_per_step
                + self._overhead_s
                + num_seqs * self._per_seq_s
            )
        if self.tile_tokens == 1:
            compute_s = (
                num_tokens * self._compute_s_per_token
                + logit_rows * self._compute_s_per_seq
                + pairs * self._compute_s_per_pair
            )
        else:
            compute_s = (
                self._linear_flops(num_tokens, logit_rows) / self._flops_per_s + pairs * self._compute_s_per_pair
            )
        weight_s = self._dense_weight_s
        if self._num_experts != 1:
            weight_s += self._expert_s_all_layers * (1.0 - self._expert_miss_prob**num_tokens)
        memory_s = weight_s + context_tokens * self._memory_s_per_context_token + num_tokens * self._memory_s_per_token
        # a conditional, not max(): this line runs millions of times per simulation
        p = self.overlap_sharpness
        return (
            (
                (compute_s if compute_s > memory_s else memory_s)
                if p == math.inf
                else (compute_s**p + memory_s**p) ** (1.0 / p)
            )
            + num_tokens * self._comm_s_per_token
            + self._comm_s_per_step
            + self._overhead_s
            + num_seqs * self._per_seq_s
        )

    def time_terms(
        self, num_tokens: int, num_seqs: int, context_tokens: float, pairs: float
    ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """A step's time split by the Efficiency parameter each part scales with, for fitting:
        (compute side, memory side, added). A fraction's term is multiplied by 1 / fraction, an
        overhead's by its value, and

            time = overlap(Σ compute side, Σ memory side, overlap_sharpness) + Σ added


        gives `time_from_totals` (its test holds the two together). Keys are Efficiency field
        names; a quantized format's are `formats.<name>.bandwidth_fraction` / `.compute_fraction`.
        With measured kernels, `added` also holds MEASURED_KERNELS_TERM: the seconds of the linear
        layers, attention and measured all-reduces, which no Efficiency field scales."""
        if num_tokens == 0:
            return {}, {}, {}
        if self.gemm is not None:
            added = self._added_terms(num_tokens, num_seqs)
            added[MEASURED_KERNELS_TERM] = self._linear_s(num_tokens, num_seqs) + self._attention_s(
                num_tokens, num_seqs, context_tokens, pairs
            )
            if self.allreduce is not None:
                added[MEASURED_KERNELS_TERM] += num_tokens * self._comm_s_per_token + self._comm_s_per_step
            new_bytes = num_tokens * (self.kv_bytes_per_token + self._activation_bytes_per_token)
            return {}, {"bandwidth_fraction": new_bytes / self.peak_bandwidth_bytes_per_s}, added
        fmt_key = (
            f"formats.{self.weight_dtype.lower()}." if self.weight_dtype.lower() in self.efficiency.formats else ""
        )
        flops = self._linear_flops(num_tokens, num_seqs) + pairs * self._flops_per_attention_pair
        other_bytes = context_tokens * self.kv_bytes_per_token + num_tokens * (
            self.kv_bytes_per_token + self._activation_bytes_per_token
        )
        bw = self.peak_bandwidth_bytes_per_s
        weight_s = self._weight_bytes(num_tokens) / bw
        memory = {"bandwidth_fraction": other_bytes / bw}
        memory[fmt_key + "bandwidth_fraction"] = memory.get(fmt_key + "bandwidth_fraction", 0.0) + weight_s
        return (
            {fmt_key + "compute_fraction": flops / self.peak_flops_per_s},
            memory,
            self._added_terms(num_tokens, num_seqs),
        )

    def _attention_s(self, num_tokens: int, num_seqs: int, context_tokens: float, pairs: float) -> float:
        """The measured attention kernels of a step, one call per layer."""
        compute_s = pairs * self._attention_s_per_pair
        memory_s = context_tokens * self._attention_s_per_context_token
        return max(compute_s, memory_s) + (
            self._prefill_attention_overhead_s if num_tokens > num_seqs else self._decode_attention_overhead_s
        )

    def _added_terms(self, num_tokens: int, num_seqs: int) -> dict[str, float]:
        added = {
            "step_overhead_s": 1.0,
            "per_layer_overhead_s": float(self.model.num_layers),
            "per_seq_overhead_s": float(num_seqs),
        }
        if self._allreduces_per_step:
            link = self.hardware.interconnect_bytes_per_s
            assert link is not None
            added["allreduce_latency_s"] = float(self._allreduces_per_step)
            added["interconnect_fraction"] = num_tokens * self._ring_bytes_per_token / link
        return added

    def step(self, shape: Shape) -> StepCost:
        return self.cost_from_totals(*self.step_totals(shape))

    def cost_from_totals(
        self, num_tokens: int, num_seqs: int, context_tokens: float, pairs: float, logit_rows: int | None = None
    ) -> StepCost:
        """A step's cost from its sums (`step_totals`: a windowed model's are layer averages)."""
        if logit_rows is None:
            logit_rows = num_seqs
        flops = (
            num_tokens * self._flops_per_token
            + logit_rows * self._flops_per_seq
            + pairs * self._flops_per_attention_pair
        )
        weight_bytes = self._weight_bytes(num_tokens) if num_tokens else 0.0
        kv_read = context_tokens * self.kv_bytes_per_token
        kv_write = num_tokens * self.kv_bytes_per_token
        activation = num_tokens * self._activation_bytes_per_token
        total_bytes = weight_bytes + kv_read + kv_write + activation
        other_memory_s = (kv_read + kv_write + activation) / self._bytes_per_s
        if num_tokens:
            comm_s = num_tokens * self._comm_s_per_token + self._comm_s_per_step
            overhead_s = self._overhead_s + num_seqs * self._per_seq_s
        else:
            comm_s = overhead_s = 0.0
        if self.gemm is not None and num_tokens:
            # Linear layers and attention as measured (their compute and memory sides reported at
            # the measured fractions, unsmoothed); new KV and activations at the end-to-end fraction.
            linear_flops = flops - pairs * self._flops_per_attention_pair
            new_bytes_s = (kv_write + activation) / self._bytes_per_s
            compute_s = pairs * self._attention_s_per_pair + linear_flops / (
                self.peak_flops_per_s * self.gemm.compute_fraction
            )
            memory_s = (
                context_tokens * self._attention_s_per_context_token
                + new_bytes_s
                + weight_bytes / (self.peak_bandwidth_bytes_per_s * self.gemm.bandwidth_fraction)
            )
            time_s = (
                self._linear_s(num_tokens, logit_rows)
                + self._attention_s(num_tokens, num_seqs, context_tokens, pairs)
                + new_bytes_s
                + comm_s
                + overhead_s
            )
        else:
            tiled_flops = self._linear_flops(num_tokens, logit_rows) + pairs * self._flops_per_attention_pair
            compute_s = tiled_flops / self._flops_per_s if num_tokens else 0.0
            memory_s = weight_bytes / self._weight_bytes_per_s + other_memory_s
            time_s = overlap(compute_s, memory_s, self.overlap_sharpness) + comm_s + overhead_s
        return StepCost(
            time_s=time_s,
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
        keys: float = context_len
        if self._num_window_layers:  # a decode token attends to min(context, window) keys on a window layer
            assert self._window is not None
            local = min(context_len, self._window)
            keys = self._layer_average(context_len, context_len, local, local)[0]
        return self.cost_from_totals(batch, batch, batch * keys, batch * keys)

    def prefill(self, prompt_len: int, batch: int = 1) -> StepCost:
        """Prefill of `batch` fresh prompts of `prompt_len` tokens in one step (TTFT at idle)."""
        if batch < 1:
            raise InvalidArgument(f"batch must be at least 1, got {batch}", param="batch")
        self._check_context(prompt_len, "prompt length")
        return self.step([(prompt_len, prompt_len)] * batch)

    def compute_bound_batch(self, context_len: int, limit: int = 1 << 24) -> int | None:
        """Smallest decode batch at `context_len` from which every larger batch is compute-bound
        (memory capacity ignored), or None: when each sequence adds more bytes (its KV) than FLOPs
        can cover, no batch ever gets there.

        GEMMs run whole tiles of rows, so within a tile the compute stays put while the KV read
        grows: near the crossover a batch just past a tile's start can be compute-bound and the
        tile's last batch memory-bound again. At the tiles' last batches both sides grow linearly,
        so the search runs over those, then finds where the first compute-bound tile turns."""
        tile = self.tile_tokens

        def compute_bound(batch: int) -> bool:
            return self.decode(batch, context_len).bound == "compute"

        last_tile = limit // tile
        if last_tile < 1 or not compute_bound(last_tile * tile):
            return None
        low, high = 0, 1  # in tiles: low's last batch is memory-bound (or 0), high's compute-bound
        while not compute_bound(high * tile):
            low, high = high, min(high * 2, last_tile)
        while high - low > 1:
            mid = (low + high) // 2
            if compute_bound(mid * tile):
                high = mid
            else:
                low = mid
        first = high * tile  # compute-bound, as is every tile end past it
        while first > low * tile + 1 and compute_bound(first - 1):
            first -= 1
        return first
