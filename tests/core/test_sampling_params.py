import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servelab.core.sequence import SamplingParams
from servelab.errors import InvalidArgument


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", -0.1),
        ("temperature", 1e39),  # overflowed the sampler's fp32 to inf and sampled past the vocabulary
        ("temperature", 100.5),
        ("top_p", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", math.nan),
        ("presence_penalty", math.nan),
        ("frequency_penalty", 2.5),
        ("max_tokens", 0),
        ("top_k", -1),
        ("logprobs", 21),
    ],
)
def test_out_of_range_values_are_rejected_with_the_parameter_named(field, value):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
    assert field in err.value.message


def test_defaults_and_edges_are_accepted():
    SamplingParams()
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0, logprobs=0)
    assert SamplingParams(temperature=0).greedy


def test_the_temperature_cap_is_named_in_the_message():
    SamplingParams(temperature=100.0)
    with pytest.raises(InvalidArgument, match=r"temperature must be a number in \[0, 100\], got 1e\+39"):
        SamplingParams(temperature=1e39)


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty")


@given(field=st.sampled_from(_FLOAT_FIELDS), value=st.floats(allow_nan=True, allow_infinity=True, width=64))
def test_every_accepted_float_is_finite_and_fits_fp32(field, value):
    """What validation lets through reaches the sampler as fp32: it must stay finite there."""
    try:
        params = SamplingParams(**{field: value})
    except InvalidArgument as exc:
        assert exc.param == field
        return
    accepted = getattr(params, field)
    assert math.isfinite(accepted) and abs(accepted) <= 100.0


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 1.5), ("seed", "x"), ("seed", True), ("max_tokens", "5"), ("max_tokens", True),
        ("temperature", "0.5"), ("temperature", None), ("temperature", True), ("logprobs", "2"),
        ("logit_bias", {1: "x"}), ("logit_bias", None), ("logit_bias", {True: 1.0}),
        ("stop_token_ids", ["a"]), ("stop_token_ids", 5), ("stop_token_ids", [True]),
        ("stop", None), ("stop", [5]), ("bad_words", None), ("allowed_token_ids", 5),
        ("structured_output", {"regex": "[0-9]+"}), ("ignore_eos", "no"),
    ],
)  # fmt: skip
def test_values_of_the_wrong_type_are_rejected_at_construction_with_the_field_named(field, value):
    """Checked when the params are made, never mid-step (stop=[5] used to fail the step)."""
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field and err.value.message.startswith(field), err.value.message


def test_a_single_stop_string_is_one_stop_string_not_its_characters():
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(bad_words="bad").bad_words == ["bad"]
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(3,)).stop_token_ids == [3]
    params = SamplingParams(temperature=1, top_p=1, seed=7, logit_bias={3: 2})  # ints where floats go
    assert params.temperature == 1 and params.logit_bias == {3: 2}
