"""benchmarks/disagg_runs.sh in its QUICK mode: two calibrations, one worker, --data-parallel 2 and
--disagg 1:1 serving the same trace on a tiny random model, and `sim` replaying it; the table
docs/disaggregation.md quotes must come out whole."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROWS = ("TTFT p50", "TTFT p90", "ITL p50", "ITL p90", "ITL p99", "ITL max", "TPOT mean", "E2E max")


@pytest.mark.slow  # three servers and two calibrations, about 90 s
def test_disagg_runs_quick_serves_and_simulates_each_mode(tmp_path):
    env = dict(os.environ, QUICK="1", OUT=str(tmp_path), PY=sys.executable)
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "disagg_runs.sh")], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    trace = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert len(trace) == 6
    for mode in ("one", "dp2", "disagg"):
        summary = json.loads((tmp_path / f"bench-{mode}.json").read_text())["summary"]
        assert summary["completed"] == 6 and summary["failed"] == 0, (mode, summary)
    for sim in ("sim-one", "sim-dp2-t1", "sim-dp2-t2", "sim-disagg-t1", "sim-disagg-t2"):
        assert json.loads((tmp_path / f"{sim}.json").read_text())["summary"]["completed"] == 6, sim
    # only the disaggregated server moves KV: one transfer per request
    transfers = re.search(
        r"^servelab:kv_transfer_seconds_count\{.*\} (\S+)$", (tmp_path / "metrics-disagg.txt").read_text(), re.M
    )
    assert transfers and float(transfers.group(1)) == 6
    assert (tmp_path / "metrics-one.txt").read_text() == ""
    table = (tmp_path / "table.txt").read_text()
    sections = re.split(r"\n\n", table.strip())
    assert [s.splitlines()[0] for s in sections] == [
        "one worker: measured vs sim-one",
        "--data-parallel 2: measured vs sim-dp2-t1, sim-dp2-t2",
        "--disagg 1:1: measured vs sim-disagg-t1, sim-disagg-t2",
    ]
    for section, sims in zip(sections, (1, 2, 2)):
        rows = section.splitlines()[2:]
        assert [r[:12].strip() for r in rows] == list(ROWS)
        for row in rows:
            measured, *replayed = row[12:].split()  # measured, then (simulated, error) per replay
            assert re.fullmatch(r"[\d.]+s", measured) and len(replayed) == 2 * sims, row
            for sim, err in zip(replayed[::2], replayed[1::2]):
                # no error against a measured 0 (a chunk that carried several tokens: an ITL of 0)
                assert re.fullmatch(r"[\d.]+s", sim) and re.fullmatch(r"[-+]\d+%|-", err), row
        # seconds to 2 places: a tiny model's token gaps round to 0.00, its requests do not
        assert float(re.findall(r"([\d.]+)s", rows[-1])[0]) > 0
