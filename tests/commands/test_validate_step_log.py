"""validate --step-log: the steps the server ran during the measured run, priced with the
profile, tell a host that changed speed since calibrate from a model that is wrong."""

from __future__ import annotations

import json

import pytest

from servelab.commands.validate import STEP_DRIFT_WARN_PCT, _log_size, describe_steps, served_steps
from servelab.errors import InvalidArgument

PROFILE = {
    "fit": {
        "coefficients": {
            "per_step_s": 0.010,
            "per_token_s": 0.0,
            "per_seq_s": 0.0,
            "per_context_token_s": 0.0,
            "per_pair_s": 0.0,
        }
    }
}


def _line(start: float, took: float) -> str:
    return (
        json.dumps(
            {
                "start_s": start,
                "end_s": start + took,
                "waited_s": 0.0,
                "step_s": took,
                "execute_s": took,
                "num_tokens": 1,
                "num_seqs": 1,
                "context_tokens": 9,
                "pairs": 9,
                "decode_seqs": 1,
            }
        )
        + "\n"
    )


def test_only_the_steps_logged_during_the_run_are_priced(tmp_path):
    log = tmp_path / "steps.jsonl"
    log.write_text(_line(0.0, 0.5) + _line(0.5, 0.5))  # before the run: slow steps, not counted
    start = _log_size(str(log))
    with log.open("a") as f:  # the run: four steps of 12 ms, back to back, priced 10 ms each
        f.write("".join(_line(10.0 + 0.012 * i, 0.012) for i in range(4)))
    steps = served_steps(PROFILE, str(log), start)
    assert steps["steps"] == 4
    assert steps["served_s"] == pytest.approx(0.048) and steps["priced_s"] == pytest.approx(0.040)
    assert steps["error_pct"] == pytest.approx(-100 / 6)
    line = describe_steps(steps)
    assert line.startswith("server steps: 4 during the run took 0.05 s; the profile prices them 0.04 s (-16.7%)")
    assert "host changed since calibrate" in line  # past STEP_DRIFT_WARN_PCT
    assert "host changed" not in describe_steps({**steps, "error_pct": STEP_DRIFT_WARN_PCT / 2})


def test_a_line_being_written_when_the_run_began_is_skipped(tmp_path):
    log = tmp_path / "steps.jsonl"
    first = _line(0.0, 0.01)
    log.write_text(first + _line(0.01, 0.01) + _line(0.02, 0.01))
    # the run began mid-way through the second line: from the third on
    assert served_steps(PROFILE, str(log), len(first) + 5)["steps"] == 1
    assert served_steps(PROFILE, str(log), len(first))["steps"] == 2  # a boundary: the second on


def test_a_missing_log_an_empty_run_and_another_file_are_clear_errors(tmp_path):
    with pytest.raises(InvalidArgument, match="--step-log: cannot read .*serve --step-log FILE"):
        _log_size(str(tmp_path / "absent.jsonl"))
    log = tmp_path / "steps.jsonl"
    log.write_text(_line(0.0, 0.01))
    with pytest.raises(InvalidArgument, match="got no step during the run"):
        served_steps(PROFILE, str(log), _log_size(str(log)))
    other = tmp_path / "other.jsonl"
    other.write_text('{"hello": 1}\n')
    with pytest.raises(InvalidArgument, match="is not a `servelab serve --step-log` file"):
        served_steps(PROFILE, str(other), 0)
