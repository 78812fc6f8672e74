"""A tiny model whose GGUF carries a SentencePiece vocabulary, as llama.cpp's converter writes Llama 2,
Mistral, Phi-3 and Gemma files, serves a chat end to end: the prompt is the template's control
tokens around the text, the tokens are transformers' greedy ones for that prompt, and the text is
what llama.cpp streams for those tokens."""

from __future__ import annotations

import pytest
import torch

from servelab.core.sequence import SamplingParams
from servelab.engine.llm import LLM
from tests.tiny_families import spm_vocab_for, write_family, write_gguf
from tests.tiny_spm import BYTE, CONTROL, UNKNOWN, UNUSED, USER_DEFINED, SpmVocab

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")


def streamed_text(vocab: SpmVocab, ids: list[int]) -> str:
    """llama.cpp's pieces for `ids`, concatenated as its server streams them."""
    out = b""
    for i in ids:
        token, kind = vocab.tokens[i], vocab.types[i]
        if kind in (CONTROL, UNKNOWN, UNUSED):
            continue
        if kind == BYTE:
            out += bytes([int(token[3:5], 16)])
        else:
            out += (token if kind == USER_DEFINED else token.replace("▁", " ")).encode("utf-8")
    return out.decode("utf-8")


@pytest.mark.parametrize(
    ("family", "tokenizer_of", "markers", "end_of_turn"),
    [
        ("phi3", "phi3", ["<|user|>", "<|end|>", "<|assistant|>"], "<|end|>"),
        ("llama3", "mistral", ["[INST]", "[/INST]"], "</s>"),  # space prefix on
        ("llama3", "gemma", ["<start_of_turn>", "<end_of_turn>", "<start_of_turn>"], "<end_of_turn>"),  # prefix off
    ],
)
def test_a_sentencepiece_gguf_serves_a_chat(tmp_path, family, tokenizer_of, markers, end_of_turn):
    hf_dir = write_family(tmp_path / family, family, seed=3)
    vocab = spm_vocab_for(tokenizer_of)
    assert vocab is not None
    llm = LLM(str(write_gguf(hf_dir, tmp_path / "model.gguf", spm=vocab)), dtype="float32")
    messages = [{"role": "user", "content": "Where is the river? Zoë 🙂"}]
    # A random model strings byte tokens into invalid UTF-8, whose rendering no reference fixes: ban them.
    byte_ids = [i for i, kind in enumerate(vocab.types) if kind == BYTE]
    allowed = sorted(set(range(len(vocab.tokens))) - set(byte_ids))
    out = llm.chat(messages, SamplingParams(max_tokens=24, temperature=0, allowed_token_ids=allowed))[0]

    prompt = out.prompt_token_ids
    assert prompt[0] == vocab.bos_id and prompt.count(vocab.bos_id) == 1
    assert [vocab.tokens[i] for i in prompt if vocab.types[i] == CONTROL][1:] == markers
    assert any(vocab.types[i] == BYTE for i in prompt)  # "ë" is not in the vocabulary: byte fallback

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        greedy = hf.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, suppress_tokens=byte_ids
        )
    greedy_ids = greedy[0, len(prompt) :].tolist()
    assert out.token_ids == greedy_ids[: len(out.token_ids)]
    stops = {vocab.eos_id, *(vocab.id(t) for t in ("<|end|>", "<end_of_turn>", "</s>") if t in vocab.tokens)}
    if out.finish_reason == "stop":
        assert out.token_ids[-1] in stops
        shown = out.token_ids[:-1]
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 24 and not stops & set(out.token_ids)
        shown = out.token_ids
    assert out.text == streamed_text(vocab, shown)
    assert out.text.strip()

    end = vocab.id(end_of_turn)  # the model ending its turn ends the request
    ended = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0, logit_bias={end: 100.0}))[0]
    assert (ended.finish_reason, ended.token_ids, ended.text) == ("stop", [end], "")
