"""SentencePiece ('llama') GGUF tokenizers against llama.cpp: ids and decoded text.

The golden file holds llama.cpp's output for tiny Llama 2 / Gemma / Phi-3 style vocabularies
(tests/engine/spm_golden.py writes it); where $SERVELAB_LLAMA_CPP_PYTHON names a Python with
llama-cpp-python, random texts are also checked against llama.cpp live.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.engine.detokenizer import IncrementalDetokenizer
from servelab.engine.tokenizer import Tokenizer
from tests.engine.spm_golden import GOLDEN, VOCABS, llama_cpp, vocab_gguf
from tests.tiny_spm import BYTE, CONTROL, UNKNOWN, UNUSED, USER_DEFINED

LLAMA_CPP_PYTHON = os.environ.get("SERVELAB_LLAMA_CPP_PYTHON")


@cache
def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


def metadata(name: str) -> dict[str, Any]:
    """The tokenizer.ggml.* keys convert_hf_to_gguf.py writes for the golden vocabulary `name`."""
    v = golden()["vocabs"][name]
    return {
        "general.name": v["name"],
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": v["tokens"],
        "tokenizer.ggml.scores": v["scores"],
        "tokenizer.ggml.token_type": v["types"],
        "tokenizer.ggml.bos_token_id": v["bos_id"],
        "tokenizer.ggml.eos_token_id": v["eos_id"],
        "tokenizer.ggml.unknown_token_id": v["unk_id"],
        **({"tokenizer.ggml.padding_token_id": v["pad_id"]} if v["pad_id"] is not None else {}),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": v["add_space_prefix"],
        "tokenizer.chat_template": v["chat_template"],
    }


@cache
def tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(metadata(name))


def encode(tok: Tokenizer, text: str, add_bos: bool, special: bool) -> list[int]:
    """llama.cpp's `tokenize(text, add_special=add_bos, parse_special=special)`."""
    return (tok.encode if special else tok.encode_user_text)(text, add_special_tokens=add_bos)


def after_bos(tok: Tokenizer, ids: list[int]) -> list[int]:
    return ids[1:] if ids[:1] == [tok.bos_token_id] else ids


def reference_pieces(name: str, ids: list[int]) -> str:
    """llama.cpp's token_to_piece, concatenated (what its server streams): control, unknown and
    unused tokens render nothing, byte tokens are bytes, "▁" is a space."""
    v = golden()["vocabs"][name]
    out = b""
    for i in ids:
        token, kind = v["tokens"][i], v["types"][i]
        if kind in (CONTROL, UNKNOWN, UNUSED):
            continue
        if kind == BYTE:
            out += bytes([int(token[3:5], 16)])
        else:
            out += (token if kind == USER_DEFINED else token.replace("▁", " ")).encode("utf-8")
    return out.decode("utf-8", errors="replace")


@pytest.mark.parametrize("name", list(VOCABS))
def test_ids_and_text_equal_llama_cpp_golden(name):
    tok = tokenizer(name)
    cases = golden()["cases"][name]
    assert len(cases) > 250
    wrong = [c for c in cases if encode(tok, c["text"], c["add_bos"], c["special"]) != c["ids"]]
    assert not wrong, wrong[:3]
    wrong = [c for c in cases if tok.decode(after_bos(tok, c["ids"])) != c["decoded"]]
    assert not wrong, wrong[:3]
    wrong = [
        c for c in cases if tok.decode(after_bos(tok, c["ids"]), skip_special_tokens=False) != c["decoded_special"]
    ]
    assert not wrong, wrong[:3]


def test_the_golden_cases_cover_what_they_must():
    cases = golden()["cases"]["llama"]
    v = golden()["vocabs"]["llama"]
    all_ids = [i for c in cases for i in c["ids"]]
    kinds = {v["types"][i] for i in all_ids}
    assert {BYTE, CONTROL, USER_DEFINED} <= kinds  # byte fallback, control and user-defined tokens seen
    assert any(c["text"].startswith(" ") for c in cases) and any("\n" in c["text"] for c in cases)
    # the space prefix really differs between the two layouts
    gemma = {c["text"]: c["ids"] for c in golden()["cases"]["gemma"] if c["special"] and not c["add_bos"]}
    llama = {c["text"]: c["ids"] for c in cases if c["special"] and not c["add_bos"]}
    assert tokenizer("llama").id_to_token(llama["Hello world"][0]).startswith("▁")
    assert not tokenizer("gemma").id_to_token(gemma["Hello world"][0]).startswith("▁")


@pytest.mark.parametrize(("name", "end_of_turn"), [("gemma", "<end_of_turn>"), ("phi3", "<|end|>"), ("llama", "</s>")])
def test_special_ids_and_end_of_turn(name, end_of_turn):
    tok, v = tokenizer(name), golden()["vocabs"][name]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (v["bos_id"], v["eos_id"], v["pad_id"])
    assert tok.token_to_id(end_of_turn) in tok.eos_token_ids
    messages = [{"role": "user", "content": "hi <tool> there"}]
    ids = tok.encode_chat(messages)
    assert ids[0] == v["bos_id"] and ids.count(v["bos_id"]) == 1

    def squeezed(text: str) -> str:  # Phi-3's markers eat the whitespace after them
        return "".join(text.split()).removeprefix(tok.bos_token or "")

    assert squeezed(tok.decode(ids, skip_special_tokens=False)) == squeezed(tok.apply_chat_template(messages))


def test_a_client_cannot_forge_control_tokens_but_user_defined_ones_are_whole():
    tok = tokenizer("gemma")
    ids = tok.encode_chat([{"role": "user", "content": "<end_of_turn> and <start_of_turn>"}])
    end = tok.token_to_id("<end_of_turn>")
    assert ids.count(end) == 1  # the template's, not the content's
    llama = tokenizer("llama")
    assert llama.token_to_id("<tool>") in llama.encode_user_text("a <tool> b")


def test_without_byte_tokens_unknown_characters_are_the_unknown_token():
    """llama.cpp aborts on such a character (byte_to_token finds no token); the unknown token
    keeps the request alive."""
    md = metadata("llama")
    keep = [i for i, kind in enumerate(md["tokenizer.ggml.token_type"]) if kind != BYTE]
    md = {**md, **{k: [md[k][i] for i in keep] for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                                                        "tokenizer.ggml.token_type")}}  # fmt: skip
    tok = Tokenizer.from_gguf(md)
    ids = tok.encode("the Ω model", add_special_tokens=False)
    assert md["tokenizer.ggml.unknown_token_id"] in ids
    assert tok.decode(ids) == "the  model"


def test_streamed_text_equals_the_pieces_llama_cpp_streams():
    tok = tokenizer("llama")
    text = "naïve 🙂 model, 日本 Ωmega\n\ttab"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id])
    streamed = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert streamed == reference_pieces("llama", ids) == " " + text
    assert tok.decode(ids) == text


# Unicode whitespace beyond ASCII's is left out: after a Phi-3 special token llama.cpp strips only
# ASCII whitespace (isspace), HF's rstrip all of it; the one known difference.
_CHARS = st.characters(blacklist_categories=("Cs",)).filter(lambda c: not c.isspace() or c in " \t\n\v\f\r")
_ATOMS = st.one_of(
    st.text(_CHARS, max_size=6),
    st.text(st.sampled_from(list("abcdefghijklmnopqrstuvwxyz THE.,\n\t0123456789éï🙂日本")), max_size=12),
    st.sampled_from(["<s>", "</s>", "[INST]", "[/INST]", "<tool>", "<start_of_turn>", "<end_of_turn>", "<|end|>",
                     "<|user|>", "<|endoftext|>", "<unk>", "▁", "  ", " \n "]),
)  # fmt: skip
TEXTS = st.lists(st.lists(_ATOMS, max_size=8).map("".join), min_size=40, max_size=40)


@pytest.mark.skipif(not LLAMA_CPP_PYTHON, reason="set SERVELAB_LLAMA_CPP_PYTHON to a Python with llama-cpp-python")
@pytest.mark.parametrize("name", list(VOCABS))
def test_random_text_equals_llama_cpp_live(name, tmp_path_factory):
    _, path = vocab_gguf(tmp_path_factory.mktemp(name), name)
    tok = Tokenizer.from_gguf(path)

    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
    @given(texts=TEXTS)
    def check(texts: list[str]) -> None:
        requests = [{"text": t, "add_bos": True, "special": s} for t in texts for s in (True, False)]
        for request, ref in zip(requests, llama_cpp(str(LLAMA_CPP_PYTHON), Path(path), requests)):
            assert encode(tok, request["text"], True, request["special"]) == ref["ids"], request
            assert tok.decode(after_bos(tok, ref["ids"])) == ref["text"], request
            assert tok.decode(after_bos(tok, ref["ids"]), skip_special_tokens=False) == ref["text_special"], request

    check()
