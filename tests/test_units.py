"""The shared parsers of CLI values: durations and comma-separated lists."""

import pytest

from servelab.errors import InvalidArgument
from servelab.units import parse_duration_s, parse_int_list, parse_str_list


def test_durations_parse_with_and_without_units():
    assert parse_duration_s("500ms") == 0.5 and parse_duration_s("2s") == 2.0 and parse_duration_s("1.5") == 1.5
    assert parse_duration_s("+3us") == pytest.approx(3e-6) and parse_duration_s("0") == 0.0


@pytest.mark.parametrize("text", ["-1ms", "-1s", "-1", " -0.5 min"])
def test_a_negative_duration_says_it_must_be_at_least_zero(text):
    with pytest.raises(InvalidArgument, match=f"--step-overhead: must be >= 0, got '{text}'"):
        parse_duration_s(text, name="--step-overhead")


@pytest.mark.parametrize("text", ["-1s", "0", "0ms"])
def test_a_positive_duration_refuses_zero_and_negatives(text):
    with pytest.raises(InvalidArgument, match=f"--slo-ttft: must be > 0, got '{text}'"):
        parse_duration_s(text, name="--slo-ttft", positive=True)


def test_an_unparsable_duration_still_says_so():
    with pytest.raises(InvalidArgument, match="cannot parse '5 parsecs' as a duration"):
        parse_duration_s("5 parsecs", name="--x")


def test_lists_refuse_empty_items():
    assert parse_int_list(" 1, 8,64", name="--batch") == [1, 8, 64]
    assert parse_str_list("a, b", name="--hardware") == ["a", "b"] and parse_str_list("") == []
    for text in ("1,,2", "1,", ",1", "1, ,2"):
        with pytest.raises(InvalidArgument, match=f"--batch: empty item in '{text}'"):
            parse_int_list(text, name="--batch")
    with pytest.raises(InvalidArgument, match="--hardware: empty item"):
        parse_str_list("h100-sxm,,h200", name="--hardware")
    with pytest.raises(InvalidArgument, match="--batch: expected a comma-separated list"):
        parse_int_list("", name="--batch")


@pytest.mark.parametrize("value", ["1e400s", "1e400", float("inf"), float("nan")])
def test_a_duration_must_be_finite(value):
    # '1e400s' was infinity, and `sim --json` then wrote "tpot_s": Infinity (not JSON)
    with pytest.raises(InvalidArgument, match="--slo-tpot: must be a finite duration"):
        parse_duration_s(value, name="--slo-tpot", positive=True)
