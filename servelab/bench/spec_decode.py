"""How much of a bench run's drafting the server accepted, from its speculative-decoding counters.

`servelab bench` reads vLLM's spec-decode counters (or servelab's, the same names under
`servelab:`) from `GET /metrics` before and after the run and reports the difference:

    {ns}:spec_decode_num_drafts_total                 verification entries (one sequence's drafts)
    {ns}:spec_decode_num_draft_tokens_total           draft tokens scored
    {ns}:spec_decode_num_accepted_tokens_total        draft tokens accepted
    {ns}:spec_decode_num_accepted_tokens_per_pos_total{position="i"}
                                                      drafts whose position i was accepted
    {ns}:generation_tokens_total, {ns}:request_success_total
                                                      with them, the decode steps the run took:
                                                      tokens - finished requests - accepted drafts

each summed over its label sets (engines, models) except `position`. A server that exports none
of them (speculation off on vLLM, or an older server) gets no report. servelab also returns each
request's own counts in its `usage.spec_decode`; the report keeps them per request
(`per_request_acceptance`), so the profile says how acceptance varies between requests. `--spec-profile-out FILE`
writes the difference as an acceptance profile, the JSON format `servelab.workload.acceptance`
documents and loads (`load_profile`), for `servelab sim --spec-acceptance-profile FILE`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from collections.abc import Iterable
from typing import Any

from servelab.errors import InvalidArgument
from servelab.workload.acceptance import AcceptanceProfile, RequestAcceptance, load_profile

__all__ = ["SpecCounters", "SpecDecodeReport", "load_profile", "parse_counters", "per_request_acceptance"]

NAMESPACES = ("servelab", "vllm")
_DRAFTS = "spec_decode_num_drafts_total"
_DRAFT_TOKENS = "spec_decode_num_draft_tokens_total"
_ACCEPTED = "spec_decode_num_accepted_tokens_total"
_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_total"
_GENERATED = "generation_tokens_total"
_FINISHED = "request_success_total"
_POSITION = re.compile(r'(?:^|,)\s*position\s*=\s*"(\d+)"')


@dataclass(frozen=True, slots=True)
class SpecCounters:
    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    accepted_per_position: tuple[float, ...]  # empty when the server exports no per-position counts
    generation_tokens: float | None = None  # None: the server exports no such total
    finished_requests: float | None = None


def parse_counters(metrics_text: str) -> SpecCounters | None:
    """The counters of the first namespace (servelab's, then vLLM's) that exports all three totals;
    None when neither does. Positions the server did not export count 0."""
    totals: dict[str, float] = {}
    positions: dict[str, dict[int, float]] = {}
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, labels, rest = _split(line)
        ns, _, family = name.partition(":")
        if ns not in NAMESPACES or family not in (
            _DRAFTS,
            _DRAFT_TOKENS,
            _ACCEPTED,
            _PER_POSITION,
            _GENERATED,
            _FINISHED,
        ):
            continue
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if family == _PER_POSITION:
            match = _POSITION.search(labels)
            if match is None:
                continue
            by_pos = positions.setdefault(ns, {})
            pos = int(match.group(1))
            by_pos[pos] = by_pos.get(pos, 0.0) + value
        else:
            totals[name] = totals.get(name, 0.0) + value
    for ns in NAMESPACES:
        drafts, draft_tokens, accepted = (f"{ns}:{family}" for family in (_DRAFTS, _DRAFT_TOKENS, _ACCEPTED))
        if drafts in totals and draft_tokens in totals and accepted in totals:
            by_pos = positions.get(ns, {})
            per_position = tuple(by_pos.get(i, 0.0) for i in range(max(by_pos) + 1)) if by_pos else ()
            generated, finished = totals.get(f"{ns}:{_GENERATED}"), totals.get(f"{ns}:{_FINISHED}")
            return SpecCounters(
                totals[drafts], totals[draft_tokens], totals[accepted], per_position, generated, finished
            )
    return None


def _split(line: str) -> tuple[str, str, str]:
    """`name{labels} value [timestamp]` or `name value [timestamp]` -> (name, labels, the rest)."""
    if "{" not in line:
        name, _, rest = line.partition(" ")
        return name, "", rest
    open_, close = line.index("{"), line.rindex("}")
    return line[:open_], line[open_ + 1 : close], line[close + 1 :]


@dataclass(frozen=True, slots=True)
class SpecDecodeReport:
    """The counters' growth over a run (warm-up included, as for the prefix cache)."""

    profile: AcceptanceProfile

    @classmethod
    def between(cls, before: SpecCounters | None, after: SpecCounters | None, source: str = "",
                per_request: tuple[RequestAcceptance, ...] = ()) -> SpecDecodeReport | None:  # fmt: skip
        if before is None or after is None:
            return None
        k = max(len(before.accepted_per_position), len(after.accepted_per_position))
        b = before.accepted_per_position + (0.0,) * (k - len(before.accepted_per_position))
        a = after.accepted_per_position + (0.0,) * (k - len(after.accepted_per_position))
        drafts = round(after.num_drafts - before.num_drafts)
        accepted = round(after.num_accepted_tokens - before.num_accepted_tokens)
        steps = None
        gb, ga = before.generation_tokens, after.generation_tokens
        fb, fa = before.finished_requests, after.finished_requests
        if gb is not None and ga is not None and fb is not None and fa is not None:
            # every finished request's first token came from its prefill, every other from a decode
            # step: one a step, plus the drafts that step accepted
            steps = round(ga - gb) - round(fa - fb) - accepted
            if steps < drafts:  # a request in flight at either read: the counts do not close
                steps = None
        return cls(
            AcceptanceProfile(
                num_drafts=drafts,
                num_draft_tokens=round(after.num_draft_tokens - before.num_draft_tokens),
                num_accepted_tokens=accepted,
                accepted_per_position=tuple(round(y - x) for x, y in zip(b, a)),
                source=source,
                num_decode_steps=steps,
                per_request=per_request,
            )
        )

    @property
    def drafted(self) -> bool:
        return self.profile.num_drafts > 0

    def lines(self) -> list[str]:
        """The printed block; none when the server drafted nothing during the run."""
        p = self.profile
        if not self.drafted:
            return []
        out = [
            "Speculative decoding (server)",
            f"{'  Drafts (draft tokens)':<34}{p.num_drafts:,} ({p.num_draft_tokens:,})",
            f"{'  Accepted tokens':<34}{p.num_accepted_tokens:,} ({p.acceptance_rate:.1%} of draft tokens)",
            f"{'  Mean accepted per draft':<34}{p.mean_accepted_per_draft:.2f}",
            f"{'  Tokens per verification step':<34}{p.tokens_per_step:.2f}",
        ]
        if p.num_decode_steps is not None:
            out.append(f"{'  Decode steps with drafts':<34}{p.num_drafts:,} of {p.num_decode_steps:,} "
                       f"({p.draft_coverage:.1%})")  # fmt: skip
        if p.accepted_per_position:
            rates = "  ".join(f"{i}: {a:.0%}" for i, a in enumerate(p.acceptance_per_position))
            out.append(f"{'  Acceptance by position':<34}{rates}")
        spread = self.per_request_spread()
        if spread is not None:
            out.append(f"{'  Per request, tokens a step':<34}p10 {spread[0]:.2f}  p50 {spread[1]:.2f}  "
                       f"p90 {spread[2]:.2f} ({len(p.per_request):,} requests)")  # fmt: skip
        return out

    def per_request_spread(self) -> tuple[float, float, float] | None:
        """p10 / p50 / p90 over requests of their output tokens per decode step (1 + accepted drafts
        per step): how unevenly speculation served them; None without per-request counts."""
        ratios = sorted(1.0 + sum(r.accepted_per_position) / r.num_decode_steps
                        for r in self.profile.per_request if r.num_decode_steps)  # fmt: skip
        if not ratios:
            return None
        at = lambda q: ratios[min(len(ratios) - 1, int(q * len(ratios)))]  # noqa: E731
        return at(0.1), at(0.5), at(0.9)

    def to_dict(self) -> dict:
        p = self.profile
        out = p.to_dict()
        del out["source"]
        out.pop("per_request", None)  # the profile file keeps them; the report their spread
        spread = self.per_request_spread()
        if spread is not None:
            out["tokens_per_decode_step_by_request"] = dict(zip(("p10", "p50", "p90"), spread))
        out["mean_accepted_per_draft"] = p.mean_accepted_per_draft
        out["tokens_per_step"] = p.tokens_per_step
        return out


def per_request_acceptance(usages: Iterable[dict[str, Any]]) -> tuple[RequestAcceptance, ...]:
    """Each finished request's counts, from servelab's `usage.spec_decode` (its decode steps
    among them). A malformed entry is left out rather than failing the run's report."""
    out = []
    for usage in usages:
        try:
            out.append(RequestAcceptance.from_dict(usage, "usage.spec_decode"))
        except InvalidArgument:
            continue
    return tuple(out)
