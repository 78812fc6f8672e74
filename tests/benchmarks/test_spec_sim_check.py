"""benchmarks/spec_sim_check.py: its arithmetic (pooled acceptance, per-round speedups, the error,
the crossover by `sim`'s rule) on made-up runs, and its `--quick` mode end to end on a tiny random
Llama behind two `servelab serve` processes, priced by a profile with the int8 default's switch."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from servelab.cost.profile import PROFILE_FORMAT, PROFILE_VERSION
from servelab.workload.acceptance import AcceptanceProfile
from tests.tiny_models import write_tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import spec_sim_check  # noqa: E402


def test_pooled_acceptance_sums_the_runs_counts():
    a = AcceptanceProfile(10, 40, 22, (8, 6, 5, 3), "a", num_decode_steps=16)
    b = AcceptanceProfile(5, 20, 6, (3, 2, 1, 0), "b", num_decode_steps=9)
    p = spec_sim_check.pooled([a, b], "both")
    assert (p.num_drafts, p.num_draft_tokens, p.num_accepted_tokens) == (15, 60, 28)
    assert p.accepted_per_position == (11, 8, 6, 3) and p.source == "both"
    assert p.num_decode_steps == 25 and p.draft_coverage == pytest.approx(15 / 25)
    p.check("pooled")  # the counts are consistent: what `sim --spec-acceptance-profile` reads
    # one run without the step count: the pool cannot say the coverage either
    unknown = spec_sim_check.pooled([a, AcceptanceProfile(5, 20, 6, (3, 2, 1, 0), "c")], "both")
    assert unknown.num_decode_steps is None and unknown.draft_coverage == 1.0


def run(tpot_ms: float, tok_s: float) -> dict:
    return {"tpot_p50_s": tpot_ms / 1e3, "output_throughput": tok_s, "load_average": 1.0, "draft_coverage": 0.7}


def test_compare_takes_per_round_ratios_and_the_first_concurrency_that_stops_paying():
    args = SimpleNamespace(concurrency=[1, 4, 16])
    runs = {
        "plain": {1: [run(4, 200), run(5, 180)], 4: [run(10, 350), run(10, 360)], 16: [run(30, 500), run(30, 500)]},
        "spec": {1: [run(2.5, 320), run(2.5, 300)], 4: [run(8, 420), run(8, 400)], 16: [run(29, 480), run(29, 490)]},
    }

    def level(c: int, plain_ms: float, spec_ms: float, ratio: float) -> dict:
        return {"concurrency": c, "plain_tpot_p50_s": plain_ms / 1e3, "spec_tpot_p50_s": spec_ms / 1e3,
                "throughput_ratio": ratio}  # fmt: skip

    sim = {"levels": [level(1, 4, 2.4, 1.6), level(4, 10, 8.5, 1.15), level(16, 30, 36, 0.9)],
           "crossover_concurrency": 16, "cost_model_crossover_batch": 20}  # fmt: skip
    out = spec_sim_check.compare(args, runs, sim)
    one, four, sixteen = out["levels"]
    assert one["speedup_rounds"] == pytest.approx([1.6, 2.0]) and one["speedup"] == pytest.approx(1.8)
    assert one["sim_speedup"] == pytest.approx(4 / 2.4)
    assert one["speedup_error_pct"] == pytest.approx((4 / 2.4 / 1.8 - 1) * 100)
    assert four["speedup"] == pytest.approx(1.25) and four["throughput_ratio"] == pytest.approx((1.2 + 400 / 360) / 2)
    # faster per user (30 / 29 ms) but fewer tokens in total: it stops paying, as `sim` says
    assert sixteen["speedup"] > 1 and sixteen["throughput_ratio"] < 1
    assert out["measured_crossover"] == out["predicted_crossover"] == 16
    assert sixteen["speedup_error_pct"] == pytest.approx((30 / 36 / (30 / 29) - 1) * 100)  # -19%
    assert not spec_sim_check.within_target(out["levels"])
    assert spec_sim_check.within_target(out["levels"][:2])  # 1 and 4: -7% and -6%


def test_compare_reports_the_mean_tpot_speedup_where_the_runs_recorded_it():
    args = SimpleNamespace(concurrency=[4])
    plain = [{**run(10, 350), "tpot_mean_s": 0.012}, {**run(10, 360), "tpot_mean_s": 0.011}]
    fast = [{**run(8, 420), "tpot_mean_s": 0.008}, {**run(8, 400), "tpot_mean_s": 0.010}]
    level = {"concurrency": 4, "plain_tpot_p50_s": 0.010, "spec_tpot_p50_s": 0.009, "plain_tpot_s": 0.0115,
             "spec_tpot_s": 0.0092, "throughput_ratio": 1.1}  # fmt: skip
    sim = {"levels": [level], "crossover_concurrency": None, "cost_model_crossover_batch": None}
    (row,) = spec_sim_check.compare(args, {"plain": {4: plain}, "spec": {4: fast}}, sim)["levels"]
    assert row["mean_speedup"] == pytest.approx((1.5 + 1.1) / 2) and row["sim_mean_speedup"] == pytest.approx(1.25)
    assert row["mean_speedup_error_pct"] == pytest.approx((1.25 / 1.3 - 1) * 100)
    # runs from before it have the median's speedup only
    (old,) = spec_sim_check.compare(args, {"plain": {4: [run(10, 350)]}, "spec": {4: [run(8, 420)]}}, sim)["levels"]
    assert "mean_speedup" not in old and old["speedup"] == pytest.approx(1.25)


def test_per_run_simulations_give_the_median_over_rounds():
    args = SimpleNamespace(concurrency=[4])
    runs = {"plain": {4: [run(10, 350), run(10, 360)]}, "spec": {4: [run(8, 420), run(5, 400)]}}

    def sim_round(plain_ms: float, spec_ms: float, ratio: float) -> dict:
        return {"concurrency": 4, "plain_tpot_p50_s": plain_ms / 1e3, "spec_tpot_p50_s": spec_ms / 1e3,
                "throughput_ratio": ratio}  # fmt: skip

    sim = {"levels": [{"concurrency": 4, "rounds": [sim_round(10, 8, 1.1), sim_round(12, 6, 1.3)]}],
           "crossover_concurrency": None, "cost_model_crossover_batch": None}  # fmt: skip
    (row,) = spec_sim_check.compare(args, runs, sim)["levels"]
    assert row["speedup"] == pytest.approx((1.25 + 2.0) / 2) and row["sim_speedup"] == pytest.approx((1.25 + 2.0) / 2)
    assert row["sim_throughput_ratio"] == pytest.approx(1.2) and row["sim_plain_tpot_ms"] == pytest.approx(11)
    assert row["speedup_error_pct"] == pytest.approx(0.0)


def test_within_target_needs_concurrency_1_4_and_16_within_15_pct():
    rows = [{"concurrency": c, "speedup_error_pct": e} for c, e in ((1, 14.9), (2, 40.0), (4, -3.0), (16, -15.0))]
    assert spec_sim_check.within_target(rows)
    rows[0]["speedup_error_pct"] = 15.1
    assert not spec_sim_check.within_target(rows)
    assert not spec_sim_check.within_target([{"concurrency": 2, "speedup_error_pct": 0.0}])


def write_profile(path: Path, model: str) -> Path:
    """A made-up calibrate profile of `model`, with the int8 default's switch at 2 rows."""
    coefficients = {"per_step_s": 1e-3, "per_token_s": 5e-5, "per_seq_s": 2e-5, "per_context_token_s": 1e-8,
                    "per_pair_s": 1e-9, "per_prefill_step_s": 5e-4, "per_wide_step_s": 4e-4}  # fmt: skip
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "model": model,
                                "fit": {"coefficients": coefficients},
                                "kernel_rows": {"fused_max_rows": 1, "max_rows": None}}))  # fmt: skip
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=1024))


@pytest.mark.slow  # two servers and six bench runs, about half a minute
def test_quick_run_measures_simulates_and_compares(tiny, tmp_path, capsys):
    profile = write_profile(tmp_path / "profile.json", "smollm2-135m")
    out = tmp_path / "out"
    report = spec_sim_check.main(["--model", tiny, "--quick", "--profile", str(profile), "--out", str(out), "--json"])
    assert json.loads(capsys.readouterr().out) == report
    assert [r["concurrency"] for r in report["levels"]] == [1, 2]
    for r in report["levels"]:
        assert r["plain_tpot_ms"] > 0 and r["spec_tpot_ms"] > 0 and r["sim_plain_tpot_ms"] > 0
        assert r["speedup"] == pytest.approx(r["speedup_rounds"][0])
        assert r["speedup_error_pct"] == pytest.approx((r["sim_speedup"] / r["speedup"] - 1) * 100)
    assert report["measured_crossover"] in (None, 1, 2) and report["predicted_crossover"] in (None, 1, 2)
    a = report["acceptance"]
    assert a["num_drafts"] > 0 and 0 <= a["acceptance_rate"] <= 1
    assert a["num_decode_steps"] >= a["num_drafts"] and 0 < a["draft_coverage"] <= 1
    assert json.loads((out / "report.json").read_text()) == report
    assert (out / "acceptance.json").exists()
    # each (round, concurrency) simulated with its own seed and the acceptance measured on its requests
    assert report["acceptance_per"] == "per-run" and all((out / f"acceptance-r0-c{c}.json").exists() for c in (1, 2))
    assert all(r["spec_p90_over_p50"] >= 1 and r["sim_spec_p90_over_p50"] >= 1 for r in report["levels"])
    pooled = spec_sim_check.main(
        ["--measured", str(out), "--profile", str(profile), "--acceptance", "pooled", "--json"]
    )
    capsys.readouterr()
    assert pooled["acceptance_per"] == "pooled" and pooled["levels"][0]["speedup"] == report["levels"][0]["speedup"]
    # the printed table, from the same report
    spec_sim_check.print_report(report)
    text = capsys.readouterr().out
    assert "sim speedup" in text and "crossover: measured" in text and "within 15%" in text
    assert all(r["mean_speedup"] > 0 and r["sim_mean_speedup"] > 0 for r in report["levels"])
    # simulated again from the folder, nothing measured: the same comparison (the simulator is seeded)
    again = spec_sim_check.main(["--measured", str(out), "--profile", str(profile), "--json"])
    capsys.readouterr()
    assert again["levels"] == report["levels"] and again["acceptance"] == report["acceptance"]


@pytest.mark.slow  # two servers and four bench runs
def test_quick_run_with_the_model_drafting_for_itself(tiny, tmp_path, capsys):
    """A draft model as large as the target: every draft accepted (greedy), the passes priced by
    the profile of the target, so the simulator says speculation does not pay, as measured."""
    profile = write_profile(tmp_path / "profile.json", "tiny")
    out = tmp_path / "out"
    report = spec_sim_check.main(["--model", tiny, "--sim-model", tiny, "--draft-model", tiny, "--quick",
                                  "--profile", str(profile), "--out", str(out), "--json"])  # fmt: skip
    capsys.readouterr()
    assert report["config"] == {"model": str(Path(tiny).resolve()), "num_speculative_tokens": 4}
    assert report["acceptance"]["acceptance_rate"] == 1.0  # greedy: the same model proposes what it checks
    for r in report["levels"]:
        assert r["sim_speedup"] < 1.0  # four draft passes cost about as much as four decodes
    again = spec_sim_check.main(["--measured", str(out), "--profile", str(profile), "--json"])
    capsys.readouterr()
    assert again["config"] == report["config"] and again["levels"] == report["levels"]
    spec_sim_check.print_report(report)
    assert "draft model" in capsys.readouterr().out
