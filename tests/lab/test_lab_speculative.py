"""Lesson 12, speculative decoding: the curves are servelab.cost.speculative's, the points
compare_speculation's, the measured overlay the server's own counters; bad inputs are 400s
naming the field."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from servelab.core.speculative import SpeculativeConfig
from servelab.cost.roofline import Roofline
from servelab.cost.speculative import Acceptance, SpeculativeCost, draft_cost
from servelab.lab.app import create_lab_app
from servelab.lab.speculative_lesson import CURVE_ALPHAS, MAX_CURVE_BATCH, SIM_CONCURRENCIES
from servelab.sim.runner import engine_sim_config
from servelab.sim.speculation_sweep import compare_speculation
from servelab.spec import get_hardware, get_model
from servelab.workload import WorkloadSpec

MODEL, HW = get_model("llama-3.1-8b"), get_hardware("h100-sxm")
DRAFT = SpeculativeConfig("draft_model", 4, model="llama-3.2-1b")

VLLM_COUNTERS = """# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0"} 1000
vllm:spec_decode_num_draft_tokens_total{engine="0"} 3000
vllm:spec_decode_num_accepted_tokens_total{engine="0"} 1500
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 800
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 500
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="2"} 200
"""


def get(client, **params) -> dict:
    response = client.post("/api/lessons/speculative", json=params)
    assert response.status_code == 200, response.text
    return response.json()


def error(client, **params) -> dict:
    response = client.post("/api/lessons/speculative", json=params)
    assert response.status_code == 400, response.text
    return response.json()["error"]


def _cost(alpha: float, config: SpeculativeConfig = DRAFT, hw=HW) -> SpeculativeCost:
    rl = Roofline(MODEL, hw, "bfloat16", "bfloat16", 1)
    draft = draft_cost(config, hw, "bfloat16", "bfloat16", 1)
    return SpeculativeCost(rl, draft, Acceptance.rate(alpha, config.num_speculative_tokens))


def test_curves_are_the_cost_models_with_the_crossover_per_alpha(client):
    d = get(client)  # llama-3.1-8b on h100-sxm, draft llama-3.2-1b, K = 4, α = 0.7, 512 + 128 tokens
    context = 512 + 128 // 2
    assert d["config"]["context"] == context
    assert [c["alpha"] for c in d["curves"]] == sorted({*CURVE_ALPHAS, 0.7})
    assert [c["chosen"] for c in d["curves"]] == [c["alpha"] == 0.7 for c in d["curves"]]
    for curve in d["curves"]:
        cost = _cost(curve["alpha"])
        assert curve["batch"][0] == 1 and curve["batch"][-1] == MAX_CURVE_BATCH
        assert curve["speedup"] == pytest.approx([r.speedup for r in cost.rows(curve["batch"], context)])
        assert curve["crossover_batch"] == cost.crossover_batch(context, limit=MAX_CURVE_BATCH)
    by_alpha = {c["alpha"]: c for c in d["curves"]}
    assert by_alpha[0.7]["speedup"][0] > 1.2  # pays at batch 1 on a GPU
    # The crossover is where the speedup falls below 1, and it moves out as acceptance rises.
    cross = [by_alpha[a]["crossover_batch"] for a in (0.7, 0.9)]
    assert 1 < cross[0] < cross[1] <= MAX_CURVE_BATCH
    for batch, curve in zip(cross, (by_alpha[0.7], by_alpha[0.9])):
        assert (
            _cost(curve["alpha"]).row(batch, context).speedup
            < 1.0
            <= _cost(curve["alpha"]).row(batch - 1, context).speedup
        )
    assert by_alpha[0.5]["crossover_batch"] == 1  # this draft model never pays at α = 0.5


def test_prompt_lookup_pays_more_and_longer_than_a_draft_model(client):
    ngram, draft = get(client, method="ngram"), get(client)
    n7 = next(c for c in ngram["curves"] if c["alpha"] == 0.7)
    d7 = next(c for c in draft["curves"] if c["alpha"] == 0.7)
    assert n7["speedup"][0] > d7["speedup"][0] > 1.0
    assert n7["crossover_batch"] > d7["crossover_batch"]
    assert ngram["config"]["speculative_config"] == SpeculativeConfig("ngram", 4).to_json()


def test_sim_points_are_compare_speculations(client):
    d = get(client, prompt_len=256, output_len=64)
    concurrencies = [level["concurrency"] for level in d["sim"]["levels"]]
    assert concurrencies == list(SIM_CONCURRENCIES) == d["config"]["sim_concurrencies"]
    config = engine_sim_config("servelab", model=MODEL, hardware=HW, tp=1, weight_dtype="bfloat16",
                               kv_cache_dtype="bfloat16", speculative=DRAFT, spec_acceptance=Acceptance.rate(0.7, 4))  # fmt: skip
    levels = compare_speculation(config, WorkloadSpec(num_requests=1, input_len="256", output_len="64", seed=0),
                                 concurrencies)  # fmt: skip
    for got, want in zip(d["sim"]["levels"], levels, strict=True):
        assert got == pytest.approx(want.to_dict())
    first = d["sim"]["levels"][0]
    assert first["speedup"] > 1.0 and first["plain_tpot_s"] > first["spec_tpot_s"]
    assert 1.0 < first["tokens_per_verification"] < 5.0
    crossover = d["sim"]["crossover_concurrency"]
    assert crossover == next((lv["concurrency"] for lv in d["sim"]["levels"] if not lv["pays"]), None)


def test_the_note_is_written_from_the_numbers(client):
    d = get(client)
    mine = next(c for c in d["curves"] if c["chosen"])
    notice = d["notice"]
    assert f"{mine['speedup'][0]:.3g}x faster at batch 1" in notice
    assert f"stops paying from batch {mine['crossover_batch']:,}" in notice
    assert "compute-bound" in notice and "compute roof" in notice  # why it stops, on the H100
    # The verification at the crossover is compute-bound: its FLOPs take longer than its reads.
    m = re.search(r"compute-bound \(([\d.]+) ms of FLOPs against ([\d.]+) ms of reads\)", notice)
    assert m and float(m.group(1)) > float(m.group(2))
    for c in d["curves"]:
        if c["alpha"] is not None and c["crossover_batch"] not in (None, 1):
            assert f"batch {c['crossover_batch']:,} at α = {c['alpha']:g}" in notice
    first = d["sim"]["levels"][0]
    assert f"finds {first['speedup']:.3g}x at concurrency 1" in notice
    if d["sim"]["crossover_concurrency"] is not None:
        assert f"from concurrency {d['sim']['crossover_concurrency']} it stops paying" in notice


def test_the_lab_cpu_stops_paying_at_a_small_batch(client):
    d = get(client, hardware="generic-cpu", method="ngram")
    assert d["config"]["hardware"] == "generic-cpu"
    cpu = _cost(0.7, SpeculativeConfig("ngram", 4), get_hardware("generic-cpu.json"))
    mine = next(c for c in d["curves"] if c["chosen"])
    assert mine["speedup"][0] == pytest.approx(cpu.row(1, 576).speedup) and mine["speedup"][0] > 1.0
    gpu = next(c for c in get(client, method="ngram")["curves"] if c["chosen"])
    # The CPU's ridge is ~15 FLOP/byte against the H100's ~300: compute catches up far sooner.
    assert mine["crossover_batch"] < 16 < gpu["crossover_batch"]


def test_a_profile_by_position_is_its_own_curve(client):
    d = get(client, acceptance_per_position="0.9,0.8,0.7,0.6,0.5")
    mine = [c for c in d["curves"] if c["chosen"]]
    assert len(mine) == 1 and mine[0]["alpha"] is None
    assert mine[0]["acceptance"]["acceptance_per_position"] == [0.9, 0.8, 0.7, 0.6]  # the first K positions
    assert [c["alpha"] for c in d["curves"] if not c["chosen"]] == list(CURVE_ALPHAS)


def test_a_configuration_that_does_not_fit_is_shaded_not_refused(client):
    d = get(client, model="llama-3.1-70b", method="ngram")
    assert d["no_fit"]["label"].startswith("does not fit: the weights take")
    d = get(client, hardware="generic-cpu", model="llama-3.1-70b", method="llama-3.1-8b")
    assert d["config"]["hardware"] == "generic-cpu" and "raise tp" in d["warning"]


@pytest.mark.parametrize(
    ("params", "field", "needle"),
    [
        ({"acceptance": 1.5}, "acceptance", "must be between 0 and 1"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens", "must be between 1 and 32"),
        ({"method": "gpt-5"}, "method", "choose one of ngram"),
        ({"method": "llama-3.1-70b"}, "method", "is not smaller than the target llama-3.1-8b"),
        ({"hardware": "tpu"}, "hardware", "generic-cpu"),
        ({"acceptance_per_position": "0.9,x"}, "acceptance_per_position", "comma-separated rates"),
        ({"acceptance_per_position": "0.9,1.2,0.5,0.5"}, "acceptance_per_position", "in [0, 1]"),
        ({"acceptance_per_position": "0.9,0.8"}, "acceptance_per_position", "fewer than num_speculative_tokens = 4"),
        ({"prompt_len": 16384, "output_len": 512, "model": "llama-2-7b"}, "prompt_len", "maximum context of 4,096"),
        ({"output_len": 1}, "output_len", "must be between 2 and 512"),
    ],
)
def test_bad_inputs_are_400s_naming_the_field(client, params, field, needle):
    err = error(client, **params)
    assert err["param"] == field and needle in err["message"], err


def test_measured_acceptance_from_the_servers_counters_is_overlaid_as_a_prediction():
    client = TestClient(create_lab_app(engine_metrics_source=lambda: VLLM_COUNTERS))
    d = get(client)
    m = d["measured"]
    assert m["available"] and m["num_drafts"] == 1000 and m["num_speculative_tokens"] == 3
    assert m["acceptance_per_position"] == pytest.approx([0.8, 0.625, 0.4])
    assert m["draft_acceptance_rate"] == pytest.approx(0.5) and m["expected_tokens_per_verification"] == pytest.approx(
        2.5
    )
    curve = m["curve"]
    assert "predicted" in curve["label"] and "measured acceptance" in curve["label"]
    measured = SpeculativeCost(
        Roofline(MODEL, HW, "bfloat16", "bfloat16", 1),
        draft_cost(SpeculativeConfig("draft_model", 3, model="llama-3.2-1b"), HW, "bfloat16", "bfloat16", 1),
        Acceptance.from_counts(1000, [800, 500, 200], "counters"),
    )
    assert curve["speedup"] == pytest.approx([r.speedup for r in measured.rows(curve["batch"], 576)])
    assert "Your server's counters measured 50% of its drafts accepted" in d["notice"]
    assert "measuring the speedup needs the server run with and without speculation" in d["notice"]


def test_counts_without_positions_are_fitted_as_one_rate():
    text = "\n".join(line for line in VLLM_COUNTERS.splitlines() if "per_pos" not in line) + "\n"
    d = get(TestClient(create_lab_app(engine_metrics_source=lambda: text)))
    m = d["measured"]
    assert m["available"] and "one rate" in m["how"] and m["num_speculative_tokens"] == 3
    assert m["expected_tokens_per_verification"] == pytest.approx(2.5)  # the measured mean, reproduced


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        (None, "not running inside `servelab serve`"),
        (lambda: "", "exports no speculative-decoding counters"),
        (lambda: 1 / 0, "metrics are unavailable"),
        (lambda: VLLM_COUNTERS.replace("} 200", "} 900"), "must not grow with position"),
    ],
)
def test_no_measurement_says_why_and_the_lesson_still_answers(source, needle):
    d = get(TestClient(create_lab_app(engine_metrics_source=source)))
    assert d["measured"]["available"] is False and needle in d["measured"]["why"]
    assert d["curves"] and d["sim"]["levels"]
