"""Every lesson's note says what its own numbers say: random inputs for each lesson's API, and
each claim of the note checked against the figures in the same response (and, where the response
does not carry them, against the memory plan the lesson used)."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from servelab.cost import MemoryPlan
from servelab.lab.app import create_lab_app
from servelab.lab.common import fmt, setup_from
from servelab.lab.params import Params
from servelab.lab.roofline_lessons import with_mha
from servelab.spec import HARDWARE, KV_DTYPES, MODELS, WEIGHT_DTYPES, get_hardware, get_model

CLIENT = TestClient(create_lab_app())
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SIMULATED = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])

setups = st.fixed_dictionaries(
    {
        "model": st.sampled_from(list(MODELS)),
        "hardware": st.sampled_from(list(HARDWARE)),
        "weight_dtype": st.sampled_from(list(WEIGHT_DTYPES)),
        "kv_dtype": st.sampled_from(list(KV_DTYPES)),
        "tp": st.sampled_from(["1", "2", "4", "8"]),
    }
)


def answer(lesson: str, params: dict) -> dict:
    """The lesson's JSON; inputs the lesson refuses (a tp that does not divide the heads, a context
    past the model's) are not this test's subject."""
    body = {k: str(v) for k, v in params.items()}
    response = CLIENT.post(f"/api/lessons/{lesson}", json=body)
    deadline = time.monotonic() + 600
    while response.status_code == 202 and time.monotonic() < deadline:  # the rest of a staged answer
        time.sleep(0.3)
        response = CLIENT.post(f"/api/lessons/{lesson}", json=body)
    assume(response.status_code == 200)
    body = response.json()
    assume("no_fit" not in body)
    return body


def plan_of(params: dict, attention: str = "gqa") -> MemoryPlan:
    model = get_model(params["model"])
    if attention == "mha":
        model = with_mha(model)
    return MemoryPlan(model, get_hardware(params["hardware"]), params["weight_dtype"], params["kv_dtype"],
                      int(params["tp"]))  # fmt: skip


def check_step_claim(text: str, point: dict, ridge: float) -> None:
    """A phase's sentence: its intensity, its side of the ridge and its bound, as its numbers say."""
    side = "above" if point["intensity"] >= ridge else "below"
    factor = ridge / point["intensity"] if side == "below" else point["intensity"] / ridge
    assert f"{fmt(point['intensity'])} FLOP/byte, {fmt(factor)}x {side} the ridge" in text
    bound = "compute" if point["compute_ms"] > point["memory_ms"] else "memory"
    assert point["bound"] == bound and f"{bound}-bound" in text
    other = "memory" if bound == "compute" else "compute"
    assert f"{other}-bound" not in text
    assert ("waits on memory" in text) == (bound == "memory")


def check_operators_claim(text: str, ops: dict, batch: int) -> None:
    """The per-operator sentence: decode attention's intensity and bound, and the MLP's move with
    the batch, as the operator points say."""
    a, mlp = ops["names"].index("attention"), ops["names"].index("mlp")
    one = ops["phases"]["decode_batch_1"]
    last = ops["phases"].get(f"decode_batch_{batch}", one)
    assert f"decode attention sits at {fmt(last['intensity'][a])} FLOP/byte and is {last['bound'][a]}-bound" in text
    if batch > 1:
        assert (
            f"the MLP moves from {fmt(one['intensity'][mlp])} FLOP/byte at batch 1 to "
            f"{fmt(last['intensity'][mlp])} at batch {batch:,} ({last['bound'][mlp]}-bound)"
        ) in text
    else:
        assert "the MLP moves" not in text


@FAST
@given(setups, st.integers(1, 131072), st.integers(1, 4096))
def test_two_workloads_note(setup, prompt_len, batch):
    d = answer("two-workloads", {**setup, "prompt_len": prompt_len, "batch": batch})
    note, ridge = d["notice"], d["ridge_flops_per_byte"]
    prefill_text, _, decode_text = note.partition("; a decode step")
    assert decode_text, note
    decode_text, _, operators_text = decode_text.partition(" Per operator, ")
    check_operators_claim(operators_text, d["operators"], batch)
    check_step_claim(prefill_text, d["prefill"], ridge)
    check_step_claim(decode_text, d["decode"], ridge)
    plan = plan_of(setup)
    assert d["fits"]["weights"] == plan.weights_fit
    if not plan.weights_fit:
        assert "does not run here" in note and "Prefill takes" not in note
    elif not plan.fits(batch, prompt_len):
        assert "does not fit the KV cache" in note and d["warning"]
    else:
        ratio = d["prefill"]["time_ms"] / d["decode"]["time_ms"]
        assert f"Prefill takes {fmt(ratio)}x as long as one decode step" in note and d["warning"] is None
    # A step never streams more weights than its own time allows (a MoE reads only the experts it hits).
    assert d["decode"]["weights_read_ms"] <= d["decode"]["time_ms"] * (1 + 1e-9)
    assert d["phases"]["bound"] == [f"{d['prefill']['bound']}-bound", f"{d['decode']['bound']}-bound"]


@FAST
@given(setups, st.integers(1, 4096), st.integers(1, 131072))
@example(
    {"model": "gemma-2-2b", "hardware": "h200", "weight_dtype": "float32", "kv_dtype": "bfloat16", "tp": "1"}, 353, 368
)  # a 32-row tile: 321 and 353 compute-bound, 352 and 384 not, every batch from 385 on
def test_batching_note(setup, batch, context):
    d = answer("batching", {**setup, "batch": batch, "context": context})
    note, sw = d["notice"], d["sweep"]
    plan = plan_of(setup)
    if not plan.weights_fit:
        assert "no batch runs here" in note and "tokens/s in total" not in note
        return
    wall = plan.max_batch(context)
    assert d["memory"]["max_batch"] == wall
    if 1 <= wall <= sw["batch"][-1]:
        assert wall in sw["batch"]  # the frontier ends at the memory limit itself
    if plan.fits(batch, context):
        assert f"batch {batch:,} runs {fmt(d['selected']['tokens_per_s_total'])} tokens/s in total" in note
    elif wall:
        i = sw["batch"].index(wall)
        assert f"full at batch {wall:,}, which runs {fmt(sw['tokens_per_s_total'][i])} tokens/s in total" in note
    else:
        assert "not one sequence" in note and "in total" not in note
    # Compute catches up at the crossover and stays caught up: the sweep's bounds agree with the note.
    # Below it a batch just past a GEMM tile's start may be compute-bound (whole tiles: the step's
    # rows, or a MoE expert's share of them), and some larger batch before the crossover is not.
    crossover = d["crossover_batch"]
    rl = setup_from(Params(setup)).roofline()
    for b, bound in zip(sw["batch"], sw["bound"]):
        if crossover is not None and b >= crossover:
            assert bound == "compute", b
        elif bound == "compute" and crossover is not None:
            assert any(rl.decode(x, context).bound == "memory" for x in range(b + 1, crossover)), b
    assert (f"compute catches up with bandwidth at batch {crossover:,}" in note) if crossover else "no batch" in note


@FAST
@given(setups, st.sampled_from(["gqa", "mha"]), st.integers(1, 131072), st.floats(1.0, 500.0))
def test_memory_note_names_what_binds(setup, attention, context, tpot_ms):
    d = answer("memory", {**setup, "attention": attention, "context": context, "tpot_ms": f"{tpot_ms:.3f}"})
    v, pick, note = d["variants"], d["selected"], d["notice"]
    target = d["config"]["tpot_ms"]
    for i, binds in enumerate(v["binds"]):
        plan = plan_of({**setup, "weight_dtype": v["weight_dtype"][i], "kv_dtype": v["kv_dtype"][i]}, v["attention"][i])
        if not plan.weights_fit:
            assert binds == "weights" and v["max_batch"][i] == 0
        elif v["max_batch"][i] == 0:
            assert binds == "kv"
        elif v["batch_at_tpot"][i] == 0:
            assert binds == "tpot"
        else:
            assert binds == ("kv-full" if v["batch_at_tpot"][i] == v["max_batch"][i] else "tpot-batch")
            assert v["step_ms_at_tpot"][i] <= target * (1 + 1e-9)
        assert v["bar_label"][i]  # a zero bar still says why
    binds = pick["binds"]
    if binds == "weights":
        assert "does not run, whatever the TPOT target" in note and "even batch 1" not in note
    elif binds == "kv":
        assert "not one sequence" in note
    elif binds == "tpot":
        assert d["batch_1_step_ms"] > target and f"even batch 1 takes {fmt(d['batch_1_step_ms'])} ms" in note
    elif binds == "kv-full":
        assert "the KV cache is full there" in note
    else:
        assert "the TPOT target binds before memory does" in note


@SIMULATED
@given(st.integers(256, 4096), st.integers(1, 64), st.integers(16, 8192))
@example(512, 64, 512)  # the budget holds the prompt alone, not beside the decodes: it is split
def test_chunked_prefill_note(prompt_len, decode_batch, chunk_tokens):
    d = answer(
        "chunked-prefill", {"prompt_len": prompt_len, "decode_batch": decode_batch, "chunk_tokens": chunk_tokens}
    )
    a, b, note = d["prefill_first"], d["chunked"], d["notice"]
    assert f"for up to {fmt(a['max_user_gap_ms'])} ms" in note
    same = all(abs(b[k] - a[k]) <= 0.005 * a[k] for k in ("max_user_gap_ms", "long_ttft_ms"))
    assert ("changes nothing" in note) == same
    if same:
        return
    if b["max_user_gap_ms"] < a["max_user_gap_ms"]:
        assert f"cap the worst gap at {fmt(b['max_user_gap_ms'])} ms" in note
    else:
        assert "do not shorten the worst gap" in note


def _verdict(split: float, colocated: float) -> str:
    if abs(split - colocated) <= 0.005 * colocated:
        return "the same"
    return "better" if split < colocated else "worse"


@SIMULATED
@given(st.floats(0.5, 12.0), st.integers(1, 3), st.integers(1, 3), st.integers(128, 2048), st.integers(16, 128))
def test_disaggregated_note_says_which_percentile_improves(rate, prefill_gpus, decode_gpus, prompt_len, output_len):
    d = answer("disaggregated", {"rate": f"{rate:.2f}", "prefill_gpus": prefill_gpus, "decode_gpus": decode_gpus,
                                 "prompt_len": prompt_len, "output_len": output_len})  # fmt: skip
    a, b, note = d["colocated"]["itl_ms"]["percentiles"], d["disaggregated"]["itl_ms"]["percentiles"], d["notice"]
    tail, median = _verdict(b["p99"], a["p99"]), _verdict(b["p50"], a["p50"])
    assert f"{fmt(a['p99'])} ms colocated ({tail})" in note
    assert f"against {fmt(a['p50'])} ms ({median})" in note
    assert ("tail improves" in note) == (tail == "better" and median != "better")
    if tail != "better":
        assert "no prefill interrupts" not in note


@SIMULATED
@given(st.floats(2.0, 40.0), st.floats(50.0, 2000.0), st.floats(5.0, 60.0))
def test_slo_note_and_sweep(rate, ttft_slo_ms, tpot_slo_ms):
    d = answer("slo", {"rate": f"{rate:.1f}", "ttft_slo_ms": f"{ttft_slo_ms:.0f}", "tpot_slo_ms": f"{tpot_slo_ms:.0f}"})
    note, sw = d["notice"], d["sweep"]
    p90_ttft, p90_tpot = d["ttft_ms"]["percentiles"]["p90"], d["tpot_ms"]["percentiles"]["p90"]
    meets = p90_ttft <= d["ttft_slo_ms"] and p90_tpot <= d["tpot_slo_ms"]
    assert ("meets the p90 targets" in note) == meets and ("misses the p90 targets" in note) == (not meets)
    assert d["saturated"] == (d["achieved_rps"] < 0.9 * d["arrived_rps"])
    assert ("more than it sustains" in note) == d["saturated"]
    # The knee is the first measured rate whose p90s break a target.
    for i, ok in enumerate(sw["meets"]):
        assert ok == (
            (sw["ttft_ms"][i] is None or sw["ttft_ms"][i] <= d["ttft_slo_ms"])
            and (sw["tpot_ms"][i] is None or sw["tpot_ms"][i] <= d["tpot_slo_ms"])
        )
    first_miss = next((r for r, ok in zip(sw["arrived_rps"], sw["meets"]) if not ok), None)
    assert sw["knee_rps"] == first_miss
    if first_miss is None:
        assert "Every swept rate meets the targets" in note
    else:
        assert f"break from about {fmt(first_miss)} req/s arriving" in note
    itl99, tpot99 = d["itl_ms"]["percentiles"]["p99"], d["tpot_ms"]["percentiles"]["p99"]
    assert f"the p99 gap is {fmt(itl99)} ms against a p99 TPOT of {fmt(tpot99)} ms" in note
    assert ("a request's average hides them" in note) == (itl99 > 1.2 * tpot99)
    assert d["status"] == "done" and sw["complete"] and "still running" not in note


@SIMULATED
@given(st.floats(2.0, 40.0), st.floats(50.0, 2000.0), st.floats(5.0, 60.0), st.integers(64, 4096))
def test_slo_first_answer_notes_only_what_it_shows(rate, ttft_slo_ms, tpot_slo_ms, prompt_len):
    """The first answer (the chosen rate, the sweep still running) claims nothing about the sweep:
    no saturation, no knee; its chosen-rate sentences hold as in the full answer."""
    from servelab.lab.app import create_lab_app
    from servelab.lab.capacity_lesson import CapacityPlanner

    app = create_lab_app()
    app.state.capacity_planner = CapacityPlanner(max_running=0)  # the sweep never starts: the first stage stays
    params = {"rate": f"{rate:.1f}", "ttft_slo_ms": f"{ttft_slo_ms:.0f}", "tpot_slo_ms": f"{tpot_slo_ms:.0f}",
              "prompt_len": str(prompt_len)}  # fmt: skip
    response = TestClient(app).post("/api/lessons/slo", json=params)
    assume(response.status_code == 202)  # a no-fit or a 400 is not this test's subject
    d = response.json()
    note, sw = d["notice"], d["sweep"]
    assert d["status"] == "running" and d["done"] == 0 and not sw["complete"] and sw["arrived_rps"] == []
    assert sw["saturation_rps"] is None and sw["knee_rps"] is None
    assert "saturates" not in note and "break from" not in note and "Every swept rate" not in note
    assert "rate sweep is still running" in note
    p90_ttft, p90_tpot = d["ttft_ms"]["percentiles"]["p90"], d["tpot_ms"]["percentiles"]["p90"]
    meets = p90_ttft <= d["ttft_slo_ms"] and p90_tpot <= d["tpot_slo_ms"]
    assert ("meets the p90 targets" in note) == meets and ("misses the p90 targets" in note) == (not meets)
    assert ("more than it sustains" in note) == (d["achieved_rps"] < 0.9 * d["arrived_rps"])
    assert all(s["label"] != "saturates at about" for s in d["stats"])


@FAST
@given(setups, st.integers(16, 32768), st.integers(2, 4096), st.integers(1, 512))
def test_request_cost_note(setup, prompt_len, output_len, batch):
    d = answer("request-cost", {**setup, "prompt_len": prompt_len, "output_len": output_len, "batch": batch})
    note, sel = d["notice"], d["selected"]
    if sel["usd_per_k_requests"]:
        assert f"costs ${fmt(sel['usd_per_k_requests'])} per" in note
    if sel["e2e_ms"]:
        assert f"take {fmt(sel['e2e_ms'])} ms end to end against a {fmt(sel['ttft_ms'])} ms TTFT" in note


@pytest.mark.parametrize("lesson", ["two-workloads", "batching", "memory"])
def test_a_model_that_does_not_fit_is_never_quoted_as_running(lesson):
    response = CLIENT.post(f"/api/lessons/{lesson}", json={"model": "llama-3.1-70b"})
    assert response.status_code == 200
    d = response.json()
    assert "does not run" in d["notice"] or "no batch runs" in d["notice"]
    assert "tokens/s in total" not in d["notice"]


def change_text(before: float, after: float) -> str:
    if abs(after - before) <= 0.01 * before:
        return f"unchanged at {fmt(before)} ms"
    return f"{'down' if after < before else 'up'} from {fmt(before)} to {fmt(after)} ms"


@SIMULATED
@given(
    st.sampled_from(["h100-sxm", "a100-80gb", "l40s"]),
    st.floats(0.5, 8.0),
    st.integers(64, 4096),
    st.integers(16, 512),
    st.integers(64, 16384),
    st.integers(8, 2048),
)
def test_limits_note(hardware, rate, prompt_len, output_len, prompt_cap, output_cap):
    d = answer("limits", {"hardware": hardware, "rate": f"{rate:.2f}", "prompt_len": prompt_len,
                          "output_len": output_len, "prompt_cap": prompt_cap, "output_cap": output_cap})  # fmt: skip
    note, v = d["notice"], d["variants"]
    if v["cut_prompts"][1]:
        assert f"Capping prompts at {prompt_cap:,} tokens cuts {v['cut_prompts'][1]:,} of them" in note
        assert f"p99 TTFT {change_text(v['ttft_p99_ms'][0], v['ttft_p99_ms'][1])}" in note
        assert f"from ${fmt(v['usd_per_k_requests'][0])} to ${fmt(v['usd_per_k_requests'][1])}" in note
    else:
        assert "the prompt cap changes nothing here" in note
        assert v["ttft_p99_ms"][1] == v["ttft_p99_ms"][0]
    if v["cut_outputs"][2]:
        assert f"Capping outputs at {output_cap:,} tokens cuts {v['cut_outputs'][2]:,}" in note
        assert f"p99 end to end {change_text(v['e2e_p99_ms'][0], v['e2e_p99_ms'][2])}" in note
        assert f"p99 TPOT {change_text(v['tpot_p99_ms'][0], v['tpot_p99_ms'][2])}" in note
    else:
        assert "the output cap changes nothing here" in note
    assert f"at ${fmt(v['usd_per_m_output_tokens'][3])} per million output tokens" in note


@FAST
@given(setups, st.floats(0.1, 1000), st.integers(5, 500), st.integers(1, 16384), st.integers(2, 4096),
       st.integers(1, 16384), st.integers(2, 4096))  # fmt: skip
def test_qps_vs_tokens_note(setup, qps, tpot_ms, a_prompt, a_output, b_prompt, b_output):
    d = answer("qps-vs-tokens", {**setup, "qps": f"{qps:.3g}", "tpot_ms": tpot_ms, "a_prompt_len": a_prompt,
                                 "a_output_len": a_output, "b_prompt_len": b_prompt, "b_output_len": b_output})  # fmt: skip
    a, b = d["workloads"]["a"], d["workloads"]["b"]
    note = d["notice"]
    assert f"B moves {fmt(b['tokens_per_s'] / a['tokens_per_s'])}x the tokens per second of A" in note
    assert f"needs {fmt(b['gpus'] / a['gpus'])}x the GPUs ({fmt(b['gpus'])} against {fmt(a['gpus'])})" in note
    assert f"one GPU serves {fmt(a['qps_per_gpu'])} req/s of A but {fmt(b['qps_per_gpu'])} of B" in note
    # More tokens per request never needs fewer GPUs at the same rate and target.
    if b_prompt >= a_prompt and b_output >= a_output:
        assert b["gpus"] >= a["gpus"] * (1 - 1e-9)


@SIMULATED
@given(setups, st.integers(1, 8192), st.integers(2, 128), st.integers(1, 64))
def test_decode_chain_note(setup, prompt_len, output_len, batch):
    d = answer("decode-chain", {**setup, "prompt_len": prompt_len, "output_len": output_len, "batch": batch})
    steps = d["chain"]["step_ms"]
    assert len(steps) == output_len
    note = d["notice"]
    assert f"Each of the {output_len - 1:,} decode steps waits for the token before it" in note
    assert (
        f"take {fmt(d['decode_ms'])} ms at batch {batch:,}, {fmt(d['decode_ms'] / (output_len - 1))} ms a step" in note
    )
    assert f"one step would compute them all in {fmt(d['one_step_ms'])} ms" in note
    assert d["decode_ms"] == pytest.approx(sum(steps[1:]))
    assert ("the dependency, not the arithmetic, sets the time" in note) == (d["decode_ms"] > 2 * d["one_step_ms"])


@SIMULATED
@given(
    st.lists(st.sampled_from(list(HARDWARE)), min_size=1, max_size=2, unique=True),
    st.sampled_from(["llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b"]),
    st.sampled_from(["1", "2"]),
    st.floats(8.0, 120.0),
    st.floats(100.0, 5000.0),
    st.integers(64, 2048),
    st.integers(8, 64),
)
@example(["h100-sxm", "h200"], "llama-3.1-70b", "1", 50.0, 1000.0, 512, 32)  # neither fits: a clause each
def test_capacity_pareto_note(accelerators, model, tp, tpot_ms, ttft_ms, prompt_len, output_len):
    assume(model in MODELS)
    d = answer("capacity-pareto", {"accelerators": ",".join(accelerators), "model": model, "tp": tp,
                                   "tpot_ms": tpot_ms, "ttft_ms": ttft_ms, "prompt_len": prompt_len,
                                   "output_len": output_len})  # fmt: skip
    note, line = d["notice"], d["tpot_line_tokens_per_s_per_user"]
    caps = {c["hardware"]: c["capacity"] for c in d["curves"] if c["capacity"] is not None}
    for hw, cap in caps.items():  # read right of the TPOT line, from a level that meets both targets
        curve = next(c for c in d["curves"] if c["hardware"] == hw)
        j = curve["points"]["concurrency"].index(cap["concurrency"])
        assert cap["tokens_per_s_per_user"] >= line and curve["points"]["pareto"][j] and curve["points"]["passed"][j]
        assert curve["points"]["tpot_ms"][j] <= tpot_ms and curve["points"]["ttft_ms"][j] <= ttft_ms
    if caps:
        best = max(caps, key=lambda hw: caps[hw]["tokens_per_s_per_device"])
        cap = caps[best]
        assert f"{best} serves the most: {fmt(cap['tokens_per_s_per_device'])} tokens/s per GPU at " in note
        assert f" at {cap['concurrency']} users" in note
        priced = {hw: c["usd_per_million_tokens"] for hw, c in caps.items() if c["usd_per_million_tokens"] is not None}
        if priced:
            cheapest = min(priced, key=priced.get)
            assert f"{cheapest} is cheapest, ${fmt(priced[cheapest])} per million" in note
    else:
        assert "serves the most" not in note and "No accelerator here serves" in note
    for hw, verdict in d["verdicts"].items():
        assert (
            (f"{hw}: does not fit" in note)
            == (verdict == "does not fit")
            == (f"{hw}: does not fit" in (d["warning"] or ""))
        )
        assert (hw in caps) == (verdict not in ("does not fit", "misses the targets at every concurrency"))
        misses = verdict == "misses the targets at every concurrency"
        assert misses == (hw not in caps and verdict != "does not fit")
        if misses:
            assert hw in note.split(" the targets at every concurrency")[0].rsplit(".", 1)[-1]


# The families whose steps read other than "all the weights, the whole context": mixtures of
# experts (a step reads the experts its tokens hit) and Gemma (window layers read their window).
FAMILY_MODELS = ["mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b", "gemma-2-9b", "gemma-3-27b"]
family_setups = st.fixed_dictionaries(
    {
        "model": st.sampled_from(FAMILY_MODELS),
        "hardware": st.sampled_from(["h100-sxm", "h200", "a100-80gb", "mi300x"]),
        "weight_dtype": st.sampled_from(list(WEIGHT_DTYPES)),
        "kv_dtype": st.sampled_from(list(KV_DTYPES)),
        "tp": st.sampled_from(["1", "2", "8"]),
    }
)


@FAST
@given(family_setups, st.integers(1, 4096), st.integers(1, 32768))
@example(
    {"model": "olmoe-1b-7b", "hardware": "h100-sxm", "weight_dtype": "fp8", "kv_dtype": "fp8", "tp": "1"}, 3073, 40
)  # compute-bound at 3,073 and through its 128-row tile, memory-bound again at 4,096 (the experts' rows)
def test_the_batching_note_says_which_experts_a_step_streams(setup, batch, context):
    d = answer("batching", {**setup, "batch": batch, "context": context})
    test_batching_note.hypothesis.inner_test(setup, batch, context)
    note, moe, sw = d["notice"], d["moe"], d["sweep"]
    model = get_model(setup["model"])
    if not model.is_moe:
        assert moe is None and "mixture of experts" not in note
        return
    plan = plan_of(setup)
    k, e = model.num_active_experts, model.num_experts
    assert moe["experts_hit_batch_1"] == pytest.approx(k)
    assert k <= moe["experts_hit"] <= e and (batch == 1 or moe["experts_hit"] > k)
    # The figures are the chart's: the sweep's batch-1 and chosen-batch weights, the plan's total.
    assert moe["weights_gb_batch_1"] == sw["weight_gb"][sw["batch"].index(1)]
    assert moe["weights_gb"] == d["selected"]["weight_gb"] <= moe["weights_gb_total"]
    assert moe["weights_gb_total"] == pytest.approx(plan.weight_bytes_per_device / 1e9)
    assert moe["weights_gb_batch_1"] <= moe["weights_gb"]
    assert (
        f"each token runs {k} of its {e} experts per MoE layer, so a batch-1 step streams "
        f"{fmt(moe['weights_gb_batch_1'])} of its {fmt(moe['weights_gb_total'])} GB of weights" in note
    )
    if batch > 1:
        assert f"a batch-{batch:,} step {fmt(moe['weights_gb'])} GB ({fmt(moe['experts_hit'])} experts hit)" in note
    # No step streams its weights faster than the datasheet bandwidth.
    for weight_gb, step_ms in zip(sw["weight_gb"], sw["step_ms"]):
        assert weight_gb * 1e9 / get_hardware(setup["hardware"]).bandwidth_bytes_per_s * 1e3 <= step_ms


@FAST
@given(family_setups, st.sampled_from(["gqa", "mha"]), st.integers(1, 32768), st.floats(1.0, 500.0))
def test_the_memory_note_says_every_expert_stays_resident(setup, attention, context, tpot_ms):
    d = answer("memory", {**setup, "attention": attention, "context": context, "tpot_ms": f"{tpot_ms:.3f}"})
    test_memory_note_names_what_binds.hypothesis.inner_test(setup, attention, context, tpot_ms)
    note, moe = d["notice"], d["moe"]
    model = get_model(setup["model"])
    if not model.is_moe:
        assert moe is None and "mixture of experts" not in note
        return
    assert moe["weights_gb"] == d["selected"]["weights_gb"]
    assert moe["weights_gb_batch_1"] < moe["weights_gb"]
    assert (
        f"all {model.num_experts} experts of every MoE layer stay resident ({fmt(moe['weights_gb'])} GB per "
        f"device), though a batch-1 decode step reads {model.num_active_experts} of them per layer "
        f"({fmt(moe['weights_gb_batch_1'])} GB)" in note
    )
