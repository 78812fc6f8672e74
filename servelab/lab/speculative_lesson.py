"""Lesson 12, spending the idle FLOPs: speculative decoding's speedup against the batch size and
the acceptance rate, and the batch where it stops paying.

Every figure comes from the code the CLI runs: the curves from `servelab.cost.speculative`
(`servelab roofline --speculative-config`), the points from `compare_speculation`
(`servelab sim --compare-speculation`). Under `servelab serve` the lesson also reads the running
server's spec-decode counters (vLLM's names, `vllm:` or `servelab:`) and prices the acceptance
they measured on the same curve. It measures no speedup: that needs the server run twice, with and
without speculation, which the lab cannot do from a page.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from servelab.core.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from servelab.cost.roofline import Roofline
from servelab.cost.speculative import (
    Acceptance,
    SpeculativeCost,
    draft_cost,
    draft_model_spec,
    expected_tokens_iid,
    kv_tokens_beside_draft,
)
from servelab.errors import DoesNotFit, InvalidArgument
from servelab.lab.common import DEFAULT_HARDWARE, Setup, fmt, powers_of_two, setup_from, stat
from servelab.lab.limits import LESSON_DEFAULTS, bounds
from servelab.lab.params import Params
from servelab.lab.simulations import Budget
from servelab.spec import HARDWARE, MODELS, HardwareSpec, get_hardware

if TYPE_CHECKING:
    from servelab.sim.speculation_sweep import ComparedLevel

LESSON = "speculative"
CURVE_ALPHAS = (0.5, 0.7, 0.9)  # drawn beside the chosen acceptance, so its effect on the crossover shows
MAX_CURVE_BATCH = 4096  # the chart's right edge and the crossover search's ceiling
# The simulated concurrencies: five requests per client per level, with and without speculation.
# At 64 clients and 128 output tokens that is ~0.6 s of simulation on one core; 256 would be ~3 s.
SIM_CONCURRENCIES = (1, 4, 16, 64)
# The lab's CPU: the shipped hardware file for a generic 8-core AVX2 host (`--hardware generic-cpu.json`).
CPU_HARDWARE = "generic-cpu"
DEFAULTS = LESSON_DEFAULTS[LESSON]
DEFAULT_METHOD = DEFAULTS["method"]

EngineMetrics = Callable[[], "Mapping[str, Any] | str"]


def hardware_choices() -> list[str]:
    return [*HARDWARE, CPU_HARDWARE]


def method_choices() -> list[str]:
    return ["ngram", *MODELS]


def _hardware(name: str) -> HardwareSpec:
    return get_hardware(f"{name}.json" if name == CPU_HARDWARE else name)


def _setup(p: Params) -> Setup:
    """The shared controls, with the lab's CPU among the accelerators."""
    hardware = p.choice("hardware", DEFAULT_HARDWARE, hardware_choices())
    rest = setup_from(Params({k: v for k, v in p.items() if k != "hardware"}))
    return dataclasses.replace(rest, hardware=_hardware(hardware))


def _speculative_config(p: Params, s: Setup) -> SpeculativeConfig:
    method = p.choice("method", DEFAULT_METHOD, method_choices())
    k = p.int("num_speculative_tokens", DEFAULTS["num_speculative_tokens"], **bounds(LESSON, "num_speculative_tokens"))
    if method == "ngram":
        return SpeculativeConfig("ngram", k)
    draft = MODELS[method]
    if draft.num_params >= s.model.num_params:
        smaller = [m.name for m in MODELS.values() if m.num_params < s.model.num_params]
        raise InvalidArgument(
            f"method: the draft model {method} ({draft.num_params / 1e9:.2g}B parameters) is not smaller than the "
            f"target {s.model.name} ({s.model.num_params / 1e9:.2g}B); choose ngram"
            + (f" or one of {', '.join(smaller)}" if smaller else ""),
            param="method",
        )
    return SpeculativeConfig("draft_model", k, model=method)


def _acceptance(p: Params, k: int) -> Acceptance:
    """The chosen acceptance: a rate, or (when given) per-position rates, e.g. "0.9,0.8,0.7,0.6"."""
    alpha = p.float("acceptance", DEFAULTS["acceptance"], **bounds(LESSON, "acceptance"))
    raw = str(dict(p.items()).get("acceptance_per_position") or "").strip()
    if not raw:
        return Acceptance.rate(alpha, k, param="acceptance")
    try:
        rates = tuple(float(x) for x in raw.split(","))
    except ValueError:
        rates = ()
    if not rates or not all(0.0 <= a <= 1.0 for a in rates):
        raise InvalidArgument(
            f"acceptance_per_position: expected comma-separated rates in [0, 1], one per draft position, got {raw!r}",
            param="acceptance_per_position",
        )
    if len(rates) < k:
        raise InvalidArgument(
            f"acceptance_per_position: {len(rates)} rate(s), fewer than num_speculative_tokens = {k}",
            param="acceptance_per_position",
        )
    return Acceptance(rates[:k], f"per position {', '.join(f'{a:g}' for a in rates[:k])}")


def _curve(cost: SpeculativeCost, batches: list[int], context: int, label: str) -> dict[str, Any]:
    rows = cost.rows(batches, context)
    return {
        "label": label,
        "acceptance": cost.acceptance.to_dict(),
        "batch": batches,
        "speedup": [r.speedup for r in rows],
        "plain_tpot_ms": [r.plain_tpot_s * 1e3 for r in rows],
        "spec_tpot_ms": [r.spec_tpot_s * 1e3 for r in rows],
        "crossover_batch": cost.crossover_batch(context, limit=MAX_CURVE_BATCH),
    }


def _why_it_stops(cost: SpeculativeCost, rl: Roofline, crossover: int, context: int) -> str:
    """What ends the gain at the crossover, from the verification step's own terms."""
    k = cost.k
    verify = rl.step([(k + 1, context + k)] * crossover)
    row = cost.row(crossover, context)
    if verify.bound == "compute":
        return (
            f"there the verification of {crossover:,} x {k + 1} tokens is compute-bound ({fmt(verify.compute_time_s * 1e3)} "
            f"ms of FLOPs against {fmt(verify.memory_time_s * 1e3)} ms of reads): the extra FLOPs have met the compute "
            "roof, so the drafts' positions are no longer free"
        )
    return (
        f"there the verification is still memory-bound ({fmt(verify.memory_time_s * 1e3)} ms of reads), but it and "
        f"the draft step ({fmt(row.draft_step_s * 1e3)} ms) cost more than the {fmt(row.tokens_per_step)} tokens "
        "per sequence they return"
    )


def _sim_levels(
    budget: Budget,
    s: Setup,
    config: SpeculativeConfig,
    acceptance: Acceptance,
    concurrencies: list[int],
    prompt_len: int,
    output_len: int,
) -> list[ComparedLevel]:
    most = 5 * max(concurrencies)  # compare_speculation's requests at its largest level
    budget.require_memory(
        prompt_tokens=most * prompt_len, output_tokens=most * output_len, inputs="prompt_len or output_len"
    )
    from servelab.sim.runner import engine_sim_config
    from servelab.sim.speculation_sweep import compare_speculation
    from servelab.workload import WorkloadSpec

    def run() -> list[ComparedLevel]:
        sim_config = engine_sim_config(
            s.engine_profile,
            model=s.model,
            hardware=s.hardware,
            tp=s.tp,
            weight_dtype=s.weight_dtype,
            kv_cache_dtype=s.kv_dtype,
            speculative=config,
            spec_acceptance=acceptance,
        )
        workload = WorkloadSpec(num_requests=1, input_len=str(prompt_len), output_len=str(output_len), seed=0)
        return compare_speculation(sim_config, workload, concurrencies, check=budget.check)

    key = (
        LESSON,
        s.model.name,
        s.hardware.name,
        s.weight_dtype,
        s.kv_dtype,
        s.tp,
        s.engine_profile,
        config.to_json(),
        acceptance.per_position,
        tuple(concurrencies),
        prompt_len,
        output_len,
    )
    # A level keeps two summaries, no records: a few kB each.
    return budget.cached(key, run, lambda levels: 4096 * len(levels))


def _fit_iid_alpha(mean_accepted: float, k: int) -> float:
    """The per-token rate α whose K drafts accept `mean_accepted` tokens in expectation."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if expected_tokens_iid(mid, k) - 1.0 < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def measured_acceptance(engine_metrics: EngineMetrics | None) -> tuple[Acceptance | None, dict[str, Any]]:
    """The acceptance the lab's own server counted so far, and what the page says about it."""
    if engine_metrics is None:
        return None, {
            "available": False,
            "status": "not attached to a server",
            "why": "the lab is not running inside `servelab serve`: open a server's "
            "/lab/ (one started with --speculative-config) to overlay its measured acceptance",
        }
    from servelab.bench.spec_decode import parse_counters

    try:
        text = engine_metrics()
    except Exception as exc:  # the engine may be starting or stopping; the lesson still answers
        return None, {
            "available": False,
            "status": "metrics unavailable",
            "why": f"the server's metrics are unavailable: {exc}",
        }
    counters = parse_counters(text) if isinstance(text, str) else None
    if counters is None or counters.num_drafts < 1:
        return None, {
            "available": False,
            "status": "no spec-decode counters",
            "why": "the server exports no speculative-decoding counters "
            "(spec_decode_num_drafts_total ...) or has verified no drafts yet: start it with "
            "--speculative-config and send it some load",
        }
    drafts = round(counters.num_drafts)
    per_position = [round(x) for x in counters.accepted_per_position]
    if per_position:
        try:
            acceptance = Acceptance.from_counts(drafts, per_position, "your server's spec-decode counters")
        except InvalidArgument as exc:  # the server's numbers, not the reader's input: say so, answer the rest
            return None, {"available": False, "status": "counters inconsistent", "why": exc.message}
        how = "by draft position"
    else:
        k = max(1, min(MAX_SPECULATIVE_TOKENS, round(counters.num_draft_tokens / drafts)))
        alpha = _fit_iid_alpha(counters.num_accepted_tokens / drafts, k)
        acceptance = Acceptance((alpha,) * k, f"your server's counters, fitted as a rate {alpha:.3f} per draft token")
        how = "as one rate (the server exports no per-position counts)"
    return acceptance, {
        "available": True,
        "status": f"{acceptance.draft_acceptance_rate:.0%} of drafts accepted, "
        f"{acceptance.expected_tokens():.2f} tokens per verification",
        "num_drafts": drafts,
        "num_draft_tokens": round(counters.num_draft_tokens),
        "num_accepted_tokens": round(counters.num_accepted_tokens),
        "num_speculative_tokens": acceptance.k,
        "how": how,
        **acceptance.to_dict(),
    }


def _no_fit(s: Setup, exc: DoesNotFit, config: dict[str, Any]) -> dict[str, Any]:
    # The shared `does_not_fit` rebuilds the setup from the catalog, which has no CPU entry.
    _, _, detail = exc.message.partition(": ")
    return {
        "config": config,
        "no_fit": {"label": "does not fit: " + (detail or exc.message).split(";")[0]},
        "warning": exc.message,
        "stats": [],
        "notice": f"{s.model.name} cannot run this lesson on {s.hardware.name} as configured; the warning says "
        "what to change.",
    }


def speculative(p: Params, budget: Budget, engine_metrics: EngineMetrics | None = None) -> dict[str, Any]:
    s = _setup(p)
    spec = _speculative_config(p, s)
    acceptance = _acceptance(p, spec.num_speculative_tokens)
    prompt_len = p.int("prompt_len", DEFAULTS["prompt_len"], **bounds(LESSON, "prompt_len"))
    output_len = p.int("output_len", DEFAULTS["output_len"], **bounds(LESSON, "output_len"))
    k = spec.num_speculative_tokens
    if prompt_len + output_len + k > s.model.max_context:
        raise InvalidArgument(
            f"prompt_len + output_len: {prompt_len + output_len:,} tokens plus {k} drafts exceed {s.model.name}'s "
            f"maximum context of {s.model.max_context:,} tokens",
            param="prompt_len",
        )
    context = prompt_len + output_len // 2  # a steady decode batch's mean context, as `sim --compare-speculation`
    config = {
        **s.to_dict(),
        "hardware": s.hardware.name,
        "speculative_config": spec.to_json(),
        "acceptance_source": acceptance.source,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "context": context,
    }
    rl = s.roofline()
    draft = draft_cost(spec, rl.hardware, rl.weight_dtype, rl.kv_dtype, rl.tp)
    try:
        rl.memory.require_weights_fit()
        draft_spec = draft_model_spec(spec)
        memory_batch = kv_tokens_beside_draft(rl.memory, draft_spec) // context
        if memory_batch < 1:
            raise DoesNotFit(
                f"{rl.memory.describe()}: not one sequence of {context:,} tokens fits beside the weights"
                + (f" and the draft model {draft_spec.name}'s weights and KV" if draft_spec else "")
                + "; lower prompt_len or output_len, or use ngram, fp8 KV, a larger tp or a bigger accelerator"
            )
    except DoesNotFit as exc:
        return _no_fit(s, exc, config)

    batches = powers_of_two(1, MAX_CURVE_BATCH)
    chosen = SpeculativeCost(rl, draft, acceptance)
    chosen_alpha = acceptance.per_position[0] if len(set(acceptance.per_position)) == 1 else None
    curves = []
    for alpha in sorted({*CURVE_ALPHAS, *([chosen_alpha] if chosen_alpha is not None else [])}):
        cost = chosen if alpha == chosen_alpha else SpeculativeCost(rl, draft, Acceptance.rate(alpha, k))
        curve = _curve(cost, batches, context, f"α = {alpha:g}")
        curve["alpha"], curve["chosen"] = alpha, alpha == chosen_alpha
        curves.append(curve)
    if chosen_alpha is None:
        curve = _curve(chosen, batches, context, f"your profile ({acceptance.source})")
        curve["alpha"], curve["chosen"] = None, True
        curves.append(curve)
    mine = next(c for c in curves if c["chosen"])

    measured, measured_info = measured_acceptance(engine_metrics)
    if measured is not None:
        m_spec = dataclasses.replace(spec, num_speculative_tokens=measured.k)
        m_cost = SpeculativeCost(rl, draft_cost(m_spec, rl.hardware, rl.weight_dtype, rl.kv_dtype, rl.tp), measured)
        measured_info["curve"] = _curve(
            m_cost, batches, context, f"your server's measured acceptance (K = {measured.k}), predicted"
        )
        measured_info["curve"]["priced_as"] = m_spec.to_json()

    # The simulator (the scheduler, numpy-heavy metrics) loads on first use, as for the other simulated lessons.
    from servelab.sim.runner import engine_sim_config
    from servelab.sim.speculation_sweep import crossover_concurrency

    max_num_seqs = engine_sim_config(
        s.engine_profile,
        model=s.model,
        hardware=s.hardware,
        tp=s.tp,
        weight_dtype=s.weight_dtype,
        kv_cache_dtype=s.kv_dtype,
    ).scheduler.max_num_seqs
    concurrencies = [c for c in SIM_CONCURRENCIES if c <= min(max_num_seqs, memory_batch)] or [1]
    levels = _sim_levels(budget, s, spec, acceptance, concurrencies, prompt_len, output_len)
    sim_crossover = crossover_concurrency(levels)

    first = chosen.row(1, context)
    crossover = mine["crossover_batch"]
    notice = _notice(
        s, spec, acceptance, chosen, rl, first, crossover, memory_batch, curves, levels, sim_crossover, context
    )
    if measured is not None:
        mc = measured_info["curve"]
        notice += (
            f" Your server's counters measured {measured_info['draft_acceptance_rate']:.0%} of its drafts accepted "
            f"({measured_info['expected_tokens_per_verification']:.2f} tokens per verification); at that acceptance "
            f"the roofline predicts {fmt(mc['speedup'][0])}x at batch 1 here and a crossover at "
            f"{_crossover_text(mc['crossover_batch'])} (predicted: measuring the speedup needs the server run with "
            "and without speculation)."
        )
    return {
        "config": {
            **config,
            "sim_concurrencies": concurrencies,
            "sim_requests_per_level": [5 * c for c in concurrencies],
        },
        "curves": curves,
        "limits": {
            "memory": {
                "batch": memory_batch,
                "label": f"KV full: batch > {memory_batch:,} does not fit at {context:,} tokens"
                + (" beside the draft model" if draft.draft_model is not None else ""),
            }
        },
        "sim": {
            "levels": [level.to_dict() for level in levels],
            "crossover_concurrency": sim_crossover,
            "label": f"simulated ({acceptance.source})",
        },
        "measured": measured_info,
        "stats": [
            stat("speedup at batch 1", fmt(first.speedup, "x")),
            stat(
                "TPOT at batch 1, plain / speculative",
                f"{fmt(first.plain_tpot_s * 1e3)} / {fmt(first.spec_tpot_s * 1e3)} ms",
            ),
            stat("tokens per verification", fmt(first.tokens_per_step)),
            stat(
                "crossover (roofline)",
                f"none up to {MAX_CURVE_BATCH:,}" if crossover is None else f"batch {crossover:,}",
            ),
            stat(
                "crossover (simulator)",
                f"none up to {concurrencies[-1]}" if sim_crossover is None else f"concurrency {sim_crossover}",
            ),
            stat("memory limit", f"batch {memory_batch:,}"),
            stat("your server (measured)", measured_info["status"]),
        ],
        "notice": notice,
    }


def _notice(
    s: Setup,
    spec: SpeculativeConfig,
    acceptance: Acceptance,
    chosen: SpeculativeCost,
    rl: Roofline,
    first: Any,
    crossover: int | None,
    memory_batch: int,
    curves: list[dict[str, Any]],
    levels: list[ComparedLevel],
    sim_crossover: int | None,
    context: int,
) -> str:
    what = "prompt lookup" if spec.method == "ngram" else f"the draft model {spec.model}"
    if first.speedup >= 1.0:
        head = (
            f"On {s.hardware.name}, {what} with K = {spec.num_speculative_tokens} makes each user "
            f"{fmt(first.speedup)}x faster at batch 1 ({fmt(first.plain_tpot_s * 1e3)} -> "
            f"{fmt(first.spec_tpot_s * 1e3)} ms per token, {fmt(first.tokens_per_step)} tokens per verification)."
        )
    else:
        head = (
            f"On {s.hardware.name}, {what} with K = {spec.num_speculative_tokens} is slower even at batch 1 "
            f"({fmt(first.speedup)}x): {fmt(first.tokens_per_step)} tokens per verification do not cover its cost."
        )
    if crossover is None:
        stop = f" It still pays at batch {MAX_CURVE_BATCH:,} (the memory limit is batch {memory_batch:,})."
    elif crossover > 1:
        where = "within" if crossover <= memory_batch else "beyond"
        stop = (
            f" It stops paying from batch {crossover:,} ({where} the memory limit of batch {memory_batch:,}): "
            + _why_it_stops(chosen, rl, crossover, context)
            + "."
        )
    else:
        stop = ""
    moves = ", ".join(
        f"{_crossover_text(c['crossover_batch'])} at α = {c['alpha']:g}" for c in curves if c["alpha"] is not None
    )
    alpha_text = f" Crossover batch by acceptance: {moves}."
    c1 = levels[0]
    sim = f" The simulator (the engine's scheduler) finds {fmt(c1.speedup)}x at concurrency {c1.concurrency}"
    if sim_crossover is None:
        sim += f" and speculation still pays at concurrency {levels[-1].concurrency}."
    else:
        at = next(level for level in levels if level.concurrency == sim_crossover)
        why = (
            f"each user's TPOT is {fmt(at.speedup)}x"
            if at.speedup < 1.0
            else f"TPOT is still {fmt(at.speedup)}x but the total tokens/s falls to {fmt(at.throughput_ratio)}x"
        )
        sim += f"; from concurrency {sim_crossover} it stops paying: {why} of plain decoding's."
    return head + stop + alpha_text + sim


def _crossover_text(batch: int | None) -> str:
    if batch is None:
        return f"none up to batch {MAX_CURVE_BATCH:,}"
    return "never pays" if batch == 1 else f"batch {batch:,}"
