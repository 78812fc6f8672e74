"""The torch-free benchmarks (scheduler, simulator, lab) in their `--quick` modes: each run must
print the figures it exists for, and sim_fingerprint must print the same fingerprints twice."""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import lab_latency  # noqa: E402
import scheduler_step  # noqa: E402
import sim_fingerprint  # noqa: E402
import sim_speed  # noqa: E402


def _ms(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in:\n{text}"
    return float(match.group(1).replace(",", ""))


def test_scheduler_step_quick_times_both_calls_and_the_floor(capsys):
    assert scheduler_step.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "16 decoding sequences, 50 steps x 1 repeats" in out
    for pattern in (
        r"\(the simulator\): median ([\d.]+) ms",
        r"\(the engine\): median ([\d.]+) ms",
        r"floor \(one object per sequence\): median ([\d.]+) ms",
    ):
        assert _ms(pattern, out) > 0


def test_sim_speed_quick_simulates_every_request_and_splits_the_time(capsys):
    sim_speed.main(["--quick"])
    out = capsys.readouterr().out
    assert _ms(r"capacity \(saturated, 300 requests\): ([\d.]+) req/s", out) > 0
    assert "300 completed" in out
    assert _ms(r"([\d,]+) simulated requests/s", out) > 0
    shares = [float(x) for x in re.findall(r"(\d+)%", out.split("split of")[1])]
    assert "schedule" in out and "executor" in out and shares and all(s >= 0 for s in shares)


def test_sim_fingerprint_quick_is_reproducible(capsys):
    sim_fingerprint.main(["--quick"])
    first = capsys.readouterr().out
    sim_fingerprint.main(["--quick"])
    assert capsys.readouterr().out == first
    lines = first.splitlines()
    assert {line.split()[0] for line in lines} >= {"disaggregated-2:1", "preempting"}
    assert all('"completed": 60' in line for line in lines)
    assert '"preemptions": 0' not in next(line for line in lines if line.startswith("preempting"))


def test_lab_latency_quick_answers_every_lesson(capsys):
    assert lab_latency.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == list(lab_latency.CHANGES)
    assert all("change" not in line for line in out.splitlines())
