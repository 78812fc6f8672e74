"""Request/sequence state shared by the scheduler, the engine and the simulator. Pure Python."""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import Any

from servelab.core.structured_output import StructuredOutputSpec
from servelab.errors import InvalidArgument

MAX_LOGPROBS = 20  # top alternatives per token, for logprobs and prompt_logprobs (OpenAI's limit)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled, or preempted and back in the queue
    RUNNING = "running"
    FINISHED = "finished"


# OpenAI's range for logit_bias values: -100 bans a token in practice, +100 all but forces it.
LOGIT_BIAS_LIMIT = 100
# Far above any useful temperature: 1e39 overflowed to inf in the sampler's fp32 and made a NaN row.
MAX_TEMPERATURE = 100.0
# Far above any useful repetition penalty (1.1-1.3 is usual); an inf one would turn a logit of 0
# into NaN (0 x inf) and fail the batch's step.
MAX_REPETITION_PENALTY = 100.0


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens (or max_model_len) reached
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"  # failed inside the engine


# Sequence.error when the request's own constraints leave a step no token to sample: the client's
# doing (the server answers 400), where any other error is the engine's (500).
NO_TOKEN_LEFT = "its constraints leave no token to sample"


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of the sampled token and the top-N alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # 1 + how many tokens the model rated higher (prompt logprobs report it)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(slots=True)
class SamplingParams:
    """What to generate and when to stop. Mirrors the OpenAI / vLLM parameters."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (and HF's): the logits of tokens seen in the prompt or the output are divided by it
    # where positive, multiplied where negative; 1.0 = off.
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, matched by the engine's detokenizer
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # The text of the stop string (or stop token) that ended the request stays in the output.
    include_stop_str_in_output: bool = False
    # Special tokens (control tokens such as <|im_start|>) are left out of the output text.
    skip_special_tokens: bool = True
    logprobs: int | None = None  # number of top alternatives to return (0 = only the sampled token)
    min_tokens: int = 0
    # vLLM's prompt_logprobs: the logprob of every prompt token after the first, with this many
    # top alternatives (0 = only the prompt's own token); None = not computed.
    prompt_logprobs: int | None = None
    # Only the prompt is wanted (completions' echo with max_tokens 0): the one token the engine
    # samples after the prefill is dropped by the caller, and metrics do not count it.
    prompt_only: bool = False
    # Logit edits applied before every sampling method, greedy included (engine/logits_processors.py).
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] = field(default_factory=list)  # never completed in the output
    structured_output: StructuredOutputSpec | None = None
    # OpenAI's `prediction`: token ids the output is expected to resemble, proposed as drafts
    # (speculative decoding; engine/speculative.py). It changes the speed, never the output.
    prediction: list[int] | None = None
    # The engine's admission-time work for the edits above (their tensors, the bad words' token
    # ids, the compiled grammar), attached off the step loop so that the step loop neither
    # tokenizes nor compiles, even if the compile cache dropped the grammar since. An opaque
    # handle into this process's engine: copies and pickles leave it behind.
    prepared_edits: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # OpenAI's stop may be one string: it is one stop string (iterated, it would stop at any
        # of its characters); the same for bad_words. Tuples become lists.
        for name in ("stop", "bad_words", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, str) and name != "stop_token_ids":
                setattr(self, name, [value])
            elif isinstance(value, tuple):
                setattr(self, name, list(value))
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.validate()

    def __getstate__(self) -> dict[str, Any]:
        state = {name: getattr(self, name) for name in self.__dataclass_fields__}
        state["prepared_edits"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)

    def sibling(self, *, seed: int | None, max_tokens: int, prompt_logprobs: int | None) -> SamplingParams:
        """Another choice (or prompt) of the same request: these params, sharing their lists (which
        may be long, and were checked once), with its own seed, length and prompt scoring."""
        twin = copy.copy(self)
        twin.seed, twin.max_tokens, twin.prompt_logprobs = seed, max_tokens, prompt_logprobs
        twin._validate_lengths()
        return twin

    def _validate_types(self) -> None:
        """Each field's type, before a range check compares it or a step uses it. bool is not an
        int here; an int is a float."""
        for name in ("max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if not (_is_int(value) or (value is None and name in ("seed", "logprobs", "prompt_logprobs"))):
                optional = " or None" if name in ("seed", "logprobs", "prompt_logprobs") else ""
                raise InvalidArgument(f"{name} must be an integer{optional}, got {value!r}", param=name)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not _is_number(value):
                raise InvalidArgument(f"{name} must be a number, got {value!r}", param=name)
        for name in ("ignore_eos", "prompt_only", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"{name} must be True or False, got {getattr(self, name)!r}", param=name)
        for name, kind in (("stop", "a string or a list of strings"), ("stop_token_ids", "a list of token ids"),
                           ("bad_words", "a string or a list of strings")):  # fmt: skip
            if not isinstance(getattr(self, name), list):
                raise InvalidArgument(f"{name} must be {kind}, got {getattr(self, name)!r}", param=name)
        if not isinstance(self.logit_bias, dict):
            raise InvalidArgument(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}",
                                  param="logit_bias")  # fmt: skip
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, list):
            raise InvalidArgument(f"allowed_token_ids must be a list of token ids or None, got {self.allowed_token_ids!r}",
                                  param="allowed_token_ids")  # fmt: skip
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutputSpec):
            raise InvalidArgument(
                f"structured_output must be a StructuredOutputSpec (e.g. StructuredOutputSpec('regex', '[0-9]+')) "
                f"or None, got {self.structured_output!r}",
                param="structured_output",
            )
        bad = next((w for w in self.stop if not isinstance(w, str)), None)
        if bad is not None:
            raise InvalidArgument(f"stop: {bad!r} is not a string", param="stop")
        bad_id = next((t for t in self.stop_token_ids if not _is_int(t)), None)  # the range: the engine's vocabulary
        if bad_id is not None:
            raise InvalidArgument(f"stop_token_ids: {bad_id!r} is not a token id (an integer)", param="stop_token_ids")

    def _validate_lengths(self) -> None:
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidArgument(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}", param="min_tokens"
            )

    def validate(self, *, lists: bool = True) -> None:
        """Every value in range. `lists=False` skips the per-entry checks of logit_bias,
        allowed_token_ids and bad_words (in proportion to their length, up to the vocabulary's),
        for params whose lists were checked when they were prepared."""
        self._validate_types()
        self._validate_lengths()
        # Comparisons are written so that NaN fails them: a NaN that got through would fail
        # the whole batch's step, not just this request.
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidArgument(
                f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature}", param="temperature"
            )
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 disables it), got {self.top_k}", param="top_k")
        if not 0 <= self.min_p <= 1:
            raise InvalidArgument(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidArgument(f"{name} must be in [-2, 2], got {value}", param=name)
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidArgument(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 disables it), got {self.repetition_penalty}",
                param="repetition_penalty",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidArgument(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", param=name)
        if lists:
            self._validate_lists()

    def _validate_lists(self) -> None:
        for token_id, bias in self.logit_bias.items():
            if not _is_int(token_id) or token_id < 0:
                raise InvalidArgument(
                    f"logit_bias: key {token_id!r} is not a token id (an integer >= 0)", param="logit_bias"
                )
            if not _is_number(bias):
                raise InvalidArgument(f"logit_bias[{token_id}] must be a number, got {bias!r}", param="logit_bias")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise InvalidArgument(
                    f"logit_bias[{token_id}] must be in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}], got {bias}",
                    param="logit_bias",
                )
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidArgument(
                    "allowed_token_ids must not be empty (leave it out to allow every token)", param="allowed_token_ids"
                )
            bad = next((t for t in self.allowed_token_ids if not _is_int(t) or t < 0), None)
            if bad is not None:
                raise InvalidArgument(
                    f"allowed_token_ids: {bad!r} is not a token id (an integer >= 0)", param="allowed_token_ids"
                )
        if self.prediction is not None:
            if not isinstance(self.prediction, list):
                raise InvalidArgument(
                    f"prediction must be a list of token ids, got {type(self.prediction).__name__}", param="prediction"
                )
            bad = next((t for t in self.prediction if not _is_int(t) or t < 0), None)
            if bad is not None:
                raise InvalidArgument(f"prediction: {bad!r} is not a token id (an integer >= 0)", param="prediction")
        bad_word = next((w for w in self.bad_words if not isinstance(w, str) or not w.strip()), None)
        if bad_word is not None:
            raise InvalidArgument(f"bad_words: {bad_word!r} is not a non-blank string", param="bad_words")

    def validate_token_ids(self, vocab_size: int) -> None:
        """The token ids a request names must be in the model's vocabulary (known to the engine only)."""
        for param, ids in (("logit_bias", self.logit_bias), ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise InvalidArgument(
                    f"{param}: token id {bad} is outside the vocabulary [0, {vocab_size})", param=param
                )

    @property
    def edits_logits(self) -> bool:
        """Whether the logits processors have work for this request (read every step: keep it cheap)."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words or self.structured_output)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


POOLING_TYPES = ("LAST", "MEAN")


@dataclass(slots=True)
class PoolingParams:
    """A prefill-only request that returns one vector instead of tokens: its prompt's final
    hidden states (after the final norm) pooled by `pooling_type` ("LAST": the last position's,
    vLLM's default for decoder models; "MEAN": the average over every position), unit length
    when `normalize` (vLLM's default for embeddings)."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidArgument(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}",
                param="pooling_type",
            )
        if not isinstance(self.normalize, bool):
            raise InvalidArgument(f"normalize must be True or False, got {self.normalize!r}", param="normalize")

    @property
    def pools_every_position(self) -> bool:
        """MEAN reads every prompt position's hidden state, so none may be skipped through the
        prefix cache; LAST reads only the last, which a sequence always computes."""
        return self.pooling_type == "MEAN"


@dataclass(slots=True)
class PrefixState:
    """The BlockManager's prefix-cache bookkeeping for one sequence. `hashes[i]` is the chained hash
    of full block i of its token_ids: computed once, when the block fills, and valid across
    preemption because token_ids only grow. `num_committed` counts the leading entries of its
    block_table already published to (or taken from) the prefix cache."""

    hashes: list[int] = field(default_factory=list)
    num_committed: int = 0


@dataclass(slots=True)
class SpecDecodeCounters:
    """vLLM's spec-decode families, a scheduler's or one request's: verification entries, draft
    tokens scored, drafts accepted, and acceptance by draft position (position i counts entries
    that accepted more than i)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_position
        if len(per_pos) < num_draft:
            per_pos.extend([0] * (num_draft - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The counters under vLLM's family names (what a response's `usage.spec_decode` carries)."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
        }

    def copy(self) -> SpecDecodeCounters:
        return SpecDecodeCounters(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_position)
        )

    @classmethod
    def merged(cls, counters: list[SpecDecodeCounters]) -> SpecDecodeCounters:
        """Several counters summed, position by position."""
        out = cls()
        for c in counters:
            out.num_drafts += c.num_drafts
            out.num_draft_tokens += c.num_draft_tokens
            out.num_accepted_tokens += c.num_accepted_tokens
            per_pos = out.accepted_per_position
            per_pos.extend([0] * (len(c.accepted_per_position) - len(per_pos)))
            for i, n in enumerate(c.accepted_per_position):
                per_pos[i] += n
        return out

    def stats_fields(self) -> dict[str, Any]:
        """The counters as SchedulerStats' spec_* fields (a copy)."""
        return {f"spec_{name}": value for name, value in self.to_dict().items()}


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's tokens and lifecycle. `token_ids` holds prompt then output.

    `num_computed_tokens` counts the tokens whose KV is in the cache; the scheduler moves it
    forward, and preemption by recompute resets it to 0 (the output so far is kept and is
    recomputed as part of the new "prompt").
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float = 0.0
    priority: int = 0  # lower runs first under the `priority` policy (as in vLLM)
    eos_token_ids: tuple[int, ...] = ()

    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (last admission)
    block_table: list[int] = field(default_factory=list)
    # The block tables of KV groups 1.. (spec/kv_groups.py); empty for a model with one group.
    group_tables: list[list[int]] = field(default_factory=list, repr=False)
    # Tokens a proposer guessed for the next step (speculative decoding); the scheduler verifies
    # as many as the budgets allow, and update() clears them.
    draft_token_ids: list[int] = field(default_factory=list, repr=False)
    # This request's verifications over its life (None until it may draft): what `usage` reports.
    spec_counters: SpecDecodeCounters | None = field(default=None, repr=False)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why the engine ended it with finish reason "error", when it knows
    num_preemptions: int = 0
    kv_booked_blocks: int = 0  # KV blocks an admission that reserves output booked for it while it runs

    # Timestamps (seconds on the caller's clock: wall clock in the engine, virtual in the sim).
    first_scheduled_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finished_s: float | None = None

    # The BlockManager's prefix-cache bookkeeping (see PrefixState).
    prefix: PrefixState = field(default_factory=PrefixState, repr=False)
    # With params.prompt_logprobs: entry j is prompt token j + 1's logprobs, filled chunk by
    # chunk as the prefill runs (the first prompt token has none).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list, repr=False)

    # A pooling request (embeddings): prefill only, no sampling; it finishes when its prompt's
    # last chunk has run, with `pooled` set to its vector.
    pooling: PoolingParams | None = None
    pooled: list[float] | None = field(default=None, repr=False)
    # The executor's running sum of hidden states over the chunks run so far (MEAN pooling):
    # an opaque tensor, reset by a chunk at position 0 (a preempted sequence starts over).
    pooling_sum: Any = field(default=None, repr=False)

    # The scheduler's admission/preemption order key, set by Scheduler.add (see by_order there).
    order_key: tuple = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def first_token_s(self) -> float | None:
        """When the first output token was sampled (every token's time is kept)."""
        return self.token_times_s[0] if self.token_times_s else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions whose logits are still to be scored: such a sequence must not skip
        them through the prefix cache (as vLLM disables reuse for it)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def skips_prefix_cache(self) -> bool:
        """Whether admission must compute every prompt position rather than reuse cached blocks."""
        return self.needs_prompt_logprobs or (self.pooling is not None and self.pooling.pools_every_position)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]


def check_stop(seq: Sequence, token: int, len_cap: int) -> FinishReason | None:
    """Why seq stops after sampling `token`, in vLLM's order: EOS and stop tokens (once
    min_tokens are out), then the length limits: max_tokens, or `len_cap` (the scheduler's
    max_model_len, or a next decode that would need a KV slot past its pool). Sets
    seq.stop_reason for a stop token."""
    params = seq.params
    num_tokens = len(seq.token_ids)
    if num_tokens - seq.num_prompt_tokens >= params.min_tokens:
        if not params.ignore_eos and token in seq.eos_token_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return FinishReason.STOP
    if num_tokens >= min(seq.num_prompt_tokens + params.max_tokens, len_cap):
        return FinishReason.LENGTH
    return None
