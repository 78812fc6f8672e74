"""Speculative decoding in the engine: proposers that guess each decoding sequence's next tokens
before the scheduler plans a step, and the rows a verification entry samples.

Proposers set `Sequence.draft_token_ids`; the scheduler (core/speculative.py) turns such a decode
into one entry of 1 + k tokens. The executor scores every position of it, and the sampler picks
one token per position as if the drafts before it had been generated (`verification_rows`): the
entry keeps the drafts up to the first position whose token differs, plus that token.

- `NgramProposer` (prompt lookup): the tokens that followed the latest earlier occurrence of the
  sequence's last n tokens, n from prompt_lookup_max down to prompt_lookup_min, over prompt and
  output. Each token's positions, indexed token by token as the sequence grows, bound a step's
  lookup to the last token's 64 latest occurrences, whatever the context's length.
- `PredictionProposer`: OpenAI's `prediction`, the request's own guess of its output. The
  output's last n tokens are found in the prediction (the first occurrence at or after where the
  last match ended, else the last one), so an edit that diverges and rejoins the text hits again.
- `DraftModelProposer`: K greedy steps of a second, smaller model, batched over the decoding
  sequences, on its own executor and paged KV cache; each sequence's draft KV is kept across
  steps up to the last position the target accepted, so a step feeds it only the new tokens.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from servelab.core.plan import ScheduledSeq, StepPlan
from servelab.core.sequence import SamplingParams, Sequence
from servelab.core.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from servelab.core.plan import Executor

logger = logging.getLogger("servelab.engine")

# Drafts per step from a request's prediction when no --speculative-config sets K.
DEFAULT_PREDICTION_TOKENS = 8
# The n-gram sizes a prediction is aligned by (longest first).
PREDICTION_LOOKUP_MAX = 4
PREDICTION_LOOKUP_MIN = 1


def may_speculate(seq: Sequence) -> bool:
    """Whether a request may ever carry drafts: one that generates, without a grammar (structured
    outputs are not verified draft by draft: their matcher advances one sampled token at a time)."""
    return seq.pooling is None and seq.params.structured_output is None and not seq.params.prompt_only


def speculates(seq: Sequence) -> bool:
    """Whether a sequence may carry drafts this step: a decoding one that may speculate at all."""
    return seq.num_computed_tokens == len(seq.token_ids) - 1 and may_speculate(seq)


# Earlier occurrences of a sequence's last token that a lookup compares, latest first: bounds a
# step's work for a token that occurs thousands of times.
MAX_NGRAM_CANDIDATES = 64


@dataclass(slots=True)
class _NgramIndex:
    """Each token's positions in a sequence (those with a token after them), ascending: O(1)
    memory a token, however long prompt_lookup_max is."""

    positions: dict[int, list[int]] = field(default_factory=dict)
    num_indexed: int = 0

    def lookup(self, tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        (n_max tokens down to n_min) found among the last token's latest occurrences."""
        L = len(tokens)
        for p in range(self.num_indexed, L - 1):  # the last token has no continuation yet
            self.positions.setdefault(tokens[p], []).append(p)
        self.num_indexed = max(self.num_indexed, L - 1)
        candidates = self.positions.get(tokens[-1])
        if not candidates:
            return []
        best_len, best_end = 0, -1
        for e in reversed(candidates[-MAX_NGRAM_CANDIDATES:]):
            m = 1
            while m < n_max and m <= e and tokens[e - m] == tokens[L - 1 - m]:
                m += 1
            if m > best_len:
                best_len, best_end = m, e
                if m == n_max:
                    break
        return tokens[best_end + 1 : best_end + 1 + k] if best_len >= n_min else []


class NgramProposer:
    """Prompt lookup (vLLM's `method: ngram`): drafts from the sequence's own tokens."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max
        self._index: dict[str, _NgramIndex] = {}

    def propose(self, seq: Sequence) -> list[int]:
        index = self._index.get(seq.request_id)
        if index is None:
            index = self._index[seq.request_id] = _NgramIndex()
        return index.lookup(seq.token_ids, self.k, self.n_min, self.n_max)

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)


@dataclass(slots=True)
class _Prediction:
    token_ids: list[int]
    # n -> {n-gram: its starts in the prediction, ascending}
    starts: dict[int, dict[tuple[int, ...], list[int]]]
    cursor: int = 0  # where the output's last match ended in the prediction


class PredictionProposer:
    """A request's `prediction` (its expected output, as token ids) as its drafts."""

    def __init__(self, k: int):
        self.k = k
        self._predictions: dict[str, _Prediction] = {}

    def add(self, request_id: str, token_ids: list[int]) -> None:
        starts: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for n in range(PREDICTION_LOOKUP_MIN, PREDICTION_LOOKUP_MAX + 1):
            table = starts[n] = {}
            for s in range(len(token_ids) - n):  # n-grams with a token after them
                table.setdefault(tuple(token_ids[s : s + n]), []).append(s)
        self._predictions[request_id] = _Prediction(list(token_ids), starts)

    def has(self, request_id: str) -> bool:
        return request_id in self._predictions

    def propose(self, seq: Sequence) -> list[int]:
        pred = self._predictions.get(seq.request_id)
        if pred is None:
            return []
        output = seq.token_ids[seq.num_prompt_tokens :]
        for n in range(min(PREDICTION_LOOKUP_MAX, len(output)), PREDICTION_LOOKUP_MIN - 1, -1):
            starts = pred.starts[n].get(tuple(output[len(output) - n :]))
            if not starts:
                continue
            i = bisect_left(starts, pred.cursor - n)
            s = starts[i] if i < len(starts) else starts[-1]
            pred.cursor = s + n
            return pred.token_ids[s + n : s + n + self.k]
        if not output:  # nothing to align yet: the prediction's start
            return pred.token_ids[: self.k]
        return []

    def release(self, request_id: str) -> None:
        self._predictions.pop(request_id, None)


_DRAFT_GREEDY = SamplingParams(max_tokens=1 << 30, temperature=0.0)


class DraftModelProposer:
    """A draft model's greedy continuation of each decoding sequence (vLLM's draft_model method).

    Each sequence has a mirror here: its tokens, the draft KV blocks from this proposer's own
    pool, and how many leading positions that KV holds. A step runs K forward passes of the
    draft over all the mirrors at once: the first feeds each the tokens its KV lacks (the ones
    the target accepted or sampled since), the others one draft each. A sequence that would
    not fit the pool or the draft's context gets no drafts this step."""

    def __init__(self, executor: Executor, k: int, num_blocks: int, block_size: int, max_context: int,
                 num_groups: int = 1):  # fmt: skip
        self.executor = executor
        self.k = k
        self.num_groups = num_groups  # the draft's KV groups (spec/kv_groups.py): a block table each
        self.block_size = block_size
        self.max_context = max_context
        self._free = list(range(num_blocks - 1, -1, -1))
        self._mirrors: dict[str, Sequence] = {}
        self._known: dict[str, int] = {}  # the target's token count when each mirror last proposed

    def propose_all(self, seqs: list[Sequence]) -> None:
        mirrors = [m for m in (self._mirror(seq) for seq in seqs) if m is not None]
        if not mirrors:
            return
        known = {m.request_id: len(m.token_ids) for m in mirrors}
        for _ in range(self.k):
            plan = StepPlan(block_size=self.block_size)
            for m in mirrors:
                n = len(m.token_ids) - m.num_computed_tokens
                plan.scheduled.append(ScheduledSeq(m, n, m.num_computed_tokens, True))
                plan.num_batched_tokens += n
            result = self.executor.execute(plan)
            alive = []
            for m, token in zip(mirrors, result.sampled_token_ids):
                m.num_computed_tokens = len(m.token_ids)
                if token is not None:  # a failed draft row only costs that sequence its drafts
                    m.token_ids.append(token)
                    alive.append(m)
            mirrors = alive
        for seq in seqs:
            mirror = self._mirrors.get(seq.request_id)
            if mirror is not None and seq.request_id in known:
                seq.draft_token_ids = mirror.token_ids[known[seq.request_id] :]

    def _mirror(self, seq: Sequence) -> Sequence | None:
        """The sequence's mirror, its tokens the target's, its KV valid up to the first position
        whose token the target did not keep, with blocks for this step's K passes; None when
        they do not fit."""
        m = self._mirrors.get(seq.request_id)
        if m is None:
            m = self._mirrors[seq.request_id] = Sequence(seq.request_id, [], _DRAFT_GREEDY)
            m.group_tables = [[] for _ in range(self.num_groups - 1)]
        tokens = seq.token_ids
        # The target's tokens only grow: past where it stood last time, the mirror's are drafts,
        # valid as far as the target kept them.
        limit = min(m.num_computed_tokens, len(tokens) - 1)
        valid = min(self._known.get(seq.request_id, 0), limit)
        while valid < limit and m.token_ids[valid] == tokens[valid]:
            valid += 1
        self._known[seq.request_id] = len(tokens)
        m.token_ids = list(tokens)
        m.num_computed_tokens = valid
        needed = len(tokens) + self.k - 1  # the last draft is sampled, never fed
        if needed > self.max_context:
            return None
        num_blocks = -(-needed // self.block_size)
        if (num_blocks - len(m.block_table)) * self.num_groups > len(self._free):
            return None
        for table in (m.block_table, *m.group_tables):  # every block kept: the draft frees no window
            while len(table) < num_blocks:
                table.append(self._free.pop())
        return m

    def release(self, request_id: str) -> None:
        m = self._mirrors.pop(request_id, None)
        self._known.pop(request_id, None)
        if m is not None:
            for table in (m.block_table, *m.group_tables):
                self._free += reversed(table)


def load_draft_proposer(
    config: SpeculativeConfig,
    *,
    dtype,
    kv_dtype,
    device: str,
    options,
    num_blocks: int,
    block_size: int,
    vocab_size: int,
) -> DraftModelProposer:
    """The draft model of `config` on an executor of its own, its KV pool as many tokens as the
    target's, in the target's KV dtype (blocks are allocated as they are first written).
    InvalidArgument naming speculative_config where the draft cannot draft for the target."""
    from servelab.engine.model_executor import ModelExecutor
    from servelab.engine.sampler import Sampler
    from servelab.errors import InvalidArgument
    from servelab.runtime.kv_cache import PagedKVCache
    from servelab.runtime.loader import load_model, servable_context

    assert config.model is not None  # SpeculativeConfig requires it for draft_model
    loaded = load_model(config.model, dtype=dtype, device=device)
    options.apply(loaded.model)
    if loaded.model.vocab_size != vocab_size:
        raise InvalidArgument(
            f"speculative_config.model: the draft model's vocabulary has {loaded.model.vocab_size} tokens and the "
            f"target's {vocab_size}; a draft must share the target's tokenizer",
            param="speculative_config",
        )
    kv = PagedKVCache(loaded.model.config, num_blocks, block_size, dtype=kv_dtype, device=device)
    executor = ModelExecutor(loaded.model, kv, sampler=Sampler(0))
    return DraftModelProposer(
        executor,
        config.num_speculative_tokens,
        num_blocks,
        block_size,
        servable_context(loaded.spec),
        kv.groups.num_groups,
    )


class Proposers:
    """The engine's proposers, run before each schedule(): a request's prediction first, else
    the configured method (n-gram); `config` None speculates only for requests with a prediction
    (none where `predictions` is False)."""

    def __init__(
        self,
        config: SpeculativeConfig | None,
        vocab_size: int,
        *,
        predictions: bool = True,
        draft: DraftModelProposer | None = None,
    ):
        self.config = config
        self.vocab_size = vocab_size
        self.predictions = predictions
        self.draft = draft
        self.ngram = NgramProposer(config) if config is not None and config.method == "ngram" else None
        k = config.num_speculative_tokens if config is not None else DEFAULT_PREDICTION_TOKENS
        self.prediction = PredictionProposer(k)

    def may_draft_for(self, seq: Sequence) -> bool:
        """Whether any proposer may ever draft for this new request: one that may speculate, with
        the configured method or its own prediction where predictions are taken."""
        if not may_speculate(seq):
            return False
        has_prediction = self.predictions and self.prediction.has(seq.request_id)
        return self.ngram is not None or self.draft is not None or has_prediction

    @property
    def active(self) -> bool:
        return self.ngram is not None or self.draft is not None or bool(self.prediction._predictions)

    def add_prediction(self, request_id: str, token_ids: list[int]) -> None:
        if not self.predictions:
            return
        # Ids past the model's vocabulary (a tokenizer with more entries) can never be accepted.
        self.prediction.add(request_id, [t for t in token_ids if 0 <= t < self.vocab_size])

    def propose(self, running: list[Sequence]) -> None:
        if not self.active:
            return
        by_draft: list[Sequence] = []
        for seq in running:
            if not speculates(seq):
                continue
            if self.prediction.has(seq.request_id):
                seq.draft_token_ids = self.prediction.propose(seq)
            elif self.ngram is not None:
                seq.draft_token_ids = self.ngram.propose(seq)
            elif self.draft is not None:
                by_draft.append(seq)
        if by_draft and (draft := self.draft) is not None:
            try:
                draft.propose_all(by_draft)
            except Exception as exc:  # drafts only make a step faster: the requests go on without
                logger.warning("the draft model failed (%s: %s); these sequences decode without drafts this step",
                               type(exc).__name__, exc)  # fmt: skip
                for seq in by_draft:
                    seq.draft_token_ids = []
                    draft.release(seq.request_id)  # its draft KV is in an unknown state

    def release(self, request_id: str) -> None:
        self.prediction.release(request_id)
        if self.ngram is not None:
            self.ngram.release(request_id)
        if self.draft is not None:
            self.draft.release(request_id)
