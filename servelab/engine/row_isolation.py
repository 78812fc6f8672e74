"""Per-request fault isolation around sampling: whatever one row of a step does, only its request ends.

The sampler works on the whole batch at once, so one request that makes it raise (penalties,
min_tokens, logit processing: a bug, or an input that validation let through) would otherwise
fail the step for every request in it. When the batched call raises, each row is sampled again
on its own, which tells the failing rows apart and gives the others the tokens they would have
had (greedy and seeded rows exactly; unseeded random rows draw from the shared generator, whose
draws depend on the batch anyway). Every id is also checked against the vocabulary: an id past
it would fail the next step's embedding lookup, again for the whole batch. A failed row gets
None, which the scheduler ends with finish reason "error".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from servelab.core.plan import TokenLogprobs
from servelab.core.sequence import Sequence
from servelab.engine.sampler import NON_FINITE_LOGITS, Sampler

logger = logging.getLogger("servelab.engine")


@dataclass(slots=True)
class SampledRows:
    tokens: list[int | None]  # None: the row failed
    logprobs: list[TokenLogprobs | None] | None  # None when no row asked for logprobs
    errors: dict[int, str] = field(default_factory=dict)  # failed row -> why


def sample_isolated(
    sampler: Sampler,
    logits: torch.Tensor,
    seqs: list[Sequence],
    vocab_size: int,
    argmax: list[int] | None = None,
    drafts: list[int] | None = None,
) -> SampledRows:
    """sampler.sample(logits, seqs, argmax, drafts), with each row's failure confined to that row."""
    # The sampler edits constrained rows (logit_bias, grammars ...) in place: keep them as the
    # model made them, so that a retry row by row does not apply the edits twice.
    edited = [i for i, s in enumerate(seqs) if s.params.edits_logits]
    original = logits[edited].clone() if edited else None
    try:
        draft_args = () if drafts is None else (drafts,)  # a step without drafts calls the plain signature
        tokens, logprobs = sampler.sample(logits, seqs, argmax, *draft_args)
        rows = SampledRows(list(tokens), None if logprobs is None else list(logprobs), dict(sampler.row_errors))
    except Exception as exc:
        logger.warning(
            "sampling a batch of %d rows raised %s: %s; sampling each row alone to find the failing request(s)",
            len(seqs), type(exc).__name__, exc,
        )  # fmt: skip
        if original is not None:
            with torch.inference_mode():  # the model's logits are inference tensors
                logits[edited] = original
        rows = _row_by_row(sampler, logits, seqs, drafts)
    for i, token in enumerate(rows.tokens):
        if token is None:
            rows.errors.setdefault(i, NON_FINITE_LOGITS)
        elif not (isinstance(token, int) and 0 <= token < vocab_size):
            rows.errors[i] = f"sampling produced token id {token!r}, outside the vocabulary [0, {vocab_size})"
    for i in rows.errors:
        rows.tokens[i] = None
        if rows.logprobs is not None:
            rows.logprobs[i] = None
    return rows


def _row_by_row(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], drafts: list[int] | None) -> SampledRows:
    rows = SampledRows([None] * len(seqs), None)
    for i, seq in enumerate(seqs):
        try:
            draft_args = () if drafts is None else (drafts[i : i + 1],)
            tokens, logprobs = sampler.sample(logits[i : i + 1], [seq], None, *draft_args)
        except Exception as exc:
            rows.errors[i] = f"sampling raised {type(exc).__name__}: {exc}"
            continue
        if 0 in sampler.row_errors:
            rows.errors[i] = sampler.row_errors[0]
        rows.tokens[i] = tokens[0]
        if logprobs is not None:
            if rows.logprobs is None:
                rows.logprobs = [None] * len(seqs)
            rows.logprobs[i] = logprobs[0]
    return rows
