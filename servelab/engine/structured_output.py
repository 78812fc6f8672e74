"""Structured outputs with xgrammar: grammars compiled once per constraint, one matcher per request.

xgrammar (the grammar engine of vLLM and SGLang) precomputes, per grammar, which tokens of the
vocabulary each grammar state admits, so a step's mask is a ~0.1 ms bitmask fill per constrained
row. It imports transformers (seconds), so it is imported on the first constrained request, not
with the engine. The server compiles in grammar worker processes (engine/grammar_workers.py)
before admission, the offline engine in its own thread, and the compiled grammar travels with the
request (SamplingParams.prepared_edits), so neither the event loop nor the step loop waits for a
compilation, even when the cache has dropped that grammar since.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from servelab.core.structured_output import StructuredOutputSpec
from servelab.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

    from servelab.engine.tokenizer import Tokenizer

# Compiled grammars kept, in bytes: most take 0.05-2 MB; a 30,000-value enum took 95 MB.
DEFAULT_CACHE_BYTES = 256 * 2**20
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _vocab_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """Each token's bytes as it appears in text (b"" for special tokens, which grammars never emit).

    Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) spells bytes with printable stand-ins;
    SentencePiece writes a space as U+2581 and unprintable bytes as <0xNN>."""
    from tokenizers import decoders

    from servelab.engine.tokenizer import _byte_level_alphabet

    special = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    byte_level = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
    inverse = {c: b for b, c in _byte_level_alphabet().items()}
    out: list[bytes] = []
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_token(i)
        if piece is None or i in special:
            out.append(b"")
        elif byte_level:
            out.append(bytes(inverse[c] for c in piece) if all(c in inverse for c in piece) else piece.encode())
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace("\u2581", " ").encode())
    return out


def _choice_grammar(choices: tuple[str, ...]) -> str:
    # JSON string escapes are valid EBNF string literals in xgrammar.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarMatcherState:
    """A request's matcher, kept in step with its output tokens.

    The sampler hook calls `sync` before each mask: it feeds the matcher the output tokens it has
    not seen (the token sampled last step, or a whole output after preemption by recompute) and
    rebuilds it if the output ever got shorter, so the matcher cannot drift from the sequence."""

    __slots__ = ("_compiled", "_xgr", "matcher", "num_accepted")

    def __init__(self, xgr: Any, compiled: Any):
        self._xgr, self._compiled = xgr, compiled
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0

    def sync(self, token_ids: list[int], num_prompt_tokens: int) -> bool:
        """Accept the output tokens (those of `token_ids` after the prompt) not seen yet; False
        if the grammar rejects one. Slices from the first unseen token: no copy of the output."""
        if len(token_ids) - num_prompt_tokens < self.num_accepted:
            self.matcher, self.num_accepted = self._xgr.GrammarMatcher(self._compiled), 0
        for token_id in token_ids[num_prompt_tokens + self.num_accepted :]:
            if self.matcher.is_terminated():
                # Only more stop tokens can follow the end (a request with ignore_eos samples them).
                if token_id not in self.matcher.stop_token_ids:
                    return False
            elif not self.matcher.accept_token(token_id):
                return False
            self.num_accepted += 1
        return True


def compile_spec(compiler: Any, spec: StructuredOutputSpec) -> Any:
    """`spec` compiled by an xgrammar GrammarCompiler; InvalidArgument naming the field on a bad one.
    Also what a grammar worker process runs (engine/grammar_workers.py)."""
    try:
        if spec.kind == "json":
            # Compact JSON (no free whitespace): a small model allowed any whitespace can spend
            # its whole max_tokens on newlines; OpenAI's strict mode is compact too.
            return compiler.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            # An object, as OpenAI's JSON mode promises (the builtin JSON grammar allows any value).
            return compiler.compile_json_schema('{"type":"object"}', any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            assert isinstance(spec.value, tuple)  # StructuredOutputSpec checked it
            return compiler.compile_grammar(_choice_grammar(spec.value))
        return compiler.compile_grammar(spec.value)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses with its parser's message
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        message = _LOG_PREFIX.sub("", message)  # "[11:44:40] /project/cpp/x.cc:94: " says nothing to a client
        raise InvalidArgument(
            f"{spec.source}: the {spec.kind} constraint does not compile: {message}", param=spec.source
        ) from e


class GrammarCache:
    """Compiled grammars by spec, least recently used dropped first, bounded by their size in bytes
    (xgrammar's `memory_size_bytes`): one grammar can take 100 kB or 400 MB, so a count bounds
    nothing. A grammar larger than the whole cache is used by its request and not kept."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.size_bytes = 0
        self._lock = threading.Lock()
        self._entries: OrderedDict[StructuredOutputSpec, tuple[Any, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, spec: StructuredOutputSpec) -> Any:
        with self._lock:
            entry = self._entries.get(spec)
            if entry is None:
                return None
            self._entries.move_to_end(spec)
            return entry[0]

    def resize(self, capacity_bytes: int) -> None:
        with self._lock:
            self.capacity_bytes = capacity_bytes
            self._evict()

    def put(self, spec: StructuredOutputSpec, compiled: Any) -> None:
        size = int(compiled.memory_size_bytes)
        if size > self.capacity_bytes:
            return
        with self._lock:
            old = self._entries.pop(spec, None)
            if old is not None:
                self.size_bytes -= old[1]
            self._entries[spec] = (compiled, size)
            self.size_bytes += size
            self._evict()

    def _evict(self) -> None:
        while self.size_bytes > self.capacity_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.size_bytes -= dropped


class StructuredOutputBackend:
    """One per engine: the tokenizer's view for xgrammar, the compiler and its cache."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._lock = threading.Lock()
        self._xgr: Any = None
        self._compiler: Any = None
        self._info: Any = None
        self.cache = GrammarCache(cache_bytes)
        self._bitmask: torch.Tensor | None = None  # used by the step loop's thread only

    def _ready(self) -> tuple[Any, Any]:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo(
                    _vocab_bytes(self._tokenizer),
                    xgr.VocabType.RAW,
                    vocab_size=self._vocab_size,
                    stop_token_ids=list(self._tokenizer.eos_token_ids),
                )
                # Our own cache, bounded in bytes; xgrammar's is unbounded by default.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                self._xgr, self._info = xgr, info
            return self._xgr, self._compiler

    def tokenizer_info(self) -> Any:
        """xgrammar's view of the vocabulary (what a grammar worker process compiles against)."""
        self._ready()
        return self._info

    def compile(self, spec: StructuredOutputSpec) -> Any:
        """The compiled grammar of `spec` (cached), compiled in this thread."""
        compiled = self.cache.get(spec)
        if compiled is None:
            compiled = compile_spec(self._ready()[1], spec)
            self.cache.put(spec, compiled)
        return compiled

    def deserialize(self, serialized: str) -> Any:
        """A grammar a worker process compiled, over this engine's tokenizer info."""
        xgr, _ = self._ready()
        return xgr.CompiledGrammar.deserialize_json(serialized, self._info)

    def new_matcher(self, compiled: Any) -> GrammarMatcherState:
        """A matcher over a grammar `compile` returned (kept by the request, not looked up)."""
        return GrammarMatcherState(self._xgr, compiled)

    def bitmask(self, rows: int) -> torch.Tensor:
        """A bitmask of at least `rows` rows, reused step to step (the fills overwrite whole rows)."""
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = self._xgr.allocate_token_bitmask(max(rows, 64), self._vocab_size)
        return self._bitmask

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self._vocab_size, indices=rows)
