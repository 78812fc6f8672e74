"""Scheduler configuration: budgets, KV pool size and policy. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from servelab.errors import InvalidArgument

POLICIES = ("chunked", "prefill-first")
ORDERS = ("fcfs", "priority")


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
    - `order`: `fcfs` admits in arrival order; `priority` admits by (priority, arrival), lower
      priority value first, and preempts the lowest-priority running sequence first.
    - `max_waiting`: bound of the waiting queue (None = unbounded); a full queue rejects new
      requests with QueueFull. Preempted requests always go back to the queue, even past it.
    - A request must satisfy prompt + max_tokens <= `max_model_len` and prompt <= the KV pool;
      one whose output outgrows the pool stops with LENGTH when its next token has no slot.
    """

    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    max_waiting: int | None = None
    policy: str = "chunked"
    order: str = "fcfs"
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
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
            raise InvalidArgument(
                f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}", param="policy"
            )
        if self.order not in ORDERS:
            raise InvalidArgument(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}", param="order")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size
