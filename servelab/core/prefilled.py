"""Sequences prefilled by another worker (a disaggregated decode pool): the blocks they reserve
here while their KV is on its way, and how they join the running set once it has arrived.

A mixin of `Scheduler`, kept apart so the scheduler file holds the step loop itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servelab.core.admission import KVReservation, WaitingQueue, check_prefilled
from servelab.core.block_manager import BlockManager
from servelab.core.config import ResolvedSchedulerConfig
from servelab.core.sequence import Sequence, SequenceStatus

_RUNNING = SequenceStatus.RUNNING


class PrefilledSequences:
    # What it uses of the Scheduler it is mixed into.
    config: ResolvedSchedulerConfig
    block_manager: BlockManager
    waiting: WaitingQueue
    running: list[Sequence]
    _live: dict[str, Sequence]
    _reservation: KVReservation | None
    _num_reserved: int

    if TYPE_CHECKING:

        def _check_id_free(self, request_id: str) -> None: ...
        def length_limit(self, seq: Sequence) -> int: ...
        def _start_running(self, seq: Sequence) -> None: ...
        def _release(self, seq: Sequence) -> None: ...

    @property
    def num_reserved(self) -> int:
        """Sequences prefilled elsewhere that hold blocks here while their KV arrives."""
        return self._num_reserved

    def reserve_prefilled(self, seq: Sequence, now: float) -> bool:
        """Blocks for a sequence prefilled by another worker (its token_ids: prompt + the first
        token), before its KV arrives: this pool's cached prefix where it has one, fresh blocks
        for the rest of the prompt. False, changing nothing, while the pool or the sequence
        budget is short; the caller retries later (back-pressure, nothing dropped)."""
        self._check_id_free(seq.request_id)
        check_prefilled(seq, self.config)
        if len(self.running) + self._num_reserved >= self.config.max_num_seqs:
            return False
        bm = self.block_manager
        res = self._reservation
        booking = 0 if res is None else res.booking(seq, self.length_limit(seq))
        if res is not None and not res.admits(booking, bm):
            return False
        hits = bm.find_cached_prefix(seq)
        if not bm.reserve(seq, hits, seq.num_prompt_tokens):
            return False
        if res is not None:
            res.book(seq, booking)
        self._num_reserved += 1
        seq.arrival_s = seq.arrival_s or now
        seq.num_cached_tokens = len(hits) * self.config.block_size
        return True

    def start_prefilled(self, seq: Sequence, now: float) -> None:
        """A reserved sequence whose KV has been written joins the running set: its prompt counts
        as computed and its next step decodes its first token, as if it had been prefilled here."""
        self._num_reserved -= 1
        seq.order_key = self.waiting.order_key(seq)
        seq.status = _RUNNING
        seq.num_computed_tokens = seq.num_prompt_tokens
        if seq.first_scheduled_s is None:
            seq.first_scheduled_s = now
        self._live[seq.request_id] = seq
        self._start_running(seq)

    def cancel_reserved(self, seq: Sequence) -> None:
        """A reservation whose KV never arrived (a failed transfer, an abort): its blocks go back."""
        self._num_reserved -= 1
        self._release(seq)
        self.block_manager.free(seq)
