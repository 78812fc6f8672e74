"""benchmarks/calibrate_repeatability.py on profiles calibrate wrote for a tiny random model: its
comparison of what each profile predicts, and its --runs mode that runs calibrate itself."""

import json
import re
import sys
from pathlib import Path

import pytest

from servelab.cli import main as servelab_main
from servelab.commands import calibrate
from tests.tiny_models import write_tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import calibrate_repeatability  # noqa: E402

SHAPES = list(calibrate_repeatability.REFERENCE_SHAPES)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def profile(tiny, tmp_path, monkeypatch) -> Path:
    """A real profile in seconds: calibrate on a small grid."""
    grid = calibrate.Grid(
        chunk=32, prefill_lens=(8, 32, 64), decode_batches=(1, 4), decode_contexts=(16, 48), decode_steps=3, repeats=2
    )
    monkeypatch.setitem(calibrate.GRIDS, "coarse", grid)
    out = tmp_path / "profile.json"
    args = ["calibrate", "--model", str(tiny), "--dtype", "float32", "--out", str(out), "--max-heldout-error", "1e9"]
    assert servelab_main(args) == 0
    return out


def test_compare_reports_each_shape_s_disagreement(profile, tmp_path, capsys):
    capsys.readouterr()
    doubled = json.loads(profile.read_text())
    doubled["fit"]["coefficients"] = {k: 2 * v for k, v in doubled["fit"]["coefficients"].items()}
    twice = tmp_path / "twice.json"
    twice.write_text(json.dumps(doubled))
    calibrate_repeatability.main([str(profile), str(twice), "--json"])
    report = json.loads(capsys.readouterr().out)
    preds = report["predictions_s"]
    for shape in SHAPES:
        assert preds[str(profile)][shape] > 0
        assert preds[str(twice)][shape] == pytest.approx(2 * preds[str(profile)][shape])
        assert report["max_disagreement"][shape] == pytest.approx(1.0)
    assert report["host_noise"][str(profile)]["cpus"] > 0

    same = tmp_path / "same.json"
    same.write_text(profile.read_text())
    calibrate_repeatability.main([str(profile), str(same)])
    out = capsys.readouterr().out
    assert re.search(r"held-out median [\d.]+%, host spread median [\d.]+%", out), out
    rows = [line for line in out.splitlines() if line.split("  ")[0].strip() in SHAPES]
    assert len(rows) == len(SHAPES) and all(row.endswith(" 0.0%") for row in rows), out
    assert "largest disagreement: 0.0%" in out


@pytest.mark.parametrize("copies", [1, 2])
def test_compare_needs_two_different_profiles(profile, copies, capsys):
    with pytest.raises(SystemExit) as exc:
        calibrate_repeatability.main([str(profile)] * copies)
    assert exc.value.code == 2 and "two or more different profiles" in capsys.readouterr().err


@pytest.mark.slow
def test_runs_calibrates_twice_and_compares_the_two(tiny, tmp_path, capsys):
    out_dir = tmp_path / "rep"
    calibrate_repeatability.main(
        ["--runs", "2", "--out-dir", str(out_dir), "--calibrate-args", f"--model {tiny} --max-heldout-error 1e9"]
    )
    out = capsys.readouterr().out
    assert sorted(p.name for p in out_dir.iterdir()) == ["profile-1.json", "profile-2.json"]
    assert out.count("$ ") == 2 and "servelab calibrate --out" in out
    times = [line for line in out.splitlines() if line.split("  ")[0].strip() in SHAPES]
    assert len(times) == len(SHAPES)
    for row in times:
        ms = [float(v) for v in re.findall(r"([\d.]+)ms", row)]
        assert len(ms) == 2 and all(v > 0 for v in ms), row
    assert re.search(r"largest disagreement: [\d.]+%", out)
