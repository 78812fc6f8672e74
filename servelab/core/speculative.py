"""Speculative decoding, in the scheduler's terms: its configuration (shared by the engine and
the simulator), the verification entries a Scheduler runs, and their acceptance counters. Pure Python.

The flag follows vLLM: `--speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4}'` proposes from the request's own tokens (prompt lookup), and
`'{"model": PATH, "num_speculative_tokens": K}'` from a smaller draft model. A request's OpenAI
`prediction` is its own draft whatever the flag says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from servelab.core.block_manager import BlockManager
from servelab.core.config import ResolvedSchedulerConfig
from servelab.core.plan import RequestOutput, ScheduledSeq, StepPlan, StepResult
from servelab.core.sequence import FinishReason, Sequence, SpecDecodeCounters, TokenLogprobs, check_stop
from servelab.errors import InvalidArgument

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32  # a verification step scores K + 1 positions per sequence; past ~32 none pays
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How the engine guesses tokens that one forward pass then verifies.

    - `method`: `ngram` (prompt lookup: the continuation of the latest earlier occurrence of the
      sequence's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`) or
      `draft_model` (K greedy steps of the smaller model at `model`).
    - `num_speculative_tokens` (K): tokens proposed per sequence per step; a verification step
      scores K + 1 positions and keeps the accepted prefix plus one token of the target's own.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidArgument(
                f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}",
                param="speculative_config",
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(
                    f"speculative_config.{name} must be an integer >= 1, got {value!r}", param="speculative_config"
                )
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise InvalidArgument(
                f"speculative_config.num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}",
                param="speculative_config",
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidArgument(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})",
                param="speculative_config",
            )
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise InvalidArgument(
                "speculative_config.model (the draft model's path) is required for method 'draft_model'",
                param="speculative_config",
            )
        if self.method == "ngram" and self.model is not None:
            raise InvalidArgument(
                "speculative_config.model is for method 'draft_model'; 'ngram' proposes from the request's own tokens",
                param="speculative_config",
            )

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A config from the flag's JSON text or a dict (vLLM's keys); None or "" stays None.
        A `model` without a `method` means `draft_model`, as in vLLM."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidArgument(
                    f"speculative_config must be a JSON object, e.g. "
                    f'\'{{"method": "ngram", "num_speculative_tokens": 4}}\' ({e.msg} at character {e.pos})',
                    param="speculative_config",
                ) from None
        if not isinstance(value, dict):
            raise InvalidArgument(
                f"speculative_config must be a JSON object, got {type(value).__name__}", param="speculative_config"
            )
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise InvalidArgument(
                f"speculative_config has unknown key(s) {', '.join(unknown)}; known: {', '.join(_KEYS)}",
                param="speculative_config",
            )
        if "num_speculative_tokens" not in value:
            raise InvalidArgument("speculative_config.num_speculative_tokens is required", param="speculative_config")
        method = value.get("method", "draft_model" if value.get("model") is not None else None)
        if method is None:
            raise InvalidArgument(
                f"speculative_config needs a method ({', '.join(METHODS)}) or a draft model path",
                param="speculative_config",
            )
        return cls(**{**value, "method": method})

    def to_json(self) -> str:
        """The flag's text for this config (what `parse` reads back)."""
        keys: tuple[str, ...] = ("method", "num_speculative_tokens")
        keys += ("model",) if self.method == "draft_model" else ("prompt_lookup_max", "prompt_lookup_min")
        return json.dumps({k: getattr(self, k) for k in keys})


class VerifiedDecodes:
    """A Scheduler mixin: decodes that carry proposed tokens (`Sequence.draft_token_ids`) run as
    verification entries of 1 + k tokens, and their results append the accepted drafts plus the
    token sampled after them, rolling the KV back past the last accepted position."""

    # What it uses of the Scheduler it is mixed into.
    config: ResolvedSchedulerConfig
    block_manager: BlockManager
    spec_counters: SpecDecodeCounters
    _verified: dict[str, tuple[list[int], list[TokenLogprobs] | None]]
    _len_cap: int

    if TYPE_CHECKING:

        def length_limit(self, seq: Sequence) -> int: ...
        def _finish(self, seq: Sequence, reason: FinishReason, now: float | None) -> None: ...

    def _num_drafts(self, seq: Sequence, budget: int) -> int:
        """How many of a decoding seq's proposals this step verifies: those within the token
        budget and the length limit whose KV slots are free. A short pool drops the proposals
        rather than preempting anyone for guesses."""
        num_known = len(seq.token_ids)
        k = min(len(seq.draft_token_ids), budget - 1, self.length_limit(seq) - num_known - 1)
        if k <= 0 or not self.block_manager.append_slots(seq, num_known + k):
            return 0
        return k

    def _take_accepted(self, plan: StepPlan, result: StepResult) -> None:
        """The accepted drafts of each verification entry, by request id, for `_apply_verified`."""
        self._verified = {plan.scheduled[i].seq.request_id: (toks, lps) for i, toks, lps in result.accepted or ()}

    def _apply_verified(
        self,
        entry: ScheduledSeq,
        token: int | None,
        lp: TokenLogprobs | None,
        now: float,
        outputs: list[RequestOutput],
        finished: list[Sequence],
        stream: bool,
    ) -> bool:
        """A verification entry's result: the accepted drafts, then `token`, each checked against
        the stop conditions in turn. True if its sequence runs on."""
        seq = entry.seq
        drafts, draft_lps = self._verified.pop(seq.request_id, ([], None))
        if len(drafts) > entry.num_draft or drafts != seq.draft_token_ids[: len(drafts)]:
            raise ValueError(f"request {seq.request_id!r}: accepted tokens {drafts} are not a prefix of its drafts")
        self.spec_counters.record(entry.num_draft, len(drafts))
        seq.draft_token_ids = []
        if token is None:  # the step failed for this request: nothing it computed is kept
            self._finish(seq, FinishReason.ERROR, now)
            finished.append(seq)
            outputs.append(RequestOutput(seq.request_id, [], True, FinishReason.ERROR, seq))
            return False
        new = [*drafts, token]
        lps = None if lp is None or (drafts and draft_lps is None) else [*(draft_lps or ()), lp]
        reason = None
        for n, tok in enumerate(new, 1):
            seq.token_ids.append(tok)
            seq.token_times_s.append(now)
            reason = check_stop(seq, tok, self._len_cap)
            if reason is not None:
                del new[n:]
                break
        if lps is not None:
            del lps[len(new) :]
        if seq.spec_counters is not None:
            # The request's own count keeps the drafts its output kept beyond the step's one token
            # (a stop token among the drafts ends it there), so that its decode steps are its
            # tokens after the first less these.
            seq.spec_counters.record(entry.num_draft, len(new) - 1)
        # KV is valid up to the last accepted draft; the slots of rejected ones are rewritten.
        seq.num_computed_tokens = entry.start_pos + 1 + len(drafts)
        self.block_manager.trim(seq, len(seq.token_ids))
        if seq.num_computed_tokens >= (seq.prefix.num_committed + 1) * self.config.block_size:
            self.block_manager.commit_computed_blocks(seq)
        if self.block_manager.windowed:
            self.block_manager.free_out_of_window(seq)
        if reason is not None:
            self._finish(seq, reason, now)
            finished.append(seq)
            outputs.append(RequestOutput(seq.request_id, new, True, reason, seq, lps))
            return False
        if stream:
            outputs.append(RequestOutput(seq.request_id, new, False, None, seq, lps))
        return True
