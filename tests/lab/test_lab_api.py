"""The lab's JSON API: every lesson's numbers are the roofline's or the simulator's, and bad
parameters get a 400 that names the parameter."""

from __future__ import annotations

import math

import numpy as np
import pytest

from servelab.cost import MemoryPlan, Roofline
from servelab.lab.roofline_lessons import with_mha
from servelab.metrics import SLO, steady_state_summary
from servelab.sim import SimConfig, simulate
from servelab.spec import get_hardware, get_model
from servelab.workload import WorkloadSpec

MODEL, HW = get_model("llama-3.1-8b"), get_hardware("h100-sxm")


def rl(model=MODEL, hw=HW, w="bf16", k="bf16", tp=1) -> Roofline:
    return Roofline(model, hw, w, k, tp)


def get(client, lesson: str, **params) -> dict:
    """The lesson's full answer: a lesson that answers in stages (202 while the rest runs) is polled."""
    import time

    deadline = time.monotonic() + 600
    response = client.post(f"/api/lessons/{lesson}", json=params)
    while response.status_code == 202 and time.monotonic() < deadline:
        time.sleep(0.3)
        response = client.post(f"/api/lessons/{lesson}", json=params)
    assert response.status_code == 200, response.text
    return response.json()


def error(client, lesson: str, status: int = 400, **params) -> str:
    response = client.post(f"/api/lessons/{lesson}", json=params)
    assert response.status_code == status, response.text
    return response.json()["error"]["message"]


# ---- catalog and page -------------------------------------------------------------------------


def test_catalog_lists_the_catalogs_and_seed_defaults(client):
    cat = client.get("/api/catalog").json()
    assert {m["name"] for m in cat["models"]} >= {"llama-3.1-8b", "llama-3.1-70b"}
    assert "h100-sxm" in {h["name"] for h in cat["hardware"]}
    assert cat["weight_dtypes"][0] == "bfloat16" and "fp8" in cat["kv_dtypes"]
    assert len(cat["lessons"]) == 13
    assert [p["name"] for p in cat["engine_profiles"]] == ["servelab", "vllm", "sglang", "trtllm"]
    for lesson in cat["lessons"]:
        d = cat["defaults"][lesson]
        assert (d["model"], d["hardware"], d["weight_dtype"], d["kv_dtype"]) == (
            "llama-3.1-8b",
            "h100-sxm",
            "bfloat16",
            "bfloat16",
        )


def test_page_and_static_files_are_served_offline(client):
    page = client.get("/")
    assert page.status_code == 200
    assert 'src="static/plotly.min.js"' in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing from a CDN
    import plotly

    bundled = (__import__("pathlib").Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
    js = client.get("/static/plotly.min.js")
    assert js.status_code == 200 and js.content == bundled
    assert client.get("/static/lab.js").status_code == 200
    assert client.get("/static/lab.css").headers["content-type"].startswith("text/css")
    assert client.get("/static/secrets.txt").status_code == 404


def test_unknown_lesson_is_404_naming_the_lessons(client):
    message = error(client, "nope", status=404)
    assert "nope" in message and "batching" in message


# ---- 1. two workloads -----------------------------------------------------------------------


def test_two_workloads_is_the_roofline(client):
    d = get(client, "two-workloads", prompt_len=2048, batch=1)
    r = rl()
    prefill, decode = r.prefill(2048), r.decode(1, 2048)
    assert d["prefill"]["time_ms"] == pytest.approx(prefill.time_s * 1e3)
    assert d["decode"]["time_ms"] == pytest.approx(decode.time_s * 1e3)
    assert d["phases"]["time_ms"] == pytest.approx([prefill.time_s * 1e3, decode.time_s * 1e3])
    assert d["prefill"]["intensity"] == pytest.approx(prefill.arithmetic_intensity)
    assert d["decode"]["achieved_tflops"] == pytest.approx(decode.flops / decode.time_s / 1e12)
    assert d["ridge_flops_per_byte"] == pytest.approx(r.ridge_flops_per_byte)
    # The seed's figures: intensity ~1 at batch 1 against a ridge of ~300; prefill is compute-bound.
    assert d["decode"]["intensity"] == pytest.approx(1.0, abs=0.2)
    assert 250 < d["ridge_flops_per_byte"] < 350
    assert (d["prefill"]["bound"], d["decode"]["bound"]) == ("compute", "memory")
    i = d["sweep"]["prompt_len"].index(8192)
    assert d["sweep"]["prefill_ms"][i] == pytest.approx(r.prefill(8192).time_s * 1e3)
    # The roofline curve is min(peak, bandwidth x intensity) at the datasheet peaks.
    x, y = d["roofline"]["intensity"], d["roofline"]["attainable_tflops"]
    for xi, yi in zip(x, y):
        assert yi == pytest.approx(min(r.peak_flops_per_s, xi * r.peak_bandwidth_bytes_per_s) / 1e12)
    assert "below the ridge" in d["notice"]


def test_two_workloads_splits_each_step_by_operator(client):
    from servelab.cost.operators import operator_costs

    d = get(client, "two-workloads", prompt_len=2048, batch=64)
    ops, r = d["operators"], rl()
    assert ops["names"] == ["qkv_proj", "attention", "o_proj", "mlp", "lm_head"]
    assert list(ops["phases"]) == ["prefill", "decode_batch_1", "decode_batch_64"]
    expected = operator_costs(r, [(1, 2048)] * 64)
    assert ops["phases"]["decode_batch_64"]["intensity"] == pytest.approx([o.arithmetic_intensity for o in expected])
    one, many = ops["phases"]["decode_batch_1"], ops["phases"]["decode_batch_64"]
    assert many["bound"][1] == one["bound"][1] == "memory"
    assert many["intensity"][1] == pytest.approx(one["intensity"][1])
    assert many["intensity"][3] > 50 * one["intensity"][3]
    assert "decode attention sits at" in d["notice"] and "the MLP moves from" in d["notice"]
    assert list(get(client, "two-workloads", batch=1)["operators"]["phases"]) == ["prefill", "decode_batch_1"]


def test_two_workloads_other_model_hardware_and_dtype(client):
    d = get(
        client,
        "two-workloads",
        model="qwen2.5-7b",
        hardware="a100-80gb",
        weight_dtype="fp8",
        kv_dtype="fp8",
        prompt_len=1000,
        batch=8,
    )
    r = Roofline(get_model("qwen2.5-7b"), get_hardware("a100-80gb"), "fp8", "fp8")
    assert d["decode"]["time_ms"] == pytest.approx(r.decode(8, 1000).time_s * 1e3)
    assert 1000 in d["sweep"]["prompt_len"]


@pytest.mark.parametrize(
    "params, needle",
    [
        ({"batch": "0"}, "batch: must be between 1 and 4096"),
        ({"batch": "abc"}, "batch: 'abc' is not an integer"),
        ({"prompt_len": "200000"}, "exceeds llama-3.1-8b's maximum context"),
        ({"model": "gpt-9"}, "model: unknown value 'gpt-9'"),
        ({"weight_dtype": "fp4"}, "weight_dtype: unknown value"),
        ({"tp": "3"}, "tp: unknown value '3'"),
    ],
)
def test_two_workloads_bad_parameters(client, params, needle):
    assert needle in error(client, "two-workloads", **params)


def test_tp_that_does_not_divide_the_heads_is_a_400(client):
    assert "does not divide" in error(client, "two-workloads", model="smollm2-135m", tp="2")


# ---- 2. batching ----------------------------------------------------------------------------


def test_batching_is_the_roofline_and_reproduces_the_seed(client):
    d = get(client, "batching", batch=64, context=2048)
    r = rl()
    for b, total, user, kv in zip(
        d["sweep"]["batch"], d["sweep"]["tokens_per_s_total"], d["sweep"]["tokens_per_s_per_user"], d["sweep"]["kv_gb"]
    ):
        c = r.decode(b, 2048)
        assert total == pytest.approx(b / c.time_s)
        assert user == pytest.approx(1 / c.time_s)
        assert kv == pytest.approx((c.kv_read_bytes + c.kv_write_bytes) / 1e9)
    sel = d["selected"]
    # seed: ~70 tok/s per user and ~4,500 in total at batch 64, 2K contexts; ~150 at batch 1
    assert sel["tokens_per_s_per_user"] == pytest.approx(70, rel=0.1)
    assert sel["tokens_per_s_total"] == pytest.approx(4500, rel=0.1)
    assert d["sweep"]["tokens_per_s_total"][0] == pytest.approx(150, rel=0.1)
    plan = MemoryPlan(MODEL, HW)
    assert d["memory"]["fits"] is True
    assert d["memory"]["max_batch"] == plan.max_batch(2048)
    assert d["memory"]["kv_gb"] == pytest.approx(plan.kv_bytes(64, 2048) / 1e9)
    assert d["crossover_batch"] == r.compute_bound_batch(2048)
    assert d["warning"] is None


def test_batching_crossover_exists_at_short_context(client):
    d = get(client, "batching", batch=8, context=64)
    assert d["crossover_batch"] == rl().compute_bound_batch(64) is not None
    assert rl().decode(d["crossover_batch"], 64).bound == "compute"
    assert 8 in d["sweep"]["batch"]


def test_batching_memory_bar_says_why_it_does_not_fit(client):
    d = get(client, "batching", batch=512, context=8192)
    assert d["memory"]["fits"] is False
    assert "the limit at this context is batch" in d["warning"]
    assert d["memory"]["max_batch"] == MemoryPlan(MODEL, HW).max_batch(8192)
    big = get(client, "batching", model="llama-3.1-70b")
    assert big["memory"]["fits"] is False and "the weights take" in big["warning"]
    assert get(client, "batching", model="llama-3.1-70b", tp="4")["memory"]["fits"] is True


@pytest.mark.parametrize("params", [{"batch": "-1"}, {"context": "0"}, {"context": "2.5"}, {"hardware": "tpu"}])
def test_batching_bad_parameters(client, params):
    name = next(iter(params))
    assert error(client, "batching", **params).startswith(name)


# ---- 6. memory ------------------------------------------------------------------------------


def test_old_dtype_spellings_still_work_and_read_as_the_canonical_names(client):
    old = get(client, "memory", context=8192, tpot_ms=50, weight_dtype="bf16", kv_dtype="fp16")
    new = get(client, "memory", context=8192, tpot_ms=50, weight_dtype="bfloat16", kv_dtype="float16")
    assert old == new
    v = new["variants"]
    chosen = [(w, k) for w, k, sel in zip(v["weight_dtype"], v["kv_dtype"], v["selected"]) if sel]
    assert chosen == [("bfloat16", "float16")]


def test_memory_variants_are_the_memory_plan_and_roofline(client):
    d = get(client, "memory", context=8192, tpot_ms=50)
    v = d["variants"]
    assert sum(v["selected"]) == 1 and v["selected"][0]
    for w, k, a, max_batch, b, tps in zip(
        v["weight_dtype"], v["kv_dtype"], v["attention"], v["max_batch"], v["batch_at_tpot"], v["tokens_per_s_per_gpu"]
    ):
        model = MODEL if a == "gqa" else with_mha(MODEL)
        plan = MemoryPlan(model, HW, w, k)
        assert max_batch == plan.max_batch(8192)
        r = Roofline(model, HW, w, k)
        # The largest batch within the TPOT target: it meets it, and one more either misses or does not fit.
        assert b >= 1
        assert r.decode(b, 8192).time_s <= 0.050
        assert b == max_batch or r.decode(b + 1, 8192).time_s > 0.050
        assert tps == pytest.approx(b / r.decode(b, 8192).time_s)
    kv = dict(zip(zip(v["weight_dtype"], v["kv_dtype"], v["attention"]), v["kv_kb_per_token"]))
    assert kv[("bfloat16", "bfloat16", "mha")] == pytest.approx(
        4 * kv[("bfloat16", "bfloat16", "gqa")]
    )  # 32 heads vs 8 KV heads
    assert kv[("bfloat16", "fp8", "gqa")] == pytest.approx(kv[("bfloat16", "bfloat16", "gqa")] / 2)


@pytest.mark.parametrize("attention", ["mha", "full"])  # "full": the first edition's name, in old URLs
def test_memory_selected_variant_follows_the_controls(client, attention):
    d = get(client, "memory", weight_dtype="int8", kv_dtype="fp8", attention=attention, context=4096, tpot_ms=30)
    i = d["variants"]["selected"].index(True)
    assert (d["variants"]["weight_dtype"][i], d["variants"]["kv_dtype"][i], d["variants"]["attention"][i]) == (
        "int8",
        "fp8",
        "mha",
    )
    assert "MHA" in d["variants"]["label"][i] and "multi-head attention" in d["notice"].lower()
    assert d["selected"]["max_batch"] == MemoryPlan(with_mha(MODEL), HW, "int8", "fp8").max_batch(4096)


def test_memory_tight_target_and_bad_parameters(client):
    d = get(client, "memory", tpot_ms=1)  # below even one weight read
    assert all(b == 0 for b in d["variants"]["batch_at_tpot"])
    assert "even batch 1 takes" in d["notice"] and d["selected"]["binds"] == "tpot"
    assert "attention: unknown value" in error(client, "memory", attention="mqa")
    assert error(client, "memory", tpot_ms="0").startswith("tpot_ms: must be between")
    assert error(client, "memory", tpot_ms="nan").startswith("tpot_ms")
    assert "maximum context" in error(client, "memory", context=500000)
    too_big = get(client, "memory", model="llama-3.1-405b")
    assert "the weights take" in too_big["warning"]


# ---- 3. SLOs -----------------------------------------------------------------------------------


def test_slo_numbers_are_the_simulators_steady_state(client):
    from servelab.lab.sim_lessons import SLO_STEADY_S, WARMUP_FRACTION, _slo_requests

    d = get(client, "slo", rate=12, ttft_slo_ms=50, tpot_slo_ms=10, prompt_len=1024, output_len=128)
    n = d["config"]["num_requests"]
    assert n == _slo_requests(12) and n >= 12 * SLO_STEADY_S  # sustained: a duration of arrivals, not a burst
    slo = SLO(ttft_s=0.05, tpot_s=0.010)
    result = simulate(
        SimConfig(), WorkloadSpec(num_requests=n, rate=12, input_len="512-1536", output_len="64-192", seed=0)
    )
    warmup_s = WARMUP_FRACTION * n / 12
    assert d["config"]["warmup_s"] == pytest.approx(warmup_s)
    sm = steady_state_summary(result.records, skip_first=0, after_s=warmup_s, slo=slo)
    assert d["config"]["measured_requests"] == sm.num_requests < n  # the warm-up is left out
    assert d["ttft_ms"]["percentiles"]["p90"] == pytest.approx(sm.ttft_s.p90 * 1e3)
    assert d["tpot_ms"]["percentiles"]["p99"] == pytest.approx(sm.tpot_s.p99 * 1e3)
    assert d["attainment"]["both"] == pytest.approx(sm.slo_attainment)
    measured = [r for r in result.records if r.arrival_s >= warmup_s]
    ttfts = sorted(r.ttft_s * 1e3 for r in measured if r.success)
    assert d["ttft_ms"]["x"] == pytest.approx(np.quantile(ttfts, np.linspace(0, 1, 201)).tolist())
    ttft_ok = sum(r.ttft_s <= 0.05 for r in measured if r.success) / len(measured)
    assert d["attainment"]["ttft"] == pytest.approx(ttft_ok)
    assert 0 < sm.slo_attainment < 1  # the targets chosen to bind
    # Achieved: completions per second between the end of the warm-up and the last arrival.
    end = max(r.arrival_s for r in result.records)
    done = sum(1 for r in result.records if r.success and warmup_s <= r.last_token_s <= end)
    assert d["achieved_rps"] == pytest.approx(done / (end - warmup_s))
    assert d["goodput_rps"] == pytest.approx(d["achieved_rps"] * sm.slo_attainment)


def test_slo_light_load_rates_need_fewer_requests_but_a_warm_up_of_a_lifetime():
    from servelab.lab.common import setup_from
    from servelab.lab.params import Params
    from servelab.lab.sim_lessons import SLO_LIGHT_MIN_REQUESTS, SLO_MIN_REQUESTS, WARMUP_FRACTION, _slo_requests
    from servelab.lab.sim_lessons import lifetime_s

    assert _slo_requests(1.0) == SLO_MIN_REQUESTS
    assert _slo_requests(1.0, light_lifetime_s=1.0) == SLO_LIGHT_MIN_REQUESTS
    # The warm-up (the first fifth of the arrivals) lasts at least one lifetime...
    n = _slo_requests(1.0, light_lifetime_s=40.0)
    assert WARMUP_FRACTION * n / 1.0 >= 40.0 and n < SLO_MIN_REQUESTS
    # ...but a light-load rate never runs more than any other, nor less than 20 s of arrivals.
    assert _slo_requests(1.0, light_lifetime_s=1000.0) == SLO_MIN_REQUESTS
    assert _slo_requests(50.0, light_lifetime_s=0.1) == _slo_requests(50.0) > SLO_MIN_REQUESTS
    s = setup_from(Params({}))
    rl = s.roofline()
    short, long = lifetime_s(s, 1024, 128, 2.0), lifetime_s(s, 1024, 2048, 2.0)
    assert long > short >= rl.prefill(1024).time_s + 128 * rl.decode(1, 1024 + 64).time_s
    assert lifetime_s(s, 1024, 2048, 20.0) > long  # more requests in flight: bigger, slower steps


def test_slo_above_saturation_shows_offered_and_achieved_and_misses(client):
    from servelab.lab.sim_lessons import SLO_STEADY_S

    # The first edition said "meets, 100%" at 40 req/s offered with ~27 sustainable: the queue never built.
    d = get(client, "slo", rate=40, ttft_slo_ms=500, tpot_slo_ms=50)
    assert d["saturated"] and d["achieved_rps"] < 0.9 * d["offered_rps"]
    assert d["attainment"]["both"] < 0.5 and "more than it sustains" in d["notice"] and "misses" in d["notice"]
    sw = d["sweep"]
    assert sw["saturation_rps"] == max(sw["achieved_rps"]) < max(sw["offered_rps"])
    # Below saturation the system keeps up; the knee is the first swept rate that breaks a p90 target.
    assert sw["achieved_rps"][0] == pytest.approx(sw["offered_rps"][0], rel=0.2)
    knee = sw["knee_rps"]
    assert knee is not None and not sw["meets"][sw["arrived_rps"].index(knee)]
    assert all(sw["meets"][: sw["arrived_rps"].index(knee)])
    # The rates plotted are the runs' own, and every rate is measured over the same steady duration.
    assert all(abs(a / o - 1) < 0.2 for a, o in zip(sw["arrived_rps"], sw["offered_rps"]))
    assert min(sw["measured_s"]) >= 0.9 * SLO_STEADY_S
    assert all(i >= t for i, t in zip(sw["itl_pct_ms"]["p99"], sw["tpot_pct_ms"]["p50"]))


def test_slo_defaults_sit_near_the_knee(client):
    d = get(client, "slo")
    sw = d["sweep"]
    assert d["offered_rps"] < sw["knee_rps"] <= 1.5 * d["offered_rps"]  # a few req/s more breaks a target
    assert not d["saturated"]


def test_slo_higher_rate_raises_tail_latency(client):
    low = get(client, "slo", rate=2)
    high = get(client, "slo", rate=40)
    assert high["ttft_ms"]["percentiles"]["p90"] > low["ttft_ms"]["percentiles"]["p90"]
    assert high["tpot_ms"]["percentiles"]["p90"] > low["tpot_ms"]["percentiles"]["p90"]


def test_slo_answers_the_chosen_rate_first_then_the_sweep_and_a_new_target_reuses_it():
    from fastapi.testclient import TestClient

    from servelab.lab.app import create_lab_app

    app = create_lab_app()
    c = TestClient(app)
    params = {"rate": "9", "ttft_slo_ms": "300", "tpot_slo_ms": "15", "prompt_len": "700", "output_len": "90"}
    try:
        first = c.post("/api/lessons/slo", json=params)
        assert first.status_code == 202, first.text  # drawn at once: the chosen rate, the sweep to come
        early = first.json()
        assert early["status"] == "running" and 0 <= early["done"] < early["total"]
        assert len(early["sweep"]["offered_rps"]) == early["done"] and early["sweep"]["saturation_rps"] is None
        full = get(c, "slo", **params)
        assert full["status"] == "done" and full["sweep"]["complete"]
        # The chosen rate's figures do not change when the sweep lands.
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "achieved_rps", "goodput_rps", "attainment"):
            assert full[k] == early[k]
        # A new target re-simulates nothing: the finished sweep is re-judged at once.
        looser = c.post("/api/lessons/slo", json={**params, "tpot_slo_ms": "60"})
        assert looser.status_code == 200, looser.text
        sw, sw2 = full["sweep"], looser.json()["sweep"]
        assert sw2["achieved_rps"] == sw["achieved_rps"] and sw2["tpot_ms"] == sw["tpot_ms"]
        assert all(g2 >= g for g, g2 in zip(sw["goodput_rps"], sw2["goodput_rps"]))
        assert sw2["meets"] == [
            (t is None or t <= 60) and (f is None or f <= 300) for t, f in zip(sw2["tpot_ms"], sw2["ttft_ms"])
        ]
    finally:
        app.state.stop()


def test_slo_runs_as_the_chosen_engines_defaults(client):
    from servelab.sim.runner import engine_sim_config

    params = {"rate": 12, "ttft_slo_ms": 50, "tpot_slo_ms": 10, "prompt_len": 1024, "output_len": 128}
    d = get(client, "slo", engine_profile="sglang", **params)
    assert d["config"]["engine_profile"] == "sglang"
    n = d["config"]["num_requests"]
    config = engine_sim_config("sglang", model="llama-3.1-8b", hardware="h100-sxm")
    result = simulate(config, WorkloadSpec(num_requests=n, rate=12, input_len="512-1536", output_len="64-192", seed=0))
    sm = steady_state_summary(result.records, skip_first=0, after_s=d["config"]["warmup_s"], slo=SLO(0.05, 0.010))
    assert d["tpot_ms"]["percentiles"]["p90"] == pytest.approx(sm.tpot_s.p90 * 1e3)
    # SGLang runs prompts before decodes: the same load decodes slower than servelab's chunked steps.
    assert d["tpot_ms"]["percentiles"]["p90"] > get(client, "slo", **params)["tpot_ms"]["percentiles"]["p90"]
    assert "choose one of servelab, vllm, sglang, trtllm" in error(client, "slo", engine_profile="tgi")


@pytest.mark.parametrize(
    "params, needle",
    [
        ({"rate": "0"}, "rate: must be between 0.1 and 1000"),
        ({"output_len": "1"}, "output_len: must be between 2"),
        ({"prompt_len": "100000", "output_len": "8000"}, "exceeds llama-3.1-8b's maximum context"),
    ],
)
def test_slo_bad_parameters(client, params, needle):
    assert needle in error(client, "slo", **params)


# ---- 4. chunked prefill -----------------------------------------------------------------------------


def test_chunked_prefill_shows_the_stall_and_its_fix(client):
    d = get(client, "chunked-prefill", prompt_len=8192, decode_batch=16, chunk_tokens=512)
    first, chunked = d["prefill_first"], d["chunked"]
    # Prefill-first runs the long prompt alone in one step: exactly the roofline's prefill.
    i = first["steps"]["prefill_tokens"].index(8192)
    assert first["steps"]["duration_ms"][i] == pytest.approx(rl().prefill(8192).time_s * 1e3)
    assert max(first["steps"]["duration_ms"]) == first["longest_step_ms"]
    # Chunked never puts more than the budget into one step.
    assert max(chunked["steps"]["prefill_tokens"]) <= 512
    assert sum(chunked["steps"]["prefill_tokens"]) >= 8192
    # Every decoding user stalls for the whole prefill without chunking.
    assert first["max_user_gap_ms"] >= rl().prefill(8192).time_s * 1e3
    assert chunked["max_user_gap_ms"] < first["max_user_gap_ms"] / 5
    assert set(first["tokens"]["seq"]) == set(range(16))
    assert first["long_tokens"]["seq"] and set(first["long_tokens"]["seq"]) == {16}
    lo, hi = d["time_range_ms"]
    assert all(lo <= t <= hi for t in first["tokens"]["time_ms"])


def test_chunked_prefill_bad_parameters(client):
    assert error(client, "chunked-prefill", chunk_tokens=8).startswith("chunk_tokens: must be between 16")
    assert error(client, "chunked-prefill", decode_batch=1000).startswith("decode_batch: must be between 1 and 64")
    assert "smollm2-135m's maximum context" in error(client, "chunked-prefill", model="smollm2-135m", prompt_len=16384)


def test_chunked_prefill_names_prompt_len_and_the_length_the_user_gave(client):
    # was: param "context", "prompt length 16392" (the request's internal 8 output tokens added unsaid)
    r = client.post("/api/lessons/chunked-prefill", json={"model": "smollm2-135m", "prompt_len": 16384})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_len"
    assert r.json()["error"]["message"].startswith("prompt_len: 16,384 plus the 8 tokens the long request generates")


# ---- 5. disaggregated ---------------------------------------------------------------------------------


def test_disaggregated_is_the_simulators(client):
    d = get(
        client, "disaggregated", rate=6, prefill_gpus=1, decode_gpus=1, link_gbps=50, prompt_len=2048, output_len=128
    )
    n = d["config"]["num_requests"]
    workload = WorkloadSpec(num_requests=n, rate=6, input_len="1024-3072", output_len="64-192", seed=0)
    colocated = simulate(SimConfig(replicas=2), workload)
    split = simulate(SimConfig(disagg=(1, 1), link_bandwidth_bytes_per_s=50e9), workload)
    assert d["colocated"]["ttft_ms"]["percentiles"]["p90"] == pytest.approx(colocated.summary.ttft_s.p90 * 1e3)
    assert d["disaggregated"]["ttft_ms"]["percentiles"]["p90"] == pytest.approx(split.summary.ttft_s.p90 * 1e3)
    assert d["disaggregated"]["itl_ms"]["percentiles"]["p99"] == pytest.approx(split.summary.itl_s.p99 * 1e3)
    assert d["disaggregated"]["kv_transfer_ms"]["p50"] == pytest.approx(split.kv_transfer_s.p50 * 1e3)
    # The lesson's claim: decode never waits on a prefill, so the ITL tail shrinks; TTFT pays the transfer.
    assert d["disaggregated"]["itl_ms"]["percentiles"]["p99"] < d["colocated"]["itl_ms"]["percentiles"]["p99"]
    assert d["disaggregated"]["kv_transfer_ms"]["p50"] > 0
    x = d["colocated"]["itl_ms"]["x"]
    assert x == sorted(x) and len(x) == 201


def test_disaggregated_slower_link_costs_ttft(client):
    fast = get(client, "disaggregated", link_gbps=400)
    slow = get(client, "disaggregated", link_gbps=2)
    assert slow["disaggregated"]["kv_transfer_ms"]["p50"] > 10 * fast["disaggregated"]["kv_transfer_ms"]["p50"]
    assert (
        slow["disaggregated"]["ttft_ms"]["percentiles"]["p50"] > fast["disaggregated"]["ttft_ms"]["percentiles"]["p50"]
    )


def test_disaggregated_bad_parameters(client):
    assert "at most 8 replicas" in error(client, "disaggregated", prefill_gpus=4, decode_gpus=6)
    assert error(client, "disaggregated", link_gbps="fast").startswith("link_gbps: 'fast' is not a number")


# ---- helpers -------------------------------------------------------------------------------------


def test_cdf_of_many_samples_uses_quantiles():
    from servelab.lab.sim_lessons import CDF_POINTS, cdf

    values = np.random.default_rng(0).exponential(size=5000)
    out = cdf(values, scale=1.0)
    assert len(out["x"]) == CDF_POINTS and out["count"] == 5000
    assert out["x"][0] == pytest.approx(values.min()) and out["x"][-1] == pytest.approx(values.max())
    assert out["x"][100] == pytest.approx(float(np.median(values)))
    few = cdf([3.0, 1.0, 2.0], scale=1.0)
    assert few["x"] == [1.0, 2.0, 3.0] and few["cdf"] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert math.isclose(few["cdf"][-1], 1.0)


# ---- 7. capacity ---------------------------------------------------------------------------------


def _wait_done(client, **params) -> dict:
    import time

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        response = client.post("/api/lessons/capacity", json=params)
        if response.status_code == 200:
            return response.json()
        assert response.status_code == 202, response.text
        progress = response.json()
        assert progress["status"] == "running" and 0 <= progress["done"] <= progress["total"]
        time.sleep(0.5)
    raise AssertionError("the capacity plan did not finish")


def _plan_cli(command: str, capsys) -> dict:
    """What `servelab plan` prints for a bar's command, as JSON."""
    import json
    import shlex

    from servelab.cli import main as cli_main

    argv = shlex.split(command)
    assert argv[:2] == ["servelab", "plan"]
    capsys.readouterr()
    assert cli_main([*argv[1:], "--json", "--workers", "1"]) == 0
    return json.loads(capsys.readouterr().out)["configs"][0]


def _assert_bar_is_the_plan(plan: dict, i: int, config: dict) -> None:
    assert config["hardware"] == plan["hardware"][i]
    assert plan["concurrency"][i] == pytest.approx(config["capacity_concurrency"], rel=0.02)
    assert plan["tokens_per_s_per_gpu"][i] == pytest.approx(config["output_tokens_per_s_per_device"], rel=0.02)
    assert plan["ttft_ms"][i] == pytest.approx(config["ttft_s"] * 1e3, rel=0.02)
    assert plan["tpot_ms"][i] == pytest.approx(config["tpot_s"] * 1e3, rel=0.02)


def test_capacity_bars_are_servelab_plans_numbers(client, capsys):
    from servelab.lab.capacity_lesson import BIND_LABEL
    from servelab.spec import HARDWARE

    d = _wait_done(client, ttft_ms=2000, tpot_ms=50, prompt_len=512, output_len=32)
    plan = d["plan"]
    assert plan["hardware"] == list(HARDWARE)  # the catalog's order: no bar moves when a simulation lands
    assert set(plan["status"]) == {"simulated"}
    i = plan["hardware"].index("h100-sxm")
    assert plan["command"][i] == (
        "servelab plan --model llama-3.1-8b --hardware h100-sxm --tp 1 --dtype bfloat16 --kv-cache-dtype bfloat16 "
        "--engine-profile servelab --max-num-seqs 4096 --slo-ttft 2000ms --slo-tpot 50ms --percentile 90 "
        "--input-len 512 --output-len 32"
    )
    _assert_bar_is_the_plan(plan, i, _plan_cli(plan["command"][i], capsys))
    assert plan["usd_per_million_tokens"][i] == pytest.approx(
        HW.price_per_hour_usd / (plan["tokens_per_s_per_gpu"][i] * 3600) * 1e6
    )
    # Users meet both targets: no bar's percentile TTFT or TPOT is over its target.
    for ok, ttft_ms, tpot_ms, binds, config in zip(
        plan["meets_slo"], plan["ttft_ms"], plan["tpot_ms"], plan["binds"], plan["config"]
    ):
        if ok:
            assert ttft_ms <= 2000 and tpot_ms <= 50
            assert binds in ("memory", "ttft", "tpot", "max-num-seqs", "max-num-batched-tokens") and config.endswith(
                BIND_LABEL[binds]
            )
    assert "p90 TTFT ≤ 2,000 ms and TPOT ≤ 50 ms" in d["stats"][0]["value"]


def test_capacity_bars_equal_the_plan_command_for_other_targets(capsys):
    """The lab's own path (its jobs from its command line, `plan_one`, `result`) on a second input:
    each bar equals what `servelab plan` prints for the bar's command."""
    from servelab.bench.planner import plan_one
    from servelab.lab.capacity_lesson import PlanKey, _jobs, result
    from servelab.lab.common import setup_from
    from servelab.lab.params import Params

    key = PlanKey("llama-3.1-8b", "bfloat16", "bfloat16", 1, "servelab", 30.0, 300.0, 1024, 16)
    rows = {job.hardware: plan_one(job) for job in _jobs(key) if job.hardware in ("h100-sxm", "l40s")}
    plan = result(setup_from(Params({})), key, rows)["plan"]
    for hw in rows:
        i = plan["hardware"].index(hw)
        assert plan["status"][i] == "simulated" and plan["meets_slo"][i]
        _assert_bar_is_the_plan(plan, i, _plan_cli(plan["command"][i], capsys))


def test_a_capacity_level_is_sized_to_the_labs_memory_budget():
    from servelab.bench.planner import level_requests
    from servelab.lab.capacity_lesson import MAX_NUM_SEQS, PlanKey, _jobs, most_running, plan_command
    from servelab.lab.simulations import (
        DEFAULT_MEMORY_BUDGET_BYTES,
        PEAK_BYTES_PER_OUTPUT_TOKEN,
        PEAK_BYTES_PER_PROMPT_TOKEN,
        max_plan_concurrency,
    )
    from servelab.spec import HARDWARE

    for prompt_len, output_len in ((16, 4096), (32768, 4096), (1024, 256), (16, 16)):
        per_request = PEAK_BYTES_PER_PROMPT_TOKEN * prompt_len + PEAK_BYTES_PER_OUTPUT_TOKEN * output_len
        cap = max_plan_concurrency(prompt_len, output_len)
        assert level_requests(cap) * per_request <= DEFAULT_MEMORY_BUDGET_BYTES < level_requests(cap + 1) * per_request
        key = PlanKey("llama-3.1-8b", "bfloat16", "bfloat16", 1, "servelab", 50.0, 2000.0, prompt_len, output_len)
        for job in _jobs(key):
            # The command caps the search only where the budget is below what runs at once.
            running = most_running(key.setup(), HARDWARE[job.hardware], prompt_len, output_len, MAX_NUM_SEQS)
            assert job.max_concurrency == (cap if cap < running else None), (prompt_len, output_len, job.hardware)
            assert ("--max-concurrency" in plan_command(key, job.hardware)) == (cap < running)
    # 16 + 4,096 tokens: a B200's KV cache holds more than the budget's 204; an L4's holds fewer.
    assert max_plan_concurrency(16, 4096) == 204
    key = PlanKey("llama-3.1-8b", "bfloat16", "bfloat16", 1, "servelab", 50.0, 2000.0, 16, 4096)
    assert "--max-concurrency 204 " in plan_command(key, "b200") and "--max-concurrency" not in plan_command(key, "l4")


def test_a_bar_capped_by_the_memory_budget_says_so_and_is_the_plans(monkeypatch, capsys):
    import servelab.lab.capacity_lesson as lesson
    from servelab.bench.planner import plan_one
    from servelab.lab.common import setup_from
    from servelab.lab.params import Params

    monkeypatch.setattr(lesson, "max_plan_concurrency", lambda prompt_len, output_len: 6)
    key = lesson.PlanKey("llama-3.1-8b", "bfloat16", "bfloat16", 1, "servelab", 200.0, 5000.0, 128, 16)
    rows = {job.hardware: plan_one(job) for job in lesson._jobs(key) if job.hardware == "h100-sxm"}
    plan = lesson.result(setup_from(Params({})), key, rows)["plan"]
    i = plan["hardware"].index("h100-sxm")
    assert "--max-concurrency 6 " in plan["command"][i]
    assert plan["concurrency"][i] == 6 and plan["binds"][i] == "search-maximum"
    assert plan["config"][i].endswith("the lab's memory budget per simulation (--max-concurrency)")
    _assert_bar_is_the_plan(plan, i, _plan_cli(plan["command"][i], capsys))


def test_a_kv_bound_bar_is_measured_at_the_kv_limit():
    from servelab.bench.planner import plan_one
    from servelab.lab.capacity_lesson import MAX_NUM_SEQS, PlanKey, _jobs, most_running
    from servelab.spec import HARDWARE

    # An L4 keeps ~42k tokens of Llama-3.1-8B KV after the weights: ten 4,160-token requests.
    key = PlanKey("llama-3.1-8b", "bfloat16", "bfloat16", 1, "servelab", 500.0, 20_000.0, 4096, 64)
    row = plan_one(next(j for j in _jobs(key) if j.hardware == "l4"))
    b = row.binding
    assert b.limit == "kv-cache" and row.capacity_concurrency == row.max_running == b.peak_running
    assert b.preemptions == 0 and row.capacity["levels"][-1]["load"] == row.max_running
    # The lab's count of what runs at once (its bounds, its memory-budget cap) is the plan's ceiling,
    # and none where one request at full length does not fit beside the weights, as plan says.
    assert most_running(key.setup(), HARDWARE["l4"], 4096, 64, MAX_NUM_SEQS) == row.max_running
    long = PlanKey("llama-3.1-70b", "bfloat16", "bfloat16", 2, "servelab", 500.0, 20_000.0, 32768, 4096)
    assert most_running(long.setup(), HARDWARE["h100-sxm"], 32768, 4096, MAX_NUM_SEQS) == 0
    assert not plan_one(next(j for j in _jobs(long) if j.hardware == "h100-sxm")).fits


def test_capacity_answers_at_once_with_upper_bounds_then_simulations():
    from fastapi.testclient import TestClient

    from servelab.lab.app import create_lab_app
    from servelab.lab.capacity_lesson import CapacityPlanner
    from servelab.spec import HARDWARE

    app = create_lab_app()
    app.state.capacity_planner = CapacityPlanner(max_workers=1)
    params = {"ttft_ms": 2000, "tpot_ms": 20, "prompt_len": 1024, "output_len": 16}
    first = TestClient(app).post("/api/lessons/capacity", json=params)
    app.state.capacity_planner.close()
    assert first.status_code == 202
    body = first.json()
    assert body["status"] == "running" and "accelerators simulated" in body["message"]
    plan = body["plan"]
    assert len(plan["hardware"]) == body["total"] and "estimate" in plan["status"]
    assert "the roofline's upper bound" in body["message"] and "the roofline's upper bound" in body["notice"]
    assert plan["hardware"] == list(HARDWARE)  # the estimates sort nothing
    i = plan["hardware"].index("h100-sxm")
    assert plan["status"][i] == "estimate"
    assert plan["config"][i].startswith("≤ ") and "upper bound from the roofline" in plan["config"][i]
    assert plan["meets_slo"][i] is None and plan["binds"][i] is None


def test_the_upper_bound_is_never_below_the_simulated_capacity():
    # The case: TPOT 20 ms with 16-token outputs on an H100 showed ≈226 users, then 8 simulated.
    from servelab.bench.planner import plan_one
    from servelab.lab.capacity_lesson import PlanKey, _jobs, upper_bound
    from servelab.lab.common import setup_from
    from servelab.lab.params import Params
    from servelab.spec import HARDWARE

    s = setup_from(Params({}))
    for key, hws in (
        (PlanKey("llama-3.1-8b", "bfloat16", "bfloat16", 1, "servelab", 20.0, 2000.0, 1024, 16), ("h100-sxm",)),
        (PlanKey("llama-3.1-8b", "bfloat16", "bfloat16", 1, "servelab", 500.0, 20_000.0, 4096, 64), ("l4",)),
    ):
        for job in _jobs(key):
            if job.hardware not in hws:
                continue
            row, bound = plan_one(job), upper_bound(s, HARDWARE[job.hardware], key)
            assert row.meets_slo
            assert bound["users"] >= row.capacity_concurrency
            assert bound["tokens_per_s_per_gpu"] >= row.tokens_per_s_per_device


def test_each_bar_is_plans_search_with_the_labs_time_limit():
    from servelab.bench.planner import PlanRow
    from servelab.lab.capacity_lesson import JOB_TIME_LIMIT_S, PlanKey, _jobs, result
    from servelab.lab.common import setup_from
    from servelab.lab.params import Params

    key = PlanKey("llama-3.1-8b", "bfloat16", "bfloat16", 1, "servelab", 50.0, 2000.0, 1024, 256)
    jobs = _jobs(key)
    assert jobs and all(j.time_limit_s == JOB_TIME_LIMIT_S for j in jobs)
    # a bar whose search ran out of time says so, not that it misses the targets
    late = PlanRow(hardware="h100-sxm", tp=1, fits=True, timed_out=True, reason="the search ran past its time limit")
    plan = result(setup_from(Params({})), key, {"h100-sxm": late})["plan"]
    i = plan["hardware"].index("h100-sxm")
    assert plan["config"][i] == "ran past the time limit" and "time limit" in plan["reason"][i]


def test_capacity_bad_parameters(client):
    assert error(client, "capacity", tpot_ms="0").startswith("tpot_ms: must be between 1")
    assert error(client, "capacity", ttft_ms="-5").startswith("ttft_ms: must be between 1")
    assert "maximum context" in error(client, "capacity", prompt_len=131072, output_len=100)


# ---- limits: one source of truth ------------------------------------------------------------------


def _n(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def test_catalog_publishes_the_limits_the_lessons_enforce(client):
    from servelab.lab.limits import LIMITS

    limits = client.get("/api/catalog").json()["limits"]
    assert set(limits) == set(LIMITS) and {"batch", "context"} <= set(limits["batching"])
    limits.pop("live")  # the "your machine" panel's load: checked by its own test
    for lesson, inputs in limits.items():
        for name, lim in inputs.items():
            above = lim["max"] + (1 if float(lim["max"]).is_integer() else 0.5)
            below = lim["min"] - (1 if lim["min"] >= 1 else lim["min"] / 2 or 0.5)
            for value in (above, below):
                message = error(client, lesson, **{name: value})
                assert message.startswith(f"{name}: must be between {_n(lim['min'])} and {_n(lim['max'])}"), message


def test_chunked_prefill_sizes_each_user_at_its_own_context(client):
    # 16 users with 256-token prompts and a 32K prompt fit easily; sizing every user at 32K did not.
    d = get(client, "chunked-prefill", prompt_len=32768, decode_batch=16, chunk_tokens=512)
    assert d["prefill_first"]["long_ttft_ms"] > d["chunked"]["max_user_gap_ms"]
    # What truly does not fit (a 135M-token KV budget is far off; use a small accelerator) says what to change.
    d = get(
        client, "chunked-prefill", model="llama-3.1-70b", hardware="h100-sxm", tp="2", prompt_len=32768, decode_batch=64
    )
    assert "need" in d["warning"] and "lower prompt_len or decode_batch" in d["warning"], d["warning"]
    assert d["no_fit"]["label"].startswith("does not fit: 64 decoding users")


def test_batching_names_the_memory_limit_for_the_charts(client):
    d = get(client, "batching", batch=64, context=2048)
    plan = MemoryPlan(MODEL, HW, "bf16", "bf16", 1)
    assert d["memory"]["max_batch"] == plan.max_batch(2048) == 208
    assert max(d["sweep"]["batch"]) > 208  # the sweep crosses the limit, so the charts must mark it
    assert d["limits"]["memory"] == {"batch": 208, "label": "KV cache full at batch 208"}
    assert d["sweep"]["fits"] == [b <= 208 for b in d["sweep"]["batch"]]


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"model": "llama-3.1-70b"}, "the weights take"),  # does not fit one H100: says why and what to change
        ({"batch": "4096", "prompt_len": "8192"}, "the limit at this context is batch"),
    ],
)
def test_two_workloads_that_do_not_fit_draw_with_a_warning(client, params, needle):
    # "Does not fit" is handled one way: the lesson still answers, names the limit, and the text says why.
    d = get(client, "two-workloads", **params)
    assert needle in d["warning"]
    limit = d["limits"]["context"]["prompt_len"]
    assert limit < int(params.get("prompt_len", 2048))
    if "batch" in params:
        assert limit == MemoryPlan(MODEL, HW, "bf16", "bf16", 1).kv_capacity_tokens // 4096
        assert f"fits up to {limit:,} tokens" in d["limits"]["context"]["label"]


def test_two_workloads_that_fit_have_no_warning(client):
    d = get(client, "two-workloads", batch=1, prompt_len=2048)
    assert d["warning"] is None
    assert d["limits"]["context"]["prompt_len"] == MemoryPlan(MODEL, HW, "bf16", "bf16", 1).kv_capacity_tokens


# ---- does not fit: one answer everywhere -----------------------------------------------------------


@pytest.mark.parametrize("lesson", ["slo", "chunked-prefill", "disaggregated", "request-cost"])
def test_a_configuration_that_does_not_fit_is_drawn_shaded_not_refused(client, lesson):
    d = get(client, lesson, model="llama-3.1-70b")  # 141 GB of weights on one 80 GB H100
    assert d["no_fit"]["label"].startswith("does not fit: the weights take 141.1 GB")
    assert "raise tp or use a smaller dtype" in d["warning"]  # what to change
    assert d["config"]["model"] == "llama-3.1-70b"


@pytest.mark.parametrize(
    ("lesson", "params"),
    [
        ("slo", {"prompt_len": 1200, "output_len": 1000, "rate": 0.1}),  # would cut every output short
        ("slo", {"prompt_len": 4000}),  # a prompt alone larger than the pool
        ("disaggregated", {"prompt_len": 4000}),
    ],
)
def test_a_request_longer_than_the_kv_pool_is_no_fit_not_truncated(client, lesson, params):
    # 70B in fp8 with float32 KV on one H100: 2,192 tokens of KV cache per replica
    d = get(client, lesson, model="llama-3.1-70b", weight_dtype="fp8", kv_dtype="float32", **params)
    assert d["no_fit"]["label"].startswith("does not fit: the longest request"), d
    assert "KV cache of 2,192 tokens" in d["warning"] and "lower prompt_len or output_len" in d["warning"]
    assert "request 0" not in d["warning"]


def test_two_workloads_roofline_names_the_decode_wall_and_the_idle_tensor_cores(client):
    d = get(client, "two-workloads", prompt_len=2048, batch=1)
    r = rl()
    wall = d["limits"]["roofline"]
    assert wall["intensity"] == pytest.approx(r.decode(208, 2048).arithmetic_intensity)
    assert "batch > 208 does not fit" in wall["label"]
    # The seed: at batch 1 the GPU is ~99% idle.
    decode = r.decode(1, 2048)
    assert d["tensor_cores_idle"] == pytest.approx(1 - decode.peak_compute_time_s / decode.time_s)
    assert d["tensor_cores_idle"] > 0.99
    # The formulas are the same StepCost's numbers.
    lines = "\n".join(d["formulas"][1]["lines"])
    assert f"{decode.time_s * 1e3:.3g} ms: memory-bound" in lines and "FLOP/byte" in lines


def test_batching_busy_share_and_frontier_data(client):
    d = get(client, "batching", batch=64, context=2048)
    r = rl()
    for b, busy in zip(d["sweep"]["batch"], d["sweep"]["busy_pct"]):
        c = r.decode(b, 2048)
        assert busy == pytest.approx(100 * c.peak_compute_time_s / c.time_s)
    assert d["sweep"]["busy_pct"] == sorted(d["sweep"]["busy_pct"])  # more users, busier cores
    assert d["formulas"][0]["title"].startswith("one decode step, batch 64")


def test_request_cost_is_the_roofline(client):
    from servelab.lab.request_cost_lesson import PER_REQUESTS, decode_seconds

    d = get(client, "request-cost", prompt_len=2048, output_len=256, batch=32, price_per_gpu_hour=2)
    r = rl()
    prefill_s = r.prefill(2048).time_s
    dec_s = decode_seconds(r, 32, 2048, 256)
    assert dec_s == pytest.approx(255 * r.decode(32, 2048 + 128).time_s)
    assert d["selected"]["e2e_ms"] == pytest.approx((prefill_s + dec_s) * 1e3)
    assert d["selected"]["usd_per_k_requests"] == pytest.approx(PER_REQUESTS * (prefill_s + dec_s / 32) * 2 / 3600)
    # Long outputs cost latency, long prompts cost money: both sweeps rise.
    e2e = [v for v in d["latency"]["e2e_ms"] if v is not None]
    usd = [v for v in d["money"]["total_usd"] if v is not None]
    assert e2e == sorted(e2e) and usd == sorted(usd)
    # Past the KV limit the batch shrinks, and the chart says where.
    lim = d["limits"]["prompt"]["prompt_len"]
    assert r.memory.max_batch(lim + 256) < 32 <= r.memory.max_batch(lim // 2 + 256)
    # The price is adjustable; without one, the catalog's.
    cheap = get(client, "request-cost", prompt_len=2048, output_len=256, batch=32, price_per_gpu_hour=1)
    assert cheap["selected"]["usd_per_k_requests"] == pytest.approx(d["selected"]["usd_per_k_requests"] / 2)
    default = get(client, "request-cost", prompt_len=2048, output_len=256, batch=32)
    assert default["config"]["price_per_gpu_hour"] == HW.price_per_hour_usd


def test_disaggregated_says_the_median_is_not_what_improves(client):
    d = get(client, "disaggregated")
    a, b = d["colocated"]["itl_ms"]["percentiles"], d["disaggregated"]["itl_ms"]["percentiles"]
    assert b["p99"] < a["p99"]
    if b["p50"] > a["p50"] * 1.005:
        assert "(worse)" in d["notice"] and "only the tail improves" in d["notice"]


def test_disaggregated_never_says_the_tail_improves_when_it_is_worse(client):
    # At 2P:2D the split's p99 ITL is above colocated: the note must say so.
    d = get(client, "disaggregated", prefill_gpus=2, decode_gpus=2)
    a, b = d["colocated"]["itl_ms"]["percentiles"], d["disaggregated"]["itl_ms"]["percentiles"]
    assert b["p99"] > a["p99"] * 1.005
    assert "tail improves" not in d["notice"] and "only the tail" not in d["notice"]


def test_capacity_names_the_labs_sequence_cap_when_it_binds():
    from types import SimpleNamespace

    from servelab.lab.capacity_lesson import BIND_LABEL, MAX_NUM_SEQS, PlanKey, _binds, _jobs

    # 18-token requests fill an H100's KV cache only past 23,000 users: the lab's cap binds first.
    key = PlanKey("llama-3.1-8b", "bfloat16", "bfloat16", 1, "servelab", 50.0, 2000.0, 16, 2)
    job = next(j for j in _jobs(key) if j.hardware == "h100-sxm")
    assert job.scheduler_overrides["max_num_seqs"] == MAX_NUM_SEQS and job.max_concurrency is None
    row = SimpleNamespace(binding=SimpleNamespace(limit="max-num-seqs"))
    assert _binds(row) == "max-num-seqs" and "4,096-sequence cap" in BIND_LABEL["max-num-seqs"]
    row.binding.limit = "kv-cache"
    assert _binds(row) == "memory"


def test_simulations_past_the_limit_answer_429_and_leave_the_lab_responsive(client):
    from servelab.lab.limits import MAX_RUNNING_SIMULATIONS

    slots = client.app.state.simulations._slots  # noqa: SLF001
    # as if MAX_RUNNING_SIMULATIONS heavy `slo` runs held their worker threads
    for _ in range(MAX_RUNNING_SIMULATIONS):
        assert slots.acquire(blocking=False)
    try:
        for lesson in ("slo", "chunked-prefill", "disaggregated"):
            r = client.post(f"/api/lessons/{lesson}", json={})
            assert r.status_code == 429 and r.headers["retry-after"] == "5", r.text
            assert f"already running {MAX_RUNNING_SIMULATIONS} simulations" in r.json()["error"]["message"]
        assert client.get("/api/health").status_code == 200
        # The lessons whose sliders redraw while dragged are the roofline's: they need no slot.
        instant = client.get("/api/catalog").json()["instant_lessons"]
        assert set(instant) == {"two-workloads", "batching", "memory", "request-cost", "qps-vs-tokens"}
        for lesson in instant:
            assert client.post(f"/api/lessons/{lesson}", json={}).status_code == 200, lesson
    finally:
        for _ in range(MAX_RUNNING_SIMULATIONS):
            slots.release()
    assert client.post("/api/lessons/slo", json={}).status_code == 200


def _context_max(rule: dict, max_context: int, others: int) -> int:
    """The page's formula (applyContextRule in lab.js) for a length's largest value."""
    num, den = rule["spread"]
    return (den * max_context + den - 1) // num - rule["extra"] - others


@pytest.mark.parametrize("model", ["llama-2-7b", "llama-3.1-8b"])
def test_the_forms_context_limits_are_the_lessons(client, model):
    """At the max the page computes, a lesson accepts the length; one token more is the context's 400."""
    cat = client.get("/api/catalog").json()
    max_context = next(m["max_context"] for m in cat["models"] if m["name"] == model)
    defaults = cat["defaults"]
    for lesson, rule in cat["context_rules"].items():
        field, *rest = rule["fields"]
        others = sum(int(defaults[lesson][f]) for f in rest)
        top = min(cat["limits"][lesson][field]["max"], _context_max(rule, max_context, others))
        params = {"model": model, **{f: defaults[lesson][f] for f in rest}}
        at_max = client.post(f"/api/lessons/{lesson}", json={**params, field: top})
        # A simulated lesson may still refuse a run that long for its budget, never for the context.
        assert "maximum context" not in at_max.text, (lesson, at_max.text)
        if top < cat["limits"][lesson][field]["max"]:
            over = client.post(f"/api/lessons/{lesson}", json={**params, field: top + 1})
            assert over.status_code == 400 and "maximum context" in over.json()["error"]["message"], (lesson, over.text)
