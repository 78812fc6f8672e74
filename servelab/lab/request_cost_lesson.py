"""Lesson 8: what one request costs, in time and in money, from the roofline.

Latency: TTFT is the prompt's prefill; every further token is one decode step of the batch, so a
request's end-to-end time grows with its output length. Money: the GPU-seconds a request takes
are its prefill (alone on the GPU) plus its share (1 / batch) of every decode step it rides in;
longer prompts cost more prefill, more KV read per step, and fewer users fit beside them.

A decode step's time is linear in its context on each side of the roofline's max(), so the sum
over a request's output steps is taken as the step count times the step at the mean context.
"""

from __future__ import annotations

from typing import Any

from servelab.cost import Roofline
from servelab.lab.common import fmt, ms, powers_of_two, setup_from, stat
from servelab.lab.formulas import step_formula
from servelab.lab.limits import bounds
from servelab.lab.params import Params

PER_REQUESTS = 1000  # dollars are shown per this many requests: per-request figures are tiny


def decode_seconds(rl: Roofline, batch: int, prompt_len: int, output_len: int) -> float:
    """The wall time of the decode steps after the first token (output_len - 1 of them)."""
    steps = output_len - 1
    return steps * rl.decode(batch, prompt_len + max(1, output_len // 2)).time_s if steps else 0.0


def _batch_that_fits(rl: Roofline, batch: int, context: int) -> int:
    plan = rl.memory
    return min(batch, plan.max_batch(context)) if plan.weights_fit else 0


def request_cost(p: Params) -> dict[str, Any]:
    s = setup_from(p)
    prompt_len = p.int("prompt_len", 2048, **bounds("request-cost", "prompt_len"))
    output_len = p.int("output_len", 256, **bounds("request-cost", "output_len"))
    batch = p.int("batch", 32, **bounds("request-cost", "batch"))
    default_price = s.hardware.price_per_hour_usd or 2.0
    price = p.float("price_per_gpu_hour", default_price, **bounds("request-cost", "price_per_gpu_hour"))
    rl = s.roofline()
    rl._check_context(prompt_len + output_len, "prompt_len + output_len")  # noqa: SLF001 - the roofline's limit
    s.memory().require_weights_fit()  # nothing below runs without the weights: one "does not fit" answer
    usd_per_gpu_s = price * s.tp / 3600.0
    max_context = s.model.max_context

    # Latency against output length, at this prompt and batch (capped where the KV cache is full).
    outputs = [n for n in powers_of_two(16, max_context - prompt_len)]
    if output_len not in outputs:
        outputs = sorted([*outputs, output_len])
    ttft_s = rl.prefill(prompt_len).time_s
    lat: dict[str, list[Any]] = {"output_len": outputs, "ttft_ms": [], "decode_ms": [], "e2e_ms": [], "batch": []}
    for n in outputs:
        b = _batch_that_fits(rl, batch, prompt_len + n)
        dec = decode_seconds(rl, b, prompt_len, n) if b else None
        lat["batch"].append(b)
        lat["ttft_ms"].append(ms(ttft_s))
        lat["decode_ms"].append(None if dec is None else ms(dec))
        lat["e2e_ms"].append(None if dec is None else ms(ttft_s + dec))
    # Money against prompt length, at this output length and batch.
    prompts = [n for n in powers_of_two(16, max_context - output_len)]
    if prompt_len not in prompts:
        prompts = sorted([*prompts, prompt_len])
    money: dict[str, list[Any]] = {
        "prompt_len": prompts,
        "prefill_usd": [],
        "decode_usd": [],
        "total_usd": [],
        "batch": [],
    }
    for n in prompts:
        b = _batch_that_fits(rl, batch, n + output_len)
        prefill_s = rl.prefill(n).time_s
        decode_share_s = decode_seconds(rl, b, n, output_len) / b if b else None
        money["batch"].append(b)
        money["prefill_usd"].append(PER_REQUESTS * prefill_s * usd_per_gpu_s)
        money["decode_usd"].append(None if decode_share_s is None else PER_REQUESTS * decode_share_s * usd_per_gpu_s)
        money["total_usd"].append(
            None if decode_share_s is None else PER_REQUESTS * (prefill_s + decode_share_s) * usd_per_gpu_s
        )
    # Where the chosen batch stops fitting: beyond it the batch shrinks and each request pays more.
    plan = rl.memory
    capped_from = next((n for n, b in zip(prompts, money["batch"]) if b < batch), None)
    out_capped_from = next((n for n, b in zip(outputs, lat["batch"]) if b < batch), None)
    limits = {
        "prompt": None
        if capped_from is None
        else {"prompt_len": capped_from, "label": f"batch {batch:,} does not fit: fewer users share each step"},
        "output": None
        if out_capped_from is None
        else {"output_len": out_capped_from, "label": f"batch {batch:,} does not fit: fewer users share each step"},
    }
    b_here = _batch_that_fits(rl, batch, prompt_len + output_len)
    warning = None
    if b_here < batch:
        warning = (
            f"{plan.describe()}: batch {batch:,} at {prompt_len + output_len:,} tokens of context does not fit "
            f"the KV cache ({plan.kv_capacity_tokens:,} tokens); the figures use batch {b_here:,}, the most "
            f"that fits. Lower the batch or the lengths, or use fp8 KV, a larger tp or a bigger accelerator."
        )
    if not b_here:
        warning = (
            f"{plan.describe()}: not even one request of {prompt_len + output_len:,} tokens fits the KV "
            f"cache; shorten the request, or use fp8 KV, a larger tp or a bigger accelerator"
        )
    i = prompts.index(prompt_len)
    j = outputs.index(output_len)
    total = money["total_usd"][i]
    prefill_pct = None if not total else 100 * (money["prefill_usd"][i] / total)  # of the request's cost
    e2e = lat["e2e_ms"][j]
    next_point = i + 1 < len(prompts) and money["total_usd"][i + 1]
    notice_money = (
        f"at {prompt_len:,} prompt tokens a request costs ${fmt(total)} per {PER_REQUESTS:,} requests "
        f"at ${fmt(price)}/GPU-hour, {fmt(prefill_pct)}% of it prefill"
        if total
        else "this request does not fit at all"
    )
    if next_point:  # the sweep's next point, not always twice the prompt
        notice_money += f"; at {prompts[i + 1]:,} prompt tokens it costs ${fmt(money['total_usd'][i + 1])}"
    notice = (
        f"{notice_money}. Its {output_len:,} output tokens take {fmt(e2e)} ms end to end against a "
        f"{fmt(ms(ttft_s))} ms TTFT: each token is one more decode step."
        if e2e
        else notice_money + "."
    )
    decode_cost = rl.decode(max(1, b_here), prompt_len + max(1, output_len // 2))
    return {
        "config": {
            **s.to_dict(),
            "prompt_len": prompt_len,
            "output_len": output_len,
            "batch": batch,
            "price_per_gpu_hour": price,
        },
        "latency": lat,
        "money": money,
        "limits": limits,
        "selected": {
            "prompt_len": prompt_len,
            "output_len": output_len,
            "batch": b_here,
            "e2e_ms": e2e,
            "ttft_ms": ms(ttft_s),
            "usd_per_k_requests": total,
        },
        "per_requests": PER_REQUESTS,
        "warning": warning,
        "formulas": [
            {
                "title": "what a request costs",
                "lines": [
                    f"GPU-seconds = prefill {fmt(ms(ttft_s))} ms + {output_len - 1:,} decode steps × "
                    f"{fmt(ms(decode_cost.time_s))} ms ÷ batch {max(1, b_here):,}",
                    f"$ per {PER_REQUESTS:,} requests = {PER_REQUESTS:,} × GPU-seconds × ${fmt(price)} × "
                    f"tp {s.tp} ÷ 3600 = ${fmt(total)}"
                    if total
                    else "the request does not fit",
                    f"E2E = TTFT {fmt(ms(ttft_s))} ms + {output_len - 1:,} × {fmt(ms(decode_cost.time_s))} ms "
                    f"= {fmt(e2e)} ms"
                    if e2e
                    else "",
                ],
            },
            step_formula(f"one decode step, batch {max(1, b_here):,} at the mean context", decode_cost, rl),
        ],
        "stats": [
            stat("TTFT (prefill)", fmt(ms(ttft_s), "ms")),
            stat("end-to-end latency", fmt(e2e, "ms")),
            stat(f"$ per {PER_REQUESTS:,} requests", "n/a" if not total else f"${fmt(total)}"),
            stat("prefill's share of the cost", "n/a" if prefill_pct is None else f"{prefill_pct:.0f}%"),
            stat("price", f"${fmt(price)} per GPU-hour"),
        ],
        "notice": notice,
    }
