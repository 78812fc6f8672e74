"""Admission: whether a request may wait for a scheduler, and the order in which waiting
sequences are admitted. Pure Python.

A request is refused up front, changing nothing, when it could never run (a prompt that with its
max_tokens passes max_model_len, or that outgrows the whole KV pool) or when the waiting queue
is full. One heap keyed by `Sequence.order_key` serves both orders. `fcfs` keys on an admission counter
alone, so a preempted sequence (older than everything still waiting) comes out first again;
`priority` keys on (priority, arrival, counter), the lowest priority value first. The same keys
order the scheduler's running list, whose tail is preempted first.

`KVReservation` is the admission of the engines that keep KV room for what running requests will
still write (TensorRT-LLM's GUARANTEED_NO_EVICT, SGLang's new-token ratio) instead of admitting on
the blocks a prompt needs now and preempting when the pool runs short (vLLM).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from operator import itemgetter

from servelab.core.block_manager import BlockManager
from servelab.core.kv_groups import FULL, pages_for
from servelab.core.config import ResolvedSchedulerConfig
from servelab.core.sequence import Sequence, SequenceStatus
from servelab.errors import InvalidArgument, QueueFull, RequestTooLong

_WAITING = SequenceStatus.WAITING


def check_new(seq: Sequence, cfg: ResolvedSchedulerConfig) -> None:
    """Raise, naming why, unless seq is a fresh sequence that fits max_model_len and the KV pool."""
    rid = seq.request_id
    if seq.status is not _WAITING or seq.num_computed_tokens or seq.block_table or seq.num_output_tokens:
        raise InvalidArgument(f"request {rid!r} is not a fresh sequence (status {seq.status.value})")
    num_prompt = seq.num_prompt_tokens
    if num_prompt < 1:
        raise InvalidArgument(f"request {rid!r}: the prompt must hold at least 1 token", param="prompt")
    max_tokens = 0 if seq.pooling is not None else seq.params.max_tokens  # pooling: prefill only
    if num_prompt + max_tokens > cfg.max_model_len:
        raise RequestTooLong(
            f"request {rid!r}: prompt of {num_prompt} tokens + max_tokens {max_tokens} = "
            f"{num_prompt + max_tokens} exceeds max_model_len {cfg.max_model_len}",
            param="max_tokens",
        )
    if num_prompt > cfg.kv_capacity_tokens:
        raise RequestTooLong(
            f"request {rid!r}: prompt of {num_prompt} tokens can never fit the KV cache pool of "
            f"{cfg.kv_capacity_tokens} tokens ({cfg.num_blocks} blocks x {cfg.block_size}"
            f"{_groups_note(len(cfg.kv_group_windows))})",
            param="prompt",
        )
    if cfg.policy == "decode-first-whole" and num_prompt > cfg.max_num_batched_tokens:
        raise RequestTooLong(
            whole_prompt_too_long(f"request {rid!r}", num_prompt, cfg.max_num_batched_tokens), param="prompt"
        )


def _groups_note(num_groups: int) -> str:
    return f", shared by {num_groups} KV groups" if num_groups > 1 else ""


def check_prefilled(seq: Sequence, cfg: ResolvedSchedulerConfig) -> None:
    """Raise, naming why, unless seq was prefilled elsewhere (its prompt and first token, no
    blocks) and fits this scheduler's max_model_len and KV pool."""
    rid = seq.request_id
    if seq.block_table or seq.num_output_tokens != 1:
        raise InvalidArgument(f"request {rid!r} is not a prefilled sequence (prompt + one token, no blocks)")
    num_prompt, max_tokens = seq.num_prompt_tokens, seq.params.max_tokens
    if num_prompt + max_tokens > cfg.max_model_len or num_prompt >= cfg.kv_capacity_tokens:
        raise RequestTooLong(
            f"request {rid!r}: prompt of {num_prompt} tokens + max_tokens {max_tokens} does not fit "
            f"this worker's max_model_len {cfg.max_model_len} or KV pool of {cfg.kv_capacity_tokens} tokens",
            param="max_tokens",
        )


def whole_prompt_too_long(what: str, num_prompt: int, budget: int) -> str:
    """Why policy decode-first-whole refuses a prompt: it would never share a step with decodes."""
    return (
        f"{what}: prompt of {num_prompt} tokens exceeds max_num_batched_tokens {budget}, and policy "
        f"decode-first-whole runs prompts whole (TensorRT-LLM without chunked context refuses it too); "
        f"raise the token budget or choose a chunked policy"
    )


class WaitingQueue:
    """Sequences waiting to run, in order. One that finishes while it waits (an abort) leaves the
    count at once and the heap when it reaches the head; `len()` counts the live ones."""

    __slots__ = ("_by_priority", "_counter", "_heap", "_num", "max_waiting")

    def __init__(self, order: str, max_waiting: int | None) -> None:
        self._by_priority = order == "priority"
        self._counter = itertools.count()
        self._heap: list[tuple[tuple, Sequence]] = []
        self._num = 0
        self.max_waiting = max_waiting  # None: unbounded

    def __len__(self) -> int:
        return self._num

    def __iter__(self) -> Iterator[Sequence]:
        """The live waiting sequences in the order they would be admitted (for inspection: it sorts)."""
        return (seq for _, seq in sorted(self._heap, key=itemgetter(0)) if seq.status is _WAITING)

    def order_key(self, seq: Sequence) -> tuple:
        """seq's place in the order, behind every key given before it among equals."""
        counter = next(self._counter)
        return (seq.priority, seq.arrival_s, counter) if self._by_priority else (counter,)

    def check_room(self, request_id: str) -> None:
        """QueueFull if a new request would go past max_waiting (a preempted one never does)."""
        if self.max_waiting is not None and self._num >= self.max_waiting:
            raise waiting_queue_full(request_id, self.max_waiting)

    def push(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.order_key, seq))
        self._num += 1

    def peek(self) -> Sequence | None:
        """The next sequence to admit, or None."""
        heap = self._heap
        while heap:
            seq = heap[0][1]
            if seq.status is _WAITING:
                return seq
            heapq.heappop(heap)  # finished (aborted) while waiting
        return None

    def pop(self) -> Sequence:
        """Take the sequence peek() returned."""
        self._num -= 1
        return heapq.heappop(self._heap)[1]

    def remove(self, seq: Sequence) -> None:
        """seq, waiting, finishes: it leaves the count now, and the heap lazily once its status
        is no longer WAITING."""
        self._num -= 1


def check_room_to_wait(request_ids: list[str], num_waiting: int, max_waiting: int | None) -> None:
    """One client request's sequences (its prompts x n) are admitted all or none: refused up
    front, before any is queued, when the waiting queue has no room for all of them (QueueFull,
    503: retry later), or could never have (InvalidArgument, 400: a retry cannot help)."""
    if max_waiting is None:
        return
    if len(request_ids) > max_waiting:
        raise InvalidArgument(
            f"the request makes {len(request_ids)} sequences (its prompts times n), more than the waiting queue "
            f"holds (max_waiting={max_waiting}, the server's --max-waiting-requests), so it could never be admitted; "
            f"send fewer prompts or a smaller n",
            param="n",
        )
    if num_waiting + len(request_ids) > max_waiting:
        raise waiting_queue_full(request_ids[0], max_waiting)


def waiting_queue_full(request_id: str, max_waiting: int) -> QueueFull:
    """The error of a request refused by a full waiting queue (one engine's, or a cluster's)."""
    return QueueFull(
        f"request {request_id!r} rejected: the waiting queue is full (max_waiting={max_waiting}); retry later",
        param="max_waiting",
    )


# SGLang's reservation defaults (python/sglang/srt/environ.py: SGLANG_INIT_NEW_TOKEN_RATIO,
# SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR, SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS,
# SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION), with --schedule-conservativeness 1.0.
SGLANG_INIT_NEW_TOKEN_RATIO = 0.7
SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS = 600
SGLANG_CLIP_MAX_NEW_TOKENS = 4096


class KVReservation:
    """Admission that keeps KV blocks free for the output running sequences will still write.

    Each admitted sequence books the blocks it will hold at its end: its tokens so far plus its
    remaining max output (clipped to `clip_tokens` where the engine clips its estimate). A waiting
    sequence is admitted only if, after setting aside `ratio` x the blocks the running sequences
    have booked but not yet taken, the free blocks cover its whole booking.

    - `no-evict` (TensorRT-LLM GUARANTEED_NO_EVICT): ratio 1, no clip. The bookings never exceed
      the pool, so a running sequence always finds its next block and nothing is preempted.
    - `reserve-ratio` (SGLang's PrefillAdder): the ratio starts at 0.7, falls linearly to
      0.7 x 0.14 over 600 decode steps, and goes back to 0.7 when a step preempts (SGLang
      re-estimates it from the retracted requests) or nothing runs; estimates are clipped at 4,096
      tokens. Admission is optimistic, so a decode can still run short and preempt.
    """

    __slots__ = ("_block_size", "_booked", "_chunk", "_clip", "_decay", "_groups", "_init", "_min", "ratio")

    def __init__(
        self,
        admission: str,
        block_size: int,
        group_windows: tuple[int | None, ...] = FULL,
        chunk_tokens: int | None = None,
    ) -> None:
        self._block_size = block_size
        # a windowed model books pages: a windowed group's are bounded by its window
        self._groups = None if group_windows == FULL else group_windows
        self._chunk = chunk_tokens
        self._booked = 0  # blocks booked by running (and reserved) sequences, all of them
        if admission == "no-evict":
            self._init = self._min = 1.0
            self._decay = 0.0
            self._clip: int | None = None
        elif admission == "reserve-ratio":
            self._init = SGLANG_INIT_NEW_TOKEN_RATIO
            self._min = SGLANG_INIT_NEW_TOKEN_RATIO * SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
            self._decay = (self._init - self._min) / SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
            self._clip = SGLANG_CLIP_MAX_NEW_TOKENS
        else:
            raise ValueError(f"no KV reservation for admission {admission!r}")
        self.ratio = self._init

    @property
    def booked_blocks(self) -> int:
        return self._booked

    def booking(self, seq: Sequence, length_limit: int) -> int:
        """Blocks seq holds at its end as admission counts them: its known tokens and its remaining
        output up to `length_limit`, less the last token, which is sampled but never written."""
        known = len(seq.token_ids)
        rest = length_limit - known
        if self._clip is not None and rest > self._clip:
            rest = self._clip
        num_tokens = max(known, known + rest - 1)
        if self._groups is not None:
            return pages_for(self._groups, num_tokens, self._block_size, self._chunk or num_tokens)
        return -(-num_tokens // self._block_size)

    def admits(self, booking: int, block_manager: BlockManager) -> bool:
        """Whether a sequence booking this many blocks fits beside the running ones' bookings."""
        not_yet_taken = self._booked - block_manager.num_used_blocks
        held_back = self.ratio * not_yet_taken if not_yet_taken > 0 else 0.0
        return block_manager.num_free_blocks - held_back >= booking

    def book(self, seq: Sequence, booking: int) -> None:
        seq.kv_booked_blocks = booking
        self._booked += booking

    def release(self, seq: Sequence) -> None:
        """seq stops running (it finished or was preempted): its booking is void."""
        self._booked -= seq.kv_booked_blocks
        seq.kv_booked_blocks = 0

    def after_step(self, *, preempted: bool, idle: bool) -> None:
        """A decode step ran (or the scheduler went idle): the ratio decays, or resets."""
        self.ratio = self._init if preempted or idle else max(self.ratio - self._decay, self._min)
