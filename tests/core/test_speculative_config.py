import pytest

from servelab.core.speculative import SpeculativeConfig
from servelab.errors import InvalidArgument


def test_parses_vllm_ngram_json():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert cfg == SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3)
    assert SpeculativeConfig.parse(cfg.to_json()) == cfg


def test_model_without_method_is_a_draft_model():
    cfg = SpeculativeConfig.parse({"model": "/m/draft.gguf", "num_speculative_tokens": 5})
    assert cfg is not None and cfg.method == "draft_model" and cfg.model == "/m/draft.gguf"
    assert SpeculativeConfig.parse(cfg.to_json()) == cfg


@pytest.mark.parametrize("empty", [None, "", "  "])
def test_unset_is_none(empty):
    assert SpeculativeConfig.parse(empty) is None


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("{not json", "must be a JSON object"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"num_speculative_tokens": 4}', "needs a method"),
        ('{"method": "eagle", "num_speculative_tokens": 4}', "method must be one of"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "integer >= 1"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "integer >= 1"),
        ('{"method": "ngram", "num_speculative_tokens": 33}', "<= 32"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5}', "prompt_lookup_min (5)"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "k": 1}', "unknown key(s) k"),
        ('{"method": "draft_model", "num_speculative_tokens": 4}', "model (the draft model's path) is required"),
        ('{"method": "ngram", "model": "x", "num_speculative_tokens": 4}', "is for method 'draft_model'"),
    ],
)
def test_bad_configs_name_the_problem(text, fragment):
    with pytest.raises(InvalidArgument) as e:
        SpeculativeConfig.parse(text)
    assert fragment in e.value.message
    assert e.value.param == "speculative_config"
