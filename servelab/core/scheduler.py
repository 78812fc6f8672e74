"""Continuous batching: which sequences run each step, and how many tokens each processes.

`schedule(now)` builds a StepPlan under the token budget, the sequence budget and the KV pool;
an executor runs it; `update(plan, result, now)` appends the sampled tokens, applies the stop
conditions, frees what finished and returns the events a streaming server needs.

Policies:
- `chunked` (vLLM V1 / Sarathi-Serve): running sequences first (a decode is 1 token; a prompt
  still being prefilled continues with its next chunk), then waiting prompts in order, each
  taking a chunk of whatever token budget is left. A long prompt spans several steps, so it never
  holds the running decodes back by more than one step's budget.
- `prefill-first` (vLLM V0 default): if waiting prompts can be admitted, the step is prefill-only
  and runs whole prompts; decodes wait for a step without new prompts. Kept to show the stall.

Preemption is by recompute: when a running sequence needs a block and none is free, the newest
running sequence (lowest priority under `priority`) loses its blocks and goes back to the front
of the waiting queue; its prompt plus the tokens generated so far are prefilled again later,
cheaply when its blocks are still in the prefix cache.

Implicit decodes (the simulator, `implicit_decode_token`): when the executor samples one known
token for every sequence, a steady decode's next steps are predictable: one token a step, no
new block until its last one fills, no stop until its length limit. Such a sequence leaves the
per-step loops: the plan carries it as a count and sums, every step that runs it appends one
time to the scheduler's implicit clock. It is touched only when something happens to it, in
the order the explicit loops would touch it: update() publishes its block when the block fills
(or finishes it at its length limit), and the next schedule() gives it a new block. It becomes
an ordinary entry again only when it is preempted, aborted or cut by the token budget, at which
point its tokens, token times and computed count catch up from the clock. The decisions and
timestamps are exactly those of the explicit loops (property tests compare them); a step costs
the few sequences that need attention instead of every running one.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import insort
from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Iterable
from itertools import chain, repeat
from operator import attrgetter

from servelab.core.block_manager import BlockManager
from servelab.core.config import SchedulerConfig
from servelab.core.plan import RequestOutput, ScheduledSeq, StepPlan, StepResult
from servelab.core.sequence import FinishReason, Sequence, SequenceStatus
from servelab.errors import InvalidArgument, NotFound, QueueFull, RequestTooLong

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING
_FINISHED = SequenceStatus.FINISHED
_NO_STOP_IDS: frozenset[int] = frozenset()
# `running` and the waiting heap are ordered by Sequence.order_key: (admission counter,) under
# fcfs, (priority, arrival, counter) under priority. An attrgetter keeps insort's key in C.
_order_key = attrgetter("order_key")
# update() items: (entry, token, logprobs), or (sequence, _WAKE, None) for an implicit event.
_WAKE = object()


def _entry_order_key(item: tuple) -> tuple:
    return item[0].order_key if item[1] is _WAKE else item[0].seq.order_key


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of blocks held by live sequences
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    prefix_cache_hits: int  # tokens
    prefix_cache_queries: int  # tokens
    num_preemptions: int
    num_finished: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        *,
        keep_finished: int = 1024,
        reuse_plan_entries: bool = False,
        implicit_decode_token: int | None = None,
    ) -> None:
        """`reuse_plan_entries` (the simulator): every plan reuses one ScheduledSeq per sequence,
        rewritten in place, instead of allocating one per sequence and step (the largest single
        cost of a decode step in pure Python). Only for a caller that is done with a plan
        (executed and passed to update) before it calls schedule() again, as the simulator is:
        the next schedule() changes the entries of the previous plan.

        `implicit_decode_token` (the simulator): the executor samples this token id for every
        entry, so steady decodes run implicitly (see the module docstring). The executor must
        price a plan from its sums (`shape_totals`), and update() then returns finished requests
        only, as with `finished_only=True`; a running sequence's token list and times are up to
        date only after `sync()`."""
        config.validate()
        self.config = config
        self._reuse_entries = reuse_plan_entries
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self._chunked = config.policy == "chunked"
        self._by_priority = config.order == "priority"
        # Both orders use one heap keyed by _order_key: fcfs keys on admission order alone, so a
        # preempted sequence (older than everything still waiting) comes out first again.
        self._waiting: list[tuple[tuple, Sequence]] = []
        self._num_waiting = 0  # aborted entries stay in the heap until popped
        self.running: list[Sequence] = []  # sorted by _order_key: the tail is preempted first
        self._live: dict[str, Sequence] = {}
        self._recent_finished: OrderedDict[str, Sequence] = OrderedDict()
        self._keep_finished = keep_finished
        self._counter = itertools.count()
        self.num_preemptions = 0
        self.num_finished = 0
        self._kv_capacity_tokens = config.num_blocks * config.block_size
        # A sequence this long stops: at max_model_len, or when its next decode would need a KV
        # slot past the whole pool.
        self._len_cap = min(config.max_model_len, self._kv_capacity_tokens + 1)
        # Implicit decodes. `_clock[i]` is the end time of the i-th step that ran implicit
        # decodes; an implicit sequence at tick c has gained c - implicit_from tokens. Its context
        # at tick c is (len(token_ids) - implicit_from) + c, so `_implicit_base` sums the former
        # and the plan's context sum is base + count * c with no pass over the sequences.
        self._implicit_token = implicit_decode_token
        self._clock: list[float] = []
        self._num_implicit = 0
        self._implicit_base = 0
        self._wake: dict[int, list[Sequence]] = {}  # tick -> sequences whose block fills or that finish then
        self._needs_block: list[Sequence] = []  # implicit, block just filled: a new one next step, in key order
        self._num_running_entries = 0  # entries of the last plan from running sequences (the rest admitted)
        self._full_implicit_block_hash = hash((implicit_decode_token,) * config.block_size)
        self._explicit: list[Sequence] = []  # running sequences that are not implicit, in `running` order

    # ---- introspection -------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def get(self, request_id: str) -> Sequence | None:
        """A live request, or one of the last `keep_finished` finished ones; None if unknown."""
        seq = self._live.get(request_id)
        return seq if seq is not None else self._recent_finished.get(request_id)

    def waiting(self) -> list[Sequence]:
        """Waiting sequences in the order they would be admitted (a copy; for inspection)."""
        return [s for _, s in sorted(self._waiting, key=lambda e: e[0]) if s.status is _WAITING]

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self._num_waiting,
            kv_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks,
            num_used_blocks=bm.num_used_blocks,
            num_cached_blocks=bm.num_cached_blocks,
            prefix_cache_hits=bm.prefix_cache_hits,
            prefix_cache_queries=bm.prefix_cache_queries,
            num_preemptions=self.num_preemptions,
            num_finished=self.num_finished,
        )

    # ---- admission -----------------------------------------------------------------------------

    def add(self, seq: Sequence, now: float | None = None) -> None:
        """Queue a new request, or raise (changing nothing) if it can never run or the queue is full.

        `arrival_s` is set to `now` when it still holds the default 0.0, so a caller that stamped
        the true arrival time (the simulator, the driver) keeps it.
        """
        cfg = self.config
        rid = seq.request_id
        if rid in self._live or rid in self._recent_finished:
            raise InvalidArgument(f"request id {rid!r} is already in use", param="request_id")
        if seq.status is not _WAITING or seq.num_computed_tokens or seq.block_table or seq.num_output_tokens:
            raise InvalidArgument(f"request {rid!r} is not a fresh sequence (status {seq.status.value})")
        num_prompt = seq.num_prompt_tokens
        if num_prompt < 1:
            raise InvalidArgument(f"request {rid!r}: the prompt must hold at least 1 token", param="prompt")
        max_tokens = seq.params.max_tokens
        if num_prompt + max_tokens > cfg.max_model_len:
            raise RequestTooLong(
                f"request {rid!r}: prompt of {num_prompt} tokens + max_tokens {max_tokens} = "
                f"{num_prompt + max_tokens} exceeds max_model_len {cfg.max_model_len}",
                param="max_tokens",
            )
        if num_prompt > self._kv_capacity_tokens:
            raise RequestTooLong(
                f"request {rid!r}: prompt of {num_prompt} tokens can never fit the KV cache pool of "
                f"{self._kv_capacity_tokens} tokens ({cfg.num_blocks} blocks x {cfg.block_size})",
                param="prompt",
            )
        if cfg.max_waiting is not None and self._num_waiting >= cfg.max_waiting:
            raise QueueFull(
                f"request {rid!r} rejected: the waiting queue is full (max_waiting={cfg.max_waiting}); retry later",
                param="max_waiting",
            )
        if now is not None and seq.arrival_s == 0.0:
            seq.arrival_s = now
        params = seq.params
        seq.stop_check_num_tokens = min(num_prompt + max_tokens, self._len_cap)
        stop_ids = params.stop_token_ids if params.ignore_eos else (*seq.eos_token_ids, *params.stop_token_ids)
        # Sequences without stop ids (every simulated one) share one set: it stays in cache.
        seq.stop_check_token_ids = frozenset(stop_ids) if stop_ids else _NO_STOP_IDS
        order = next(self._counter)
        key = (seq.priority, seq.arrival_s, order) if self._by_priority else (order,)
        seq.order_key = key
        self._live[rid] = seq
        self._push_waiting(seq)

    def _push_waiting(self, seq: Sequence) -> None:
        heapq.heappush(self._waiting, (seq.order_key, seq))
        self._num_waiting += 1

    def _peek_waiting(self) -> Sequence | None:
        heap = self._waiting
        while heap:
            seq = heap[0][1]
            if seq.status is _WAITING:
                return seq
            heapq.heappop(heap)  # finished (aborted) while waiting
        return None

    # ---- scheduling ----------------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan:
        """The next step. Call update() with its result before scheduling again."""
        cfg = self.config
        bm = self.block_manager
        bs = cfg.block_size
        plan = StepPlan(block_size=bs, sums_kept=True)
        scheduled = plan.scheduled
        budget = cfg.max_num_batched_tokens

        if not self._chunked and self._num_waiting and self._schedule_waiting(plan, budget, now, whole=True):
            return plan  # prefill-first: a prefill-only step

        running = self.running
        preempted = plan.preempted
        append = scheduled.append
        reuse = self._reuse_entries
        implicit = self._implicit_token is not None
        if implicit:
            tick = len(self._clock)
            seqs, cutting = self._implicit_step_order(budget)
        else:
            seqs, cutting = running, False
        last = None
        # The shape's sums, kept here for the cost model (see StepPlan.shape_totals). A decode (the
        # common entry) attends to exactly its context, so it only adds to `context_tokens`; a
        # prefill chunk adds what its causal pairs exceed that by.
        context_tokens = chunk_extra_pairs = num_chunks = 0
        # len(running) <= max_num_seqs always (admission keeps it), so only the token budget binds.
        # Popping victims off the tail while iterating is safe: the iterator stops earlier.
        for seq in seqs:
            if budget <= 0:
                break
            if implicit:
                if seq.implicit_from >= 0:
                    if seq.implicit_needs_block and not self._implicit_take_block(seq, tick, preempted):
                        break  # seq itself was the newest left and was preempted: nothing more runs
                    if cutting:
                        budget -= 1
                        last = seq
                    continue
                if seq.status is not _RUNNING:
                    continue  # preempted by an earlier entry of this step
                last = seq
            start = seq.num_computed_tokens
            num_known = len(seq.token_ids)
            n = num_known - start
            if n > budget:  # noqa: PLR1730 -- a compare is cheaper than min() on this hot path
                n = budget
            end = start + n
            # A decode needs a new block only when its last one is full (every block_size steps).
            if (
                end > len(seq.block_table) * bs
                and not bm.append_slots(seq, end)
                and not self._preempt_until_fits(seq, end, preempted)
            ):
                break  # seq itself was the newest left and was preempted: nothing more runs
            if (
                implicit
                and n == 1
                and end == num_known
                and seq.first_token_s is not None
                and self._go_implicit(seq, tick, num_known)
            ):
                # A decode (not a prompt's last token, whose update stamps the first token) that
                # can run implicitly from this very step, typically one that just took its new
                # block: no entry; the implicit sums below count it, and so does the budget (here
                # while walking all of `running`, else with the others below).
                if cutting:
                    budget -= 1
                continue
            if reuse:
                entry = seq.plan_entry
                entry.num_tokens = n  # type: ignore[union-attr]
                entry.start_pos = start  # type: ignore[union-attr]
                entry.samples = end == num_known  # type: ignore[union-attr]
                append(entry)
            else:
                append(ScheduledSeq(seq, n, start, end == num_known))
            budget -= n
            context_tokens += end
            if n != 1:
                chunk_extra_pairs += (n - 1) * end - (n * (n - 1) >> 1)
                num_chunks += 1
        num_implicit = 0
        if implicit:
            self._num_running_entries = len(scheduled)
            if cutting:
                self._explicit_after(last)  # the budget ran out before them: they skip this step
            else:
                budget -= self._num_implicit
            num_implicit = plan.num_implicit_decodes = self._num_implicit
            context_tokens += self._implicit_base + num_implicit * tick
        plan.num_batched_tokens = cfg.max_num_batched_tokens - budget
        plan.context_tokens += context_tokens
        plan.attention_pairs += context_tokens + chunk_extra_pairs
        # `scheduled` holds only this loop's entries: a prefill-first step that admitted returned above.
        plan.num_decode_seqs += len(scheduled) + num_implicit - num_chunks
        # Every entry samples except one the token budget cut short, which ends the loop: only
        # the last entry can be a non-sampling chunk.
        plan.num_sampling_seqs += (
            len(scheduled) + num_implicit - (1 if scheduled and not scheduled[-1].samples else 0)
        )

        # As vLLM: a step that had to preempt admits nobody new; the pool is already short.
        if self._chunked and not preempted and self._num_waiting:
            self._schedule_waiting(plan, budget, now, whole=False)
        return plan

    def _schedule_waiting(self, plan: StepPlan, budget: int, now: float, *, whole: bool) -> bool:
        """Admit waiting sequences in order while budgets and blocks allow. `whole`: whole prompts
        only (the first may exceed the token budget), else chunks of the remaining budget."""
        cfg = self.config
        bm = self.block_manager
        scheduled = plan.scheduled
        running = self.running
        max_seqs = cfg.max_num_seqs
        admitted = False
        while budget > 0 and len(running) < max_seqs and len(scheduled) < max_seqs:
            seq = self._peek_waiting()
            if seq is None:
                break
            hits = [] if seq.needs_prompt_logprobs else bm.find_cached_prefix(seq)
            num_cached = len(hits) * cfg.block_size
            n = len(seq.token_ids) - num_cached
            if whole:
                if scheduled and n > budget:
                    break
            elif n > budget:
                n = budget
            if not bm.allocate(seq, hits, num_cached + n):
                break  # head-of-line blocking keeps the order: nobody overtakes it
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            seq.status = _RUNNING
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = now
            insort(running, seq, key=_order_key)
            if self._implicit_token is not None:
                insort(self._explicit, seq, key=_order_key)
            end = num_cached + n
            entry = ScheduledSeq(seq, n, num_cached, end == len(seq.token_ids))
            if self._reuse_entries:
                seq.plan_entry = entry
            scheduled.append(entry)
            plan.num_sampling_seqs += entry.samples
            plan.num_batched_tokens += n
            plan.context_tokens += end
            plan.attention_pairs += n * end - (n * (n - 1) >> 1)
            if n == 1:
                plan.num_decode_seqs += 1
            budget -= n
            admitted = True
        return admitted

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
        if self._implicit_token is not None:
            self._leave_running(seq)
        self.block_manager.free(seq)
        seq.plan_entry = None  # re-admission makes a new one; no seq <-> entry cycle meanwhile
        seq.num_computed_tokens = 0
        seq.status = _WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(seq)

    # ---- implicit decodes (the simulator) ------------------------------------------------------

    def _implicit_step_order(self, budget: int) -> tuple[Iterable[Sequence], bool]:
        """The sequences the running loop must visit, in `running` order, and whether the token
        budget may cut the step short. If every running sequence's whole need fits the budget,
        only the explicit ones and the implicit ones that need a block are visited; otherwise
        the loop walks all of `running`, implicit ones costing one token each, so that the cut
        falls where the explicit loop would put it."""
        need = self._num_implicit
        for seq in self._explicit:
            need += len(seq.token_ids) - seq.num_computed_tokens
        needs_block = self._needs_block
        if needs_block:
            self._needs_block = []
        if need > budget:
            return self.running, True
        explicit = list(self._explicit)  # a copy: preemption edits the list
        if not needs_block:
            return explicit, False
        needs_block = [s for s in needs_block if s.implicit_needs_block]
        if not explicit:
            return needs_block, False
        return sorted(explicit + needs_block, key=_order_key), False  # both few, both in key order

    def _implicit_take_block(self, seq: Sequence, tick: int, preempted: list[Sequence]) -> bool:
        """An implicit sequence whose block filled last step takes a new one, as the explicit loop
        would (preempting from the tail if the pool is short), and waits for its next event.
        False if it was preempted itself."""
        end = len(seq.token_ids) + tick - seq.implicit_from
        if not self.block_manager.append_slots(seq, end) and not self._preempt_until_fits(seq, end, preempted):
            return False
        seq.implicit_needs_block = False
        self._schedule_wake(seq, tick, end)
        return True

    def _schedule_wake(self, seq: Sequence, tick: int, end: int) -> None:
        """File an implicit sequence, whose context at `tick` is `end`, under the tick of its next
        event: its last block fills (update publishes it; the next step needs a new one) or it
        reaches its length limit, one tick before its context would."""
        wake = tick + min(len(seq.block_table) * self.config.block_size - end, seq.stop_check_num_tokens - end - 1)
        seq.implicit_wake = wake
        bucket = self._wake.get(wake)
        if bucket is None:
            self._wake[wake] = [seq]
        else:
            bucket.append(seq)

    def _wake_implicit(self, seq: Sequence, now: float, finished: list[Sequence], outputs: list[RequestOutput]) -> None:
        """update() at an implicit sequence's event tick, at its place in the step's order: publish
        the block that filled, and finish it at its length limit or mark it for a new block."""
        tick = len(self._clock) - 1
        token = self._implicit_token
        num_known = len(seq.token_ids)
        end = num_known + tick - seq.implicit_from  # its computed count after this step
        bs = self.config.block_size
        if end >= (seq.num_committed_blocks + 1) * bs:  # its last block filled: publish it
            if end - bs >= num_known:
                block_tokens_hash = self._full_implicit_block_hash
            else:
                block_tokens_hash = hash((*seq.token_ids[end - bs :], *repeat(token, end - num_known)))
            self.block_manager.commit_next_block(seq, block_tokens_hash)
        if end + 1 >= seq.stop_check_num_tokens:
            # The implicit token cannot stop it: only the length limit ends it.
            self._finish(seq, FinishReason.LENGTH, now)  # catches it up, this step's token included
            finished.append(seq)
            outputs.append(RequestOutput(seq.request_id, [token], True, FinishReason.LENGTH, seq))
        else:
            seq.implicit_needs_block = True
            seq.implicit_wake = -1
            self._needs_block.append(seq)

    def _explicit_after(self, last: Sequence | None) -> None:
        """After a step the token budget cut: implicit sequences past `last` did not run."""
        running = self.running
        if last is None:
            rest = running
        elif last.status is _RUNNING:
            rest = running[running.index(last) + 1 :]
        else:
            return  # `last` was preempted, and everything after it before it
        explicit = self._explicit
        key = _order_key
        for seq in rest:
            if seq.implicit_from >= 0:
                self._catch_up(seq)
                insort(explicit, seq, key=key)

    def _catch_up(self, seq: Sequence) -> None:
        """Bring an implicit sequence's tokens, times and computed count up to the last completed
        tick and make it explicit (the caller puts it in `_explicit` if it stays running)."""
        start = seq.implicit_from
        token_ids = seq.token_ids
        num_known = len(token_ids)
        self._num_implicit -= 1
        self._implicit_base -= num_known - start
        seq.implicit_from = -1
        seq.implicit_needs_block = False
        clock = self._clock
        gained = len(clock) - start
        if gained > 0:
            token_ids.extend(repeat(self._implicit_token, gained))
            seq.token_times_s.extend(clock[start:])
            seq.num_computed_tokens = num_known - 1 + gained

    def _go_implicit(self, seq: Sequence, tick: int, num_known: int) -> bool:
        """Run a running decode implicitly from `tick`, at which its context is `num_known`
        (its token count then), if that is steady: the implicit token cannot stop it, its blocks
        cover that context, and it would not wake at once. Called by update() after a sampled
        token (for the next tick) and by schedule() after a decode got its block (for this one)."""
        table_end = len(seq.block_table) * self.config.block_size
        if (
            num_known > table_end
            or num_known + 1 >= seq.stop_check_num_tokens
            or self._implicit_token in seq.stop_check_token_ids
        ):
            return False  # it needs a block or stops at this very step: the loops handle that
        seq.implicit_from = tick
        self._num_implicit += 1
        self._implicit_base += num_known - tick
        self._schedule_wake(seq, tick, num_known)
        self._explicit.remove(seq)
        return True

    def _leave_running(self, seq: Sequence) -> None:
        """A running sequence is preempted or finishes: out of the implicit bookkeeping."""
        if seq.implicit_from >= 0:
            self._catch_up(seq)
        else:
            self._explicit.remove(seq)

    def sync(self) -> None:
        """Bring every implicit decode up to date (tokens, times, computed counts) and make it
        explicit. For inspection and tests; the simulator never needs it."""
        if self._implicit_token is None:
            return
        explicit = self._explicit
        for seq in self.running:
            if seq.implicit_from >= 0:
                self._catch_up(seq)
        explicit[:] = self.running
        self._wake.clear()
        self._needs_block.clear()

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
            raise ValueError(
                f"StepResult has {len(sampled)} sampled tokens for a plan of {len(scheduled)} sequences"
            )
        bm = self.block_manager
        bs = self.config.block_size
        len_cap = self._len_cap
        if result.prompt_logprobs:
            for i, scored in result.prompt_logprobs:
                scheduled[i].seq.prompt_logprobs.extend(scored)
        logprobs = result.logprobs if result.logprobs is not None else repeat(None)
        outputs: list[RequestOutput] = []
        append_output = outputs.append
        output = RequestOutput
        implicit = self._implicit_token is not None
        entries: Iterable[tuple] = zip(scheduled, sampled, logprobs)
        if implicit:
            finished_only = True
            if plan.num_implicit_decodes:
                tick = len(self._clock)
                self._clock.append(now)  # every implicit decode gained a token at `now`
                woken = self._wake.pop(tick, None)
                if woken:
                    entries = self._merge_woken(woken, tick, scheduled, sampled)
        stream = not finished_only
        running_status = _RUNNING
        finished: list[Sequence] = []
        for ss, token, lp in entries:
            if token is _WAKE:
                self._wake_implicit(ss, now, finished, outputs)
                continue
            seq = ss.seq
            if seq.status is not running_status:
                continue  # aborted or finished by the engine while the step ran
            seq.num_computed_tokens = computed = ss.start_pos + ss.num_tokens
            if computed >= (seq.num_committed_blocks + 1) * bs:  # a block filled: publish it
                bm.commit_computed_blocks(seq)
            if not ss.samples:
                continue
            if token is None:
                self._finish(seq, FinishReason.ERROR, now)
                finished.append(seq)
                append_output(output(seq.request_id, [], True, FinishReason.ERROR, seq))
                continue
            token_ids = seq.token_ids
            token_ids.append(token)
            seq.token_times_s.append(now)  # every token's time: the simulator's ITL needs them
            if seq.first_token_s is None:
                seq.first_token_s = now
            # One compare and one set lookup screen the token (see Sequence.stop_check_*);
            # _stop_reason decides whether and why it really stops.
            if len(token_ids) >= seq.stop_check_num_tokens or token in seq.stop_check_token_ids:
                reason = self._stop_reason(seq, token, len_cap)
                if reason is not None:
                    self._finish(seq, reason, now)
                    finished.append(seq)
                    append_output(output(seq.request_id, [token], True, reason, seq, None if lp is None else [lp]))
                    continue
            if stream:
                append_output(output(seq.request_id, [token], False, None, seq, None if lp is None else [lp]))
            elif implicit:
                self._go_implicit(seq, len(self._clock), len(token_ids))
        # Usually one or two of ~100 finish in a step: list.remove (a C scan by identity, order
        # kept) is cheaper than rebuilding the list in Python.
        for seq in finished:
            self.running.remove(seq)
        return outputs

    def _merge_woken(
        self, woken: list[Sequence], tick: int, scheduled: list[ScheduledSeq], sampled: list[int | None]
    ) -> Iterable[tuple]:
        """The step's entries with the implicit sequences whose event is at `tick` put where the
        explicit loop would meet them: among the running sequences' entries in `running` order,
        before the entries of sequences admitted this step. (No logprobs: the simulator's.)"""
        due = [(seq, _WAKE, None) for seq in woken if seq.implicit_from >= 0 and seq.implicit_wake == tick]
        num_running = self._num_running_entries  # usually 0: every running sequence is implicit
        due += zip(scheduled[:num_running], sampled[:num_running], repeat(None))
        due.sort(key=_entry_order_key)
        return chain(due, zip(scheduled[num_running:], sampled[num_running:], repeat(None)))

    @staticmethod
    def _stop_reason(seq: Sequence, token: int, len_cap: int) -> FinishReason | None:
        """Why seq stops after sampling `token`, in vLLM's order: EOS and stop tokens (once
        min_tokens are out), then the length limits. Sets seq.stop_reason for a stop token."""
        params = seq.params
        num_output = len(seq.token_ids) - seq.num_prompt_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in seq.eos_token_ids:
                return FinishReason.STOP
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return FinishReason.STOP
        if num_output >= params.max_tokens or len(seq.token_ids) >= len_cap:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason, now: float | None) -> None:
        """Mark finished and free blocks. The caller removes it from `running`."""
        if seq.status is _WAITING:
            self._num_waiting -= 1  # its heap entry is dropped lazily
        elif self._implicit_token is not None and seq.status is _RUNNING:
            self._leave_running(seq)
        seq.status = _FINISHED
        seq.finish_reason = reason
        seq.finished_s = now
        self.block_manager.free(seq)
        seq.plan_entry = None  # break the seq <-> entry cycle: refcounting frees both at once
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
            done = self._recent_finished.get(request_id)
            if done is not None:
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
        if not strict:
            try:
                return self._finish_now(request_id, FinishReason.ABORT, now, "abort")
            except NotFound:
                return False
        seq = self._recent_finished.get(request_id)
        if seq is not None and request_id not in self._live:
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
        if self._finish_now(request_id, reason, now, "finish"):
            if stop_reason is not None:
                seq.stop_reason = stop_reason  # type: ignore[union-attr]
            return True
        return False

    # ---- checks --------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the scheduler's state is inconsistent (used by tests)."""
        bm = self.block_manager
        bm.check_invariants()
        running_ids = [s.request_id for s in self.running]
        assert len(set(running_ids)) == len(running_ids), "a sequence runs twice"
        assert len(self.running) <= self.config.max_num_seqs, "more running sequences than max_num_seqs"
        keys = [s.order_key for s in self.running]
        assert keys == sorted(keys), "running is out of order"
        waiting = [s for _, s in self._waiting if s.status is _WAITING]
        assert len(waiting) == self._num_waiting, "waiting count is off"
        assert not set(running_ids) & {s.request_id for s in waiting}, "a sequence is both running and waiting"
        for s in self.running:
            assert s.status is _RUNNING
            assert s.num_computed_tokens < len(s.token_ids), f"{s.request_id}: nothing left to compute"
            assert len(s.block_table) * bm.block_size >= s.num_computed_tokens, f"{s.request_id}: KV beyond its blocks"
        for s in waiting:
            assert not s.block_table and s.num_computed_tokens == 0, f"{s.request_id}: waiting but holds KV"
        live = set(running_ids) | {s.request_id for s in waiting}
        assert live == set(self._live), "live requests are neither running nor waiting"
        owners = {s.request_id for s in bm.owners()}
        assert owners <= set(running_ids), "a non-running sequence owns blocks"
        if self._implicit_token is not None:
            implicit = [s for s in self.running if s.implicit_from >= 0]
            assert self._explicit == [s for s in self.running if s.implicit_from < 0], "explicit list out of step"
            assert self._num_implicit == len(implicit), "implicit count is off"
            assert self._implicit_base == sum(len(s.token_ids) - s.implicit_from for s in implicit), "implicit sums off"
            tick = len(self._clock)
            for s in implicit:
                # Its context at the next tick fits its blocks, or its block just filled and it
                # is queued for a new one; otherwise it has an event ahead.
                next_end = len(s.token_ids) + tick - s.implicit_from
                table_end = len(s.block_table) * bm.block_size
                if s.implicit_needs_block:
                    assert next_end == table_end + 1 and s in self._needs_block, f"{s.request_id}: lost its block"
                else:
                    assert next_end <= table_end, f"{s.request_id}: implicit past its blocks"
                    assert s.implicit_wake >= tick and s in self._wake.get(s.implicit_wake, ()), f"{s.request_id}: no wake"
