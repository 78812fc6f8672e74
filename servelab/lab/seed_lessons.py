"""The seed's design claims, each computed by the simulator or the roofline:

- limits (9): "Long prompts cost TTFT and money. Long outputs cost total latency. Put limits on
  both." One heavy-tailed workload simulated without caps, with a prompt cap, with an output cap
  and with both: TTFT and TPOT tails and the GPU time each costs.
- QPS against tokens/s (10): "capacity is measured in tokens per second per GPU at a target
  TPOT, not in QPS." Two workloads at the same request rate and the GPUs each needs.
- token by token (11): "Each new token depends on the previous one." One sequence's decode steps
  as a chain, against the one step that would compute the same tokens were they known.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from servelab.errors import DoesNotFit, InvalidArgument
from servelab.lab.common import Setup, fmt, ms, setup_from, stat
from servelab.lab.limits import bounds
from servelab.lab.params import Params
from servelab.lab.roofline_lessons import batch_at_tpot
from servelab.lab.sim_lessons import _key, _ms_or_none, _percentiles_ms, _setup_from_key, _sim_config, cdf
from servelab.lab.simulations import Budget, result_bytes
from servelab.metrics import steady_state_summary
from servelab.sim import SimResult, simulate
from servelab.workload import RequestSpec, WorkloadSpec

# ---- 9. Put limits on both ------------------------------------------------------------------------

LIMITS_REQUESTS = 400
LIMITS_SIGMA = 1.0  # lognormal spread of both lengths: a heavy tail, a few requests 10-20x the mean
LIMITS_WARMUP_FRACTION = 0.2  # the first fifth of the arrivals fill the system from empty: not measured
VARIANTS = (("none", "no caps"), ("prompt", "prompt cap"), ("output", "output cap"), ("both", "both caps"))


def _heavy_tailed_requests(
    rate: float, prompt_len: int, output_len: int, longest: tuple[int, int], num_requests: int = LIMITS_REQUESTS
) -> list[RequestSpec]:
    """A Poisson stream (seed 0) with lognormal prompt and output lengths of the given means; no
    request is longer than what the deployment accepts with no caps (`longest`: tokens in all, as
    the model's context and one replica's KV cache allow, and in a prompt, as a step that runs
    prompts whole allows), its prompt shortened first."""
    longest_total, longest_prompt = longest
    workload = WorkloadSpec(
        num_requests=num_requests,
        rate=rate,
        input_len=f"lognormal:{prompt_len},{LIMITS_SIGMA}",
        output_len=f"lognormal:{output_len},{LIMITS_SIGMA}",
        seed=0,
    )
    out = []
    for r in workload.generate():
        output = max(2, min(r.output_tokens, longest_total // 2))
        prompt = max(1, min(r.prompt_tokens, longest_total - output, longest_prompt))
        out.append(RequestSpec(r.index, r.arrival_s, prompt, output))
    return out


def _capped(requests: list[RequestSpec], prompt_cap: int | None, output_cap: int | None) -> list[RequestSpec]:
    """The same requests under the caps: prompts cut to `prompt_cap` tokens (as a server that
    truncates, or a client that sends less, would), outputs stopped at `output_cap` (max_tokens)."""
    return [
        RequestSpec(
            r.index,
            r.arrival_s,
            r.prompt_tokens if prompt_cap is None else min(r.prompt_tokens, prompt_cap),
            r.output_tokens if output_cap is None else min(r.output_tokens, output_cap),
        )
        for r in requests
    ]


def _longest_request(s: Setup) -> tuple[int, int]:
    """(tokens a request may hold in all, tokens its prompt may hold) with no caps."""
    from servelab.sim.runner import scheduler_config

    s.memory().require_weights_fit()
    sched = scheduler_config(_sim_config(s))
    total = min(s.model.max_context, sched.num_blocks * sched.block_size - sched.block_size)
    return total, sched.max_num_batched_tokens if sched.policy == "decode-first-whole" else total


def _limits_runs(
    budget: Budget, s_key: tuple, rate: float, prompt_len: int, output_len: int, prompt_cap: int, output_cap: int
) -> dict[str, tuple[list[RequestSpec], SimResult]]:
    s = _setup_from_key(s_key)
    base = _heavy_tailed_requests(rate, prompt_len, output_len, _longest_request(s))
    caps = {
        "none": (None, None),
        "prompt": (prompt_cap, None),
        "output": (None, output_cap),
        "both": (prompt_cap, output_cap),
    }
    budget.require_memory(prompt_tokens=4 * sum(r.prompt_tokens for r in base),
                          output_tokens=4 * sum(r.output_tokens for r in base),
                          inputs="prompt_len or output_len")  # fmt: skip

    def run() -> dict[str, tuple[list[RequestSpec], SimResult]]:
        config = _sim_config(s)
        out = {}
        for name, (pc, oc) in caps.items():
            requests = _capped(base, pc, oc)
            out[name] = (requests, simulate(config, requests, check=budget.check))
        return out

    key = ("limits", s_key, rate, prompt_len, output_len, prompt_cap, output_cap)
    return budget.cached(key, run, lambda runs: result_bytes(r for _, r in runs.values()))


def full_load_gpu_s(s: Setup, requests: list[RequestSpec]) -> tuple[float, int]:
    """The GPU-seconds these requests take with the KV cache full of them, and that batch: as many
    sequences as fit at their mean length (at most the scheduler's cap), each paying its prefill
    alone and its share (1 / batch) of each of its decode steps at its mean context. A rate below
    capacity leaves the GPU idle part of the time; this is what a request costs when it does not."""
    rl = s.roofline()
    mean_tokens = sum(r.prompt_tokens + r.output_tokens for r in requests) / len(requests)
    max_num_seqs = _sim_config(s).scheduler.max_num_seqs
    batch = max(1, min(max_num_seqs, int(rl.memory.kv_capacity_tokens // mean_tokens)))
    prefill_s: dict[int, float] = {}
    total_s = 0.0
    for r in requests:
        if r.prompt_tokens not in prefill_s:
            prefill_s[r.prompt_tokens] = rl.prefill(r.prompt_tokens).time_s
        context = r.prompt_tokens + max(1, r.output_tokens // 2)
        total_s += prefill_s[r.prompt_tokens] + (r.output_tokens - 1) * rl.decode(batch, context).time_s / batch
    return total_s * s.tp, batch


def limits(p: Params, budget: Budget) -> dict[str, Any]:
    s = setup_from(p)
    rate = p.float("rate", 4.0, **bounds("limits", "rate"))
    prompt_len = p.int("prompt_len", 2048, **bounds("limits", "prompt_len"))
    output_len = p.int("output_len", 256, **bounds("limits", "output_len"))
    prompt_cap = p.int("prompt_cap", 4096, **bounds("limits", "prompt_cap"))
    output_cap = p.int("output_cap", 512, **bounds("limits", "output_cap"))
    if prompt_len + output_len > s.model.max_context:
        raise InvalidArgument(
            f"prompt_len + output_len: {prompt_len + output_len:,} tokens exceeds {s.model.name}'s maximum context "
            f"of {s.model.max_context:,} tokens",
            param="prompt_len",
        )
    runs = _limits_runs(budget, _key(s), rate, prompt_len, output_len, prompt_cap, output_cap)
    price = s.hardware.price_per_hour_usd or 2.0
    variants: dict[str, list[Any]] = {k: [] for k in (
        "name", "label", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "e2e_p99_ms",
        "prompt_tokens_mean", "output_tokens_mean", "gpu_s", "full_load_batch", "usd_per_m_output_tokens", "usd_per_k_requests",
        "cut_prompts", "cut_outputs")}  # fmt: skip
    ttft_cdfs = {}
    for name, label in VARIANTS:
        requests, result = runs[name]
        start_s = requests[int(LIMITS_WARMUP_FRACTION * len(requests))].arrival_s or 0.0
        sm = steady_state_summary(result.records, skip_first=0, after_s=start_s)
        assert sm is not None
        measured = [r for r in result.records if r.arrival_s >= start_s and r.success]
        gpu_s, full_batch = full_load_gpu_s(s, requests)
        output_tokens = sum(r.output_tokens for r in requests)
        variants["name"].append(name)
        variants["label"].append(label)
        variants["ttft_p50_ms"].append(_ms_or_none(sm.ttft_s.p50))
        variants["ttft_p99_ms"].append(_ms_or_none(sm.ttft_s.p99))
        variants["tpot_p50_ms"].append(_ms_or_none(sm.tpot_s.p50))
        variants["tpot_p99_ms"].append(_ms_or_none(sm.tpot_s.p99))
        variants["e2e_p99_ms"].append(_ms_or_none(sm.e2e_s.p99))
        variants["prompt_tokens_mean"].append(sum(r.prompt_tokens for r in requests) / len(requests))
        variants["output_tokens_mean"].append(output_tokens / len(requests))
        variants["gpu_s"].append(gpu_s)
        variants["full_load_batch"].append(full_batch)
        variants["usd_per_m_output_tokens"].append(gpu_s * price / 3600.0 / output_tokens * 1e6)
        variants["usd_per_k_requests"].append(gpu_s * price / 3600.0 / len(requests) * 1e3)
        base = runs["none"][0]
        variants["cut_prompts"].append(sum(a.prompt_tokens != b.prompt_tokens for a, b in zip(base, requests)))
        variants["cut_outputs"].append(sum(a.output_tokens != b.output_tokens for a, b in zip(base, requests)))
        ttft_cdfs[name] = {**cdf([r.ttft_s for r in measured if r.ttft_s is not None]), "label": label,
                           "percentiles": _percentiles_ms(sm.ttft_s)}  # fmt: skip
    base_prompts = [float(r.prompt_tokens) for r in runs["none"][0]]
    base_outputs = [float(r.output_tokens) for r in runs["none"][0]]
    v = variants
    return {
        "config": {
            **s.to_dict(),
            "rate": rate,
            "prompt_len": prompt_len,
            "output_len": output_len,
            "prompt_cap": prompt_cap,
            "output_cap": output_cap,
            "num_requests": LIMITS_REQUESTS,
            "price_per_gpu_hour": price,
        },  # fmt: skip
        "variants": variants,
        "ttft_ms": ttft_cdfs,
        "lengths": {"prompt": cdf(base_prompts, scale=1.0), "output": cdf(base_outputs, scale=1.0)},
        "stats": [
            stat("requests cut by the prompt cap", f"{v['cut_prompts'][1]:,} of {LIMITS_REQUESTS:,}"),
            stat("requests cut by the output cap", f"{v['cut_outputs'][2]:,} of {LIMITS_REQUESTS:,}"),
            stat("p99 TTFT: no caps / both", f"{fmt(v['ttft_p99_ms'][0])} / {fmt(v['ttft_p99_ms'][3])} ms"),
            stat("p99 TPOT: no caps / both", f"{fmt(v['tpot_p99_ms'][0])} / {fmt(v['tpot_p99_ms'][3])} ms"),
            stat("p99 end to end: no caps / both", f"{fmt(v['e2e_p99_ms'][0])} / {fmt(v['e2e_p99_ms'][3])} ms"),
            stat(
                "$ per 1,000 requests at full load: no caps / both",
                f"${fmt(v['usd_per_k_requests'][0])} / ${fmt(v['usd_per_k_requests'][3])}",
            ),  # fmt: skip
            stat("price", f"${fmt(price)} per GPU-hour"),
        ],
        "notice": _limits_notice(variants, prompt_cap, output_cap),
    }


def _change(before: float | None, after: float | None) -> str:
    """'from 810 to 240 ms' with the direction named; 'unchanged' within 1%."""
    if before is None or after is None:
        return "n/a"
    if abs(after - before) <= 0.01 * before:
        return f"unchanged at {fmt(before)} ms"
    return f"{'down' if after < before else 'up'} from {fmt(before)} to {fmt(after)} ms"


def _limits_notice(v: dict[str, list[Any]], prompt_cap: int, output_cap: int) -> str:
    """What each cap does to the tails and to the money, read from the four runs."""
    none, prompt, output, both = range(4)
    parts = []
    if v["cut_prompts"][prompt]:
        parts.append(
            f"Capping prompts at {prompt_cap:,} tokens cuts {v['cut_prompts'][prompt]:,} of them: p99 TTFT "
            f"{_change(v['ttft_p99_ms'][none], v['ttft_p99_ms'][prompt])}, and $ per 1,000 requests at full load from "
            f"${fmt(v['usd_per_k_requests'][none])} to ${fmt(v['usd_per_k_requests'][prompt])}."
        )
    else:
        parts.append(f"No prompt is longer than {prompt_cap:,} tokens: the prompt cap changes nothing here.")
    if v["cut_outputs"][output]:
        parts.append(
            f"Capping outputs at {output_cap:,} tokens cuts {v['cut_outputs'][output]:,}: p99 end to end "
            f"{_change(v['e2e_p99_ms'][none], v['e2e_p99_ms'][output])}, p99 TPOT "
            f"{_change(v['tpot_p99_ms'][none], v['tpot_p99_ms'][output])}."
        )
    else:
        parts.append(f"No output is longer than {output_cap:,} tokens: the output cap changes nothing here.")
    parts.append(
        f"With both, p99 TTFT is {fmt(v['ttft_p99_ms'][both])} ms and p99 TPOT {fmt(v['tpot_p99_ms'][both])} ms, "
        f"at ${fmt(v['usd_per_m_output_tokens'][both])} per million output tokens at full load against "
        f"${fmt(v['usd_per_m_output_tokens'][none])} without caps."
    )
    return " ".join(parts)


# ---- 10. Capacity in tokens/s, not QPS -----------------------------------------------------------


def _workload_need(s: Setup, qps: float, prompt_len: int, output_len: int, tpot_s: float) -> dict[str, Any]:
    """What `qps` requests per second of one shape need: the largest decode batch meeting the
    TPOT target that fits the KV cache at the mean context, a request's GPU time at that batch
    (its prefill alone, plus its share of each decode step), and the GPUs that adds up to."""
    rl = s.roofline()
    plan = rl.memory
    context = prompt_len + output_len // 2
    max_batch = plan.max_batch(prompt_len + output_len) if plan.weights_fit else 0
    batch = batch_at_tpot(rl, context, max_batch, tpot_s)
    if batch == 0:
        return {"batch": 0, "fits": False}
    prefill_s = rl.prefill(prompt_len).time_s
    step_s = rl.decode(batch, context).time_s
    request_s = prefill_s + (output_len - 1) * step_s / batch
    replicas = qps * request_s
    return {
        "batch": batch,
        "fits": True,
        "step_ms": ms(step_s),
        "prefill_ms": ms(prefill_s),
        "gpu_s_per_request": request_s * s.tp,
        "gpus": replicas * s.tp,
        "gpus_whole": math.ceil(replicas - 1e-9) * s.tp,
        "prompt_tokens_per_s": qps * prompt_len,
        "output_tokens_per_s": qps * output_len,
        "tokens_per_s": qps * (prompt_len + output_len),
        # Capacity as the seed defines it: output tokens/s per GPU at the target, and the QPS it is.
        "output_tokens_per_s_per_gpu": output_len / (request_s * s.tp),
        "qps_per_gpu": 1.0 / (request_s * s.tp),
    }


def qps_vs_tokens(p: Params) -> dict[str, Any]:
    s = setup_from(p)
    qps = p.float("qps", 10.0, **bounds("qps-vs-tokens", "qps"))
    tpot_ms = p.float("tpot_ms", 50.0, **bounds("qps-vs-tokens", "tpot_ms"))
    shapes = {}
    for name in ("a", "b"):
        prompt = p.int(
            f"{name}_prompt_len", 256 if name == "a" else 8192, **bounds("qps-vs-tokens", f"{name}_prompt_len")
        )
        output = p.int(
            f"{name}_output_len", 128 if name == "a" else 512, **bounds("qps-vs-tokens", f"{name}_output_len")
        )
        if prompt + output > s.model.max_context:
            raise InvalidArgument(
                f"{name}_prompt_len + {name}_output_len: {prompt + output:,} tokens exceeds {s.model.name}'s maximum "
                f"context of {s.model.max_context:,} tokens",
                param=f"{name}_prompt_len",
            )
        shapes[name] = (prompt, output)
    plan = s.memory()
    if not plan.weights_fit:
        plan.require_weights_fit()  # a DoesNotFit: the page shades every chart with the limit named
    needs = {name: _workload_need(s, qps, *shape, tpot_ms / 1e3) for name, shape in shapes.items()}
    for name, need in needs.items():
        if not need["fits"]:
            prompt, output = shapes[name]
            raise DoesNotFit(
                f"{plan.describe()}: workload {name.upper()} ({prompt:,} + {output:,} tokens) cannot meet a "
                f"{fmt(tpot_ms)} ms TPOT even at batch 1, or one sequence does not fit the KV cache; raise tpot_ms, "
                f"shorten it, or use a bigger accelerator"
            )
    labels = {name: f"{name.upper()}: {shapes[name][0]:,} in + {shapes[name][1]:,} out" for name in shapes}
    sweep_qps = [q for q in (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if q <= max(1000.0, qps)]
    if qps not in sweep_qps:
        sweep_qps = sorted([*sweep_qps, qps])
    a, b = needs["a"], needs["b"]
    ratio_gpus = b["gpus"] / a["gpus"]
    ratio_tokens = b["tokens_per_s"] / a["tokens_per_s"]
    return {
        "config": {
            **s.to_dict(),
            "qps": qps,
            "tpot_ms": tpot_ms,
            **{f"{n}_{k}": v for n, (pl, ol) in shapes.items() for k, v in (("prompt_len", pl), ("output_len", ol))},
        },  # fmt: skip
        "workloads": {
            name: {**needs[name], "label": labels[name], "prompt_len": shapes[name][0], "output_len": shapes[name][1]}
            for name in shapes
        },  # fmt: skip
        "sweep": {
            "qps": sweep_qps,
            **{
                f"gpus_{name}": [
                    math.ceil(q * needs[name]["gpu_s_per_request"] / s.tp - 1e-9) * s.tp for q in sweep_qps
                ]
                for name in shapes
            },  # fmt: skip
        },
        "stats": [
            stat("same request rate", f"{fmt(qps)} req/s"),
            stat(f"GPUs: {labels['a']}", f"{a['gpus_whole']:,} ({fmt(a['gpus'])})"),
            stat(f"GPUs: {labels['b']}", f"{b['gpus_whole']:,} ({fmt(b['gpus'])})"),
            stat("tokens/s: A / B", f"{fmt(a['tokens_per_s'])} / {fmt(b['tokens_per_s'])}"),
            stat("req/s per GPU: A / B", f"{fmt(a['qps_per_gpu'])} / {fmt(b['qps_per_gpu'])}"),
            stat(
                "output tokens/s per GPU at the target: A / B",
                f"{fmt(a['output_tokens_per_s_per_gpu'])} / {fmt(b['output_tokens_per_s_per_gpu'])}",
            ),  # fmt: skip
        ],
        "notice": (
            f"Both workloads arrive at {fmt(qps)} req/s, yet B moves {fmt(ratio_tokens)}x the tokens per second of A and "
            f"needs {fmt(ratio_gpus)}x the GPUs ({fmt(b['gpus'])} against {fmt(a['gpus'])}) at a {fmt(tpot_ms)} ms TPOT: "
            f"one GPU serves {fmt(a['qps_per_gpu'])} req/s of A but {fmt(b['qps_per_gpu'])} of B. A QPS figure says "
            f"nothing until the tokens per request are known."
        ),
    }


# ---- 11. Token by token ------------------------------------------------------------------------


def _chain_requests(s: Setup, prompt_len: int, output_len: int, batch: int) -> tuple[list[RequestSpec], float]:
    """`batch - 1` other sequences start at t = 0 and keep decoding past the end of the traced one,
    which arrives once they are decoding: its every step runs at the chosen batch."""
    rl = s.roofline()
    step_s = rl.decode(batch, prompt_len + output_len).time_s
    others = batch - 1
    arrival_s = (2 * rl.prefill(prompt_len, others).time_s + 4 * step_s) if others else 0.0
    busy_s = arrival_s + rl.prefill(prompt_len).time_s + 1.5 * output_len * step_s
    others_output = math.ceil(busy_s / rl.decode(batch, prompt_len).time_s) + 8
    if others and prompt_len + others_output > s.model.max_context:
        raise InvalidArgument(
            f"prompt_len: the other {others} sequences must keep decoding ({others_output:,} tokens each) through "
            f"the traced one's steps, past {s.model.name}'s context of {s.model.max_context:,} tokens at a "
            f"{prompt_len:,}-token prompt: lower prompt_len or output_len",
            param="prompt_len",
        )
    requests = [RequestSpec(i, 0.0, prompt_len, others_output) for i in range(others)]
    return [*requests, RequestSpec(others, arrival_s, prompt_len, output_len)], arrival_s


def decode_chain(p: Params, budget: Budget) -> dict[str, Any]:
    s = setup_from(p)
    prompt_len = p.int("prompt_len", 1024, **bounds("decode-chain", "prompt_len"))
    output_len = p.int("output_len", 32, **bounds("decode-chain", "output_len"))
    batch = p.int("batch", 8, **bounds("decode-chain", "batch"))
    if prompt_len + output_len > s.model.max_context:
        raise InvalidArgument(
            f"prompt_len + output_len: {prompt_len + output_len:,} tokens exceeds {s.model.name}'s maximum context "
            f"of {s.model.max_context:,} tokens",
            param="prompt_len",
        )
    plan = s.memory()
    plan.require_weights_fit()
    requests, arrival_s = _chain_requests(s, prompt_len, output_len, batch)
    need = sum(r.prompt_tokens + r.output_tokens for r in requests)
    if need > plan.kv_capacity_tokens:
        raise DoesNotFit(
            f"{plan.describe()}: {batch:,} sequences of {prompt_len:,} tokens decoding together need {need:,} tokens "
            f"of KV cache, but {plan.kv_capacity_tokens:,} fit after the weights; lower batch or prompt_len"
        )
    budget.require_memory(prompt_tokens=sum(r.prompt_tokens for r in requests),
                          output_tokens=sum(r.output_tokens for r in requests), inputs="batch or output_len")  # fmt: skip

    def run() -> SimResult:
        config = _sim_config(s, scheduler={"max_num_seqs": max(256, batch), "enable_prefix_caching": False})
        return simulate(config, requests, concurrency=len(requests), check=budget.check)

    result = budget.cached(("decode-chain", _key(s), prompt_len, output_len, batch), run, lambda r: result_bytes([r]))
    traced = next(r for r in result.records if r.request_id == str(batch - 1))
    times_s = np.asarray(traced.token_times_s, dtype=np.float64)
    sent_s = traced.arrival_s
    # Each token's step: from the previous token (the prompt's arrival for the first) to its own.
    step_ms = (np.diff(np.concatenate([[sent_s], times_s])) * 1e3).tolist()
    rl = s.roofline()
    # Were the tokens known (a prompt, or a draft to verify), one step would compute them all.
    together = rl.step([(output_len, prompt_len + output_len)])
    decode_ms = float(sum(step_ms[1:]))
    steps = len(step_ms) - 1
    notice = (
        f"Each of the {steps:,} decode steps waits for the token before it: tokens 2 to {len(step_ms):,} take "
        f"{fmt(decode_ms)} ms at batch {batch:,}, {fmt(decode_ms / max(1, steps))} ms a step. Were the same "
        f"{output_len:,} tokens known in advance, one step would compute them all in {fmt(ms(together.time_s))} ms"
    )
    notice += ": the dependency, not the arithmetic, sets the time." if decode_ms > 2 * ms(together.time_s) else "."
    return {
        "config": {**s.to_dict(), "prompt_len": prompt_len, "output_len": output_len, "batch": batch},
        "chain": {
            "token": list(range(1, len(times_s) + 1)),
            "time_ms": ((times_s - sent_s) * 1e3).tolist(),
            "step_ms": step_ms,
        },
        "ttft_ms": step_ms[0],
        "decode_ms": decode_ms,
        "one_step_ms": ms(together.time_s),
        "stats": [
            stat("TTFT (prefill, then token 1)", fmt(step_ms[0], "ms")),
            stat("decode steps, one after another", f"{len(step_ms) - 1:,}"),
            stat("time for tokens 2 to N", fmt(decode_ms, "ms")),
            stat("mean step (TPOT)", fmt(decode_ms / max(1, len(step_ms) - 1), "ms")),
            stat(f"one step for {output_len:,} known tokens", fmt(ms(together.time_s), "ms")),
        ],
        "notice": notice,
    }
