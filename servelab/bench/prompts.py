"""Prompt texts of a given token length for the load generator.

A server is sent text, and only a tokenizer knows how many tokens a text is. With one (the
bundled model's, or `--tokenizer PATH`), prompts are cut from a pool of token ids made by
tokenizing seeded random English words, so each prompt is exactly `prompt_tokens` tokens under
that tokenizer (re-encoding is checked, and adjusted where a decoded boundary re-tokenizes
differently). The shared prefix of a prefix group is one fixed text, so a server's prefix cache
hits on it as on a common system prompt; suffixes start at seeded random offsets, so two prompts
share nothing beyond their group's prefix.

Without a tokenizer the length is approximated from words at the workload's rate of 4 tokens per
3 English words (`servelab.workload.datasets.TOKENS_PER_WORD`); the server's usage reports the
true counts, and the bench reports the difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from servelab.errors import InvalidArgument, NotFound
from servelab.workload import RequestSpec
from servelab.workload.datasets import TOKENS_PER_WORD

_WORDS = (
    "the of and to in is was that for on with as by at from his her they this which be or an had "
    "not are but were have one all their there been has when who will more no if out so said what up "
    "its about into than them can only other new some could time these two may then do first any my now "
    "such like our over man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state good very make "
    "world still own see men work long get here between both life being under never day same another know "
    "while last might us great old year off come since against go came right used take three states "
    "himself few house use during without again place american around however home small found thought "
    "went say part once general high upon school every does got united left number course war until always "
    "away something fact though water less public put think almost hand enough far took head yet "
    "government system better set told nothing night end why called didn find going look asked later "
    "knew point next program city business give group toward young days let room president side social "
    "given present several order national possible rather second face per among form important often "
    "things looked early white case large become large big need four within felt along children saw best "
    "church ever least power development light thing seemed family interest want members mind country "
    "area others although turned done open god service certain kind problem began different door thus help "
    "sense means whole matter perhaps itself york times law human line above name example action company "
    "hands local show whether five history gave today either act feet across taken past quite anything "
    "seen having death week experience body word half really field am car words already themselves "
    "information tell college shall money period held keep sure probably free seems real behind cannot miss "
    "political air question making office brought whose special heard major problems ago became federal "
    "moment study available known result street economic boy position reason change south board individual "
    "job areas society west close turn love community true court force full seem am wife age future voice"
).split()

_POOL_TOKENS = 1 << 15  # distinct text to cut prompts from; longer prompts wrap around


class TextTokenizer(Protocol):
    def encode(self, text: str) -> Sequence[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class _HFTokenizerFile:
    """A bare `tokenizer.json` file (no model directory around it)."""

    def __init__(self, path: Path) -> None:
        from servelab.engine.tokenizer import load_tokenizer_json

        self._tok = load_tokenizer_json(path, name=f"--tokenizer {str(path)!r}")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


def load_tokenizer(path: str | None) -> TextTokenizer | None:
    """`path`: a GGUF file, a HF model directory or a tokenizer.json; None: the bundled model's
    tokenizer when it is installed, else None (word-count approximation)."""
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise NotFound(f"--tokenizer {path!r}: no such file or directory")
        if p.is_file() and p.suffix == ".json":
            return _HFTokenizerFile(p)
        from servelab.engine.tokenizer import Tokenizer

        return Tokenizer.from_pretrained(p)
    try:
        from servelab.engine.bundled import bundled_model_path
        from servelab.engine.tokenizer import Tokenizer

        return Tokenizer.from_pretrained(bundled_model_path())
    except (ImportError, OSError, NotFound, InvalidArgument):
        return None


class PromptBuilder:
    def __init__(self, tokenizer: TextTokenizer | None, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.seed = seed
        rng = np.random.default_rng([seed, 0xB3])
        words = [_WORDS[i] for i in rng.integers(len(_WORDS), size=_POOL_TOKENS)]
        self._words = words
        self._pool: np.ndarray | None = None
        if tokenizer is not None:
            # Every word with its leading space, so slices start on a word boundary.
            self._pool = np.asarray(tokenizer.encode(" " + " ".join(words)), dtype=np.int64)
            if self._pool.size < 16:
                raise InvalidArgument("the tokenizer produced almost no tokens for English text")
        self._prefix_cache: dict[tuple[int, int], str] = {}

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def count_tokens(self, text: str) -> int:
        if self.tokenizer is None:
            return max(1, round(len(text.split()) * TOKENS_PER_WORD))
        return len(self.tokenizer.encode(text))

    def prompt_for(self, spec: RequestSpec, round_: int = 0) -> str:
        """The prompt text of a request. `round_` > 0 gives a different text of the same
        lengths, for runs that reuse a workload's specs (so no prompt is ever repeated)."""
        if spec.prompt_text is not None:
            return spec.prompt_text
        prefix = ""
        if spec.prefix_tokens > 0:
            key = (spec.prefix_group, spec.prefix_tokens)
            if key not in self._prefix_cache:
                start = int(np.random.default_rng([self.seed, 0x9F, spec.prefix_group]).integers(1 << 30))
                self._prefix_cache[key] = self._text(start, spec.prefix_tokens)
            prefix = self._prefix_cache[key]
        start = int(np.random.default_rng([self.seed, 0x5A, spec.index, round_]).integers(1 << 30))
        suffix_tokens = spec.prompt_tokens - spec.prefix_tokens
        suffix = self._text(start, suffix_tokens) if suffix_tokens > 0 else ""
        return prefix + suffix

    def _text(self, start: int, n_tokens: int) -> str:
        if self._pool is None:
            n_words = max(1, round(n_tokens / TOKENS_PER_WORD))
            idx = (start + np.arange(n_words)) % len(self._words)
            return " " + " ".join(self._words[i] for i in idx)
        assert self.tokenizer is not None
        want = n_tokens
        take = n_tokens
        text = ""
        for _ in range(4):  # decode/encode is not always a round trip at slice edges
            idx = (start + np.arange(take)) % self._pool.size
            text = self.tokenizer.decode(self._pool[idx].tolist())
            if not text.startswith(" "):
                text = " " + text
            got = len(self.tokenizer.encode(text))
            if got == want:
                break
            take = max(1, take + (want - got))
        return text
