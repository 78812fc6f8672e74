"""Test helpers: tiny SentencePiece (BPE-type) vocabularies and GGUF files that carry them, laid
out as llama.cpp's converter writes Llama 2 / Mistral / Phi-3 (`<unk> <s> </s>`, 256 byte tokens,
then pieces) and Gemma (`<pad> <eos> <bos> <unk>`, no space prefix) vocabularies.

Pieces come from a BPE trained in-process on words marked with "▁"; each merged piece scores
minus its merge rank and single characters score below every merge, as sentencepiece scores a
BPE model. Importable without servelab (the llama.cpp reference runs in another Python).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_WORDS = (
    "the a of to in on for with from by model token cache block prefill decode batch queue server "
    "request latency memory bandwidth compute kernel layer head attention weight matrix paris france "
    "capital city river bread cheese hello world what where when why how who quick brown fox jumps "
    "lazy dog is are was were be has have do does will can first last good bad café naïve"
).split()


@dataclass
class SpmVocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    bos_id: int
    eos_id: int
    unk_id: int
    pad_id: int | None
    add_space_prefix: bool
    chat_template: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def id(self, token: str) -> int:
        return self.tokens.index(token)


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(300):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 999)))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ":\n", "\n\n"]))
    lines += ["日本語 テキスト", "tab\tand  two  spaces", "emoji 🙂 ok"] * 2
    return lines


def _pieces(n_pieces: int, seed: int) -> tuple[list[str], list[str]]:
    """(merged pieces in merge order, single characters) of a BPE trained on ▁-marked words."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=n_pieces, show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    vocab = tok.get_vocab()
    chars = sorted((t for t in vocab if len(t) == 1), key=vocab.__getitem__)
    merged = sorted((t for t in vocab if len(t) > 1), key=vocab.__getitem__)
    return merged, chars


def _layout(head: list[tuple[str, int]], merged: list[str], chars: list[str], size: int, byte_tokens: bool):
    tokens = [t for t, _ in head]
    types = [k for _, k in head]
    if byte_tokens:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [BYTE] * 256
    scores = [0.0] * len(tokens)
    room = size - len(tokens) - len(chars)
    merged = merged[:room]
    tokens += merged + chars
    types += [NORMAL] * (len(merged) + len(chars))
    scores += [-float(i) for i in range(len(merged) + len(chars))]
    while len(tokens) < size:  # converters pad a short vocabulary with unused tokens
        tokens.append(f"<unused{len(tokens)}>")
        types.append(UNUSED)
        scores.append(-1e9)
    return tokens, scores, types


LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else "
    "m['role']) + '\n' + m['content'] + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def llama_vocab(size: int = 512, seed: int = 0, *, byte_tokens: bool = True) -> SpmVocab:
    """A Llama 2 / Mistral v0.3 style vocabulary: `<unk> <s> </s>`, bytes, `[INST] [/INST]` as
    control tokens, a user-defined `<tool>`, space prefix on."""
    merged, chars = _pieces(size, seed)
    head = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL), ("[INST]", CONTROL), ("[/INST]", CONTROL),
            ("<tool>", USER_DEFINED)]  # fmt: skip
    tokens, scores, types = _layout(head, merged, chars, size, byte_tokens)
    return SpmVocab(tokens, scores, types, bos_id=1, eos_id=2, unk_id=0, pad_id=None, add_space_prefix=True,
                    chat_template=LLAMA2_TEMPLATE)  # fmt: skip


PHI3_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def phi3_vocab(size: int = 512, seed: int = 0) -> SpmVocab:
    """A Phi-3 style vocabulary: Llama 2's, plus chat control tokens llama.cpp strips the
    whitespace after when the model's name says Phi-3."""
    merged, chars = _pieces(size, seed)
    head = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL), ("<|endoftext|>", CONTROL),
            ("<|user|>", CONTROL), ("<|assistant|>", CONTROL), ("<|end|>", CONTROL), ("<tool>", USER_DEFINED)]  # fmt: skip
    tokens, scores, types = _layout(head, merged, chars, size, True)
    return SpmVocab(tokens, scores, types, bos_id=1, eos_id=3, unk_id=0, pad_id=3, add_space_prefix=True,
                    chat_template=PHI3_TEMPLATE)  # fmt: skip


def gemma_vocab(size: int = 512, seed: int = 0) -> SpmVocab:
    """A Gemma 2/3 style vocabulary: `<pad> <eos> <bos> <unk>`, `<start_of_turn> <end_of_turn>`
    control tokens, bytes, no space prefix."""
    merged, chars = _pieces(size, seed)
    head = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN),
            ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)]  # fmt: skip
    tokens, scores, types = _layout(head, merged, chars, size, True)
    return SpmVocab(tokens, scores, types, bos_id=2, eos_id=1, unk_id=3, pad_id=0, add_space_prefix=False,
                    chat_template=GEMMA_TEMPLATE)  # fmt: skip


def add_spm_tokenizer(w: Any, vocab: SpmVocab, *, add_bos: bool = True) -> None:
    """The tokenizer.ggml.* keys convert_hf_to_gguf.py writes for a SentencePiece model."""
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab.tokens)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    w.add_bos_token_id(vocab.bos_id)
    w.add_eos_token_id(vocab.eos_id)
    w.add_unk_token_id(vocab.unk_id)
    if vocab.pad_id is not None:
        w.add_pad_token_id(vocab.pad_id)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)


def write_vocab_gguf(path: Path, vocab: SpmVocab, *, add_bos: bool = True, name: str = "tiny-spm") -> Path:
    """A GGUF with a Llama architecture header and `vocab`, no tensors (llama.cpp opens it with
    vocab_only)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(vocab.tokens))
    add_spm_tokenizer(w, vocab, add_bos=add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
