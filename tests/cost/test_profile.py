"""The profile step cost and its fit: known coefficients come back, bad files get clear errors."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.cost.profile import PROFILE_FORMAT, PROFILE_VERSION, TERMS, ProfileStepCost, fit, load_profile
from servelab.cost.roofline import Roofline
from servelab.errors import InvalidArgument

KNOWN = {"per_step_s": 2e-3, "per_token_s": 5e-5, "per_seq_s": 1e-4, "per_context_token_s": 2e-7, "per_pair_s": 1e-8}


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
    ms = [{"num_tokens": 1, "num_seqs": 1, "context_tokens": c, "pairs": c, "time_s": 1e-2 - c * 1e-6}
          for c in range(100, 2000, 50)]
    coefs = fit(ms)["coefficients"]
    assert all(v >= 0 for v in coefs.values()) and coefs["per_context_token_s"] == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 3000)), min_size=1, max_size=20))
def test_step_time_equals_formula_and_totals_path(pairs):
    shape = [(q, q + cached) for q, cached in pairs]
    cost = ProfileStepCost(**KNOWN)
    t, s, c, p = Roofline.totals(shape)
    formula = (KNOWN["per_step_s"] + KNOWN["per_token_s"] * t + KNOWN["per_seq_s"] * s
               + KNOWN["per_context_token_s"] * c + KNOWN["per_pair_s"] * p)
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
    assert set(TERMS) == set(KNOWN)
