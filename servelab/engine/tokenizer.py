"""Tokenizer and chat template, from a HF `tokenizer.json` directory or from GGUF metadata.

Both paths end in a HF `tokenizers.Tokenizer` (Rust, fast). A GGUF carries no `tokenizer.json`,
only llama.cpp's description of one: the vocabulary, the merges, a pre-tokenizer *name*
(`tokenizer.ggml.pre`) and special token ids. We rebuild the byte-level BPE from those; the
pre-tokenizer name maps to the split regex llama.cpp uses for it (llama-vocab.cpp), because the
same merges give different ids if the text is split differently before BPE.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from servelab.errors import InvalidArgument, NotFound
from servelab.spec.gguf_reader import gguf_metadata

# --------------------------------------------------------------------------------------------
# Pre-tokenizers for byte-level BPE GGUFs, keyed by `tokenizer.ggml.pre`.
# The regexes are llama.cpp's / the original tokenizer.json's (they are facts of the vocabulary).
# --------------------------------------------------------------------------------------------

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# name -> (split regex, split digits one by one first, BPE ignore_merges)
# ignore_merges: a pre-token that is itself in the vocabulary is taken whole (llama3's
# tokenizer.json sets it and llama.cpp honours it for that family).
_BPE_PRE_TOKENIZERS: dict[str, tuple[str, bool, bool]] = {
    "default": (_GPT2_SPLIT, False, False),
    "gpt2": (_GPT2_SPLIT, False, False),
    "gpt-2": (_GPT2_SPLIT, False, False),
    "llama3": (_LLAMA3_SPLIT, False, True),
    "llama-v3": (_LLAMA3_SPLIT, False, True),
    "llama-bpe": (_LLAMA3_SPLIT, False, True),
    "smaug-bpe": (_LLAMA3_SPLIT, False, False),
    "dbrx": (_LLAMA3_SPLIT, False, False),
    "falcon3": (_LLAMA3_SPLIT, False, False),
    "qwen2": (_QWEN2_SPLIT, False, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False, False),
    "megrez": (_QWEN2_SPLIT, False, False),
    "gpt-4o": (_GPT4O_SPLIT, False, False),
    "llama4": (_GPT4O_SPLIT, False, False),
    # The StarCoder family (SmolLM's vocabulary comes from it) splits every digit on its own
    # before the GPT-2 regex.
    "smollm": (_GPT2_SPLIT, True, False),
    "starcoder": (_GPT2_SPLIT, True, False),
    "refact": (_GPT2_SPLIT, True, False),
    "codeshell": (_GPT2_SPLIT, True, False),
}

SUPPORTED_GGUF_PRE_TOKENIZERS = tuple(sorted(_BPE_PRE_TOKENIZERS))

# Below this many ids `decode` (the streaming detokenizer's few-token windows) skips the batch
# call's overhead; above it, other threads must not wait for the decode.
_DECODE_RELEASING_GIL_FROM = 1024

# llama.cpp token types
_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_TOKEN_TYPE_BYTE = 6

_PHI3_KEEPS_WHITESPACE_AFTER = frozenset({"<unk>", "<s>", "<|endoftext|>"})

SUPPORTED_GGUF_TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}

# Chat templates end a turn with one of these; when the template uses one and it is not the
# declared EOS, generation must stop on it too (SmolLM2/Qwen: <|im_end|>, Llama 3: <|eot_id|>).
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (as in tokenizers' ByteLevel)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token_id: int | None = None,
        name: str = "",
        strip_space_prefix: bool = False,
    ):
        """`strip_space_prefix`: the vocabulary prefixes text with a space (SentencePiece's dummy
        prefix), which `decode` drops from the first token, unless that token is a skipped
        special one (llama.cpp's rule)."""
        self.backend = backend
        self.strip_space_prefix = strip_space_prefix
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self.bos_token = bos_token if bos_token is not None else self._token_or_none(bos_token_id)
        self.eos_token = eos_token if eos_token is not None else self._token_or_none(self.eos_token_id)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.name = name
        self._compiled_template: Any = None
        # Text a client sends is encoded by a twin that reads special-token text as plain text,
        # so that only the chat template's own markers become control tokens.
        self._plain = HFTokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        special = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special and t.content}
        self.special_token_ids: dict[str, int] = special  # text -> id of every special (control) token
        self._special_ids = frozenset(special.values())
        self._special_text = (
            re.compile("|".join(re.escape(t) for t in sorted(special, key=len, reverse=True))) if special else None
        )
        self._post_processor_ids = self._ids_added_by_post_processor()
        # An unknown token may stand for a word of any length: then no bound holds.
        has_unk = getattr(backend.model, "unk_token", None) is not None
        longest = max((len(t.encode("utf-8")) for t in backend.get_vocab(with_added_tokens=True)), default=0)
        self._max_bytes_per_token: int | None = None if has_unk or not longest else 2 * longest

    def _token_or_none(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    # ---------------------------------------------------------------- encode / decode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. `<|im_start|>` from a
        rendered chat template) are recognised either way; `add_special_tokens` adds the BOS/EOS
        the model's post-processor asks for."""
        if not isinstance(text, str):
            raise InvalidArgument(f"prompt must be a string, got {type(text).__name__}", param="prompt")
        return _encode_releasing_gil(self.backend, text, add_special_tokens)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt as the engine runs it: `encode`, minus a doubled BOS (a rendered
        chat template already starts with BOS; adding one more confuses the model)."""
        return self._without_doubled_bos(self.encode(text, add_special_tokens=add_special_tokens))

    def encode_user_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text a client sent (a completion prompt): like `encode_prompt`, except
        that special-token text in it (`<|im_start|>` ...) is tokenized as the plain text it is,
        so a client can never forge a control token. Token-id prompts remain the way to send one."""
        if not isinstance(text, str):
            raise InvalidArgument(f"prompt must be a string, got {type(text).__name__}", param="prompt")
        return self._with_post_processor(_encode_releasing_gil(self._plain, text, False), add_special_tokens)

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on the token count of `text`, without tokenizing it: no token covers more
        bytes than twice the longest vocabulary entry (twice: a normalizer may shorten text). 0
        when no bound holds."""
        if self._max_bytes_per_token is None:
            return 0
        return -(-len(text.encode("utf-8", errors="surrogatepass")) // self._max_bytes_per_token)

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of a chat, rendered by the template, where only the template's own markers
        are special tokens: special-token text inside a message's content stays plain text.

        Messages without such text take exactly `encode_prompt(apply_chat_template(...))` (the
        path whose output matches transformers'). Otherwise each special-token text in a content
        is swapped for a sentinel before rendering; the rendered text is split at the special
        tokens left (the template's), and the pieces between are encoded as plain text with the
        sentinels turned back into the text they stand for.

        `chat_template` renders instead of the model's; `continue_final_message` leaves the last
        message open (the text after its content is cut), as transformers does."""
        messages = _normalise_messages(messages)
        template_kwargs.update(chat_template=chat_template, continue_final_message=continue_final_message)
        pattern = self._special_text
        if pattern is None or not any(pattern.search(m["content"]) for m in messages):
            text = self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
            return self.encode_prompt(text, add_special_tokens)
        nonce = uuid.uuid4().hex
        sentinel = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
        originals: list[str] = []

        def escape(match: re.Match[str]) -> str:
            originals.append(match.group(0))
            return f"\ue000{nonce}:{len(originals) - 1}\ue001"

        escaped = [{**m, "content": pattern.sub(escape, m["content"])} for m in messages]
        rendered = self.apply_chat_template(escaped, add_generation_prompt, **template_kwargs)
        ids: list[int] = []
        pos = 0
        for marker in pattern.finditer(rendered):
            ids += self._encode_plain_piece(rendered[pos : marker.start()], sentinel, originals)
            ids.append(self.special_token_ids[marker.group(0)])
            pos = marker.end()
        ids += self._encode_plain_piece(rendered[pos:], sentinel, originals)
        return self._with_post_processor(ids, add_special_tokens)

    def _encode_plain_piece(self, piece: str, sentinel: re.Pattern[str], originals: list[str]) -> list[int]:
        if not piece:
            return []
        text = sentinel.sub(lambda m: originals[int(m.group(1))], piece)
        return _encode_releasing_gil(self._plain, text, False)

    def _ids_added_by_post_processor(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after a sequence (BOS, EOS), learnt from a probe."""
        bare = self.backend.encode("a", add_special_tokens=False).ids
        full = self.backend.encode("a", add_special_tokens=True).ids
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                return full[:start], full[start + len(bare) :]
        return [], []

    def _with_post_processor(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if add_special_tokens:
            prefix, suffix = self._post_processor_ids
            ids = [*prefix, *ids, *suffix]
        return self._without_doubled_bos(ids)

    def _without_doubled_bos(self, ids: list[int]) -> list[int]:
        bos = self.bos_token_id
        if bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:
            return ids[1:]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if len(ids) > _DECODE_RELEASING_GIL_FROM:
            # `decode` holds the GIL throughout; `decode_batch` releases it.
            text = self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        else:
            text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if (
            self.strip_space_prefix
            and text.startswith(" ")
            and not (skip_special_tokens and ids[0] in self._special_ids)
        ):
            return text[1:]
        return text

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ---------------------------------------------------------------- chat template

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render a chat (OpenAI-style messages) to the prompt text the model was trained on, with
        the model's template or `chat_template` (a request's: the same sandbox renders it)."""
        import jinja2

        if chat_template is not None:
            template = _compile_request_template(chat_template)
        elif self.chat_template is None:
            raise InvalidArgument(
                f"model {self.name or '(unnamed)'} has no chat template; send a plain completion prompt instead",
                param="messages",
            )
        else:
            if self._compiled_template is None:
                self._compiled_template = _jinja_env().from_string(self.chat_template)
            template = self._compiled_template
        messages = _normalise_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise InvalidArgument(
                "continue_final_message and add_generation_prompt cannot both be true: set add_generation_prompt "
                "to false to continue the last message", param="continue_final_message",
            )  # fmt: skip
        variables = {**template_kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt,
                     "continue_final_message": continue_final_message,
                     "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}  # fmt: skip
        # A request's template is blamed by its field's name; the model's on the messages.
        param, name = ("messages", "chat template") if chat_template is None else ("chat_template", "chat_template")
        try:
            rendered = template.render(**variables)
        except jinja2.TemplateError as e:
            raise InvalidArgument(f"{name} failed to render the messages: {e}", param=param) from e
        except InvalidArgument:
            raise
        except Exception as e:  # noqa: BLE001 - a request's template may fail in any way a Jinja expression can
            if chat_template is None:
                raise
            raise InvalidArgument(f"chat_template failed to render the messages: {type(e).__name__}: {e}",
                                  param="chat_template") from e  # fmt: skip
        return _open_final_message(rendered, messages[-1]["content"]) if continue_final_message else rendered

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`,
        `generation_config.json` when present) from a HF model directory."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise NotFound(f"no tokenizer.json in {path} (only fast HF tokenizers are supported)")
        backend = load_tokenizer_json(tokenizer_file)
        config = _read_json(path / "tokenizer_config.json")
        generation_config = _read_json(path / "generation_config.json")

        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            by_name = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
            chat_template = by_name.get("default") or next(iter(by_name.values()), None)
        jinja_file = path / "chat_template.jinja"
        if chat_template is None and jinja_file.is_file():
            chat_template = jinja_file.read_text(encoding="utf-8")

        bos_token = _token_content(config.get("bos_token"))
        eos_token = _token_content(config.get("eos_token"))
        pad_token = _token_content(config.get("pad_token"))
        bos_id = backend.token_to_id(bos_token) if bos_token else None
        eos_ids: list[int] = []
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        if eos_id is not None:
            eos_ids.append(eos_id)
        gen_eos = generation_config.get("eos_token_id")
        if isinstance(gen_eos, int):
            eos_ids.append(gen_eos)
        elif isinstance(gen_eos, list):
            eos_ids.extend(int(i) for i in gen_eos)
        if bos_id is None and isinstance(generation_config.get("bos_token_id"), int):
            bos_id = generation_config["bos_token_id"]
        eos_ids.extend(_end_of_turn_ids(backend, chat_template))
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=chat_template,
            bos_token=bos_token,
            eos_token=eos_token,
            pad_token_id=backend.token_to_id(pad_token) if pad_token else None,
            name=path.name,
        )

    @classmethod
    def from_gguf(cls, path_or_metadata: str | os.PathLike[str] | Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer a GGUF file describes. Accepts the file path or its metadata as a
        mapping of plain Python values (what `spec.gguf_reader.gguf_metadata` returns)."""
        if isinstance(path_or_metadata, Mapping):
            metadata, source = path_or_metadata, str(path_or_metadata.get("general.name", "GGUF metadata"))
        else:
            metadata, source = gguf_metadata(path_or_metadata), str(path_or_metadata)

        model_type = metadata.get("tokenizer.ggml.model")
        strip_space_prefix = False
        if model_type == "gpt2":
            backend = _byte_level_bpe_from_gguf(metadata, source)
            defaults: dict[str, Any] = {"add_bos": False}
        elif model_type == "llama":
            backend = _sentencepiece_from_gguf(metadata, source)
            strip_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
            # llama.cpp's defaults for a SentencePiece vocabulary that omits these keys
            defaults = {"add_bos": True, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
        else:
            raise InvalidArgument(
                f"{source}: tokenizer.ggml.model {model_type!r} is not supported; servelab builds "
                f"{', '.join(f'{k!r} ({v})' for k, v in SUPPORTED_GGUF_TOKENIZER_MODELS.items())} tokenizers "
                f"from GGUF. Use the model's HF directory (tokenizer.json) instead."
            )
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]

        bos_id = metadata.get("tokenizer.ggml.bos_token_id", defaults.get("tokenizer.ggml.bos_token_id"))
        eos_id = metadata.get("tokenizer.ggml.eos_token_id", defaults.get("tokenizer.ggml.eos_token_id"))
        pad_id = metadata.get("tokenizer.ggml.padding_token_id")
        for key, token_id in (("bos_token_id", bos_id), ("eos_token_id", eos_id), ("padding_token_id", pad_id)):
            if token_id is not None and not 0 <= token_id < len(tokens):
                raise InvalidArgument(f"{source}: tokenizer.ggml.{key}={token_id} is outside the {len(tokens)} tokens")
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", defaults["add_bos"]))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        template_single, template_pair, special_pairs = "$A", "$A $B", []
        if add_bos and bos_id is not None:
            template_single, template_pair = f"{tokens[bos_id]} {template_single}", f"{tokens[bos_id]} $A $B"
            special_pairs.append((tokens[bos_id], bos_id))
        if add_eos and eos_id is not None:
            template_single, template_pair = f"{template_single} {tokens[eos_id]}", f"{template_pair} {tokens[eos_id]}"
            special_pairs.append((tokens[eos_id], eos_id))
        if special_pairs:
            backend.post_processor = processors.TemplateProcessing(
                single=template_single, pair=template_pair, special_tokens=list(dict.fromkeys(special_pairs))
            )

        chat_template = metadata.get("tokenizer.chat_template")
        eos_ids = [eos_id] if eos_id is not None else []
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if metadata.get(key) is not None:
                eos_ids.append(metadata[key])
        eos_ids.extend(_end_of_turn_ids(backend, chat_template))
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=chat_template,
            pad_token_id=pad_id,
            name=str(metadata.get("general.name") or Path(str(source)).stem),
            strip_space_prefix=strip_space_prefix,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """A GGUF file or a HF model directory, whichever `path` is."""
        p = Path(path)
        if p.is_dir():
            return cls.from_hf_dir(p)
        if p.is_file() and p.suffix.lower() == ".gguf":
            return cls.from_gguf(p)
        raise NotFound(f"no tokenizer at {p}: expected a .gguf file or a directory with tokenizer.json")


def _byte_level_bpe_from_gguf(metadata: Mapping[str, Any], source: str) -> HFTokenizer:
    """A 'gpt2' GGUF vocabulary: byte-level BPE over the split regex `tokenizer.ggml.pre` names."""
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _BPE_PRE_TOKENIZERS:
        raise InvalidArgument(
            f"{source}: pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_GGUF_PRE_TOKENIZERS)}). Use the model's HF directory instead."
        )
    split_regex, split_digits, ignore_merges = _BPE_PRE_TOKENIZERS[pre]

    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges: list[str] = metadata.get("tokenizer.ggml.merges") or []

    alphabet = _byte_level_alphabet()
    alphabet_chars = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        # Vocabulary entries are stored in the byte-level spelling; an entry written in plain
        # text (some converters do this for added tokens) is respelled so BPE can reach it.
        if not set(token) <= alphabet_chars:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    merge_pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if sep:
            merge_pairs.append((left, right))

    bpe = models.BPE(vocab=vocab, merges=merge_pairs, ignore_merges=ignore_merges)
    backend = HFTokenizer(bpe)
    splits: list[Any] = []
    if split_digits:
        splits.append(pre_tokenizers.Digits(individual_digits=True))
    splits.append(pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False))
    splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(splits)
    backend.decoder = decoders.ByteLevel()
    _add_control_and_user_defined(backend, metadata, tokens, token_types, lambda t: set(t) <= alphabet_chars)
    return backend


def _sentencepiece_from_gguf(metadata: Mapping[str, Any], source: str) -> HFTokenizer:
    """A 'llama' GGUF vocabulary: SentencePiece BPE as llama.cpp's `llm_tokenizer_spm` runs it.

    SPM merges the adjacent pair whose concatenation is the highest-scoring vocabulary piece
    (leftmost on ties). BPE does the same given every split of every piece into two pieces as a
    merge, ranked by the piece's score (transformers' SentencePieceExtractor); a BPE rank cannot
    tie, so two different pieces of equal score go by id rather than leftmost. Characters outside
    the vocabulary fall back to the `<0xXX>` byte tokens, or to the unknown token without them.
    """
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [_TOKEN_TYPE_NORMAL] * len(tokens)
    scores: list[float] | None = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens) or len(token_types) != len(tokens):
        raise InvalidArgument(
            f"{source}: a SentencePiece GGUF needs tokenizer.ggml.scores and tokenizer.ggml.token_type with one "
            f"entry per token ({len(tokens)}); got {'no' if scores is None else len(scores)} scores and "
            f"{len(token_types)} token types"
        )
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id", 0)  # llama.cpp's default
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    bpe = models.BPE(
        vocab=vocab,
        merges=_merges_by_score(vocab, scores),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=_TOKEN_TYPE_BYTE in token_types,
    )
    backend = HFTokenizer(bpe)
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    replace_spaces = normalizers.Replace(" ", "▁")
    # The prefix goes before every run of text, the first and each one after a special token, as
    # llama.cpp does; the HF normalizer runs on exactly those runs.
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend("▁"), replace_spaces]) if add_space_prefix else replace_spaces
    )
    # The prefix space is dropped by `Tokenizer.decode`, which knows whether a special token led.
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    _add_control_and_user_defined(backend, metadata, tokens, token_types, lambda t: True)
    return backend


def _merges_by_score(vocab: Mapping[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two vocabulary pieces, the best-scoring piece's first."""
    ranked = []
    for token, token_id in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[token_id], token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_control_and_user_defined(
    backend: HFTokenizer,
    metadata: Mapping[str, Any],
    tokens: Sequence[str],
    token_types: Sequence[int],
    representable: Callable[[str], bool],
) -> None:
    """Control (and unknown) tokens (<|im_start|>, <end_of_turn>, ...) are matched whole in text and
    skipped when decoding with skip_special_tokens; user-defined ones are matched whole but kept
    in decoded text."""
    # llama.cpp strips the whitespace after Phi-3's special tokens, keyed on the model's name
    # (llama-vocab.cpp): the file itself does not say so.
    name = str(metadata.get("general.name") or "").lower()
    rstrip = "phi-3" in name or "phi3" in name

    def added(token: str, special: bool) -> AddedToken:
        strip = rstrip and token not in _PHI3_KEEPS_WHITESPACE_AFTER
        return AddedToken(token, special=special, normalized=False, rstrip=strip)

    special = [
        added(t, True)
        for t, kind in zip(tokens, token_types)
        if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_UNKNOWN) and t and representable(t)
    ]
    user_defined = [added(t, False) for t, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_USER_DEFINED and t]
    if special:
        backend.add_special_tokens(special)
    if user_defined:
        backend.add_tokens(user_defined)


def _encode_releasing_gil(backend: HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # tokenizers' `encode` holds the GIL for the whole encoding; `encode_batch` releases it, so
    # the server's event loop runs meanwhile.
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def _end_of_turn_ids(backend: HFTokenizer, chat_template: str | None) -> list[int]:
    if not chat_template:
        return []
    ids = []
    for token in _END_OF_TURN_TOKENS:
        token_id = backend.token_to_id(token)
        # "<|endoftext|>" and "</s>" only count when the template itself closes turns with them.
        if token_id is not None and token in chat_template:
            ids.append(token_id)
    return ids


def _token_content(token: Any) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", "lstrip": false, ...}
        return token.get("content")
    return token if isinstance(token, str) else None


def load_tokenizer_json(path: Path, *, name: str | None = None) -> HFTokenizer:
    """A `tokenizer.json` file; `name` says where it came from in errors (default: its path)."""
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for unreadable, non-UTF-8 or malformed files
        raise InvalidArgument(f"{name or path}: not a valid tokenizer.json ({exc})", param="tokenizer") from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"{path} is not valid JSON: {e}") from e


def _normalise_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the messages and flatten OpenAI content parts ([{"type": "text", ...}]) to a string,
    which is what most chat templates expect."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidArgument(f"messages[{i}] must be an object with a string 'role'", param="messages")
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidArgument(
                        f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                        param="messages",
                    )
                texts.append(part["text"])
            message["content"] = "".join(texts)
        elif content is None:
            message["content"] = ""
        elif not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append(message)
    return out


def _open_final_message(rendered: str, final: str) -> str:
    """The rendered chat cut just after the last message's content, so the model continues it
    (transformers' continue_final_message)."""
    stripped = final.strip()
    if not stripped or stripped not in rendered:
        raise InvalidArgument(
            "continue_final_message: the chat template does not write the last message's content, so there "
            "is nothing to continue", param="continue_final_message",
        )  # fmt: skip
    at = rendered.rindex(stripped)
    if rendered[at : at + len(final.lstrip())] == final.lstrip():
        return rendered[: at + len(final.lstrip())]  # the template kept the message's trailing spaces
    return rendered[: at + len(stripped)]


# A request's own chat template: bounded, as it is compiled on the server's threads.
MAX_CHAT_TEMPLATE_CHARS = 65536


@lru_cache(maxsize=16)
def _compile_request_template(source: str) -> Any:
    """A request's chat template, compiled in the model template's sandbox (clients tend to send
    the same one with every request: the compile is cached)."""
    import jinja2

    if len(source) > MAX_CHAT_TEMPLATE_CHARS:
        raise InvalidArgument(
            f"chat_template has {len(source):,} characters; at most {MAX_CHAT_TEMPLATE_CHARS:,} are allowed",
            param="chat_template",
        )
    try:
        return _jinja_env().from_string(source)
    except jinja2.TemplateError as e:
        raise InvalidArgument(f"chat_template is not a valid Jinja template: {e}", param="chat_template") from e


def _raise_template_exception(message: str) -> None:
    raise InvalidArgument(f"chat template rejected the messages: {message}", param="messages")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


@lru_cache(maxsize=1)
def _jinja_env() -> Any:
    """The environment HF renders chat templates in: sandboxed, trim/lstrip blocks, loop
    controls, `tojson`, `raise_exception` and `strftime_now`."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
