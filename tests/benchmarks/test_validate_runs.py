"""benchmarks/validate_runs.sh in its QUICK mode (calibrate, serve and validate on a tiny random
model), and the scripts that read the folder it writes, each run on that folder: every one must
print the rows it exists for."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import client_gap  # noqa: E402
import refit_profile  # noqa: E402
import step_residuals  # noqa: E402
import validate_table  # noqa: E402

pytestmark = pytest.mark.slow  # one calibrate and one server, about a minute

LOADS = ("c1", "c4", "c16", "rate")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("validate-runs")
    env = dict(os.environ, QUICK="1", OUT=str(out), PY=sys.executable)
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "validate_runs.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr + (out / "calibrate.txt").read_text()
    return out


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def _pair(cell: str) -> tuple[float, float]:
    """'9.5 / 1.4 ms (-86%)' -> (measured, simulated). A measured TPOT may be 0: a loaded host can
    send all of a reply's tokens in one chunk."""
    m = re.match(r"([\d,.]+) / ([\d,.]+)", cell)
    assert m, cell
    return float(m.group(1).replace(",", "")), float(m.group(2).replace(",", ""))


def test_validate_runs_quick_writes_every_stage_and_the_table(folder):
    for name in ("profile.json", "steps.jsonl", "host.txt", "table.md", *(f"{k}.json" for k in LOADS)):
        assert (folder / name).stat().st_size > 0, name
    profile = json.loads((folder / "profile.json").read_text())
    assert profile["server"]["served_steps"] and profile["server"]["per_seq_s"] >= 0
    marks = re.findall(r"^(\w+):.*steps logged (\d+)$", (folder / "host.txt").read_text(), re.M)
    assert [name for name, _ in marks] == [*LOADS, "end"]
    counts = [int(n) for _, n in marks]
    assert counts == sorted(counts) and counts[-1] == len((folder / "steps.jsonl").read_text().splitlines())
    for key in LOADS:
        run = json.loads((folder / f"{key}.json").read_text())
        assert run["config"]["sim_model"] == "smollm2-135m" and run["measured"]["output_throughput"] > 0
    rows = re.findall(r"^\| (?:concurrency|Poisson) .*$", (folder / "table.md").read_text(), re.M)
    assert len(rows) == len(LOADS)


def test_validate_table_prints_the_profile_and_a_row_per_load(folder, capsys):
    validate_table.main([str(folder), "--label", "quick"])
    out = capsys.readouterr().out
    shapes = len(json.loads((folder / "profile.json").read_text())["measurements"])
    assert re.search(rf"{shapes} shapes in \d+ s; held-out error median [\d.]+%", out), out
    assert re.search(r"serving term [\d.]+ ms/step \+ [\d.]+ ms/seq \(from \d+ served steps", out), out
    rows = [_cells(r) for r in out.splitlines() if r.startswith("| ") and "quick" in r]
    assert [r[0] for r in rows] == [
        "concurrency 1 (4 requests)",
        "concurrency 4 (7 requests)",
        "concurrency 16 (19 requests)",
        "Poisson 8.0 req/s (12 requests)",
    ]
    for row in rows:
        assert len(row) == 6 and all(m >= 0 and s > 0 for m, s in map(_pair, row[2:])), row


def test_step_residuals_groups_each_stage_s_steps(folder, capsys):
    step_residuals.main([str(folder)])
    out = capsys.readouterr().out
    logged = re.findall(r"^(\w+): (\d+) steps, ([\d.]+) s served", out, re.M)
    assert [name for name, _, _ in logged] == list(LOADS)
    steps = len((folder / "steps.jsonl").read_text().splitlines())
    assert sum(int(n) for _, n, _ in logged) == steps
    # each stage's table accounts for every one of its steps, by kind and sequences
    tables = re.split(r"\n(?=\w+: \d+ steps)", out.strip())
    for (name, n, _), table in zip(logged, tables):
        rows = [_cells(r) for r in table.splitlines() if re.match(r"\| (decode|prefill|mixed) \|", r)]
        assert sum(int(r[2]) for r in rows) == int(n), name
        assert all(float(r[3]) > 0 for r in rows)
        assert {"decode", "prefill"} <= {r[0] for r in rows}, name  # each stage prefills and decodes


def test_step_residuals_takes_a_profile_and_a_log(folder, capsys):
    step_residuals.main(["--profile", str(folder / "profile.json"), "--steps", str(folder / "steps.jsonl")])
    steps = len((folder / "steps.jsonl").read_text().splitlines())
    assert re.search(rf"^all: {steps} steps", capsys.readouterr().out, re.M)
    with pytest.raises(SystemExit):
        step_residuals.main(["--profile", str(folder / "profile.json")])


def test_client_gap_replays_the_closed_loops_at_each_gap(folder, capsys):
    client_gap.main([str(folder), "--gaps", "0", "0.02"])
    rows = [_cells(r) for r in capsys.readouterr().out.splitlines() if re.match(r"\| c\d+ \|", r)]
    assert [(r[0], r[2]) for r in rows] == [(c, g) for c in ("c1", "c4", "c16") for g in ("0 ms", "20 ms")]
    by = {(r[0], r[2]): r for r in rows}
    for c in ("c1", "c4", "c16"):
        now, later = by[c, "0 ms"], by[c, "20 ms"]
        # the same measured run; a client that waits 20 ms after each answer gets fewer tokens a second
        assert [_pair(x)[0] for x in now[4:]] == [_pair(x)[0] for x in later[4:]]
        assert _pair(later[-1])[1] < _pair(now[-1])[1], c


def test_refit_profile_refits_by_statistic_and_replays_each_load(folder, capsys):
    refit_profile.main([str(folder), "--replay", "--spread", "none", "passes"])
    out = capsys.readouterr().out
    for stat in ("fastest", "median"):
        assert re.search(rf"^  {stat}\s+revised\s+all [\d.]+% / [\d.]+% \(\d+\)", out, re.M), stat
    assert "refitted from the served steps" in out
    rows = [_cells(r) for r in out.splitlines() if re.match(r"\| (c\d+|rate) \|", r)]
    assert len(rows) == len(LOADS) * 2 * 2  # loads x statistics x spreads
    assert {r[0] for r in rows} == set(LOADS) and {r[4] for r in rows} == {"none", "passes"}
    for row in rows:
        assert all(m >= 0 and s > 0 for m, s in map(_pair, row[5:])), row
