"""The seed's design claims as lessons: limits on prompts and outputs (9), capacity in tokens/s
rather than QPS (10), one token at a time (11). Each figure is the simulator's or the roofline's."""

from __future__ import annotations

import math

import pytest

from servelab.cost import Roofline
from servelab.lab.roofline_lessons import batch_at_tpot
from servelab.lab.seed_lessons import _capped, _heavy_tailed_requests
from servelab.spec import get_hardware, get_model

MODEL, HW = get_model("llama-3.1-8b"), get_hardware("h100-sxm")


def get(client, lesson: str, **params) -> dict:
    response = client.post(f"/api/lessons/{lesson}", json=params)
    assert response.status_code == 200, response.text
    return response.json()


def error(client, lesson: str, **params) -> str:
    response = client.post(f"/api/lessons/{lesson}", json=params)
    assert response.status_code == 400, response.text
    return response.json()["error"]["message"]


# ---- 9. limits ------------------------------------------------------------------------------------


def test_caps_cut_only_the_tail_and_the_same_requests_run_in_every_variant():
    base = _heavy_tailed_requests(4.0, 2048, 256, longest=(131072, 131072))
    capped = _capped(base, 4096, 512)
    assert [r.arrival_s for r in capped] == [r.arrival_s for r in base]
    assert all(c.prompt_tokens == min(b.prompt_tokens, 4096) for b, c in zip(base, capped))
    assert all(c.output_tokens == min(b.output_tokens, 512) for b, c in zip(base, capped))
    # A heavy tail: the longest prompt is many times the mean, and the cap cuts a minority.
    assert max(r.prompt_tokens for r in base) > 8 * 2048
    assert 0 < sum(r.prompt_tokens > 4096 for r in base) < len(base) / 4
    # Nothing longer than the deployment takes, prompt first.
    short = _heavy_tailed_requests(4.0, 2048, 256, longest=(4096, 4096))
    assert all(r.prompt_tokens + r.output_tokens <= 4096 and r.output_tokens >= 2 for r in short)


def test_limits_prompt_cap_cuts_ttft_tail_and_cost_output_cap_cuts_e2e(client):
    d = get(client, "limits")
    v = d["variants"]
    assert v["name"] == ["none", "prompt", "output", "both"]
    none, prompt, output, both = range(4)
    assert v["cut_prompts"][prompt] > 0 and v["cut_outputs"][output] > 0
    assert v["cut_prompts"][output] == 0 and v["cut_outputs"][prompt] == 0
    assert v["ttft_p99_ms"][prompt] < 0.8 * v["ttft_p99_ms"][none]
    assert v["e2e_p99_ms"][output] < 0.5 * v["e2e_p99_ms"][none]
    assert v["tpot_p99_ms"][both] < v["tpot_p99_ms"][none]
    assert v["usd_per_k_requests"][both] < v["usd_per_k_requests"][prompt] < v["usd_per_k_requests"][none]
    # Cost per output token is the same GPU time over fewer tokens when outputs are cut.
    for i in range(4):
        per_m = v["usd_per_k_requests"][i] / 1e3 / v["output_tokens_mean"][i] * 1e6
        assert v["usd_per_m_output_tokens"][i] == pytest.approx(per_m)
    assert d["ttft_ms"]["none"]["percentiles"]["p99"] == pytest.approx(v["ttft_p99_ms"][none])


def test_limits_gpu_time_is_the_roofline_at_the_batch_the_kv_cache_holds(client):
    from servelab.lab.common import setup_from
    from servelab.lab.params import Params
    from servelab.lab.seed_lessons import full_load_gpu_s

    d = get(client, "limits", rate=2, prompt_len=1024, output_len=128, prompt_cap=2048, output_cap=256)
    requests = _capped(_heavy_tailed_requests(2.0, 1024, 128, longest=(131072, 131072)), 2048, 256)
    rl = Roofline(MODEL, HW)
    mean = sum(r.prompt_tokens + r.output_tokens for r in requests) / len(requests)
    batch = min(256, int(rl.memory.kv_capacity_tokens // mean))
    gpu_s = sum(
        rl.prefill(r.prompt_tokens).time_s
        + (r.output_tokens - 1) * rl.decode(batch, r.prompt_tokens + r.output_tokens // 2).time_s / batch
        for r in requests
    )
    assert full_load_gpu_s(setup_from(Params({})), requests) == (pytest.approx(gpu_s), batch)
    assert d["variants"]["gpu_s"][3] == pytest.approx(gpu_s)
    assert d["variants"]["full_load_batch"][3] == batch


def test_limits_bad_inputs_name_the_field(client):
    assert "prompt_cap" in error(client, "limits", prompt_cap=8)
    assert "rate" in error(client, "limits", rate=0)
    assert "maximum context" in error(client, "limits", model="llama-2-7b", prompt_len=4000, output_len=200)
    d = get(client, "limits", model="llama-3.1-70b")
    assert d["no_fit"]["label"].startswith("does not fit: the weights take")


# ---- 10. QPS against tokens/s ---------------------------------------------------------------------


def test_same_qps_different_gpus_from_the_roofline(client):
    d = get(client, "qps-vs-tokens", qps=10, tpot_ms=50)
    rl = Roofline(MODEL, HW)
    for name, (prompt, output) in {"a": (256, 128), "b": (8192, 512)}.items():
        w = d["workloads"][name]
        context = prompt + output // 2
        batch = batch_at_tpot(rl, context, rl.memory.max_batch(prompt + output), 0.05)
        request_s = rl.prefill(prompt).time_s + (output - 1) * rl.decode(batch, context).time_s / batch
        assert w["batch"] == batch
        assert w["gpus"] == pytest.approx(10 * request_s)
        assert w["gpus_whole"] == math.ceil(10 * request_s)
        assert w["tokens_per_s"] == 10 * (prompt + output)
        assert w["qps_per_gpu"] == pytest.approx(1 / request_s)
    a, b = d["workloads"]["a"], d["workloads"]["b"]
    assert b["gpus"] > 10 * a["gpus"]
    assert f"needs {b['gpus'] / a['gpus']:.3g}x the GPUs" in d["notice"]
    i = d["sweep"]["qps"].index(10)
    assert d["sweep"]["gpus_a"][i] == a["gpus_whole"] and d["sweep"]["gpus_b"][i] == b["gpus_whole"]


def test_qps_counts_tensor_parallel_gpus(client):
    one = get(client, "qps-vs-tokens", qps=100)["workloads"]["b"]
    two = get(client, "qps-vs-tokens", qps=100, tp=2)["workloads"]["b"]
    assert one["gpus_whole"] == math.ceil(one["gpus"])
    # A tp=2 replica is two GPUs: whole replicas, counted in GPUs.
    assert two["gpus_whole"] % 2 == 0 and two["gpus_whole"] >= two["gpus"]
    assert two["gpus"] == pytest.approx(100 * two["gpu_s_per_request"])


def test_qps_bad_inputs(client):
    assert "b_prompt_len" in error(client, "qps-vs-tokens", b_prompt_len=131072, b_output_len=512)
    assert "qps" in error(client, "qps-vs-tokens", qps=-1)
    d = get(client, "qps-vs-tokens", tpot_ms=1)
    assert d["no_fit"] and "TPOT" in d["warning"]


# ---- 11. one token at a time ----------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 16])
def test_decode_chain_steps_are_the_simulated_token_gaps(client, batch):
    d = get(client, "decode-chain", prompt_len=1024, output_len=24, batch=batch)
    c = d["chain"]
    rl = Roofline(MODEL, HW)
    assert c["token"] == list(range(1, 25))
    # Each token comes after the previous one, one step later.
    gaps = [b - a for a, b in zip(c["time_ms"], c["time_ms"][1:])]
    assert gaps == pytest.approx(c["step_ms"][1:])
    assert c["time_ms"][0] == pytest.approx(c["step_ms"][0])
    # Its decode steps run at the chosen batch: the roofline's decode step at that batch, give or take
    # the context growing by a token a step.
    for i, step in enumerate(c["step_ms"][1:], start=1):
        assert step == pytest.approx(rl.decode(batch, 1024 + i).time_s * 1e3, rel=0.02)
    assert d["one_step_ms"] == pytest.approx(rl.step([(24, 1048)]).time_s * 1e3)
    assert d["decode_ms"] > 10 * d["one_step_ms"]


def test_decode_chain_that_does_not_fit_says_so(client):
    d = get(client, "decode-chain", prompt_len=100000, batch=8)
    assert d["no_fit"] and "lower batch or prompt_len" in d["warning"]
    assert "output_len" in error(client, "decode-chain", output_len=600)


def test_form_valid_inputs_the_deployment_refuses_name_the_field(client):
    # an engine that runs prompts whole: the limits lesson's no-cap stream keeps its prompts within
    # the step (it ran at the defaults), and the simulator lessons name prompt_len
    assert get(client, "limits", engine_profile="trtllm")
    assert "runs a prompt whole" in error(client, "slo", engine_profile="trtllm", prompt_len=6000)
    # the traced sequence's companions decode through its steps: past the context, prompt_len is named
    response = client.post("/api/lessons/decode-chain", json={"prompt_len": 130000, "output_len": 512, "batch": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_len", response.text
