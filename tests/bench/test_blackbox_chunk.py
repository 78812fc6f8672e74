"""What calibrate --base-url reads from single-request prefills: the chunk budget, where TTFT(L)
steps up by a step's fixed cost each time L crosses a multiple of it. A prompt written for a
target length tokenizes a few tokens off it, differently in each repeat, so a target near a
boundary can straddle it."""

from __future__ import annotations

import math
import random

import pytest

from servelab.bench.blackbox import Results, infer_chunk, make_design, observations

STEP_S, TOKEN_S = 0.008, 40e-6
TARGETS = make_design(400, 4, 2048).prefill_lens  # the lengths calibrate asks for up to 400 tokens


def _ttft(n: int, chunk: int | None) -> float:
    return (1 if chunk is None else math.ceil(n / chunk)) * STEP_S + n * TOKEN_S


def _results(
    chunk: int | None, tokens: dict[int, list[int]], slow: dict[int, float] | None = None, jitter: int | None = None
) -> Results:
    """Three repeats a target, each of the prompt length `tokens` gives it (else the target), the
    targets in `slow` that many times slower in every repeat (a host's hiccup), every repeat up to
    6% slower with a `jitter` seed (what a quiet host adds)."""
    rng = random.Random(jitter)
    records = []
    for target in TARGETS:
        for repeat, n in enumerate(tokens.get(target, [target] * 3)):
            ttft = _ttft(n, chunk) * (slow or {}).get(target, 1.0) * (1 + (0.06 * rng.random() if jitter else 0))
            records.append({"phase": "prefill", "target": target, "prompt_tokens": n, "ttft_s": ttft, "repeat": repeat})
    return Results(None, records)


# What the tokenizer made of some targets, as measured: 144 came out at 129 twice and 128 once.
STRADDLE = {112: [101, 101, 101], 144: [129, 129, 128], 160: [153, 153, 153]}


def test_each_prefill_is_priced_at_its_own_length():
    obs = [o for o in observations(_results(128, STRADDLE), 0.0, 128) if o.label.startswith("prefill")]
    # the fastest repeat of target 144 is the one of 128 tokens: one step, not two
    point = next(o for o in obs if o.detail["prompt_tokens"] in (128, 129))
    assert point.detail["prompt_tokens"] == 128 and point.time_s == pytest.approx(_ttft(128, 128))


@pytest.mark.parametrize("slow", [{}, {144: 1.45}, {112: 1.4, 288: 0.75}, {48: 1.5, 320: 1.3}])
@pytest.mark.parametrize("tokens", [{}, STRADDLE], ids=["on-target", "straddling"])
def test_a_chunked_servers_budget_is_found(tokens, slow):
    found = infer_chunk(_results(128, tokens, slow), 0.0)
    assert found["value"] == 128, found


@pytest.mark.parametrize("slow", [{}, {144: 1.45}, {112: 1.4, 288: 0.75}])
@pytest.mark.parametrize("tokens", [{}, STRADDLE], ids=["on-target", "straddling"])
def test_an_unchunked_server_shows_no_budget(tokens, slow):
    found = infer_chunk(_results(None, tokens, slow), 0.0)
    assert found["value"] is None, found


@pytest.mark.parametrize("jitter", range(1, 9))
def test_the_budget_is_told_from_a_larger_one_through_a_quiet_hosts_jitter(jitter):
    # 128 and 256 price these lengths alike below 128 tokens and above 256: only the four between
    # tell them apart.
    found = infer_chunk(_results(128, STRADDLE, jitter=jitter), 0.0)
    assert found["value"] == 128 and found["errors_pct"]["256"] > 2 * found["errors_pct"]["128"], found
