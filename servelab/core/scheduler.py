"""Continuous batching: which sequences run each step, and how many tokens each processes.

`schedule(now)` builds a StepPlan under the token budget, the sequence budget and the KV pool;
an executor runs it; `update(plan, result, now)` appends the sampled tokens, applies the stop
conditions, frees what finished and returns the events a streaming server needs.

Policies (`SchedulerConfig.policy`, whose docstring defines them): `chunked` mixes running
decodes and prompt chunks in one step; `prefill-first` and `prefill-first-chunked` give prompts
steps of their own, whole or in chunks; `decode-first-whole` adds whole prompts after the decodes.

Preemption is by recompute: when a running sequence needs a block and none is free, the newest
running sequence (lowest priority under `priority`) loses its blocks and goes back to the front
of the waiting queue; its prompt plus the tokens generated so far are prefilled again later,
cheaply when its blocks are still in the prefix cache.

Admission (the checks a new request passes, the waiting queue's order and bound, the KV
reservation of `no-evict` and `reserve-ratio`) is in `admission.py`; sequences prefilled by
another worker join through `prefilled.py`; decodes carrying speculative drafts are verified
through `speculative.py`. The simulator runs a subclass (`sim/implicit_decodes.py`) that takes
steady decodes out of the per-step loops through the methods marked "hook", and decides exactly
what this class decides.
"""

from __future__ import annotations

from bisect import insort
from collections import OrderedDict
from itertools import repeat
from operator import attrgetter

from servelab.core.block_manager import BlockManager
from servelab.core.config import SchedulerConfig
from servelab.core.prefilled import PrefilledSequences
from servelab.core.plan import RequestOutput, ScheduledSeq, StepPlan, StepResult, TokenLogprobs
from servelab.core.sequence import FinishReason, Sequence, SequenceStatus, SpecDecodeCounters, check_stop
from servelab.core.admission import KVReservation, WaitingQueue, check_new
from servelab.core.scheduler_stats import SchedulerStats
from servelab.core.speculative import VerifiedDecodes
from servelab.errors import InvalidArgument, NotFound

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING
_FINISHED = SequenceStatus.FINISHED
# `running` is ordered by Sequence.order_key, as the waiting queue is. An attrgetter keeps
# insort's key in C.
by_order = attrgetter("order_key")


class Scheduler(PrefilledSequences, VerifiedDecodes):
    def __init__(self, config: SchedulerConfig, *, keep_finished: int = 1024) -> None:
        self.config = config = config.resolve()  # InvalidArgument while the pool or context is unsized
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, config.kv_group_windows
        )
        self._frees_window = bool(self.block_manager.windowed)
        self._mixed = config.policy in ("chunked", "decode-first-whole")  # decodes and prompts share a step
        self._whole = config.policy in ("prefill-first", "decode-first-whole")  # prompts never chunked
        self._partial: Sequence | None = None  # prefill-first-chunked: the prompt part-way through
        self._reservation = (
            KVReservation(config.admission, config.block_size, config.kv_group_windows, config.chunk_tokens)
            if config.admission != "recompute"
            else None
        )
        self.waiting = WaitingQueue(config.order, config.max_waiting)
        self.running: list[Sequence] = []  # sorted by order_key: the tail is preempted first
        self._live: dict[str, Sequence] = {}
        self._recent_finished: OrderedDict[str, Sequence] = OrderedDict()
        self._keep_finished = keep_finished
        self.num_preemptions = 0
        self.num_finished = 0
        self.spec_counters = SpecDecodeCounters()
        self._num_reserved = 0  # sequences holding blocks for KV on its way (reserve_prefilled)
        context = config.kv_context_tokens  # see length_limit
        self._len_cap = config.max_model_len if context is None else min(config.max_model_len, context + 1)

    # ---- introspection -------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def get(self, request_id: str) -> Sequence | None:
        """A live request, or one of the last `keep_finished` finished ones; None if unknown."""
        seq = self._live.get(request_id)
        return seq if seq is not None else self._recent_finished.get(request_id)

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks,
            num_used_blocks=bm.num_used_blocks,
            num_cached_blocks=bm.num_cached_blocks,
            prefix_cache_hits=bm.prefix_cache_hits,
            prefix_cache_queries=bm.prefix_cache_queries,
            num_preemptions=self.num_preemptions,
            num_finished=self.num_finished,
            **self.spec_counters.stats_fields(),
        )

    # ---- admission -----------------------------------------------------------------------------

    def add(self, seq: Sequence, now: float | None = None) -> None:
        """Queue a new request, or raise (changing nothing) if it can never run or the queue is full.

        `arrival_s` is set to `now` when it still holds the default 0.0, so a caller that stamped
        the true arrival time (the simulator) keeps it.
        """
        rid = seq.request_id
        self._check_id_free(rid)
        check_new(seq, self.config)
        self.waiting.check_room(rid)
        if now is not None and seq.arrival_s == 0.0:
            seq.arrival_s = now
        seq.order_key = self.waiting.order_key(seq)
        self._live[rid] = seq
        self.waiting.push(seq)

    def _check_id_free(self, request_id: str) -> None:
        if request_id in self._live or request_id in self._recent_finished:
            raise InvalidArgument(f"request id {request_id!r} is already in use", param="request_id")

    # ---- scheduling ----------------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan:
        """The next step. Call update() with its result before scheduling again."""
        budget = self.config.max_num_batched_tokens
        plan = self._new_plan()
        if not self._mixed and (self.waiting or self._partial) and self._prefill_step(plan, budget, now):
            return plan
        budget = self._schedule_running(plan, budget)
        plan.num_batched_tokens = self.config.max_num_batched_tokens - budget
        # As vLLM: a step that had to preempt admits nobody new; the pool is already short.
        if self._mixed and not plan.preempted and self.waiting:
            self._schedule_waiting(plan, budget, now, whole=self._whole)
        if self._reservation is not None:
            self._reservation.after_step(preempted=bool(plan.preempted), idle=not self.running)
        return plan

    def _prefill_step(self, plan: StepPlan, budget: int, now: float) -> bool:
        """A prefill-only step (prefill-first policies): the prompt part-way through its chunks
        continues, then waiting prompts are admitted. False if no prompt could run."""
        seq = self._partial
        if seq is not None:
            entry = self._next_chunk(seq, budget, plan.preempted)
            if entry is not None:
                if seq.pooling is not None:
                    plan.pooled.append(len(plan.scheduled))
                plan.scheduled.append(entry)
                plan.num_batched_tokens += entry.num_tokens
                budget -= entry.num_tokens
                if entry.start_pos + entry.num_tokens == len(seq.token_ids):
                    self._partial = None
        if budget > 0 and not plan.preempted and self.waiting:
            self._schedule_waiting(plan, budget, now, whole=self._whole)
        return bool(plan.scheduled)

    def _new_plan(self) -> StepPlan:
        """An empty plan (hook: the simulator's plan also carries its implicit decodes)."""
        return StepPlan(block_size=self.config.block_size)

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        """Running sequences, in order, while the token budget lasts; returns what is left of it.
        (Hook: the simulator visits only the sequences that need attention.)"""
        append = plan.scheduled.append
        # len(running) <= max_num_seqs always (admission keeps it), so only the token budget binds.
        # Popping victims off the tail while iterating is safe: the iterator stops earlier.
        for seq in self.running:
            if budget <= 0:
                break
            entry = self._next_chunk(seq, budget, plan.preempted)
            if entry is None:
                break  # seq itself was the newest left and was preempted: nothing more runs
            if seq.pooling is not None:
                plan.pooled.append(len(plan.scheduled))
            append(entry)
            budget -= entry.num_tokens
        return budget

    def _next_chunk(self, seq: Sequence, budget: int, preempted: list[Sequence]) -> ScheduledSeq | None:
        """A running sequence's next chunk within `budget` (a decode is one token), its KV slots
        reserved, preempting from the tail of `running` if the pool is short. None if seq itself
        had to go."""
        start = seq.num_computed_tokens
        num_known = len(seq.token_ids)
        n = num_known - start
        if n > budget:  # noqa: PLR1730 -- a compare is cheaper than min() on this hot path
            n = budget
        k = self._num_drafts(seq, budget) if n == 1 and seq.draft_token_ids else 0
        end = start + n
        # A decode needs a new block only when its last one is full (every block_size steps).
        if (
            end > len(seq.block_table) * self.config.block_size
            and not self.block_manager.append_slots(seq, end)
            and not self._preempt_until_fits(seq, end, preempted)
        ):
            return None
        return ScheduledSeq(seq, n + k, start, end == num_known and seq.pooling is None, k)

    def _schedule_waiting(self, plan: StepPlan, budget: int, now: float, *, whole: bool) -> bool:
        """Admit waiting sequences in order while budgets and blocks allow. `whole`: whole prompts
        only (the first may exceed the token budget), else chunks of the remaining budget."""
        cfg = self.config
        bm = self.block_manager
        res = self._reservation
        waiting = self.waiting
        scheduled = plan.scheduled
        max_seqs = cfg.max_num_seqs
        admitted = False
        while budget > 0 and len(self.running) < max_seqs and len(scheduled) < max_seqs:
            seq = waiting.peek()
            if seq is None:
                break
            hits = [] if seq.skips_prefix_cache else bm.find_cached_prefix(seq)
            num_cached = len(hits) * cfg.block_size
            n = len(seq.token_ids) - num_cached
            if whole:
                if plan.num_batched_tokens and n > budget:  # only a step's first prompt may pass it
                    break
            elif n > budget:
                n = budget
            if res is not None:
                booking = res.booking(seq, self.length_limit(seq))
                if not res.admits(booking, bm):
                    break
            if not bm.allocate(seq, hits, num_cached + n):
                break  # head-of-line blocking keeps the order: nobody overtakes it
            waiting.pop()
            if res is not None:
                res.book(seq, booking)
            if not self._mixed and num_cached + n < len(seq.token_ids):
                self._partial = seq
            seq.status = _RUNNING
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = now
            self._start_running(seq)
            if seq.pooling is not None:
                plan.pooled.append(len(scheduled))
            scheduled.append(
                ScheduledSeq(seq, n, num_cached, num_cached + n == len(seq.token_ids) and seq.pooling is None)
            )
            plan.num_batched_tokens += n
            budget -= n
            admitted = True
        return admitted

    def _start_running(self, seq: Sequence) -> None:
        """An admitted sequence joins `running` at its place in the order (hook)."""
        insort(self.running, seq, key=by_order)

    def _leave_running(self, seq: Sequence) -> None:
        """A running sequence is preempted or finishes; the caller takes it out of `running` (hook)."""

    def _preempt_until_fits(self, seq: Sequence, num_tokens: int, preempted: list[Sequence]) -> bool:
        """Preempt from the tail of `running` until seq's table covers num_tokens positions.
        False if seq itself had to go."""
        running = self.running
        while True:
            victim = running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
            if self.block_manager.append_slots(seq, num_tokens):
                return True

    def _preempt(self, seq: Sequence) -> None:
        self._leave_running(seq)
        self._release(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = _WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(seq)

    def _release(self, seq: Sequence) -> None:
        """seq stops running: its KV booking (if admission booked one) and its partial prefill end."""
        if self._reservation is not None:
            self._reservation.release(seq)
        if seq is self._partial:
            self._partial = None

    # ---- results -------------------------------------------------------------------------------

    def update(
        self, plan: StepPlan, result: StepResult, now: float, *, finished_only: bool = False
    ) -> list[RequestOutput]:
        """Apply an executed step: advance computed tokens, append sampled tokens, stop, free.

        Returns one RequestOutput per request that gained a token or finished this step, or with
        `finished_only` (the simulator, which streams nothing) only those that finished: building
        an output per token is a large share of a decode step's cost in pure Python.
        """
        scheduled = plan.scheduled
        sampled = result.sampled_token_ids
        if len(sampled) != len(scheduled):
            raise ValueError(f"StepResult has {len(sampled)} sampled tokens for a plan of {len(scheduled)} sequences")
        if result.prompt_logprobs:
            for i, scored in result.prompt_logprobs:
                scheduled[i].seq.prompt_logprobs.extend(scored)
        if result.pooled:
            for i, vector in result.pooled:
                scheduled[i].seq.pooled = vector
        outputs: list[RequestOutput] = []
        finished: list[Sequence] = []
        self._take_accepted(plan, result)  # speculative decoding's verification entries, if any
        self._apply(plan, result, now, outputs, finished, stream=not finished_only)
        # Usually one or two of ~100 finish in a step: list.remove (a C scan by identity, order
        # kept) is cheaper than rebuilding the list in Python.
        for seq in finished:
            self.running.remove(seq)
        return outputs

    def _apply(
        self,
        plan: StepPlan,
        result: StepResult,
        now: float,
        outputs: list[RequestOutput],
        finished: list[Sequence],
        *,
        stream: bool,
    ) -> None:
        """Every entry's result, in plan order (hook: the simulator adds its implicit decodes)."""
        logprobs = result.logprobs if result.logprobs is not None else repeat(None)
        apply_entry = self._apply_entry
        for entry, token, lp in zip(plan.scheduled, result.sampled_token_ids, logprobs):
            apply_entry(entry, token, lp, now, outputs, finished, stream)

    def _apply_entry(
        self,
        entry: ScheduledSeq,
        token: int | None,
        lp: TokenLogprobs | None,
        now: float,
        outputs: list[RequestOutput],
        finished: list[Sequence],
        stream: bool,
    ) -> bool:
        """One entry's result. True if its sequence gained a token and runs on."""
        seq = entry.seq
        if seq.status is not _RUNNING:
            return False  # aborted or finished by the engine while the step ran
        if entry.num_draft:
            return self._apply_verified(entry, token, lp, now, outputs, finished, stream)
        seq.num_computed_tokens = computed = entry.start_pos + entry.num_tokens
        if computed >= (seq.prefix.num_committed + 1) * self.config.block_size:  # a block filled: publish it
            self.block_manager.commit_computed_blocks(seq)
        if self._frees_window:
            self.block_manager.free_out_of_window(seq)
        if not entry.samples:
            if seq.pooling is not None and computed == seq.num_prompt_tokens:
                self._finish_pooled(seq, now, outputs, finished)
            return False
        if token is None:
            self._finish(seq, FinishReason.ERROR, now)
            finished.append(seq)
            outputs.append(RequestOutput(seq.request_id, [], True, FinishReason.ERROR, seq))
            return False
        token_ids = seq.token_ids
        token_ids.append(token)
        seq.token_times_s.append(now)  # every token's time: the simulator's ITL needs them
        reason = check_stop(seq, token, self._len_cap)
        if reason is not None:
            self._finish(seq, reason, now)
            finished.append(seq)
            outputs.append(RequestOutput(seq.request_id, [token], True, reason, seq, None if lp is None else [lp]))
            return False
        if stream:
            outputs.append(RequestOutput(seq.request_id, [token], False, None, seq, None if lp is None else [lp]))
        return True

    def _finish_pooled(self, seq: Sequence, now: float, outputs: list[RequestOutput], finished: list[Sequence]) -> None:
        """A pooling sequence whose prompt has run: done, its blocks freed (kept in the prefix
        cache). No vector from the executor (one that does not pool, as the simulator's) is an error."""
        reason = FinishReason.STOP if seq.pooled is not None else FinishReason.ERROR
        if seq.pooled is None and seq.error is None:
            seq.error = "the executor returned no pooled output for this request"
        self._finish(seq, reason, now)
        finished.append(seq)
        outputs.append(RequestOutput(seq.request_id, [], True, reason, seq))

    def length_limit(self, seq: Sequence) -> int:
        """The token count at which seq stops: max_tokens, max_model_len, or a next decode that
        would need a KV slot past the whole pool."""
        return min(seq.num_prompt_tokens + seq.params.max_tokens, self._len_cap)

    def _finish(self, seq: Sequence, reason: FinishReason, now: float | None) -> None:
        """Mark finished and free blocks. The caller removes it from `running`."""
        if seq.status is _WAITING:
            self.waiting.remove(seq)
        elif seq.status is _RUNNING:
            self._leave_running(seq)
            self._release(seq)
        seq.status = _FINISHED
        seq.finish_reason = reason
        seq.finished_s = now
        self.block_manager.free(seq)
        rid = seq.request_id
        del self._live[rid]
        self.num_finished += 1
        if self._keep_finished > 0:
            self._recent_finished[rid] = seq
            if len(self._recent_finished) > self._keep_finished:
                self._recent_finished.popitem(last=False)

    def _finish_now(self, request_id: str, reason: FinishReason, now: float | None, action: str) -> bool:
        seq = self._live.get(request_id)
        if seq is None:
            if request_id in self._recent_finished:
                return False
            raise NotFound(f"cannot {action} request {request_id!r}: no such request", param="request_id")
        was_running = seq.status is _RUNNING
        self._finish(seq, reason, now)
        if was_running:
            self.running.remove(seq)
        return True

    def abort(self, request_id: str, now: float | None = None, *, strict: bool = False) -> bool:
        """Cancel a request in any state and free its blocks. Returns True if it was live.

        An already finished or unknown request changes nothing: False by default (a client that
        disconnects after its last token is normal), or NotFound naming why with `strict=True`.
        """
        if request_id in self._live or not strict:
            return request_id in self._live and self._finish_now(request_id, FinishReason.ABORT, now, "abort")
        seq = self._recent_finished.get(request_id)
        if seq is not None:
            raise NotFound(
                f"cannot abort request {request_id!r}: it already finished "
                f"({seq.finish_reason.value if seq.finish_reason else 'unknown'})",
                param="request_id",
            )
        return self._finish_now(request_id, FinishReason.ABORT, now, "abort")

    def finish(
        self, request_id: str, reason: FinishReason, now: float | None = None, stop_reason: int | str | None = None
    ) -> bool:
        """End a live request from outside (a stop string matched, an engine error). Frees its
        blocks at once. False if it had already finished; NotFound if the id is unknown."""
        seq = self._live.get(request_id)
        if not self._finish_now(request_id, reason, now, "finish"):
            return False
        if seq is not None and stop_reason is not None:  # seq: live, since _finish_now finished it
            seq.stop_reason = stop_reason
        return True
