"""Streaming text: token ids -> UTF-8-safe text deltas, and stop strings across token boundaries.

A byte-level BPE token is a run of bytes, not characters: "é" (2 bytes) or an emoji (4 bytes) can
be split over several tokens, and decoding a prefix then shows U+FFFD for the unfinished
character. `IncrementalDetokenizer` decodes a small window of recent tokens and only emits text
once it no longer ends in U+FFFD, so the concatenated deltas equal the full decode. The window
keeps a few tokens of left context because some decoders (SentencePiece's leading space) render
a token differently at the start of a string than after another token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

_REPLACEMENT = "\ufffd"
# How many prompt tokens to decode as context for the first output token (as vLLM does).
_CONTEXT_TOKENS = 5


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas as they arrive."""

    __slots__ = ("_tokenizer", "_ids", "_prefix_offset", "_read_offset", "skip_special_tokens", "text")

    def __init__(self, tokenizer: _Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0  # start of the decode window (already emitted, kept as context)
        self._read_offset = len(context)  # tokens before this have been emitted as text
        self.text = ""  # everything emitted so far

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new text that is now complete (may be "")."""
        self._ids.extend(token_ids)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        full_text = decode(self._ids[self._prefix_offset :], self.skip_special_tokens)
        # An unfinished UTF-8 character decodes as a trailing U+FFFD: wait for its other bytes.
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._trim()
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the request: release whatever is held back, U+FFFD included (the model
        really did stop inside a character)."""
        if self._read_offset == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        full_text = decode(self._ids[self._prefix_offset :], self.skip_special_tokens)
        delta = full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _trim(self) -> None:
        # Only the window [prefix_offset:] is ever decoded again; drop the rest so a long
        # generation does not keep its whole id list here twice.
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0


@dataclass(slots=True)
class StopCheck:
    """What `StopChecker.add` decided for one piece of text.

    `text` is safe to emit now. When `stop` is set, a stop string matched: `text` ends just before
    it, `stop_offset` is where the stop string starts in the whole output text (where to
    truncate), and nothing more should be emitted for the request.
    """

    text: str
    stop: str | None = None
    stop_offset: int | None = None


@dataclass(slots=True)
class StopChecker:
    """Finds stop strings in streamed text, across token boundaries, without emitting them
    (with `include_stop`, emitting them as the output's last text, vLLM's include_stop_str_in_output).

    Text that could be the beginning of a stop string is held back until it either completes a
    stop (then it is dropped, or with `include_stop` emitted) or stops matching (then it is released).
    """

    stop_strings: Sequence[str]
    include_stop: bool = False
    _held: str = field(default="", init=False)
    _emitted_chars: int = field(default=0, init=False)
    stopped: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.stop_strings = [s for s in dict.fromkeys(self.stop_strings) if s]

    @property
    def max_hold_chars(self) -> int:
        return max((len(s) for s in self.stop_strings), default=1) - 1

    def add(self, text: str) -> StopCheck:
        if self.stopped is not None:
            return StopCheck("", self.stopped, None)
        if not self.stop_strings:
            self._emitted_chars += len(text)
            return StopCheck(text)
        buf = self._held + text
        match_at, match = -1, None
        for stop in self.stop_strings:
            at = buf.find(stop)
            if at != -1 and (match is None or at < match_at or (at == match_at and len(stop) > len(match))):
                match_at, match = at, stop
        if match is not None:
            self.stopped = match
            self._held = ""
            emitted = buf[: match_at + len(match)] if self.include_stop else buf[:match_at]
            offset = self._emitted_chars + match_at
            self._emitted_chars += len(emitted)
            return StopCheck(emitted, match, offset)
        hold = self._partial_match_len(buf)
        emit_upto = len(buf) - hold
        self._held = buf[emit_upto:]
        self._emitted_chars += emit_upto
        return StopCheck(buf[:emit_upto])

    def release(self, text: str) -> str:
        """`text` emitted unchecked: nothing may stop the request yet (its min_tokens)."""
        self._emitted_chars += len(text)
        return text

    def flush(self) -> str:
        """At the end of the request (EOS, length, ...): the held-back text was not a stop."""
        held, self._held = self._held, ""
        if self.stopped is not None:
            return ""
        self._emitted_chars += len(held)
        return held

    def _partial_match_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest


@dataclass(slots=True)
class TextDelta:
    text: str
    stop: str | None = None  # the stop string that ended the request, if one matched


class RequestTextStream:
    """One request's detokenizer and stop checker together: token ids in, emit-ready text out.

    Convenience for the engine: `add()` each step's new tokens, finish the request with
    FinishReason.STOP when `stop` is set, and call `flush()` when it finishes for any other reason.
    """

    __slots__ = ("detokenizer", "stop_checker", "min_tokens", "num_tokens")

    def __init__(
        self, tokenizer: _Decoder, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
        skip_special_tokens: bool = True, include_stop: bool = False, min_tokens: int = 0,
    ):  # fmt: skip
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.stop_checker = StopChecker(stop, include_stop)
        self.min_tokens = min_tokens  # no stop string ends a request before it has more (vLLM's rule)
        self.num_tokens = 0

    def add(self, token_ids: Sequence[int]) -> TextDelta:
        if self.stop_checker.stopped is not None:
            return TextDelta("", self.stop_checker.stopped)
        text = self.detokenizer.add(token_ids)
        self.num_tokens += len(token_ids)
        if self.num_tokens <= self.min_tokens:
            return TextDelta(self.stop_checker.release(text))
        check = self.stop_checker.add(text)
        return TextDelta(check.text, check.stop)

    def flush(self) -> TextDelta:
        """The request finished: release held-back text (a stop string may still complete in it)."""
        if self.stop_checker.stopped is not None:
            return TextDelta("", self.stop_checker.stopped)
        check = self.stop_checker.add(self.detokenizer.flush())
        return TextDelta(check.text + self.stop_checker.flush(), check.stop)
