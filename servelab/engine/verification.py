"""Speculative decoding's verification rows: how a step's verification entries (a decode plus k
drafts) become the rows the sampler samples, and how many drafts each entry keeps."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from servelab.core.plan import ScheduledSeq
from servelab.core.sequence import Sequence


@dataclass(slots=True)
class VerificationRows:
    """The rows a step samples: one per sampling entry, 1 + k for a verification entry. Row j of
    an entry's span sees its sequence with the first j drafts as generated, so penalties,
    min_tokens, bad words and seeds treat them as they would have treated sampled tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # per row: the draft it verifies, -1 for none
    logit_rows: list[int] = field(default_factory=list)  # per row: its row in the forward's output
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (entry, first row, num drafts)

    @property
    def any_drafts(self) -> bool:
        return len(self.seqs) > len(self.spans)


def verification_rows(
    entries: list[ScheduledSeq], sampling: list[int], row_of_last: dict[int, int]
) -> VerificationRows:
    rows = VerificationRows()
    for i in sampling:
        s = entries[i]
        k, last = s.num_draft, row_of_last[i]
        rows.spans.append((i, len(rows.seqs), k))
        if not k:
            rows.seqs.append(s.seq)
            rows.drafts.append(-1)
            rows.logit_rows.append(last)
            continue
        drafts = s.seq.draft_token_ids[:k]
        rows.seqs.append(s.seq)
        for j in range(1, k + 1):
            view = copy.copy(s.seq)
            view.token_ids = s.seq.token_ids + drafts[:j]
            rows.seqs.append(view)
        rows.drafts += [*drafts, -1]
        rows.logit_rows += range(last - k, last + 1)
    return rows


def accepted_length(tokens: list[int | None], first: int, drafts: list[int]) -> int:
    """How many drafts the entry keeps: up to the first row whose token differs from its draft."""
    a = 0
    while a < len(drafts) and tokens[first + a] == drafts[a]:
        a += 1
    return a
