"""What calibrate --base-url asks a server for: every request fits the server's context, and a run
cut short says how to get enough points rather than failing inside the fit."""

from __future__ import annotations

import pytest

from servelab.bench import blackbox as bb
from servelab.errors import InvalidArgument, ServelabError


@pytest.mark.parametrize("max_prompt", [47, 62, 95, 126, 127, 298, 400, 4094])
def test_every_request_fits_the_context_the_prompts_were_capped_by(max_prompt):
    # max_prompt leaves room for one output token (calibrate caps it at the context less 2)
    d = bb.make_design(max_prompt, 32, max(4096, 2 * max_prompt))
    assert max(d.prefill_lens) + 1 <= max_prompt + 1
    assert all(n + d.burst_output <= max_prompt + 1 for _, n in d.bursts), d.bursts
    # a join's decodes run 64-token prompts and twice the bursts' outputs
    assert not d.joins or bb.BURST_PROMPT_LENS[0] + 2 * d.burst_output <= max_prompt + 1


def test_a_large_context_keeps_the_usual_design():
    d = bb.make_design(400, 8, 4096)
    assert sorted({n for _, n in d.bursts}) == [64, 320, 368] and d.joins == ((2, 128), (2, 200))


def test_a_context_too_small_for_a_burst_is_refused_with_what_it_needs():
    with pytest.raises(InvalidArgument, match="prompts of up to 47 tokens"):
        bb.make_design(46, 8, 4096)


def _burst(batch: int, out: int = 32) -> dict:
    step = 0.01 + 0.001 * batch
    requests = [{"prompt_tokens": 64, "send_s": 0.0, "output_tokens": out,
                 "chunk_times_s": [0.02 + k * step for k in range(out)]} for _ in range(batch)]  # fmt: skip
    return {"phase": "burst", "batch": batch, "target": 64, "repeat": 0, "requests": requests}


def test_too_few_points_for_the_folds_say_how_to_get_more():
    prefills = [{"phase": "prefill", "batch": 1, "target": n, "repeat": 0, "prompt_tokens": n, "ttft_s": 0.005 + 2e-5 * n}
                for n in (16, 32, 48, 56, 72)]  # fmt: skip
    results = bb.Results(None, [{"phase": "rtt", "samples_s": [0.0]}, *prefills, *(_burst(b) for b in (1, 2, 4))])
    server = bb.ServerInfo("http://x/v1", "m", "unknown", None, None, {}, False)
    run = {"stopped": "the budget ran out", "measured": 8, "resumed": 0, "wall_s": 1.0}
    with pytest.raises(ServelabError, match=r"only 8 prefill and decode points measured \(the budget ran out\).*"
                                            r"give a longer --budget, or --resume"):  # fmt: skip
        bb.build_profile(server, results, run, bb.make_design(320, 4, 4096))


def test_the_round_trip_subtracted_is_a_fast_one_as_the_fastest_repeat_rode():
    results = bb.Results(None, [{"phase": "rtt", "samples_s": [0.001, 0.002, 0.003, 0.004, 0.009]}])
    assert bb.round_trip_s(results) == pytest.approx(0.002)  # the lower quartile, not the median 3 ms
    assert bb.round_trip_s(bb.Results(None, [])) == 0.0
