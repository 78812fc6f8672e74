"""The roofline against published measurements (benchmarks/published_measurements.json): the
committed Efficiency defaults are what benchmarks/fit_published.py fits to the training set, every
test-set point is within its documented bound, and each fitted term prices a step in the
direction it should."""

import importlib.util
import math
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.cost import Efficiency, Roofline
from servelab.cost.roofline import MEASURED_KERNELS_EFFICIENCY, FormatEfficiency, overlap
from servelab.spec import get_hardware, get_model

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fit_published.py"
_spec = importlib.util.spec_from_file_location("fit_published", _SCRIPT)
assert _spec is not None and _spec.loader is not None
fp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fp)

DATA = fp.load()
TRAIN = [p for p in DATA["points"] if p["set"] == "train"]
TEST = [p for p in DATA["points"] if p["set"] == "test"]
H100 = get_hardware("h100-sxm")


@pytest.fixture(scope="module")
def fitted() -> Efficiency:
    return fp.fit(TRAIN)


def test_the_fit_reproduces_the_committed_defaults(fitted):
    committed, refit = Efficiency(), fp.rounded(fitted)
    drift = {
        k: (fp.get_param(committed, k), fp.get_param(refit, k))
        for k in fp.PARAMS
        if not math.isclose(fp.get_param(committed, k), fp.get_param(refit, k), rel_tol=1e-9)
    }
    assert not drift, f"Efficiency defaults differ from the fit (committed, fitted): {drift}"


def test_the_measured_kernel_terms_are_the_refit_on_top_of_the_kernels():
    committed, refit = MEASURED_KERNELS_EFFICIENCY, fp.rounded(fp.fit(TRAIN, measured=True))
    drift = {
        k: (fp.get_param(committed, k), fp.get_param(refit, k))
        for k in fp.PARAMS
        if not math.isclose(fp.get_param(committed, k), fp.get_param(refit, k), rel_tol=1e-9)
    }
    assert not drift, f"MEASURED_KERNELS_EFFICIENCY differs from the fit (committed, fitted): {drift}"


def _median_abs_error(points, eff, measured):
    return statistics.median(abs(fp.error_pct(p, eff, measured)) for p in points)


def test_the_default_is_the_better_of_the_two_on_the_test_set():
    """docs/fidelity.md, "Measured GPU kernels": the end-to-end defaults stay the CLI's default while
    the measured kernels with their refitted terms do worse on the held-out points. Should that
    turn, this fails: make measured kernels the default."""
    end_to_end = _median_abs_error(TEST, Efficiency(), False)
    measured = _median_abs_error(TEST, MEASURED_KERNELS_EFFICIENCY, True)
    assert end_to_end < measured
    assert not fp.MEASURED and Roofline(get_model("llama-3.1-8b"), H100).gemm is None


def test_the_fit_does_not_depend_on_where_it_starts(fitted):
    seed_era = Efficiency(
        bandwidth_fraction=0.7,
        compute_fraction=0.6,
        step_overhead_s=1.5e-4,
        per_layer_overhead_s=0.0,
        allreduce_latency_s=5e-6,
        formats={f: FormatEfficiency(0.7, 0.6) for f in fp.FORMATS},
    )
    assert fp.rounded(fp.fit(TRAIN, start=seed_era)) == fp.rounded(fitted)


@pytest.mark.parametrize("points", [TRAIN, TEST], ids=["training", "test"])
def test_every_point_is_within_its_documented_bound(points):
    for p in points:
        bound = p.get("bound_pct", fp.DEFAULT_BOUND_PCT)
        if bound > fp.DEFAULT_BOUND_PCT:
            assert len(p.get("why", "")) > 40, f"{p['id']}: a bound above 15% needs its reason"
        err = fp.error_pct(p, Efficiency())
        assert abs(err) <= bound, f"{p['id']}: {err:+.1f}% (bound {bound}%)"
    # the exceptions stay exceptions: most points meet the 15% target
    assert sum("bound_pct" in p for p in points) <= len(points) // 3


def test_the_data_is_well_formed_and_the_split_is_honest():
    ids = [p["id"] for p in DATA["points"]]
    assert len(ids) == len(set(ids))
    for p in DATA["points"]:
        assert p["set"] in ("train", "test", *fp.MODERN_SETS) and p["source"] in DATA["sources"]
        fp.roofline(p, Efficiency())  # model, hardware, dtypes and tp are expressible
    train_models = {p["model"] for p in TRAIN}
    train_hardware = {p["hardware"] for p in TRAIN}
    assert {p["model"] for p in TEST} - train_models, "the test set holds models the fit never saw"
    assert {p["hardware"] for p in TEST} - train_hardware, "and hardware it never saw"
    assert {p["weight_dtype"] for p in TRAIN} >= {"bf16", "fp16", "int8", "int4", "fp8"}
    sets = {}
    for p in DATA["points"]:
        sets.setdefault(p["source"], set()).add(p["set"])
    assert all(len(v) == 1 for v in sets.values() if v & set(fp.MODERN_SETS)), "a modern source sits in one set"


# ---- the terms the fit uses are the roofline's own ---------------------------------------------
MODELS = ["llama-3.1-8b", "llama-2-70b", "mixtral-8x7b", "llama-2-7b"]
fractions = st.floats(0.05, 1.0)


@st.composite
def efficiencies(draw) -> Efficiency:
    return Efficiency(
        bandwidth_fraction=draw(fractions),
        compute_fraction=draw(fractions),
        step_overhead_s=draw(st.floats(0, 1e-3)),
        per_layer_overhead_s=draw(st.floats(0, 1e-4)),
        per_seq_overhead_s=draw(st.floats(0, 1e-4)),
        interconnect_fraction=draw(fractions),
        allreduce_latency_s=draw(st.floats(0, 2e-5)),
        formats={f: FormatEfficiency(draw(fractions), draw(fractions)) for f in fp.FORMATS},
    )


shapes = st.lists(
    st.tuples(st.integers(1, 600), st.integers(0, 3000)).map(lambda qc: (qc[0], qc[0] + qc[1])), min_size=1, max_size=12
)


@settings(max_examples=150, deadline=None)
@given(
    eff=efficiencies(),
    shape=shapes,
    model=st.sampled_from(MODELS),
    tp=st.sampled_from([1, 2, 8]),
    dtype=st.sampled_from(["bf16", "fp8", "int8", "int4", "q4_0"]),
)
def test_time_terms_add_up_to_the_step_time(eff, shape, model, tp, dtype):
    r = Roofline(get_model(model), H100, weight_dtype=dtype, tp=tp, efficiency=eff)
    totals = Roofline.totals(shape)
    compute, memory, added = r.time_terms(*totals)
    c = sum(v / fp.get_param(eff, k) for k, v in compute.items())
    m = sum(v / fp.get_param(eff, k) for k, v in memory.items())
    rest = sum(v / fp.get_param(eff, k) if fp.is_fraction(k) else v * fp.get_param(eff, k) for k, v in added.items())
    expected = overlap(c, m, r.overlap_sharpness) + rest
    assert r.time_from_totals(*totals) == pytest.approx(expected, rel=1e-9)
    assert r.step(shape).time_s == pytest.approx(expected, rel=1e-9)


# ---- each new term moves a step's price the way it should ---------------------------------------
def price(shape, model="llama-3.1-8b", tp=1, dtype="bf16", **changes) -> float:
    eff = replace(Efficiency(), **changes)
    return Roofline(get_model(model), H100, weight_dtype=dtype, tp=tp, efficiency=eff).step_time_s(shape)


decode_batches = st.integers(1, 256).map(lambda b: [(1, 1024)] * b)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, extra=st.floats(1e-6, 1e-4))
def test_per_layer_cost_grows_with_depth(shape, extra):
    base8, base70 = price(shape), price(shape, model="llama-2-70b", tp=8)
    more8 = price(shape, per_layer_overhead_s=Efficiency().per_layer_overhead_s + extra)
    more70 = price(shape, model="llama-2-70b", tp=8, per_layer_overhead_s=Efficiency().per_layer_overhead_s + extra)
    assert more8 - base8 == pytest.approx(32 * extra, rel=1e-6)
    assert more70 - base70 == pytest.approx(80 * extra, rel=1e-6)


@settings(max_examples=40, deadline=None)
@given(shape=decode_batches, extra=st.floats(1e-7, 1e-4))
def test_per_sequence_cost_grows_with_the_batch(shape, extra):
    assert price(shape, per_seq_overhead_s=extra) - price(shape, per_seq_overhead_s=0.0) == pytest.approx(
        len(shape) * extra, rel=1e-6
    )


@settings(max_examples=40, deadline=None)
@given(shape=shapes, latency=st.floats(1e-6, 5e-5), frac=st.floats(0.05, 0.99))
def test_all_reduces_cost_latency_and_link_time_under_tp_only(shape, latency, frac):
    eff = Efficiency()
    assert price(shape, tp=4, allreduce_latency_s=eff.allreduce_latency_s + latency) > price(shape, tp=4)
    assert price(shape, tp=4, interconnect_fraction=frac / 2) > price(shape, tp=4, interconnect_fraction=frac)
    assert price(shape, tp=1, allreduce_latency_s=latency, interconnect_fraction=frac) == price(shape, tp=1)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, dtype=st.sampled_from(fp.FORMATS), frac=st.floats(0.05, 0.99))
def test_a_formats_kernel_efficiency_prices_only_that_format(shape, dtype, frac):
    own = dict(Efficiency().formats)
    mine = own[dtype]
    slower_bw = {**own, dtype: FormatEfficiency(min(frac, mine.bandwidth_fraction) / 2, mine.compute_fraction)}
    slower_compute = {**own, dtype: FormatEfficiency(mine.bandwidth_fraction, frac / 2)}
    faster_compute = {**own, dtype: FormatEfficiency(mine.bandwidth_fraction, frac)}
    r = Roofline(get_model("llama-3.1-8b"), H100, weight_dtype=dtype)
    # the max() hides a change on the side that does not bind; on the side that does, it shows
    memory_bound = r.step(shape).bound == "memory"
    base, slower = price(shape, dtype=dtype), price(shape, dtype=dtype, formats=slower_bw)
    assert slower > base if memory_bound else slower >= base
    fast = Roofline(
        get_model("llama-3.1-8b"), H100, weight_dtype=dtype, efficiency=replace(Efficiency(), formats=faster_compute)
    )
    slow_c, fast_c = (
        price(shape, dtype=dtype, formats=slower_compute),
        price(shape, dtype=dtype, formats=faster_compute),
    )
    assert slow_c > fast_c if fast.step(shape).bound == "compute" else slow_c >= fast_c
    for other in ("bf16", "fp16", "q4_0"):  # formats without an entry keep the 16-bit fractions
        assert price(shape, dtype=other, formats=slower_bw) == price(shape, dtype=other)
        assert price(shape, dtype=other, formats=slower_compute) == price(shape, dtype=other)


def test_quantized_formats_are_priced_by_their_own_fractions():
    # at batch 1 every format is memory-bound: its weight stream runs at its own fraction
    r = {
        d: Roofline(get_model("llama-2-7b"), get_hardware("a100-80gb"), weight_dtype=d)
        for d in ("bf16", "int8", "int4")
    }
    eff = Efficiency()
    weights = {d: r[d].decode(1, 64).weight_bytes for d in r}
    assert weights["int8"] == pytest.approx(weights["bf16"] / 2) and weights["int4"] == pytest.approx(
        weights["bf16"] / 4
    )
    t = {d: r[d].decode(1, 64).memory_time_s for d in r}
    kv_act = t["bf16"] - weights["bf16"] / (r["bf16"].peak_bandwidth_bytes_per_s * eff.bandwidth_fraction)
    for d in ("int8", "int4"):
        frac = eff.for_format(d).bandwidth_fraction
        assert t[d] == pytest.approx(kv_act + weights[d] / (r[d].peak_bandwidth_bytes_per_s * frac))
    # ... so int4 saves less than its 4x in bytes: the published 1.9x of gpt-fast, not 4x
    assert 1.5 < r["bf16"].decode(1, 64).time_s / r["int4"].decode(1, 64).time_s < 2.5


def test_new_terms_are_checked():
    with pytest.raises(Exception, match="per_seq_overhead_s"):
        Efficiency(per_seq_overhead_s=-1e-6)
    with pytest.raises(Exception, match="bandwidth_fraction"):
        FormatEfficiency(bandwidth_fraction=0.0, compute_fraction=0.5)


# ---- engine presets: each fitted on its own engine's training points -----------------------------
PRESETS = fp.committed_preset_efficiencies()
BY_PRESET = fp.by_preset(DATA, PRESETS)
MODERN_TEST = [p for p in DATA["points"] if p["set"] == "modern-test" and p["run"]["kind"] in fp.PRICED_KINDS]
MODERN = [p for p in DATA["points"] if p["set"] in fp.MODERN_SETS and p["run"]["kind"] in fp.PRICED_KINDS]


def test_each_engine_preset_carries_the_fit_on_its_engines_training_points():
    fitted = fp.fit_presets(DATA)
    assert set(fitted) == {"trtllm"}, "only TensorRT-LLM has training points of its own"
    for name, eff in fitted.items():
        drift = {
            k: (fp.get_param(PRESETS[name], k), fp.get_param(eff, k))
            for k in fp.PARAMS
            if not math.isclose(fp.get_param(PRESETS[name], k), fp.get_param(eff, k), rel_tol=1e-9)
        }
        assert not drift, f"engine_profiles.json's {name} gpu terms differ from the fit (committed, fitted): {drift}"
    for name in ("servelab", "vllm", "sglang"):
        assert PRESETS[name] == Efficiency()


def test_every_point_names_an_engine_and_no_preset_is_fitted_on_held_out_points():
    for p in DATA["points"]:
        assert fp.engine_of(p, DATA) in ("trtllm", "vllm", "sglang", "other")
    trained = {p["source"] for p in DATA["points"] if p["set"] in fp.PRESET_TRAINING_SETS}
    held_out = {p["source"] for p in DATA["points"] if p["set"] == "modern-test"}
    assert not trained & held_out


def test_the_engine_presets_beat_the_defaults_on_every_held_out_set():
    """docs/fidelity.md, "Engine presets": priced by each point's engine preset, the held-out sets
    come out closer than with the defaults alone, and modern-test stays at its documented medians."""
    for name in ("test", "modern-test"):
        pts = [p for p in DATA["points"] if p["set"] == name and p["run"]["kind"] in fp.PRICED_KINDS]
        assert fp.medians(pts, BY_PRESET)["all"] < fp.medians(pts, Efficiency())["all"], name
    m = fp.medians(MODERN_TEST, BY_PRESET)
    assert m["all"] <= 7.0 and m["TTFT"] <= 10.0 and m["throughput"] <= 10.0, m


def test_every_modern_point_is_within_its_bound_and_each_past_30pct_names_its_cause():
    for p in MODERN:
        err = fp.error_pct(p, BY_PRESET)
        bound = p.get("bound_pct", fp.CAUSE_PCT)
        if bound > fp.CAUSE_PCT:
            assert len(p.get("why", "")) > 60, f"{p['id']}: a point past 30% needs its cause"
        assert abs(err) <= bound, f"{p['id']}: {err:+.1f}% (bound {bound}%)"


def test_the_trtllm_preset_prices_short_prompts_and_wide_tp_closer_than_the_defaults():
    """Two patterns on TensorRT-LLM's held-out points: 128-token first tokens (median within 10%;
    each within 15% but Mixtral's over four L40S, whose cause docs/fidelity.md writes), and TP >= 4
    at batch >= 64 (L40S over PCIe), every one within 15% now that the preset fits the link's rate
    on its own TP runs."""
    short = [p for p in MODERN_TEST if p["metric"] == "ttft_ms" and p["run"]["input_len"] <= 512]
    wide = [p for p in MODERN_TEST if p["tp"] >= 4 and p["run"]["batch"] >= 64 and fp.engine_of(p, DATA) == "trtllm"]
    assert len(short) == 8 and len(wide) == 5
    assert fp.medians(short, BY_PRESET)["all"] <= 10.0 < fp.medians(short, Efficiency())["all"]
    past_15 = [(p["model"], p["hardware"]) for p in short if abs(fp.error_pct(p, BY_PRESET)) > 15.0]
    assert past_15 == [("mixtral-8x7b", "l40s")], past_15
    # Mixtral's experts see 32 of the 128 rows each, one FP8 tile of 128 on an H200: -15.0% without
    # the tiles, -10.6% with them.
    (moe_h200,) = [p for p in short if (p["model"], p["hardware"]) == ("mixtral-8x7b", "h200")]
    assert abs(fp.error_pct(moe_h200, BY_PRESET)) < 12.0
    assert all(abs(fp.error_pct(p, BY_PRESET)) <= 15.0 for p in wide), [fp.error_pct(p, BY_PRESET) for p in wide]
    held = dict(PRESETS["trtllm"].to_dict(), interconnect_fraction=fp.HELD["interconnect_fraction"])
    at_held_rate = fp.by_preset(DATA, {**PRESETS, "trtllm": Efficiency.from_dict(held)})
    assert fp.medians(wide, BY_PRESET)["all"] < fp.medians(wide, at_held_rate)["all"]


def test_an_engine_preset_fits_the_links_rate_the_defaults_hold_it():
    """The defaults' TP points are all at batch 1 (kilobyte all-reduces): the rate stays held. The
    trtllm preset's TP runs at batch 64 to 1,024 identify it, and it comes out below the held 0.7."""
    assert Efficiency().interconnect_fraction == fp.HELD["interconnect_fraction"]
    assert "interconnect_fraction" not in fp.PRESET_HELD
    assert PRESETS["trtllm"].interconnect_fraction < fp.HELD["interconnect_fraction"]


# ---- the overlap of compute and memory is the part's measured steps' or GEMMs' ----------------
def test_the_overlap_sharpness_is_the_parts_measured_steps_else_its_gemms(tmp_path):
    import json

    from servelab.spec.hardware import HARDWARE

    kernels = {name: HARDWARE[name].kernels for name in ("a100-80gb", "h100-sxm", "h200")}
    sharpness = {
        (hw, dtype): Roofline(get_model("llama-3.1-8b"), get_hardware(hw), weight_dtype=dtype).overlap_sharpness
        for hw in ("a100-80gb", "h100-sxm", "h200", "l40s", "mi300x")
        for dtype in ("bf16", "fp8", "int4")
    }
    # whole BF16 steps measured on both Hoppers: their fit, not one GEMM's
    for hw in ("h100-sxm", "h200"):
        steps = kernels[hw].steps
        assert steps is not None
        assert sharpness[hw, "bf16"] == sharpness[hw, "int4"] == steps.sharpness["bf16"]
        # FP8: no FP8 steps fitted, its GEMMs'
        assert sharpness[hw, "fp8"] == kernels[hw].gemm["fp8"].sharpness
    # no FP8 tensor cores, and weight-only int4: 16-bit math, the part's 16-bit GEMMs (no steps measured)
    assert kernels["a100-80gb"].steps is None
    assert (
        sharpness["a100-80gb", "fp8"] == sharpness["a100-80gb", "int4"] == kernels["a100-80gb"].gemm["bf16"].sharpness
    )
    # nothing measured on the architecture: the plain roofline's max()
    assert all(sharpness[hw, d] == math.inf for hw in ("l40s", "mi300x") for d in ("bf16", "fp8", "int4"))
    body = {"memory_bytes": 80e9, "bandwidth_bytes_per_s": 3.35e12, "peak_flops": {"bf16": 989e12, "fp8": 1979e12}}
    h100 = kernels["h100-sxm"]
    assert h100.steps is not None
    for arch, dtype, expected in (
        ("hopper", "fp8", h100.gemm["fp8"].sharpness),
        ("hopper", "bf16", h100.steps.sharpness["bf16"]),  # the part whose GEMMs it takes: the H100's
        ("", "fp8", math.inf),
    ):
        path = tmp_path / f"part-{arch or 'none'}.json"
        path.write_text(json.dumps({**body, "architecture": arch}))
        r = Roofline(get_model("llama-3.1-8b"), get_hardware(str(path)), dtype)
        assert r.overlap_sharpness == expected
        # Its first line says what it borrows: the part it takes the overlap from, or max().
        source = {"fp8": "measured GEMMs on h100-sxm", "bf16": "measured steps on h100-sxm"}[dtype] if arch else ""
        assert r.overlap_source == source
        assert r.extrapolation[0].endswith(f"combined as the p-norm of the {source}" if arch else "combined by max()")


def test_the_step_sharpness_is_the_fit_to_the_parts_measured_steps():
    """kernel_fits.json's whole-step sharpness is what benchmarks/gpu_steps_check.py fits to the
    committed steps with the committed defaults. It prices the H200's plain steps far better than
    its GEMMs' sharpness (3.1: a step of many kernels overlaps more softly than one GEMM), and the
    H100's, whose GEMMs (Vidur's) already overlap softly, about as well."""
    import json
    import sys

    sys.path.insert(0, str(_SCRIPT.parent))
    import gpu_steps_check

    from servelab.spec.hardware import HARDWARE

    data = _SCRIPT.parent / "data"
    for hw, short in (("h100-sxm", "h100"), ("h200", "h200")):
        runs = {run: json.loads((data / f"{short}_steps{sfx}.json").read_text())
                for run, sfx in (("plain", ""), ("compiled", "_compiled"))}  # fmt: skip
        p, residuals = gpu_steps_check.fit_step_sharpness(runs, "bf16")
        steps = HARDWARE[hw].kernels.steps
        assert steps is not None and steps.sharpness["bf16"] == p
        assert {run: dict(r) for run, r in steps.residuals.items()} == residuals
        for r in residuals.values():
            assert r["median_abs_error_pct"] <= r["median_abs_error_pct_at_gemm_sharpness"] + 1.0
    h200 = HARDWARE["h200"].kernels.steps.residuals["plain"]
    assert h200["median_abs_error_pct"] < 10.0 < h200["median_abs_error_pct_at_gemm_sharpness"]


@settings(max_examples=200, deadline=None)
@given(c=st.floats(1e-6, 1.0), m=st.floats(1e-6, 1.0), p=st.floats(1.0, 12.0))
def test_the_overlap_lies_between_max_and_sum_and_its_weights_rebuild_it(c, m, p):
    t = overlap(c, m, p)
    assert max(c, m) * (1 - 1e-12) <= t <= (c + m) * (1 + 1e-12)
    w_c, w_m = fp.side_weights(c, m, p)
    assert w_c * c + w_m * m == pytest.approx(t, rel=1e-9)  # Euler: the fit's linearisation is exact
    assert overlap(c, m, math.inf) == max(c, m) and fp.side_weights(c, m, math.inf) in ((1.0, 0.0), (0.0, 1.0))


def test_a_step_near_the_ridge_costs_more_than_its_slower_side():
    """The short-prompt effect: a 256-token prefill of Llama-2-7B on an H100 sits at the ridge, where
    the whole steps measured on it overlap loads and math imperfectly (2^(1/2) = 1.41x either side),
    128 tokens a little below it (1.13x); batch-1 decode, 300x below, does not notice."""
    r = Roofline(get_model("llama-2-7b"), H100)
    ratio = {}
    for tokens in (128, 256):
        s = r.prefill(tokens)
        ratio[tokens] = (s.time_s - s.overhead_s) / max(s.compute_time_s, s.memory_time_s)
    assert 1.1 < ratio[128] < ratio[256] <= 2 ** (1 / r.overlap_sharpness) * (1 + 1e-9)
    far = r.decode(1, 128)
    assert far.time_s - far.overhead_s == pytest.approx(far.memory_time_s, rel=1e-3)
