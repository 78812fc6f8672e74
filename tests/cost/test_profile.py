"""The profile step cost and its fit: known coefficients come back, bad files get clear errors."""

import json
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.cost.profile import PROFILE_FORMAT, PROFILE_VERSION, TERMS, KernelRows, ProfileStepCost, fit, load_profile
from servelab.cost.roofline import Roofline
from servelab.errors import InvalidArgument

KNOWN = {
    "per_step_s": 2e-3,
    "per_prefill_step_s": 6e-3,
    "per_token_s": 5e-5,
    "per_seq_s": 1e-4,
    "per_context_token_s": 2e-7,
    "per_pair_s": 1e-8,
}


def profile_dict(coefs=KNOWN, model="smollm2-135m"):
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "model": model, "fit": {"coefficients": dict(coefs)}}


def synthetic_measurements(coefs, n=60, seed=0):
    cost = ProfileStepCost(**coefs)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        shape = [(rng.choice([1, 1, 16, 64, 200]), rng.randrange(200, 4000)) for _ in range(rng.randrange(1, 12))]
        shape = [(q, max(q, c)) for q, c in shape]
        t, s, c, p = Roofline.totals(shape)
        out.append({"num_tokens": t, "num_seqs": s, "context_tokens": c, "pairs": p, "time_s": cost.step_time_s(shape)})
    return out


def test_fit_recovers_known_coefficients():
    result = fit(synthetic_measurements(KNOWN))
    for name, value in KNOWN.items():
        assert result["coefficients"][name] == pytest.approx(value, rel=1e-4), name
    assert result["heldout"]["count"] == 15 and result["heldout"]["max_abs_pct"] < 1e-3


def test_fit_keeps_coefficients_non_negative():
    # Times that fall with context would want a negative slope: NNLS clamps it to 0.
    ms = [
        {"num_tokens": 1, "num_seqs": 1, "context_tokens": c, "pairs": c, "time_s": 1e-2 - c * 1e-6}
        for c in range(100, 2000, 50)
    ]
    coefs = fit(ms)["coefficients"]
    assert all(v >= 0 for v in coefs.values()) and coefs["per_context_token_s"] == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 3000)), min_size=1, max_size=20))
def test_step_time_equals_formula_and_totals_path(pairs):
    shape = [(q, q + cached) for q, cached in pairs]
    cost = ProfileStepCost(**KNOWN)
    t, s, c, p = Roofline.totals(shape)
    prefill = any(q > 1 for q, _ in shape)  # the engine's per-op path: a step with any prompt token
    formula = (
        KNOWN["per_step_s"]
        + KNOWN["per_prefill_step_s"] * prefill
        + KNOWN["per_token_s"] * t
        + KNOWN["per_seq_s"] * s
        + KNOWN["per_context_token_s"] * c
        + KNOWN["per_pair_s"] * p
    )
    assert cost.step_time_s(shape) == pytest.approx(formula, rel=1e-12)
    assert cost.time_from_totals(t, s, c, p) == cost.step_time_s(shape)
    assert cost.step(shape).time_s == cost.step_time_s(shape)


def test_load_profile_errors(tmp_path, capsys):
    def write(obj, name="p.json"):
        path = tmp_path / name
        path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
        return str(path)

    with pytest.raises(InvalidArgument, match="cannot read"):
        load_profile(str(tmp_path / "missing.json"))
    with pytest.raises(InvalidArgument, match="not JSON"):
        load_profile(write("{"))
    with pytest.raises(InvalidArgument, match="not a servelab profile"):
        load_profile(write({"fit": {}}))
    with pytest.raises(InvalidArgument, match="lacks per_pair_s"):
        load_profile(write(profile_dict({k: v for k, v in KNOWN.items() if k != "per_pair_s"})))
    with pytest.raises(InvalidArgument, match="per_token_s=-1"):
        load_profile(write(profile_dict({**KNOWN, "per_token_s": -1})))
    assert load_profile(write(profile_dict(model="SmolLM2-135M-Instruct.Q4_1")), model="smollm2-135m")
    assert capsys.readouterr().err == ""
    load_profile(write(profile_dict()), model="llama-3.1-8b")
    err = capsys.readouterr().err
    assert "'smollm2-135m'" in err and "'llama-3.1-8b'" in err
    assert set(TERMS) == set(KNOWN) | set(SWITCHES)


def test_load_profile_rejects_binary_files_and_non_finite_values(tmp_path):
    path = tmp_path / "p.json"
    path.write_bytes(b"\xff\xfe\x00\x01binary")
    with pytest.raises(InvalidArgument, match="p.json: not JSON"):
        load_profile(str(path))
    for value, shown in ((float("inf"), "per_token_s=inf"), (float("nan"), "per_token_s=nan")):
        path.write_text(json.dumps(profile_dict({**KNOWN, "per_token_s": value})))  # writes Infinity / NaN
        with pytest.raises(InvalidArgument, match=f"finite numbers >= 0: {shown}"):
            load_profile(str(path))
    path.write_text(json.dumps({**profile_dict(), "server": {"per_step_s": float("inf"), "per_seq_s": 0}}))
    with pytest.raises(InvalidArgument, match="server.per_step_s must be a finite number"):
        load_profile(str(path))


def test_a_profile_from_before_the_prefill_term_loads_and_prices_as_it_did(tmp_path):
    old = {k: v for k, v in KNOWN.items() if k != "per_prefill_step_s"}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(profile_dict(old)))
    cost = ProfileStepCost.from_profile(load_profile(str(path)))
    assert cost.per_prefill_step_s == 0.0
    for shape in ([(64, 64)], [(1, 300)] * 3, [(1, 300)] * 3 + [(16, 16)]):
        t, s, c, p = Roofline.totals(shape)
        assert cost.step_time_s(shape) == pytest.approx(
            old["per_step_s"]
            + old["per_token_s"] * t
            + old["per_seq_s"] * s
            + old["per_context_token_s"] * c
            + old["per_pair_s"] * p
        )
    assert "one form for decode-only and prefill steps" in cost.describe()


def test_only_steps_with_prefill_tokens_pay_the_prefill_term():
    cost = ProfileStepCost(**KNOWN)
    decodes = [(1, 300)] * 4
    joined = decodes + [(1, 1)]  # a one-token prompt is a decode to the engine too
    mixed = decodes + [(2, 2)]
    flat = ProfileStepCost(**{**KNOWN, "per_prefill_step_s": 0.0})
    assert cost.step_time_s(decodes) == flat.step_time_s(decodes)
    assert cost.step_time_s(joined) == flat.step_time_s(joined)
    assert cost.step_time_s(mixed) == pytest.approx(flat.step_time_s(mixed) + KNOWN["per_prefill_step_s"], rel=1e-12)
    assert cost.step(mixed).overhead_s == pytest.approx(KNOWN["per_step_s"] + KNOWN["per_prefill_step_s"])
    assert "prefill steps +6.00 ms over decode-only ones" in cost.describe()


def test_fit_separates_decode_only_from_prefill_steps():
    # decode-only steps alone cannot tell per_token from per_seq (one token a sequence): the prefill
    # steps do, and the indicator column takes the per-op path's extra fixed cost
    ms = synthetic_measurements(KNOWN, n=80, seed=3)
    assert any(m["num_tokens"] == m["num_seqs"] for m in ms) and any(m["num_tokens"] > m["num_seqs"] for m in ms)
    result = fit(ms)
    assert result["coefficients"]["per_prefill_step_s"] == pytest.approx(KNOWN["per_prefill_step_s"], rel=1e-4)
    assert "per_prefill_step_s*per_op_path" in result["form"]


def test_serving_term_per_step_and_per_sequence(tmp_path):
    shape = [(1, 300)] * 4 + [(64, 64)]
    plain = ProfileStepCost.from_profile(profile_dict())
    served = ProfileStepCost.from_profile({**profile_dict(), "server": {"per_step_s": 3e-3, "per_seq_s": 1e-4}})
    assert served.step_time_s(shape) == pytest.approx(plain.step_time_s(shape) + 3e-3 + 5 * 1e-4, rel=1e-12)
    assert served.time_from_totals(*Roofline.totals(shape)) == served.step_time_s(shape)
    assert served.time_from_totals(0, 0, 0, 0) == 0.0  # an empty step costs nothing, serving included
    assert "serving term 3.00 ms per step + 0.10 ms per sequence" in served.describe()
    assert ProfileStepCost.from_profile({**profile_dict(), "server": None}) == plain
    assert "no serving term" in plain.describe()
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**profile_dict(), "server": {"per_step_s": -1, "per_seq_s": 0}}))
    with pytest.raises(InvalidArgument, match=r"server.per_step_s must be a finite number >= 0, got -1"):
        load_profile(str(path))


def test_an_old_per_token_serving_term_is_priced_per_sequence_and_named(tmp_path):
    # profiles written before the per-step form have server.per_token_s only: priced as they were
    shape = [(1, 300)] * 4 + [(64, 64)]
    plain = ProfileStepCost.from_profile(profile_dict())
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**profile_dict(), "server": {"per_token_s": 2e-3}}))
    served = ProfileStepCost.from_profile(load_profile(str(path)))
    assert served.step_time_s(shape) == pytest.approx(plain.step_time_s(shape) + 5 * 2e-3, rel=1e-12)
    assert "old per-token form" in served.describe() and "--server-term" in served.describe()
    path.write_text(json.dumps({**profile_dict(), "server": {"per_token_s": -1}}))
    with pytest.raises(InvalidArgument, match=r"server.per_token_s must be a finite number >= 0, got -1"):
        load_profile(str(path))


TP_TERM = {
    "ranks": 2,
    "backend": "gloo",
    "allreduce_latency_s": 500e-6,
    "allreduce_bytes_per_s": 500e6,
    "collectives_per_step": 62,
    "hidden_allreduces_per_step": 61,
    "bytes_per_token": 576 * 4,
    "compute_scales_with_ranks": False,
}


def test_fit_allreduce_recovers_latency_and_bandwidth():
    from servelab.cost.profile import fit_allreduce

    rows = [{"bytes": b, "median_s": 600e-6 + b / 400e6} for b in (2304, 18432, 73728, 294912, 1179648)]
    fitted = fit_allreduce(rows)
    assert fitted["latency_s"] == pytest.approx(600e-6, rel=1e-6)
    assert fitted["bytes_per_s"] == pytest.approx(400e6, rel=1e-6)
    flat = fit_allreduce([{"bytes": b, "median_s": 1e-3} for b in (10, 1000, 100000)])
    assert flat["latency_s"] == pytest.approx(1e-3) and flat["bytes_per_s"] is None


def test_profile_step_cost_moves_the_communication_between_tp_sizes():
    from servelab.cost.profile import profile_step_cost

    tp1 = profile_dict()
    assert profile_step_cost(tp1, 1) == ProfileStepCost.from_profile(tp1)
    with pytest.raises(InvalidArgument, match=r"calibrated at tensor-parallel size 1 and has no TP term.*--tp 2"):
        profile_step_cost(tp1, 2)
    shape = [(1, 200)] * 4
    comm_step = 62 * 500e-6
    comm_token = 61 * 576 * 4 / 500e6  # 2 ranks, as measured: the ring factor is 1
    with_term = {**tp1, "tp": TP_TERM}
    at2 = profile_step_cost(with_term, 2)
    # a CPU host's ranks share its cores: the engine's compute stays, the all-reduces add
    assert at2.step_time_s(shape) == pytest.approx(
        ProfileStepCost.from_profile(tp1).step_time_s(shape) + comm_step + 4 * comm_token, rel=1e-12
    )
    # calibrated at TP=2 (the all-reduces inside the fit): TP=1 takes them out again
    calibrated_at2 = {
        **with_term,
        "engine_flags": {"tensor_parallel_size": 2},
        "fit": {"coefficients": {k: getattr(at2, k) for k in KNOWN}},
    }
    assert profile_step_cost(calibrated_at2, 2) == at2
    assert profile_step_cost(calibrated_at2, 1).step_time_s(shape) == pytest.approx(
        ProfileStepCost.from_profile(tp1).step_time_s(shape), rel=1e-9
    )
    # ranks with a device each: compute splits between them; 4 ranks move 1.5x a 2-rank ring's bytes
    gpus = {**tp1, "tp": {**TP_TERM, "compute_scales_with_ranks": True}}
    at4 = profile_step_cost(gpus, 4)
    assert at4.per_seq_s == pytest.approx(KNOWN["per_seq_s"] / 4)
    assert at4.per_token_s == pytest.approx(KNOWN["per_token_s"] / 4 + comm_token * 1.5)
    assert at4.per_step_s == pytest.approx(KNOWN["per_step_s"] + comm_step)


# The kernel-switch terms (KernelRows): the engine's GGUF linears change kernel above 4 and 128 rows.
SWITCHES = {"per_wide_step_s": 9e-3, "per_dense_step_s": 4e-3, "per_dense_token_s": 2e-5}
ROWS = KernelRows(fused_max_rows=4, max_rows=128)


def switch_measurements(coefs, rows, seed=0):
    """Steps like calibrate's grid at the serving budget: decode batches 1-16, prompts of 16-128
    tokens alone, k prompts of 128 together (up to 2048 tokens), and decodes joined by a prompt."""
    cost = ProfileStepCost(**coefs, fused_max_rows=rows.fused_max_rows, max_rows=rows.max_rows)
    rng = random.Random(seed)
    shapes = [[(1, c)] * b for b in range(1, 17) for c in (rng.randrange(30, 200), rng.randrange(30, 200))]
    shapes += [[(n, n)] for n in (16, 64, 100, 128)] + [[(128, 128)] * k for k in (2, 3, 4, 8, 12, 16)]
    shapes += [[(1, rng.randrange(30, 200))] * b + [(q, q)] for b in (1, 3, 8, 15) for q in (32, 112, 128)]
    out = []
    for shape in shapes:
        t, s, c, p = Roofline.totals(shape)
        out.append({"num_tokens": t, "num_seqs": s, "context_tokens": c, "pairs": p, "time_s": cost.step_time_s(shape)})
    rng.shuffle(out)
    return out


def test_fit_recovers_the_kernel_switch_terms():
    truth = {**KNOWN, **SWITCHES}
    result = fit(switch_measurements(truth, ROWS), rows=ROWS)
    for name, value in truth.items():
        assert result["coefficients"][name] == pytest.approx(value, rel=1e-4), name
    assert result["heldout"]["max_abs_pct"] < 1e-3


def test_without_kernel_rows_the_switch_terms_stay_out_of_the_fit():
    # the same steps from an engine with one kernel at every row count: the terms are 0, not guessed
    ms = switch_measurements(KNOWN, KernelRows())
    result = fit(ms)
    assert all(result["coefficients"][name] == 0.0 for name in SWITCHES)
    for name, value in KNOWN.items():
        assert result["coefficients"][name] == pytest.approx(value, rel=1e-4), name


def test_a_switch_no_measured_step_went_past_is_not_fitted():
    # a grid whose steps stop at 128 rows cannot price the rows past them: dropping the switch keeps
    # one slope for every row, where a 0 coefficient would make them free
    truth = {**KNOWN, **SWITCHES}
    small = [m for m in switch_measurements(truth, ROWS) if m["num_tokens"] <= 128]
    result = fit(small, rows=ROWS)
    assert result["kernel_rows"] == {"fused_max_rows": 4, "max_rows": None}
    assert result["coefficients"]["per_dense_token_s"] == result["coefficients"]["per_dense_step_s"] == 0.0
    cost = ProfileStepCost.from_profile({**profile_dict(result["coefficients"]), "kernel_rows": result["kernel_rows"]})
    c = result["coefficients"]
    assert cost.step_time_s([(128, 128)] * 16) - cost.step_time_s([(128, 128)] * 8) == pytest.approx(
        8 * (128 * c["per_token_s"] + c["per_seq_s"] + 128 * c["per_context_token_s"] + 8256 * c["per_pair_s"])
    )
    assert c["per_token_s"] > 0


def test_kernel_switches_price_the_engine_paths():
    cost = ProfileStepCost(**KNOWN, **SWITCHES, fused_max_rows=4, max_rows=128)
    flat = ProfileStepCost(**KNOWN)
    dec4, dec5 = [(1, 100)] * 4, [(1, 100)] * 5
    assert cost.step_time_s(dec4) == flat.step_time_s(dec4)
    assert cost.step_time_s(dec5) == pytest.approx(flat.step_time_s(dec5) + SWITCHES["per_wide_step_s"], rel=1e-12)
    at_r, past_r = [(128, 128)], [(128, 128)] * 16  # 2048 tokens: 1920 of them past R, at the MKL slope
    assert cost.step_time_s(at_r) == pytest.approx(flat.step_time_s(at_r) + SWITCHES["per_wide_step_s"], rel=1e-12)
    assert cost.step_time_s(past_r) == pytest.approx(
        flat.step_time_s(past_r)
        + SWITCHES["per_wide_step_s"]
        + SWITCHES["per_dense_step_s"]
        + 1920 * (SWITCHES["per_dense_token_s"] - KNOWN["per_token_s"]),
        rel=1e-12,
    )
    # a decode batch over R leaves the one-call decode stack: it pays the per-op path too
    big = [(1, 100)] * 130
    assert cost.step_time_s(big) == pytest.approx(
        flat.step_time_s(big)
        + KNOWN["per_prefill_step_s"]
        + SWITCHES["per_wide_step_s"]
        + SWITCHES["per_dense_step_s"]
        + 2 * (SWITCHES["per_dense_token_s"] - KNOWN["per_token_s"]),
        rel=1e-12,
    )
    assert cost.step(big).overhead_s == pytest.approx(
        KNOWN["per_step_s"] + KNOWN["per_prefill_step_s"] + SWITCHES["per_wide_step_s"] + SWITCHES["per_dense_step_s"]
    )
    assert "kernel switches: +9.00 ms over 4 rows, +4.00 ms and 0.020 ms a token over 128 rows" in cost.describe()


def test_a_verification_step_is_priced_as_the_decode_rows_the_engine_runs():
    # the int8 default's switch (kernel_rows.fused_max_rows = 1): one row takes the exact kernel,
    # two or more the int8 path; a verification of K = 4 drafts is 5 decode rows on the decode stack
    cost = ProfileStepCost(**KNOWN, **SWITCHES, fused_max_rows=1)
    tokens, seqs, context, pairs = Roofline.totals([(5, 304)] * 3)
    decode_rows = cost.step_time_s([(1, c) for c in range(300, 305)] * 3)
    # but a sequence's 5 rows read its KV once: the KV-read term counts 3 contexts, not 15 rows'
    as_rows = decode_rows - KNOWN["per_context_token_s"] * (pairs - context)
    assert context == 3 * 304 and pairs == 3 * sum(range(300, 305))
    assert cost.time_from_totals(tokens, seqs, context, pairs, logit_rows=15) == pytest.approx(as_rows, rel=1e-12)
    # no per-op path: that is a prefill chunk's, whose rows do not all compute logits
    chunk = cost.time_from_totals(tokens, seqs, context, pairs, logit_rows=3)
    assert chunk - as_rows > KNOWN["per_prefill_step_s"] / 2
    one_row = cost.step_time_s([(1, 300)])
    assert as_rows > 3 * one_row + SWITCHES["per_wide_step_s"] - 2 * KNOWN["per_step_s"]
    # the serving term streams each sequence once a step, however many rows it verified
    served = replace(cost, server_per_step_s=1e-3, server_per_seq_s=2e-4)
    assert served.time_from_totals(tokens, seqs, context, pairs, logit_rows=15) == pytest.approx(
        as_rows + 1e-3 + 3 * 2e-4, rel=1e-12
    )


def test_verification_steps_let_the_fit_split_the_kv_read_from_the_dot_products():
    # a decode row has as many pairs as context tokens, so decode steps alone cannot tell the KV
    # read (per context token) from the dot products (per pair); calibrate's verification steps,
    # K + 1 rows a sequence over one KV read, can: the fit prices them as time_from_totals does
    truth = ProfileStepCost(**KNOWN, **SWITCHES, fused_max_rows=1)
    rng = random.Random(5)
    ms = []
    for _ in range(60):
        b, c = rng.choice([1, 4, 16]), rng.randrange(100, 2000)
        k = rng.choice([0, 0, 8, 63])  # plain decodes, verifications of 8 drafts, prefill chunks
        shape = [(k + 1, c + k)] * b
        totals = Roofline.totals(shape)
        logit_rows = b * (k + 1) if k < 63 else b
        t = truth.time_from_totals(*totals, logit_rows=logit_rows)
        ms.append(
            dict(zip(("num_tokens", "num_seqs", "context_tokens", "pairs"), totals), logit_rows=logit_rows, time_s=t)
        )
    result = fit(ms, rows=KernelRows(1, None))
    split = result["coefficients"]
    assert split["per_context_token_s"] == pytest.approx(KNOWN["per_context_token_s"], rel=1e-4)
    assert split["per_pair_s"] == pytest.approx(KNOWN["per_pair_s"], rel=1e-4)
    assert result["heldout"]["max_abs_pct"] < 1e-6
    # read without their logit rows, verifications would take the prefill chunks' per-op path
    blind = fit([{k: v for k, v in m.items() if k != "logit_rows"} for m in ms], rows=KernelRows(1, None))
    assert blind["heldout"]["max_abs_pct"] > 1.0
    # the decodes alone leave the split to chance: here NNLS puts it all on one of the two
    decodes = fit([m for m in ms if m["num_tokens"] == m["num_seqs"]], rows=KernelRows(1, None))["coefficients"]
    assert 0.0 in (decodes["per_context_token_s"], decodes["per_pair_s"])


def test_a_verification_step_grows_with_context_by_one_kv_read_per_sequence():
    # B sequences x (K + 1) rows: a longer context adds its KV read once per sequence and its dot
    # products once per row, where B x (K + 1) independent decode rows would read it K + 1 times
    cost = ProfileStepCost(**KNOWN, **SWITCHES, fused_max_rows=1)
    b, k, longer = 4, 4, 500

    def verify_s(context: int) -> float:
        return cost.time_from_totals(*Roofline.totals([(k + 1, context + k)] * b), logit_rows=b * (k + 1))

    growth = verify_s(100 + longer) - verify_s(100)
    assert growth == pytest.approx(
        longer * b * (KNOWN["per_context_token_s"] + (k + 1) * KNOWN["per_pair_s"]), rel=1e-9
    )
    # the same rows as decodes: each sequence's KV read K times more, contexts c .. c + K
    c = 100 + longer
    rows = cost.step_time_s([(1, c + j) for j in range(k + 1)] * b)
    assert rows - verify_s(c) == pytest.approx(KNOWN["per_context_token_s"] * b * (k * c + k * (k - 1) // 2), rel=1e-9)


def test_a_profile_with_kernel_rows_loads_and_one_from_before_prices_as_it_did(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps({**profile_dict({**KNOWN, **SWITCHES}), "kernel_rows": {"fused_max_rows": 4, "max_rows": 128}})
    )
    cost = ProfileStepCost.from_profile(load_profile(str(path)))
    assert (cost.fused_max_rows, cost.max_rows, cost.per_dense_token_s) == (4, 128, 2e-5)
    # written before kernel_rows: the switch terms are absent and every token is priced per_token_s
    old = ProfileStepCost.from_profile(profile_dict())
    assert old.kernel_rows == KernelRows() and old.step_time_s([(128, 128)] * 16) == pytest.approx(
        KNOWN["per_step_s"]
        + KNOWN["per_prefill_step_s"]
        + 2048 * KNOWN["per_token_s"]
        + 16 * KNOWN["per_seq_s"]
        + 2048 * KNOWN["per_context_token_s"]
        + 16 * 128 * 129 / 2 * KNOWN["per_pair_s"],
        rel=1e-12,
    )
    for bad in ({"fused_max_rows": 0, "max_rows": 128}, {"fused_max_rows": 4, "max_rows": "many"}, [4, 128]):
        path.write_text(json.dumps({**profile_dict(), "kernel_rows": bad}))
        with pytest.raises(InvalidArgument, match=r"kernel_rows\.\w+ must be a row count >= 1 or null"):
            load_profile(str(path))


def test_load_profile_checks_the_tp_term(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**profile_dict(), "tp": {**TP_TERM, "allreduce_latency_s": "fast"}}))
    with pytest.raises(InvalidArgument, match=r"the tp term lacks valid allreduce_latency_s"):
        load_profile(str(path))
