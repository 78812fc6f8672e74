"""Per-request logit edits made before sampling: logit_bias, allowed_token_ids, bad_words and
structured-output grammars.

The sampler calls `LogitsProcessors.apply` once per step. Rows whose request asks for none of
these are not touched (one attribute test each), so a batch pays only for its constrained rows.
A row that cannot go on (its grammar rejects a token it already has, or no token is left to
sample) is reported back and ends alone with finish reason "error"; the rest of the batch samples.
Requests whose first token could have no candidate are refused at admission.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from servelab.core.sequence import NO_TOKEN_LEFT, SamplingParams, Sequence
from servelab.engine.structured_output import GrammarMatcherState, StructuredOutputBackend
from servelab.engine.tokenizer import Tokenizer
from servelab.errors import InvalidArgument


_MASK = float("-inf")


@dataclass(frozen=True, slots=True)
class PreparedEdits:
    """A request's edits as the step loop applies them, built at admission off the step loop
    (SamplingParams.prepared_edits): read-only, so the choices of one request share one."""

    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    allowed_ids: torch.Tensor | None
    bad_words: list[list[int]]  # token ids, as written and after a space
    compiled_grammar: Any  # xgrammar's, or None


@dataclass(slots=True)
class _RowState:
    """A request's edits and its own grammar matcher, set up on its first sampled token."""

    edits: PreparedEdits
    matcher: GrammarMatcherState | None


def bad_word_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's rule: each word's tokens as written at the start of a text and after a space
    (the second only where the space makes a different first token of the same length)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return [ids for ids in out if ids]


class LogitsProcessors:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.structured = StructuredOutputBackend(tokenizer, vocab_size)
        # Per request (by id): the edits' tensors and the grammar matcher, built at its first
        # sampled row and kept across preemption; the engine releases it when the request ends.
        self._rows: dict[str, _RowState] = {}

    def release(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def prepare(self, params: SamplingParams, *siblings: SamplingParams, grammar: Any = None) -> None:
        """Admission-time work, attached to the params as PreparedEdits: token ids checked
        against the vocabulary, their tensors built, bad words tokenized, the grammar compiled
        (cached; milliseconds, seconds for the first one, which imports xgrammar). The server
        calls this on a worker thread, so the step loop neither tokenizes nor compiles.
        `siblings` (other choices made by SamplingParams.sibling, sharing its lists) share the
        work. `grammar`: the request's grammar, compiled elsewhere (the server's worker processes).
        Raises InvalidArgument naming the field."""
        if params.prepared_edits is None:
            params.validate_token_ids(self.vocab_size)
            params.prepared_edits = self._prepare(params, grammar)
        for other in siblings:
            same = (
                other.logit_bias is params.logit_bias
                and other.allowed_token_ids is params.allowed_token_ids
                and other.bad_words is params.bad_words
                and other.structured_output == params.structured_output
            )
            if same and other.prepared_edits is None:
                other.prepared_edits = params.prepared_edits
            else:
                self.prepare(other, grammar=grammar if other.structured_output == params.structured_output else None)

    def _prepare(self, params: SamplingParams, grammar: Any = None) -> PreparedEdits:
        bias_ids = bias_values = allowed = None
        if params.logit_bias:
            bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        if params.allowed_token_ids:
            allowed = torch.tensor(sorted(set(params.allowed_token_ids)), dtype=torch.long)
        bad_words = bad_word_token_ids(self.tokenizer, params.bad_words) if params.bad_words else []
        if params.allowed_token_ids:
            self._check_allowed_ids_left(params, bad_words)
        compiled = grammar
        if compiled is None and params.structured_output is not None:
            compiled = self.structured.compile(params.structured_output)
        return PreparedEdits(bias_ids, bias_values, allowed, bad_words, compiled)

    def _check_allowed_ids_left(self, params: SamplingParams, bad_words: list[list[int]]) -> None:
        """Refuses, before it runs, a request whose first token could have no candidate: every
        allowed id a one-token bad word (banned always), or, under min_tokens, an EOS or stop id.
        Conflicts that only arise later (a grammar's, a longer bad word's) end the request when
        they do (NO_TOKEN_LEFT)."""
        allowed, banned = set(params.allowed_token_ids or ()), {w[0] for w in bad_words if len(w) == 1}
        if allowed <= banned:
            raise InvalidArgument(
                "every id in allowed_token_ids is also a one-token bad word, so no token can ever be sampled",
                param="bad_words",
            )
        if params.min_tokens:
            held = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.tokenizer.eos_token_ids))
            if allowed <= banned | held:
                raise InvalidArgument(
                    f"min_tokens={params.min_tokens} holds back the EOS and stop_token_ids ids, and allowed_token_ids "
                    "has no other (bad_words aside), so the first token has no candidate",
                    param="min_tokens",
                )

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, str]:
        """Edits the rows that ask for it in place (a copy of the whole batch's logits would cost
        every row, constrained or not) and returns the rows that cannot be sampled, with why,
        zeroed so that they sample harmlessly before the sampler discards them."""
        rows = [i for i, s in enumerate(seqs) if s.params.edits_logits]
        if not rows:
            return {}
        # The model's forward runs under inference_mode, and its logits may only be edited in place there.
        with torch.inference_mode():
            failed = self._apply(logits, seqs, rows)
            if failed:
                logits[list(failed)] = 0.0
        return failed

    def _apply(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> dict[int, str]:
        failed: dict[int, str] = {}
        masked: list[int] = []  # rows whose grammar mask goes into the bitmask
        for i in rows:
            seq = seqs[i]
            state = self._rows.get(seq.request_id)
            if state is None:
                state = self._rows[seq.request_id] = self._new_state(seq.params)
            row, edits = logits[i], state.edits
            if edits.bias_ids is not None and edits.bias_values is not None:
                row[edits.bias_ids] += edits.bias_values
            if edits.allowed_ids is not None:
                kept = row[edits.allowed_ids]
                row.fill_(_MASK)
                row[edits.allowed_ids] = kept
            if edits.bad_words:
                self._ban_bad_words(row, seq, edits.bad_words)
            if state.matcher is not None:
                # Before this step the matcher sees the tokens sampled since its last step.
                if not state.matcher.sync(seq.token_ids, seq.num_prompt_tokens):
                    failed[i] = "its grammar rejects its output so far"
                elif state.matcher.matcher.is_terminated():
                    stop = [t for t in seq.eos_token_ids if t < self.vocab_size]
                    kept = row[stop]
                    row.fill_(_MASK)
                    row[stop] = kept
                else:
                    masked.append(i)
        bitmask = None
        if masked:
            bitmask = self.structured.bitmask(logits.shape[0])
            for i in masked:
                matcher = self._rows[seqs[i].request_id].matcher
                assert matcher is not None  # masked rows are the ones with a grammar
                matcher.matcher.fill_next_token_bitmask(bitmask, i)
            self.structured.apply_bitmask(logits, bitmask, masked)
        for i in rows:
            if i not in failed and self._leaves_no_token(logits, i, seqs[i], bitmask if i in masked else None):
                failed[i] = NO_TOKEN_LEFT
        return failed

    def _leaves_no_token(self, logits: torch.Tensor, i: int, seq: Sequence, bitmask: torch.Tensor | None) -> bool:
        """Whether row i has no finite logit left. Told from the few entries that can still be
        finite where possible: a whole-row reduction over 50k logits per row per step is what
        the hook must not cost (a bias is finite, and a few bad words cannot ban everything)."""
        state, params = self._rows[seq.request_id], seq.params
        allowed_ids = state.edits.allowed_ids
        if state.matcher is None:
            if allowed_ids is None:
                return False
            return bool(torch.isneginf(logits[i, allowed_ids]).all())
        if bitmask is not None and allowed_ids is None and not state.edits.bad_words and not params.min_tokens:
            return not bool(bitmask[i].any())  # nothing else masks: the grammar's tokens are the row's
        return bool(torch.isneginf(logits[i].max()))

    def _new_state(self, params: SamplingParams) -> _RowState:
        if params.prepared_edits is None:  # a caller that skipped add_request's prepare
            self.prepare(params)
        edits: PreparedEdits = params.prepared_edits
        matcher = None if edits.compiled_grammar is None else self.structured.new_matcher(edits.compiled_grammar)
        return _RowState(edits, matcher)

    @staticmethod
    def _ban_bad_words(row: torch.Tensor, seq: Sequence, bad_words: list[list[int]]) -> None:
        """A bad word's last token is banned when the output so far ends with the rest of it."""
        tokens, start = seq.token_ids, seq.num_prompt_tokens
        n_out = len(tokens) - start
        for ids in bad_words:
            prefix = len(ids) - 1
            if prefix > n_out:
                continue
            if prefix == 0 or tokens[len(tokens) - prefix :] == ids[:-1]:
                row[ids[-1]] = _MASK
