"""Lessons answered by the roofline alone: the two workloads (1), batching (2), memory (6)."""

from __future__ import annotations

import dataclasses
from typing import Any, TypedDict

import numpy as np

from servelab.cost import MemoryPlan, Roofline, StepCost
from servelab.cost.step_cost import Bound
from servelab.errors import DoesNotFit
from servelab.lab.common import fmt, gb, ms, powers_of_two, setup_from, stat
from servelab.lab.formulas import step_formula
from servelab.lab.limits import bounds
from servelab.lab.params import Params
from servelab.spec import ModelSpec


def _point(cost: StepCost) -> dict[str, Any]:
    return {
        "time_ms": ms(cost.time_s),
        "flops": cost.flops,
        "bytes": cost.total_bytes,
        "intensity": cost.arithmetic_intensity,
        # Where the step lands on the roofline chart: the FLOP rate it actually achieves.
        "achieved_tflops": cost.flops / cost.time_s / 1e12 if cost.time_s else 0.0,
        "compute_ms": ms(cost.compute_time_s),
        "memory_ms": ms(cost.memory_time_s),
        "bound": cost.bound,
    }


def busy_fraction(cost: StepCost) -> float:
    """The share of a step the tensor cores spend on its FLOPs at their datasheet peak; the rest
    of the step they sit idle, waiting on memory and fixed costs."""
    return cost.peak_compute_time_s / cost.time_s if cost.time_s else 0.0


def roofline_curve(rl: Roofline) -> dict[str, list[float]]:
    """Attainable FLOP/s at the datasheet peaks: bandwidth × intensity up to the ridge, then flat."""
    intensity = np.logspace(-1, 5, 61)
    ridge = rl.ridge_flops_per_byte
    intensity = np.unique(np.append(intensity, ridge))
    attainable = np.minimum(rl.peak_flops_per_s, intensity * rl.peak_bandwidth_bytes_per_s) / 1e12
    return {"intensity": intensity.tolist(), "attainable_tflops": attainable.tolist()}


def two_workloads(p: Params) -> dict[str, Any]:
    s = setup_from(p)
    prompt_len = p.int("prompt_len", 2048, **bounds("two-workloads", "prompt_len"))
    batch = p.int("batch", 1, **bounds("two-workloads", "batch"))
    rl = s.roofline()
    prefill = rl.prefill(prompt_len)
    decode = rl.decode(batch, prompt_len)
    # A decode step at this batch and context needs their KV resident. Where it is not, the
    # lesson still draws (a no-fit shade on the sweep) and the warning says what to change.
    plan = rl.memory
    fit_context = plan.kv_capacity_tokens // batch if plan.weights_fit else 0
    warning = None
    try:
        plan.require_fit(batch, prompt_len)
    except DoesNotFit as exc:
        warning = exc.message
    lengths = [n for n in powers_of_two(16, s.model.max_context)]
    if prompt_len not in lengths:
        lengths = sorted([*lengths, prompt_len])
    sweep = {
        "prompt_len": lengths,
        "prefill_ms": [ms(rl.prefill(n).time_s) for n in lengths],
        "decode_step_ms": [ms(rl.decode(batch, n).time_s) for n in lengths],
    }
    ridge = rl.ridge_flops_per_byte
    ratio = prefill.time_s / decode.time_s
    # On the roofline, a decode step's intensity grows with its batch until the KV cache is full:
    # further right, decode at this context does not fit.
    max_batch = plan.max_batch(prompt_len) if plan.weights_fit else 0
    decode_wall = {
        "intensity": rl.decode(max_batch, prompt_len).arithmetic_intensity if max_batch else 0.0,
        "label": (
            f"decode at {prompt_len:,} tokens: batch > {max_batch:,} does not fit"
            if max_batch
            else "decode at this context does not fit"
        ),
    }
    idle = 1.0 - busy_fraction(decode)
    return {
        "config": {**s.to_dict(), "prompt_len": prompt_len, "batch": batch},
        "prefill": _point(prefill),
        "decode": _point(decode),
        "phases": {
            "label": [f"prefill {prompt_len:,} tokens", f"one decode step (batch {batch})"],
            "time_ms": [ms(prefill.time_s), ms(decode.time_s)],
            "bound": [f"{prefill.bound}-bound", f"{decode.bound}-bound"],
        },
        "warning": warning,
        "limits": {
            "context": {
                "prompt_len": fit_context,
                "label": (
                    f"KV cache full: batch {batch:,} fits up to {fit_context:,} tokens"
                    if plan.weights_fit
                    else "the weights alone do not fit"
                ),
            },
            "roofline": decode_wall,
        },
        "tensor_cores_idle": idle,
        "formulas": [
            step_formula(f"prefill of {prompt_len:,} tokens", prefill, rl),
            step_formula(f"one decode step, batch {batch:,} at {prompt_len:,} tokens", decode, rl),
        ],
        "ridge_flops_per_byte": ridge,
        "ridge_label": f"{ridge:.0f} FLOP/byte",
        "roofline": roofline_curve(rl),
        "sweep": sweep,
        "stats": [
            stat("prefill time (TTFT floor)", fmt(ms(prefill.time_s), "ms")),
            stat("one decode step (TPOT)", fmt(ms(decode.time_s), "ms")),
            stat("weights streamed once at peak bandwidth", fmt(ms(rl.weight_stream_time_s), "ms")),
            stat("compute per token at peak", fmt(ms(rl.token_compute_time_s), "ms")),
            stat("prefill intensity", fmt(prefill.arithmetic_intensity, "FLOP/B")),
            stat("decode intensity", fmt(decode.arithmetic_intensity, "FLOP/B")),
            stat("ridge", fmt(ridge, "FLOP/B")),
            stat(f"tensor cores idle in a batch-{batch:,} decode step", f"{100 * idle:.1f}%"),
        ],
        "notice": (
            f"prefill of {prompt_len:,} tokens is {prefill.bound}-bound at {fmt(prefill.arithmetic_intensity)} "
            f"FLOP/byte and takes {fmt(ratio)}x as long as one decode step, which sits at "
            f"{fmt(decode.arithmetic_intensity)} FLOP/byte, {fmt(ridge / decode.arithmetic_intensity)}x below "
            f"the ridge of {ridge:.0f}: decode waits on memory, and the tensor cores sit idle "
            f"{100 * idle:.1f}% of the step."
        ),
    }


class SelectedStep(TypedDict):
    """The decode step at the chosen batch, as the batching lesson's JSON carries it."""

    batch: int
    step_ms: float
    tokens_per_s_per_user: float
    tokens_per_s_total: float
    weight_gb: float
    kv_gb: float
    intensity: float
    bound: Bound


def batching(p: Params) -> dict[str, Any]:
    s = setup_from(p)
    batch = p.int("batch", 64, **bounds("batching", "batch"))
    context = p.int("context", 2048, **bounds("batching", "context"))
    rl = s.roofline()
    plan = rl.memory
    batches = powers_of_two(1, 1024)
    if batch not in batches:
        batches = sorted([*batches, batch])
    costs = [rl.decode(b, context) for b in batches]
    sweep = {
        "batch": batches,
        "step_ms": [ms(c.time_s) for c in costs],
        "tokens_per_s_per_user": [1.0 / c.time_s for c in costs],
        "tokens_per_s_total": [b / c.time_s for b, c in zip(batches, costs)],
        "weight_gb": [gb(c.weight_bytes) for c in costs],
        "kv_gb": [gb(c.kv_read_bytes + c.kv_write_bytes) for c in costs],
        "compute_ms": [ms(c.compute_time_s) for c in costs],
        "memory_ms": [ms(c.memory_time_s) for c in costs],
        "bound": [c.bound for c in costs],
        "busy_pct": [100 * busy_fraction(c) for c in costs],
        "fits": [plan.fits(b, context) for b in batches],
    }
    chosen = rl.decode(batch, context)
    crossover = rl.compute_bound_batch(context)
    fits = plan.fits(batch, context)
    reason = None
    if not fits:
        try:
            plan.require_fit(batch, context)
        except DoesNotFit as exc:
            reason = exc.message
    memory = {
        "capacity_gb": gb(plan.usable_bytes),
        "capacity_label": f"{gb(plan.usable_bytes):.1f} GB ({plan.memory_fraction:.0%} of {gb(s.hardware.memory_bytes):.0f} GB)",
        "weights_gb": gb(plan.weight_bytes_per_device),
        "kv_gb": gb(plan.kv_bytes(batch, context)),
        "fits": fits,
        "max_batch": plan.max_batch(context) if plan.weights_fit else 0,
        "reason": reason,
    }
    selected: SelectedStep = {
        "batch": batch,
        "step_ms": ms(chosen.time_s),
        "tokens_per_s_per_user": 1.0 / chosen.time_s,
        "tokens_per_s_total": batch / chosen.time_s,
        "weight_gb": gb(chosen.weight_bytes),
        "kv_gb": gb(chosen.kv_read_bytes + chosen.kv_write_bytes),
        "intensity": chosen.arithmetic_intensity,
        "bound": chosen.bound,
    }
    one = costs[0]
    if crossover is None:
        crossing = "at this context each sequence's KV adds more bytes than its FLOPs can cover: no batch becomes compute-bound"
    else:
        crossing = f"compute catches up with bandwidth at batch {crossover:,}"
    notice = (
        f"batch {batch} runs {fmt(selected['tokens_per_s_total'])} tokens/s in total but "
        f"{fmt(selected['tokens_per_s_per_user'])} per user (batch 1: {fmt(1.0 / one.time_s)}); "
        f"KV is {fmt(100 * selected['kv_gb'] / (selected['kv_gb'] + selected['weight_gb']))}% of the bytes; {crossing}."
    )
    # Where the sweep crosses a limit, the charts shade beyond it and name it.
    limits = {
        "memory": (
            {"batch": memory["max_batch"], "label": f"KV cache full at batch {memory['max_batch']:,}"}
            if plan.weights_fit
            else {"batch": 0, "label": "the weights alone do not fit"}
        ),
        "compute": None
        if crossover is None
        else {"batch": crossover, "label": f"compute-bound from batch {crossover:,}"},
    }
    return {
        "config": {**s.to_dict(), "batch": batch, "context": context},
        "sweep": sweep,
        "limits": limits,
        "selected": selected,
        "crossover_batch": crossover,
        "memory": memory,
        "warning": reason,
        "formulas": [step_formula(f"one decode step, batch {batch:,} at {context:,} tokens", chosen, rl)],
        "stats": [
            stat("step time", fmt(selected["step_ms"], "ms")),
            stat("tokens/s per user", fmt(selected["tokens_per_s_per_user"])),
            stat("tokens/s in total", fmt(selected["tokens_per_s_total"])),
            stat("weights / KV read per step", f"{fmt(selected['weight_gb'])} / {fmt(selected['kv_gb'])} GB"),
            stat("compute catches up at batch", "never" if crossover is None else f"{crossover:,}"),
            stat("largest batch that fits", f"{memory['max_batch']:,}"),
            stat(
                "tensor cores busy at batch 1 / yours",
                f"{100 * busy_fraction(one):.1f}% / {100 * busy_fraction(chosen):.1f}%",
            ),
        ],
        "notice": notice,
    }


def with_mha(model: ModelSpec) -> ModelSpec:
    """The same model with one KV head per attention head (multi-head attention, no GQA)."""
    return dataclasses.replace(model, name=f"{model.name} (MHA)", num_kv_heads=model.num_heads)


ATTENTION_CHOICES = ("gqa", "mha")
ATTENTION_ALIASES = {"full": "mha"}  # the first edition's name, still read from old URLs


def batch_at_tpot(rl: Roofline, context: int, max_batch: int, tpot_s: float) -> int:
    """Largest batch no larger than `max_batch` whose decode step at `context` takes at most
    `tpot_s` (0 if not even batch 1 does). Step time grows with the batch, so bisect."""
    if max_batch < 1 or rl.decode(1, context).time_s > tpot_s:
        return 0
    low, high = 1, max_batch  # low meets the target
    if rl.decode(high, context).time_s <= tpot_s:
        return high
    while high - low > 1:
        mid = (low + high) // 2
        if rl.decode(mid, context).time_s <= tpot_s:
            low = mid
        else:
            high = mid
    return low


VARIANT_WEIGHT_DTYPES = ("bfloat16", "fp8", "int4")
VARIANT_KV_DTYPES = ("bfloat16", "fp8")


def memory(p: Params) -> dict[str, Any]:
    s = setup_from(p)
    attention = p.choice("attention", "gqa", (*ATTENTION_CHOICES, *ATTENTION_ALIASES))
    attention = ATTENTION_ALIASES.get(attention, attention)
    context = p.int("context", 8192, **bounds("memory", "context"))
    tpot_ms = p.float("tpot_ms", 50.0, **bounds("memory", "tpot_ms"))
    s.roofline()._check_context(context, "context")  # noqa: SLF001 - the roofline's own limit and message
    combos = [(w, k, a) for a in ATTENTION_CHOICES for w in VARIANT_WEIGHT_DTYPES for k in VARIANT_KV_DTYPES]
    chosen = (s.weight_dtype, s.kv_dtype, attention)
    if chosen not in combos:
        combos.append(chosen)
    variants: dict[str, list[Any]] = {
        k: []
        for k in (
            "label",
            "weight_dtype",
            "kv_dtype",
            "attention",
            "selected",
            "weights_gb",
            "kv_kb_per_token",
            "max_batch",
            "batch_at_tpot",
            "step_ms_at_tpot",
            "tokens_per_s_per_gpu",
        )
    }
    for w, k, a in combos:
        model = s.model if a == "gqa" else with_mha(s.model)
        plan = MemoryPlan(model, s.hardware, w, k, s.tp)
        rl = Roofline(model, s.hardware, w, k, s.tp)
        max_batch = plan.max_batch(context) if plan.weights_fit else 0
        b = batch_at_tpot(rl, context, max_batch, tpot_ms / 1e3)
        step_s = rl.decode(b, context).time_s if b else None
        variants["label"].append(f"W {w}<br>KV {k}<br>{a.upper()}")
        variants["weight_dtype"].append(w)
        variants["kv_dtype"].append(k)
        variants["attention"].append(a)
        variants["selected"].append((w, k, a) == chosen)
        variants["weights_gb"].append(gb(plan.weight_bytes_per_device))
        variants["kv_kb_per_token"].append(plan.kv_bytes_per_token_per_device / 1e3)
        variants["max_batch"].append(max_batch)
        variants["batch_at_tpot"].append(b)
        variants["step_ms_at_tpot"].append(None if step_s is None else ms(step_s))
        variants["tokens_per_s_per_gpu"].append(0.0 if step_s is None else b / step_s / s.tp)
    i = combos.index(chosen)
    pick = {key: values[i] for key, values in variants.items()}
    model = s.model if attention == "gqa" else with_mha(s.model)
    plan = MemoryPlan(model, s.hardware, s.weight_dtype, s.kv_dtype, s.tp)
    warning = None
    if not plan.weights_fit:
        try:
            plan.require_weights_fit()
        except DoesNotFit as exc:
            warning = exc.message
    elif pick["max_batch"] == 0:
        warning = (
            f"{plan.describe()}: not even one sequence of {context:,} tokens fits the "
            f"{plan.kv_capacity_tokens:,}-token KV cache left after the weights"
        )
    best = max(range(len(combos)), key=lambda j: variants["tokens_per_s_per_gpu"][j])
    if pick["batch_at_tpot"]:
        yours = (
            f"your choice fits {pick['max_batch']:,} sequences of {context:,} tokens and serves "
            f"{fmt(pick['tokens_per_s_per_gpu'])} tokens/s per GPU at batch {pick['batch_at_tpot']:,} within "
            f"{fmt(tpot_ms)} ms TPOT"
        )
    else:
        yours = f"your choice cannot meet {fmt(tpot_ms)} ms TPOT at {context:,} tokens of context"
    best_label = variants["label"][best].replace("<br>", " · ")
    notice = (
        f"{yours}; {best_label} serves {fmt(variants['tokens_per_s_per_gpu'][best])}. "
        f"Multi-head attention (MHA, one KV head per query head) needs "
        f"{s.model.num_heads // s.model.num_kv_heads}x the KV per token of GQA here."
    )
    return {
        "config": {**s.to_dict(), "attention": attention, "context": context, "tpot_ms": tpot_ms},
        "variants": variants,
        "selected": pick,
        "warning": warning,
        "stats": [
            stat("weights per device", fmt(pick["weights_gb"], "GB")),
            stat("KV per token", fmt(pick["kv_kb_per_token"], "kB")),
            stat("largest batch at this context", f"{pick['max_batch']:,}"),
            stat("batch within the TPOT target", f"{pick['batch_at_tpot']:,}"),
            stat("tokens/s per GPU at the target", fmt(pick["tokens_per_s_per_gpu"])),
        ],
        "notice": notice,
    }
