"""Scheduler configuration: budgets, KV pool size and policy. Pure Python.

`SchedulerConfig` is the one definition of the scheduler's knobs: the engine's `EngineArgs`, the
simulator's `SimConfig` and the planner's `PlanJob` contain one, and the CLI flags are generated
from its fields (`servelab.commands._scheduler_cli`), so a default or a help line lives here only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from servelab.core.kv_groups import FULL, max_context_tokens
from servelab.errors import InvalidArgument

POLICIES = ("chunked", "prefill-first", "prefill-first-chunked", "decode-first-whole")
ORDERS = ("fcfs", "priority")
ADMISSIONS = ("recompute", "no-evict", "reserve-ratio")


def knob(help: str, **cli: Any) -> dict[str, Any]:
    """Field metadata: the flag's help line (its default is added from the field) and CLI hints:
    `flag` (default --field-name), `choices`, `zero_is_none` (the flag's 0 means None),
    `deprecated_flags` (old spellings kept as aliases)."""
    return {"help": help, **cli}


@dataclass(slots=True)
class SchedulerConfig:
    """What one scheduler may do per step and how much KV cache it owns.

    - `num_blocks` × `block_size` is the KV pool in tokens.
    - `max_num_batched_tokens` bounds the query tokens of one step; `max_num_seqs` bounds the
      sequences running at once (and so the sequences of one step).
    - `policy="chunked"` (vLLM V1 / Sarathi): running sequences first, then waiting prompts in
      chunks that fill the rest of the token budget.
      `policy="prefill-first"` (vLLM V0 default): whole prompts in prefill-only steps before any
      decode, never chunked. A prompt longer than `max_num_batched_tokens` still runs whole, alone,
      in one step: it is the "no chunking" baseline, kept to show the decode stall it causes.
      `policy="prefill-first-chunked"` (SGLang): prefill-only steps while any prompt waits or is
      part-way through, in chunks of the token budget; decodes run in steps of their own.
      `policy="decode-first-whole"` (TensorRT-LLM without chunked context): running sequences
      first, then whole prompts that fit the rest of the token budget in the same step.
    - `admission`: what a waiting prompt needs to start. `recompute` (vLLM): blocks for the chunk
      it runs now; a running sequence short of a block preempts the newest, which recomputes
      later. `no-evict` (TensorRT-LLM's GUARANTEED_NO_EVICT): room for its whole max output too,
      beside every running sequence's, so nothing is ever preempted. `reserve-ratio` (SGLang):
      room for its max output while keeping a decaying fraction of the running sequences'
      remaining output free (see `admission.KVReservation`).
    - `order`: `fcfs` admits in arrival order; `priority` admits by (priority, arrival), lower
      priority value first, and preempts the lowest-priority running sequence first.
    - `max_waiting`: bound of the waiting queue (None = unbounded); a full queue rejects new
      requests with QueueFull. Preempted requests always go back to the queue, even past it.
    - A request must satisfy prompt + max_tokens <= `max_model_len` and prompt <= the KV pool;
      one whose output outgrows the pool stops with LENGTH when its next token has no slot.
    - `num_blocks` and `max_model_len` may be None while the config is a user's request: the
      owner (the engine from its KV memory and model, the simulator from its memory plan) fills
      them in with `resolve`, which returns the `ResolvedSchedulerConfig` a `Scheduler` runs on.
    """

    num_blocks: int | None = field(
        default=None,
        metadata=knob("KV blocks in the pool (pages of a KV group's layers for a model with sliding-window layers)"),
    )
    block_size: int = field(default=16, metadata=knob("tokens per KV block"))
    max_num_batched_tokens: int = field(default=2048, metadata=knob("token budget of one step"))
    max_num_seqs: int = field(default=256, metadata=knob("most sequences running at once"))
    max_model_len: int | None = field(default=None, metadata=knob("longest prompt + completion in tokens"))
    max_waiting: int | None = field(
        default=None,
        metadata=knob("bound on the waiting queue (behind data-parallel or disaggregated workers: the cluster's "
                      "waiting requests, all workers together); beyond it requests are refused (503 + Retry-After)",
                      flag="--max-waiting-requests", zero_is_none=True),
    )  # fmt: skip
    policy: str = field(
        default="chunked",
        metadata=knob("scheduling policy: chunked (decodes first, then prompt chunks), prefill-first (whole "
                      "prompts in steps of their own), prefill-first-chunked (prompt chunks in steps of their "
                      "own) or decode-first-whole (decodes first, then whole prompts)",
                      choices=POLICIES, deprecated_flags=("--scheduler",)),
    )  # fmt: skip
    admission: str = field(
        default="recompute",
        metadata=knob("admission: recompute (admit on the blocks a chunk needs; preempt when short), no-evict "
                      "(reserve each request's whole max output) or reserve-ratio (reserve a decaying share of "
                      "the running requests' output)", choices=ADMISSIONS),
    )  # fmt: skip
    order: str = field(
        default="fcfs",
        metadata=knob("waiting-queue order: fcfs, or priority (honours the request's 'priority' field)",
                      choices=ORDERS),
    )  # fmt: skip
    enable_prefix_caching: bool = field(
        default=True, metadata=knob("disable the prefix cache", flag="--no-prefix-caching")
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Checks every knob; `num_blocks` and `max_model_len` may still be None (unsized)."""
        for name in ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if value is None and name in UNSIZED:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name} must be an integer >= 1, got {value!r}", param=name)
        if self.max_waiting is not None and (
            isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) or self.max_waiting < 1
        ):
            raise InvalidArgument(
                f"max_waiting must be an integer >= 1 or None (unbounded), got {self.max_waiting!r}",
                param="max_waiting",
            )
        if self.policy not in POLICIES:
            raise InvalidArgument(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}", param="policy")
        if self.admission not in ADMISSIONS:
            raise InvalidArgument(
                f"admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}", param="admission"
            )
        if self.order not in ORDERS:
            raise InvalidArgument(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}", param="order")

    def resolve(
        self,
        *,
        num_blocks: int | None = None,
        max_model_len: int | None = None,
        kv_group_windows: tuple[int | None, ...] | None = None,
    ) -> ResolvedSchedulerConfig:
        """This config with the pool size and context limit the owner derived (by default the ones
        already set), and the windows of the model's KV groups, as the type a Scheduler runs on.
        InvalidArgument names one still unset."""
        if isinstance(self, ResolvedSchedulerConfig) and num_blocks is max_model_len is kv_group_windows is None:
            return self
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if num_blocks is not None:
            values["num_blocks"] = num_blocks
        if max_model_len is not None:
            values["max_model_len"] = max_model_len
        if kv_group_windows is not None:
            values["kv_group_windows"] = kv_group_windows
        return ResolvedSchedulerConfig(**values)

    def budget_running(self, prompt_tokens: float, output_tokens: float) -> int:
        """The most sequences the token budget keeps running under a steady stream of requests of
        these mean lengths (`prompt_tokens`: the ones computed, past prefix-cache hits), so that
        clients beyond it wait for admission. A request costs prompt + D step tokens over its
        D = output - 1 decode steps (a speculative step scores at least as many tokens as it
        keeps, so its requests cost no less and run no more).
        - Chunked: requests finish at L = budget / that cost a step, and by Little's law L x D
          decode at once beside at most L + 1 prompts in prefill (L whole ones and a chunk of the
          next).
        - Decode-first-whole: k = budget // that cost whole prompts join a step beside the decodes
          of k x D requests, so k x output run; under one a step, a prompt joins whenever the
          decodes leave room for it, at most budget - prompt of them.
        - Prefill-first policies run prompts in steps of their own: one decode step's batch is
          the bound, the budget."""
        budget = self.max_num_batched_tokens
        if self.policy in ("prefill-first", "prefill-first-chunked"):
            return budget
        decodes = max(0.0, output_tokens - 1.0)
        cost = max(1.0, prompt_tokens + decodes)
        if self.policy == "decode-first-whole":
            whole = math.floor(budget / cost)
            if whole >= 1 or not decodes:
                return max(1, math.ceil(whole * (decodes + 1.0)))
            return max(1, math.ceil(max(0.0, budget - prompt_tokens) * (decodes + 1.0) / decodes))
        return math.ceil(budget / cost * (decodes + 1.0) + 1.0)

    @property
    def chunk_tokens(self) -> int | None:
        """The most positions one step computes of a sequence: a chunk, or None (a whole
        context) where the policy runs whole prompts."""
        return None if self.policy in ("prefill-first", "decode-first-whole") else self.max_num_batched_tokens


UNSIZED = ("num_blocks", "max_model_len")  # the knobs the owner sizes: None until resolved


@dataclass(slots=True, kw_only=True)
class ResolvedSchedulerConfig(SchedulerConfig):
    """A SchedulerConfig whose KV pool size and context limit are known: what a Scheduler runs on.
    Made by `SchedulerConfig.resolve`."""

    num_blocks: int
    max_model_len: int
    # The window of each KV group the model's layers share the pool's pages in (spec/kv_groups.py;
    # None: full attention); one full group: a block holds every layer.
    kv_group_windows: tuple[int | None, ...] = FULL

    def __post_init__(self) -> None:
        for name in UNSIZED:
            if getattr(self, name) is None:
                raise InvalidArgument(
                    f"{name} is unset: the engine or the simulator sizes it (SchedulerConfig.resolve) "
                    f"before a scheduler starts", param=name,
                )  # fmt: skip
        self.validate()

    @property
    def kv_capacity_tokens(self) -> int:
        """The longest prompt the pool holds: a prompt's one step writes every group's pages."""
        return self.num_blocks // len(self.kv_group_windows) * self.block_size

    @property
    def kv_context_tokens(self) -> int | None:
        """The longest sequence the pool holds on its own (None: no length is too long: every
        layer attends over a window)."""
        return max_context_tokens(self.kv_group_windows, self.num_blocks, self.block_size, self.chunk_tokens)
