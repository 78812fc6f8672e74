"""A closed loop's think time: one workload parameter, checked where the workload is defined."""

from __future__ import annotations

import argparse
import math

import pytest

from servelab.errors import InvalidArgument
from servelab.workload import WorkloadSpec, add_workload_arguments, workload_from_args


def _parse(*argv: str) -> WorkloadSpec:
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    return workload_from_args(parser.parse_args(list(argv)))


def test_the_flag_reaches_the_spec_its_description_and_its_dict():
    spec = _parse("--concurrency", "16", "--think-time", "50ms")
    assert spec.think_time_s == pytest.approx(0.05)
    assert spec.arrivals.describe() == "closed loop, concurrency 16, think time 50 ms"
    assert spec.to_dict()["think_time_s"] == pytest.approx(0.05)
    assert "think time 2.5 s" in WorkloadSpec(concurrency=2, think_time_s=2.5).describe()
    # none by default: the description is what it was
    plain = _parse("--concurrency", "16")
    assert plain.think_time_s == 0.0 and plain.arrivals.describe() == "closed loop, concurrency 16"
    assert plain.to_dict()["think_time_s"] == 0.0


@pytest.mark.parametrize("argv", [["--rate", "2"], ["--rate", "2", "--concurrency", "4"]])
def test_an_open_loop_refuses_a_think_time_naming_both_flags(argv):
    with pytest.raises(InvalidArgument, match="--think-time.*--rate"):
        _parse(*argv, "--think-time", "50ms")
    _parse(*argv, "--think-time", "0")  # zero is no think time: allowed


def test_a_trace_sent_at_its_own_times_refuses_a_think_time(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0.0, "prompt_tokens": 8, "output_tokens": 2}\n')
    with pytest.raises(InvalidArgument, match="--concurrency.*--think-time"):
        WorkloadSpec(trace=str(trace), think_time_s=1.0)
    assert WorkloadSpec(trace=str(trace), concurrency=1, think_time_s=1.0).generate()[0].arrival_s is None


@pytest.mark.parametrize("value", [-0.1, math.inf, math.nan])
def test_a_negative_or_endless_think_time_is_refused(value):
    with pytest.raises(InvalidArgument, match="think time must be a finite duration >= 0"):
        WorkloadSpec(concurrency=2, think_time_s=value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("-5ms", "--think-time must be >= 0"),
        ("inf", "--think-time: cannot parse"),
        ("soon", "--think-time: cannot parse"),
    ],
)
def test_bad_flag_values_name_the_flag(text, message):
    with pytest.raises(InvalidArgument, match=message):
        _parse("--concurrency", "2", f"--think-time={text}")


def test_an_exponential_think_time_is_drawn_per_request_from_the_seed():
    spec = _parse("--concurrency", "4", "--think-time", "exp:2s", "--num-requests", "4000", "--input-len", "64-512")
    assert (spec.think_time_s, spec.think_time_dist) == (2.0, "exponential")
    assert spec.arrivals.describe() == "closed loop, concurrency 4, think time exponential, mean 2 s"
    thinks = [r.think_s for r in spec.generate()]
    assert abs(sum(thinks) / len(thinks) / 2.0 - 1) < 0.05 and len(set(thinks)) == len(thinks)
    assert [r.think_s for r in spec.generate()] == thinks  # seeded
    # its own random stream: the lengths are those of the same workload without a think time
    plain = _parse("--concurrency", "4", "--num-requests", "4000", "--input-len", "64-512").generate()
    assert [r.prompt_tokens for r in plain] == [r.prompt_tokens for r in spec.generate()]
    assert {r.think_s for r in plain} == {0.0}
    assert {r.think_s for r in _parse("--concurrency", "2", "--think-time", "50ms").generate()} == {0.05}
    with pytest.raises(InvalidArgument, match="exp:DURATION"):
        _parse("--concurrency", "2", "--think-time", "gauss:2s")
