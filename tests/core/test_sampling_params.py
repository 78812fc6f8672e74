import math

import pytest

from servelab.core.sequence import SamplingParams
from servelab.errors import InvalidArgument


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", -0.1),
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
