"""Lessons answered by the roofline alone: the two workloads (1), batching (2), memory (6)."""

from __future__ import annotations

import dataclasses
from typing import Any, TypedDict

import numpy as np

from servelab.cost import MemoryPlan, Roofline, StepCost
from servelab.cost.operators import OPERATOR_LABELS, operator_costs
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
        "side_of_ridge": side_of_ridge(cost),
    }


def side_of_ridge(cost: StepCost) -> str:
    """ "above" or "below" the datasheet ridge: where the step's intensity puts it on the roofline."""
    return "above" if cost.arithmetic_intensity >= cost.ridge_flops_per_byte else "below"


def bound_sentence(name: str, cost: StepCost) -> str:
    """Where a step sits against the ridge and what it waits on, both read from its own numbers.
    The bound is the cost model's verdict (compute time against memory time at the achievable
    rates); when it disagrees with the datasheet ridge, the sentence says why."""
    ridge = cost.ridge_flops_per_byte
    intensity = cost.arithmetic_intensity
    side = side_of_ridge(cost)
    factor = ridge / intensity if side == "below" else intensity / ridge
    where = f"{name} sits at {fmt(intensity)} FLOP/byte, {fmt(factor)}x {side} the ridge of {ridge:.0f}"
    waits = "waits on memory" if cost.bound == "memory" else "waits on arithmetic"
    if (side == "below") == (cost.bound == "memory"):
        return f"{where}: {cost.bound}-bound, it {waits}"
    return (
        f"{where}, yet {cost.bound}-bound: at the achievable rates its compute takes "
        f"{fmt(ms(cost.compute_time_s))} ms against {fmt(ms(cost.memory_time_s))} ms of memory traffic, so it {waits}"
    )


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


def operator_points(rl: Roofline, prompt_len: int, batch: int) -> dict[str, Any]:
    """Each operator of a prefill step and of a decode step (at batch 1 and at `batch`) as a
    point under the roof: its intensity and the FLOP rate it attains."""

    def points(shape: list[tuple[int, int]]) -> dict[str, list[Any]]:
        ops = operator_costs(rl, shape)
        return {
            "intensity": [o.arithmetic_intensity for o in ops],
            "achieved_tflops": [o.attained_flops_per_s / 1e12 for o in ops],
            "time_ms": [ms(o.time_s) for o in ops],
            "bound": [o.bound for o in ops],
        }

    phases = {"prefill": points([(prompt_len, prompt_len)]), "decode_batch_1": points([(1, prompt_len)])}
    if batch > 1:
        phases[f"decode_batch_{batch}"] = points([(1, prompt_len)] * batch)
    return {
        "names": list(OPERATOR_LABELS),
        "labels": list(OPERATOR_LABELS.values()),
        "phases": phases,
        "phase_labels": {
            "prefill": f"prefill {prompt_len:,} tokens",
            "decode_batch_1": "decode, batch 1",
            **({f"decode_batch_{batch}": f"decode, batch {batch:,}"} if batch > 1 else {}),
        },
    }


def _operators_sentence(ops: dict[str, Any], batch: int) -> str:
    """Which operators stay memory-bound in decode and how far the matmuls move with the batch."""
    names = ops["names"]
    phases = ops["phases"]
    a, mlp = names.index("attention"), names.index("mlp")
    one = phases["decode_batch_1"]
    last = phases.get(f"decode_batch_{batch}", one)
    text = (
        f"Per operator, decode attention sits at {fmt(last['intensity'][a])} FLOP/byte and is "
        f"{last['bound'][a]}-bound at any batch (each sequence reads its own KV)"
    )
    if batch > 1:
        text += (
            f", while the MLP moves from {fmt(one['intensity'][mlp])} FLOP/byte at batch 1 to "
            f"{fmt(last['intensity'][mlp])} at batch {batch:,} ({last['bound'][mlp]}-bound)"
        )
    return text + "."


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
    decode_point = _point(decode)
    # A mixture of experts reads only the experts its tokens hit, not every resident weight.
    decode_point["weights_read_ms"] = ms(decode.weight_bytes / rl.peak_bandwidth_bytes_per_s)
    operators = operator_points(rl, prompt_len, batch)
    return {
        "config": {**s.to_dict(), "prompt_len": prompt_len, "batch": batch},
        "prefill": _point(prefill),
        "decode": decode_point,
        "fits": {"weights": plan.weights_fit, "decode": warning is None},
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
        "operators": operators,
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
            stat("weights one decode step reads, at peak bandwidth", fmt(decode_point["weights_read_ms"], "ms")),
            stat("compute per token at peak", fmt(ms(rl.token_compute_time_s), "ms")),
            stat("prefill intensity", fmt(prefill.arithmetic_intensity, "FLOP/B")),
            stat("decode intensity", fmt(decode.arithmetic_intensity, "FLOP/B")),
            stat("ridge", fmt(ridge, "FLOP/B")),
            stat(f"tensor cores idle in a batch-{batch:,} decode step", f"{100 * idle:.1f}%"),
        ],
        "notice": _two_workloads_notice(plan, prompt_len, batch, prefill, decode, idle, warning is None)
        + " "
        + _operators_sentence(operators, batch),
    }


def _two_workloads_notice(
    plan: MemoryPlan, prompt_len: int, batch: int, prefill: StepCost, decode: StepCost, idle: float, decode_fits: bool
) -> str:
    """Lesson 1's note: what fits, where each phase sits against the ridge, and what decode waits on."""
    ratio = prefill.time_s / decode.time_s
    steps = (
        f"{bound_sentence(f'prefill of {prompt_len:,} tokens', prefill)}; "
        f"{bound_sentence(f'a decode step of batch {batch:,}', decode)}"
    )
    if decode.bound == "memory":
        steps += f", and the tensor cores sit idle {100 * idle:.1f}% of it"
    if not plan.weights_fit:
        return (
            f"{plan.model.name}'s weights take {fmt(gb(plan.weight_bytes_per_device))} GB per device and only "
            f"{fmt(gb(plan.usable_bytes))} GB is usable: it does not run here. Were there memory for it, {steps}."
        )
    timing = f"Prefill takes {fmt(ratio)}x as long as one decode step."
    if not decode_fits:
        timing = (
            f"Batch {batch:,} at {prompt_len:,} tokens does not fit the KV cache: the decode step is what it would "
            f"take with enough memory."
        )
    return f"{steps[0].upper()}{steps[1:]}. {timing}"


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
    # The frontier's last point that fits is the memory limit itself, not the power of two below it.
    wall = plan.max_batch(context) if plan.weights_fit else 0
    extra = {b for b in (batch, wall) if 1 <= b <= max(batch, batches[-1])}
    batches = sorted({*batches, *extra})
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
    notice = _batching_notice(rl, batch, context, chosen, one, crossing)
    moe = _moe_streamed(rl, batch, chosen, one)
    if moe is not None:
        notice += " " + moe["sentence"]
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
        "moe": moe,
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


def _batching_notice(rl: Roofline, batch: int, context: int, chosen: StepCost, one: StepCost, crossing: str) -> str:
    """Lesson 2's note: throughput is quoted only for a batch that fits; otherwise for the largest
    one that does, or for none when the weights alone do not fit."""
    plan = rl.memory
    kv_share = 100 * (chosen.kv_read_bytes + chosen.kv_write_bytes) / chosen.total_bytes
    shape = f"KV is {fmt(kv_share)}% of the bytes a batch-{batch:,} step reads; {crossing}"
    if not plan.weights_fit:
        return (
            f"{plan.model.name}'s weights take {fmt(gb(plan.weight_bytes_per_device))} GB per device and only "
            f"{fmt(gb(plan.usable_bytes))} GB is usable: no batch runs here, and the curves are the steps' cost "
            f"were there memory for them. {shape[0].upper()}{shape[1:]}."
        )
    batch_1 = f"batch 1: {fmt(1.0 / one.time_s)} tokens/s"
    if plan.fits(batch, context):
        head = (
            f"batch {batch:,} runs {fmt(batch / chosen.time_s)} tokens/s in total but "
            f"{fmt(1.0 / chosen.time_s)} per user ({batch_1})"
        )
    else:
        wall = plan.max_batch(context)
        if wall:
            at_wall = rl.decode(wall, context)
            head = (
                f"batch {batch:,} does not fit at {context:,} tokens: the KV cache is full at batch {wall:,}, "
                f"which runs {fmt(wall / at_wall.time_s)} tokens/s in total and {fmt(1.0 / at_wall.time_s)} per user "
                f"({batch_1})"
            )
        else:
            head = f"not one sequence of {context:,} tokens fits the KV cache left after the weights ({batch_1})"
    return f"{head}; {shape}."


def _moe_streamed(rl: Roofline, batch: int, chosen: StepCost, one: StepCost) -> dict[str, Any] | None:
    """What a mixture of experts changes in lesson 2: a decode step streams only the experts its
    tokens are routed to, few at batch 1 and nearly all at a large batch, against all the weights
    resident. None for a dense model."""
    m = rl.model
    if not m.is_moe:
        return None
    total_gb, one_gb, chosen_gb = gb(rl.memory.weight_bytes_per_device), gb(one.weight_bytes), gb(chosen.weight_bytes)
    hit_1, hit = rl.experts_hit(1), rl.experts_hit(batch)
    per_layer = f"of its {m.num_experts} experts per MoE layer"
    sentence = (
        f"{m.name} is a mixture of experts: each token runs {m.num_active_experts} {per_layer}, so a batch-1 "
        f"step streams {fmt(one_gb)} of its {fmt(total_gb)} GB of weights ({fmt(hit_1)} experts hit per layer)"
    )
    if batch > 1:
        sentence += (
            f" and a batch-{batch:,} step {fmt(chosen_gb)} GB ({fmt(hit)} experts hit): the weights a step reads "
            f"grow with the batch until every expert is hit"
        )
    return {
        "weights_gb_total": total_gb,
        "weights_gb_batch_1": one_gb,
        "weights_gb": chosen_gb,
        "experts": m.num_experts,
        "experts_hit_batch_1": hit_1,
        "experts_hit": hit,
        "sentence": sentence + ".",
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


# What sets a variant's batch at the TPOT target: the first limit it meets.
BINDS_LABEL = {
    "weights": "weights do not fit",
    "kv": "no sequence fits the KV cache",
    "tpot": "batch 1 misses the TPOT target",
    "kv-full": "KV cache full",
    "tpot-batch": "TPOT target",
}


def capacity_binds(plan: MemoryPlan, max_batch: int, batch_at_target: int) -> str:
    """Which limit sets a variant's batch: the weights, the KV of one sequence, the TPOT target
    at batch 1, the full KV cache (the target would allow more) or the TPOT target."""
    if not plan.weights_fit:
        return "weights"
    if max_batch == 0:
        return "kv"
    if batch_at_target == 0:
        return "tpot"
    return "kv-full" if batch_at_target == max_batch else "tpot-batch"


def _memory_yours(plan: MemoryPlan, pick: dict[str, Any], context: int, tpot_ms: float, batch_1_ms: float) -> str:
    binds = pick["binds"]
    if binds == "weights":
        return (
            f"your choice's weights take {fmt(gb(plan.weight_bytes_per_device))} GB per device and only "
            f"{fmt(gb(plan.usable_bytes))} GB is usable: it does not run, whatever the TPOT target"
        )
    if binds == "kv":
        return (
            f"your choice's weights fit, but not one sequence of {context:,} tokens fits the "
            f"{plan.kv_capacity_tokens:,}-token KV cache left beside them"
        )
    if binds == "tpot":
        return (
            f"your choice fits {pick['max_batch']:,} sequences of {context:,} tokens, but even batch 1 takes "
            f"{fmt(batch_1_ms)} ms a step, over the {fmt(tpot_ms)} ms TPOT target"
        )
    served = (
        f"serves {fmt(pick['tokens_per_s_per_gpu'])} tokens/s per GPU at batch {pick['batch_at_tpot']:,} within "
        f"{fmt(tpot_ms)} ms TPOT"
    )
    if binds == "kv-full":
        return (
            f"your choice {served}: the KV cache is full there ({pick['max_batch']:,} sequences of {context:,} tokens)"
        )
    return (
        f"your choice fits {pick['max_batch']:,} sequences of {context:,} tokens but {served}: the TPOT target "
        f"binds before memory does"
    )


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
            "binds",
            "bar_label",
        )
    }
    for w, k, a in combos:
        model = s.model if a == "gqa" else with_mha(s.model)
        plan = MemoryPlan(model, s.hardware, w, k, s.tp)
        rl = s.roofline(model, w, k)
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
        binds = capacity_binds(plan, max_batch, b)
        variants["binds"].append(binds)
        variants["bar_label"].append(BINDS_LABEL[binds])
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
    batch_1_ms = ms(s.roofline(model).decode(1, context).time_s)
    yours = _memory_yours(plan, pick, context, tpot_ms, batch_1_ms)
    best_label = variants["label"][best].replace("<br>", " · ")
    best_text = (
        f"{best_label} serves the most, {fmt(variants['tokens_per_s_per_gpu'][best])} tokens/s per GPU"
        if variants["tokens_per_s_per_gpu"][best] > 0
        else "no variant serves this context within the target"
    )
    group = s.model.num_heads // s.model.num_kv_heads
    mha = (
        f"Multi-head attention (MHA, one KV head per query head) needs {group}x the KV per token of GQA here."
        if group > 1
        else f"{s.model.name} already has one KV head per query head: GQA and MHA are the same here."
    )
    notice = f"{yours}; {best_text}. {mha}"
    moe = None
    if s.model.is_moe:
        rl = s.roofline(model)
        moe = {
            "weights_gb": gb(plan.weight_bytes_per_device),
            "weights_gb_batch_1": gb(rl.decode(1, context).weight_bytes),
            "active_experts": s.model.num_active_experts,
            "experts": s.model.num_experts,
        }
        notice += (
            f" {s.model.name} is a mixture of experts: all {moe['experts']} experts of every MoE layer stay "
            f"resident ({fmt(moe['weights_gb'])} GB per device), though a batch-1 decode step reads "
            f"{moe['active_experts']} of them per layer ({fmt(moe['weights_gb_batch_1'])} GB)."
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
            stat("what binds", BINDS_LABEL[pick["binds"]]),
        ],
        "batch_1_step_ms": batch_1_ms,
        "moe": moe,
        "notice": notice,
    }
