"""A speculative-decoding acceptance profile: how many drafted tokens a server accepted, by draft
position, on a workload. `servelab bench --spec-profile-out FILE` measures one from the server's
counters; `servelab sim --spec-acceptance-profile FILE` replays it. Pure Python, so both may load it.

The file is one JSON object:

    {
      "num_speculative_tokens": 4,            K: the draft positions the counters showed
      "num_drafts": 1200,                     verification entries (a sequence's drafts in one step)
      "num_draft_tokens": 4800,               draft tokens scored
      "num_accepted_tokens": 2900,            draft tokens accepted
      "acceptance_rate": 0.604,               num_accepted_tokens / num_draft_tokens
      "accepted_per_position": [1000, 800, 640, 460],
                                              drafts that accepted position i (so more than i tokens)
      "acceptance_per_position": [0.833, 0.8, 0.8, 0.719],
                                              a_i: accepted_per_position[i] / accepted_per_position[i-1],
                                              a_0 = accepted_per_position[0] / num_drafts: the chance
                                              position i is accepted once every earlier one was
      "source": "http://127.0.0.1:8000/v1 llama-1b 200 requests, edit a Python docs passage, ...",
      "num_decode_steps": 1500,               optional: decode steps of the run's sequences, with
                                              drafts or without (prompt lookup proposes nothing where
                                              its last n-gram has no earlier match: that step decodes
                                              one token); num_drafts / num_decode_steps is the
                                              draft coverage (1 when absent)
      "per_request": [                        optional: the same counts for each finished request,
        {"num_decode_steps": 40, "num_drafts": 31, "num_draft_tokens": 120,
         "accepted_per_position": [25, 20, 16, 11]},
        ...                                   from servelab's `usage.spec_decode`; with them the
      ]                                       simulator gives each request one measured request's
    }                                         acceptance, so requests differ as they did

A draft's accepted tokens are a prefix of it, so the counts never rise with the position and
sum to `num_accepted_tokens`. A draft may be shorter than K (the length limit or the token
budget cut it), which is why rates are kept beside the counts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servelab.errors import InvalidArgument, NotFound

_INT_FIELDS = ("num_speculative_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass(frozen=True, slots=True)
class RequestAcceptance:
    """One request's verifications: its decode steps, those that drafted, and what they accepted."""

    num_decode_steps: int
    num_drafts: int
    num_draft_tokens: int
    accepted_per_position: tuple[int, ...]

    def check(self, where: str) -> None:
        counts = self.accepted_per_position
        if self.num_drafts > self.num_decode_steps:
            raise InvalidArgument(
                f"{where}: num_drafts ({self.num_drafts}) exceeds num_decode_steps ({self.num_decode_steps})"
            )
        if self.num_draft_tokens > self.num_drafts * max(len(counts), 1) or (counts and counts[0] > self.num_drafts):
            raise InvalidArgument(f"{where}: more draft tokens or acceptances than {self.num_drafts} drafts allow")
        if sum(counts) > self.num_draft_tokens or any(b > a for a, b in zip(counts, counts[1:])):
            raise InvalidArgument(
                f"{where}: accepted_per_position must not rise with the position nor pass num_draft_tokens, "
                f"got {list(counts)}"
            )

    @classmethod
    def from_dict(cls, record: object, where: str) -> RequestAcceptance:
        """One request's counts from JSON (a profile's `per_request` entry, or a response's
        `usage.spec_decode`), checked: an InvalidArgument names `where` and the field."""
        if not isinstance(record, dict):
            raise InvalidArgument(f"{where} must be an object, got {record!r}")
        for name in ("num_decode_steps", "num_drafts", "num_draft_tokens"):
            if name not in record:
                raise InvalidArgument(f"{where}: missing field {name!r}")
            _check_count(record[name], f"{where}.{name}")
        counts = record.get("accepted_per_position", [])
        if not isinstance(counts, list):
            raise InvalidArgument(f"{where}.accepted_per_position must be a list of counts, got {counts!r}")
        for j, count in enumerate(counts):
            _check_count(count, f"{where}.accepted_per_position[{j}]")
        request = cls(record["num_decode_steps"], record["num_drafts"], record["num_draft_tokens"], tuple(counts))
        request.check(where)
        return request

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_decode_steps": self.num_decode_steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "accepted_per_position": list(self.accepted_per_position),
        }


@dataclass(frozen=True, slots=True)
class AcceptanceProfile:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    source: str = ""
    num_decode_steps: int | None = None  # None: unknown, taken as every decode step drafting
    per_request: tuple[RequestAcceptance, ...] = ()  # empty: the server reports no request's own

    @property
    def draft_coverage(self) -> float:
        """The share of decode steps that verified drafts (1.0 when num_decode_steps is unknown)."""
        return self.num_drafts / self.num_decode_steps if self.num_decode_steps else 1.0

    @property
    def num_speculative_tokens(self) -> int:
        return len(self.accepted_per_position)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per draft token scored."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_per_draft(self) -> float:
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a sequence gains per verification step: its accepted drafts plus the target's own."""
        return 1.0 + self.mean_accepted_per_draft

    @property
    def acceptance_per_position(self) -> tuple[float, ...]:
        """a_i: the chance draft position i is accepted given positions 0..i-1 were (0 where none were)."""
        rates = []
        previous = self.num_drafts
        for count in self.accepted_per_position:
            rates.append(count / previous if previous else 0.0)
            previous = count
        return tuple(rates)

    def check(self, where: str) -> None:
        """Raise InvalidArgument (naming `where` and the field) unless the counts are ones a server
        can report: some drafts, a prefix of each accepted, the positions summing to the total."""
        counts = self.accepted_per_position
        if self.num_drafts == 0:
            raise InvalidArgument(f"{where}: num_drafts is 0: no speculation was measured")
        if not counts:
            raise InvalidArgument(f"{where}: accepted_per_position is empty: no draft position was measured")
        if self.num_draft_tokens > self.num_drafts * len(counts):
            raise InvalidArgument(
                f"{where}: num_draft_tokens ({self.num_draft_tokens}) exceeds num_drafts x num_speculative_tokens "
                f"({self.num_drafts} x {len(counts)})"
            )
        if self.num_accepted_tokens > self.num_draft_tokens:
            raise InvalidArgument(
                f"{where}: num_accepted_tokens ({self.num_accepted_tokens}) exceeds num_draft_tokens "
                f"({self.num_draft_tokens})"
            )
        if sum(counts) != self.num_accepted_tokens:
            raise InvalidArgument(
                f"{where}: accepted_per_position sums to {sum(counts)}, not num_accepted_tokens "
                f"({self.num_accepted_tokens})"
            )
        if self.num_decode_steps is not None and self.num_decode_steps < self.num_drafts:
            raise InvalidArgument(
                f"{where}: num_decode_steps ({self.num_decode_steps}) is below num_drafts ({self.num_drafts}): "
                f"every draft is verified in a decode step"
            )
        if counts[0] > self.num_drafts or any(b > a for a, b in zip(counts, counts[1:])):
            raise InvalidArgument(
                f"{where}: accepted_per_position must not rise with the position nor pass num_drafts "
                f"({self.num_drafts}), got {list(counts)}"
            )

    def to_dict(self) -> dict[str, Any]:
        out = {
            "num_speculative_tokens": self.num_speculative_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_per_position": list(self.acceptance_per_position),
            "source": self.source,
        }
        if self.num_decode_steps is not None:
            out["num_decode_steps"] = self.num_decode_steps
            out["draft_coverage"] = self.draft_coverage
        if self.per_request:
            out["per_request"] = [r.to_dict() for r in self.per_request]
        return out

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")


def load_profile(path: str | Path) -> AcceptanceProfile:
    """The profile in `path`, checked: an InvalidArgument names the file and the field at fault."""
    where = f"acceptance profile {str(path)!r}"
    p = Path(path)
    if not p.is_file():
        raise NotFound(f"{where}: no such file (write one with servelab bench --spec-profile-out FILE)")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{where}: expected a JSON object, got {type(data).__name__}")
    for name in (*_INT_FIELDS, "accepted_per_position"):
        if name not in data:
            raise InvalidArgument(f"{where}: missing field {name!r}")
    for name in _INT_FIELDS:
        _check_count(data[name], f"{where}: {name}")
    counts = data["accepted_per_position"]
    if not isinstance(counts, list):
        raise InvalidArgument(f"{where}: accepted_per_position must be a list of counts, got {counts!r}")
    for i, count in enumerate(counts):
        _check_count(count, f"{where}: accepted_per_position[{i}]")
    steps = data.get("num_decode_steps")
    if steps is not None:
        _check_count(steps, f"{where}: num_decode_steps")
    profile = AcceptanceProfile(
        num_drafts=data["num_drafts"],
        num_draft_tokens=data["num_draft_tokens"],
        num_accepted_tokens=data["num_accepted_tokens"],
        accepted_per_position=tuple(counts),
        source=str(data.get("source", "")),
        num_decode_steps=steps,
        per_request=_load_per_request(data.get("per_request", []), where),
    )
    if data["num_speculative_tokens"] != len(counts):
        raise InvalidArgument(
            f"{where}: num_speculative_tokens is {data['num_speculative_tokens']} but accepted_per_position has "
            f"{len(counts)} entries"
        )
    profile.check(where)
    rate = data.get("acceptance_rate")
    if rate is not None and not (
        isinstance(rate, (int, float)) and math.isclose(rate, profile.acceptance_rate, abs_tol=1e-6)
    ):
        raise InvalidArgument(
            f"{where}: acceptance_rate {rate!r} is not num_accepted_tokens / num_draft_tokens "
            f"({profile.acceptance_rate:.6g})"
        )
    return profile


def _load_per_request(records: object, where: str) -> tuple[RequestAcceptance, ...]:
    if not isinstance(records, list):
        raise InvalidArgument(f"{where}: per_request must be a list of objects, got {type(records).__name__}")
    return tuple(RequestAcceptance.from_dict(record, f"{where}: per_request[{i}]") for i, record in enumerate(records))


def _check_count(value: object, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"{where} must be an integer >= 0, got {value!r}")
