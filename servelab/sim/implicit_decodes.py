"""Implicit decodes: the simulator's scheduler, which skips the steps where nothing happens.

When the executor samples one known token for every sequence (the simulator's), a steady
decode's next steps are predictable: one token a step, no new block until its last one fills,
no stop until its length limit. Such a sequence leaves the per-step loops: the plan carries it
as a count and a context sum, and every step that runs it appends one time to the scheduler's
implicit clock. It is touched only when something happens to it, in the order the core
Scheduler's loops would touch it: `update()` marks it when its block fills (or finishes it at
its length limit), and the next `schedule()` gives it a new block. It becomes an ordinary entry
again only when it is preempted, aborted or cut by the token budget, at which point its tokens,
token times and computed count catch up from the clock. The decisions and timestamps are exactly
those of the core Scheduler (tests/sim/test_implicit_decodes.py compares them); a step costs the
few sequences that need attention instead of every running one.

A filled block is published when it fills, as the core Scheduler does, unless the sequence's
prompt has tokens of its own (`SimSequence.unique_chain`: every request of the simulator's
workloads, whose index is its own in the run; `simulate` checks). Then no other sequence's
lookup can meet the blocks it generates, and they are published together when it leaves
implicit mode: under their chain hashes if it lives on (preempted, it may recompute them from
the cache), and when it finishes under keys of their own with no hash computed
(`commit_unreachable_blocks`), so that they still join the prefix cache's LRU as published
blocks. Decisions, records and the prefix-cache counters stay the core Scheduler's; what lags
while such a sequence runs implicitly is bookkeeping no decision reads: its
`prefix.num_committed` and `prefix.hashes` (sync() brings them up to date) and the cached-block
count (`num_cached_blocks`); a finished one's blocks stay under their own keys until evicted.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat
from typing import cast

from servelab.core.config import SchedulerConfig
from servelab.core.plan import RequestOutput, ScheduledSeq, StepPlan, StepResult
from servelab.core.scheduler import Scheduler, by_order
from servelab.core.sequence import FinishReason, Sequence, SequenceStatus

_RUNNING = SequenceStatus.RUNNING


@dataclass(slots=True, eq=False)
class SimSequence(Sequence):
    """A Sequence with the implicit-decode state. While `implicit_from` >= 0 it is a steady
    decode advanced implicitly, one token per tick of the scheduler's clock from that tick on;
    `token_ids`, `token_times_s` and `num_computed_tokens` hold its state at that tick. At tick
    `implicit_wake` its block fills or it finishes; `implicit_needs_block` marks one whose block
    filled and that takes a new one next step."""

    implicit_from: int = field(default=-1, init=False, repr=False)
    # While implicit: its context at tick c is implicit_offset + c, and at tick implicit_finish it
    # reaches its length limit (the tick before its context would).
    implicit_offset: int = field(default=0, init=False, repr=False)
    implicit_finish: int = field(default=0, init=False, repr=False)
    implicit_wake: int = field(default=-1, init=False, repr=False)
    implicit_needs_block: bool = field(default=False, init=False, repr=False)
    # Set at admission: the token count at which it stops by length, or 0 if the implicit token
    # would stop it (an EOS or stop id): such a sequence never runs implicitly.
    implicit_limit: int = field(default=0, init=False, repr=False)
    # Set by the simulator where the prompt has tokens of its own: no other sequence's blocks can
    # hash like its blocks from there on, so no lookup meets a block it generates while it runs
    # implicitly, and its filled blocks are published together when it leaves implicit mode.
    unique_chain: bool = field(default=False, init=False, repr=False)


@dataclass(slots=True)
class ImplicitStepPlan(StepPlan):
    """A plan plus the steady decodes that run without an entry in `scheduled`: one query token
    each, at contexts that sum to `implicit_context_tokens`. `shape()` leaves them out;
    `shape_totals()` and `num_batched_tokens` count them."""

    num_implicit_decodes: int = 0
    implicit_context_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.num_implicit_decodes

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled) + self.num_implicit_decodes

    def shape_totals(self) -> tuple[int, int, int, int, int]:
        num_tokens, num_seqs, context, pairs, decodes = StepPlan.shape_totals(self)
        n, implicit_context = self.num_implicit_decodes, self.implicit_context_tokens
        return num_tokens + n, num_seqs + n, context + implicit_context, pairs + implicit_context, decodes + n


class ImplicitDecodeScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, token: int, *, keep_finished: int = 1024) -> None:
        """`token`: the id the executor samples for every entry (with no logprobs). The executor
        must price a plan from `shape_totals()`; update() returns finished requests only, and a
        running sequence's tokens and times are up to date only after `sync()`."""
        super().__init__(config, keep_finished=keep_finished)
        self._token = token
        # `_clock[i]` is the end time of the i-th step that ran implicit decodes; an implicit
        # sequence at tick c has gained c - implicit_from tokens. Its context at tick c is
        # (len(token_ids) - implicit_from) + c, so `_implicit_base` sums the former and the
        # plan's context sum is base + count * c with no pass over the sequences.
        self._clock: list[float] = []
        self._num_implicit = 0
        self._implicit_base = 0
        self._wake: dict[int, list[SimSequence]] = {}  # tick -> sequences whose block fills or that finish then
        self._needs_block: list[SimSequence] = []  # block just filled: a new one next step, in key order
        self._num_running_entries = 0  # entries of the last plan from running sequences (the rest admitted)
        self._full_block_hash = hash((token,) * config.block_size)
        self._explicit: list[SimSequence] = []  # running sequences that are not implicit, in `running` order

    def add(self, seq: Sequence, now: float | None = None) -> None:
        if not isinstance(seq, SimSequence):
            raise TypeError(f"ImplicitDecodeScheduler runs SimSequence, got {type(seq).__name__} ({seq.request_id!r})")
        super().add(seq, now)
        params = seq.params
        stops = self._token in params.stop_token_ids or (not params.ignore_eos and self._token in seq.eos_token_ids)
        seq.implicit_limit = 0 if stops else self.length_limit(seq)

    @property
    def _sim_running(self) -> list[SimSequence]:
        """`running`, typed as what it holds: add() admits SimSequence only."""
        return cast("list[SimSequence]", self.running)

    # ---- hooks of the core Scheduler -----------------------------------------------------------
    # They take a SimSequence and an ImplicitStepPlan where the core's take a Sequence and a
    # StepPlan (hence `type: ignore[override]`): add() admits SimSequence only, and _new_plan
    # makes every plan these hooks see.

    def _new_plan(self) -> ImplicitStepPlan:
        return ImplicitStepPlan(block_size=self.config.block_size)

    def _start_running(self, seq: SimSequence) -> None:  # type: ignore[override]
        super()._start_running(seq)
        insort(self._explicit, seq, key=by_order)

    def _leave_running(self, seq: SimSequence) -> None:  # type: ignore[override]
        if seq.implicit_from >= 0:
            self._catch_up(seq)
        else:
            self._explicit.remove(seq)

    def _schedule_running(self, plan: ImplicitStepPlan, budget: int) -> int:  # type: ignore[override]
        tick = len(self._clock)
        scheduled = plan.scheduled
        preempted = plan.preempted
        seqs, cutting = self._step_order(budget)
        last = None
        # Implicit decodes whose block filled, met in a row: they take their blocks together
        # before the next explicit entry (the budget cannot stop the loop among them uncut).
        group: list[SimSequence] = []
        if not cutting and not self._explicit:
            group, seqs = seqs, []  # only those (a list of their own): one group
        for seq in seqs:
            if budget <= 0:
                break
            if seq.implicit_from >= 0:
                if seq.implicit_needs_block:
                    if not cutting:
                        group.append(seq)
                        continue
                    if not self._take_block(seq, tick, preempted):
                        break  # seq itself was the newest left and was preempted: nothing more runs
                if cutting:
                    budget -= 1
                    last = seq
                continue
            if group:
                taken = self._take_group(group, tick, preempted)
                group = []
                if not taken:
                    break
            if seq.status is not _RUNNING:
                continue  # preempted by an earlier entry of this step
            last = seq
            entry = self._next_chunk(seq, budget, preempted)
            if entry is None:
                break
            if (
                entry.num_tokens == 1
                and entry.samples
                and seq.first_token_s is not None
                and self._go_implicit(seq, tick, entry.start_pos + 1)
            ):
                # A decode (not a prompt's last token, whose update stamps the first token) that
                # can run implicitly from this very step, typically one that just took its new
                # block: no entry; the implicit count covers it, and so does the budget (here
                # while walking all of `running`, else with the others below).
                if cutting:
                    budget -= 1
                continue
            scheduled.append(entry)
            budget -= entry.num_tokens
        if group:
            self._take_group(group, tick, preempted)
        self._num_running_entries = len(scheduled)
        if cutting:
            self._explicit_after(last)  # the budget ran out before them: they skip this step
        else:
            budget -= self._num_implicit
        plan.num_implicit_decodes = count = self._num_implicit
        plan.implicit_context_tokens = self._implicit_base + count * tick
        return budget

    def _apply(  # type: ignore[override]
        self,
        plan: ImplicitStepPlan,
        result: StepResult,
        now: float,
        outputs: list[RequestOutput],
        finished: list[Sequence],
        *,
        stream: bool,
    ) -> None:
        scheduled = plan.scheduled
        sampled = result.sampled_token_ids
        start = 0  # the entries before it are applied
        if plan.num_implicit_decodes:
            tick = len(self._clock)
            self._clock.append(now)  # every implicit decode gained a token at `now`
            woken = self._wake.pop(tick, None)
            if woken:
                # The implicit sequences whose event is now, where the core loop would meet them:
                # among the running sequences' entries in `running` order (both in key order),
                # before the entries of sequences admitted this step.
                due = self._due(woken, tick)
                due.sort(key=by_order)
                pos = 0
                for start in range(self._num_running_entries):  # usually none: all running are implicit
                    entry = scheduled[start]
                    end = bisect_left(due, entry.seq.order_key, pos, key=by_order)
                    if end > pos:
                        self._wake_implicit(due[pos:end], now, finished, outputs)
                        pos = end
                    self._apply_running(entry, sampled[start], now, outputs, finished)
                start = self._num_running_entries
                self._wake_implicit(due[pos:] if pos else due, now, finished, outputs)
        for entry, token in zip(scheduled[start:] if start else scheduled, sampled[start:] if start else sampled):
            self._apply_running(entry, token, now, outputs, finished)

    def _apply_running(
        self,
        entry: ScheduledSeq,
        token: int | None,
        now: float,
        outputs: list[RequestOutput],
        finished: list[Sequence],
    ) -> None:
        if self._apply_entry(entry, token, None, now, outputs, finished, False):
            seq = entry.seq
            self._go_implicit(seq, len(self._clock), len(seq.token_ids))  # type: ignore[arg-type]

    # ---- implicit decodes ----------------------------------------------------------------------

    def _step_order(self, budget: int) -> tuple[list[SimSequence], bool]:
        """The sequences the running loop must visit, in `running` order, and whether the token
        budget may cut the step short. If every running sequence's whole need fits the budget,
        only the explicit ones and the implicit ones that need a block are visited; otherwise
        the loop walks all of `running`, implicit ones costing one token each, so that the cut
        falls where the core loop would put it."""
        need = self._num_implicit
        for seq in self._explicit:
            need += len(seq.token_ids) - seq.num_computed_tokens
        needs_block = self._needs_block
        if needs_block:
            self._needs_block = []
        if need > budget:
            return self._sim_running, True
        explicit = list(self._explicit)  # a copy: preemption edits the list
        if not needs_block:
            return explicit, False
        needs_block = [s for s in needs_block if s.implicit_needs_block]
        if not explicit:
            return needs_block, False
        return sorted(explicit + needs_block, key=by_order), False  # both few, both in key order

    def _take_group(self, seqs: list[SimSequence], tick: int, preempted: list[Sequence]) -> bool:
        """_take_block for each of `seqs` (implicit decodes whose block filled, in `running` order,
        with no other entry between them): in one go when the pool has a block for each, so that
        none preempts, else one by one. False if one was preempted itself (nothing more runs)."""
        # Each filled its last block at the last tick (update() marked it then, and this is the
        # next schedule), so it needs exactly one more, as append_slots would count, and that one
        # fills a block's worth of ticks later unless it finishes first.
        if self.block_manager.append_block_each(seqs):
            fills = tick - 1 + self.config.block_size
            wakes = self._wake
            bucket: list[SimSequence] = []
            for seq in seqs:  # _schedule_wake, inlined: one pass over many
                seq.implicit_needs_block = False
                finish = seq.implicit_finish
                if finish < fills:
                    seq.implicit_wake = finish
                    wakes.setdefault(finish, []).append(seq)
                else:
                    seq.implicit_wake = fills
                    bucket.append(seq)
            if bucket:
                wakes.setdefault(fills, []).extend(bucket)
            return True
        for seq in seqs:
            # One preempted by an earlier one's block is explicit now, and not running: as the
            # step's loop would, pass over it.
            if seq.implicit_from >= 0 and not self._take_block(seq, tick, preempted):
                return False
        return True

    def _take_block(self, seq: SimSequence, tick: int, preempted: list[Sequence]) -> bool:
        """An implicit sequence whose block filled last step takes a new one, as the core loop
        would (preempting from the tail if the pool is short), and waits for its next event.
        False if it was preempted itself."""
        end = seq.implicit_offset + tick
        if not self.block_manager.append_slots(seq, end) and not self._preempt_until_fits(seq, end, preempted):
            return False
        seq.implicit_needs_block = False
        self._schedule_wake(seq)
        return True

    def _schedule_wake(self, seq: SimSequence) -> None:
        """File an implicit sequence under the tick of its next event: its last block fills
        (update() marks it; the next step needs a new one) or it reaches its length limit."""
        wake = min(len(seq.block_table) * self.config.block_size - seq.implicit_offset, seq.implicit_finish)
        seq.implicit_wake = wake
        bucket = self._wake.get(wake)
        if bucket is None:
            self._wake[wake] = [seq]
        else:
            bucket.append(seq)

    def _due(self, woken: list[SimSequence], tick: int) -> list[SimSequence]:
        """The sequences filed under `tick` whose event it still is, each once (one caught up and
        made implicit again can be filed twice under one tick)."""
        due = [seq for seq in woken if seq.implicit_wake == tick and seq.implicit_from >= 0]
        if len(set(map(id, due))) < len(due):  # rare: keep one of each (the caller sorts them)
            due = list({id(seq): seq for seq in due}.values())
        return due

    def _wake_implicit(
        self, seqs: Iterable[SimSequence], now: float, finished: list[Sequence], outputs: list[RequestOutput]
    ) -> None:
        """update() at implicit sequences' event tick, in the step's order: publish the block that
        filled (unless that waits: `unique_chain`), and finish each at its length limit or mark
        it for a new block."""
        tick = len(self._clock) - 1
        token = self._token
        bs = self.config.block_size
        full_block_hash = self._full_block_hash
        commit_next_block = self.block_manager.commit_next_block
        needs_block = self._needs_block
        for seq in seqs:
            if not seq.unique_chain:  # else published when it leaves implicit mode (_catch_up)
                end = seq.implicit_offset + tick  # its computed count after this step
                if end >= (seq.prefix.num_committed + 1) * bs:  # its last block filled: publish it
                    num_known = len(seq.token_ids)
                    if end - bs >= num_known:
                        commit_next_block(seq, full_block_hash)
                    else:
                        commit_next_block(seq, hash((*seq.token_ids[end - bs :], *repeat(token, end - num_known))))
            if tick >= seq.implicit_finish:
                # The implicit token cannot stop it: only the length limit ends it.
                self._finish(seq, FinishReason.LENGTH, now)  # catches it up, this step's token included
                finished.append(seq)
                outputs.append(RequestOutput(seq.request_id, [token], True, FinishReason.LENGTH, seq))
            else:
                seq.implicit_needs_block = True
                seq.implicit_wake = -1
                needs_block.append(seq)

    def _explicit_after(self, last: SimSequence | None) -> None:
        """After a step the token budget cut: implicit sequences past `last` did not run."""
        running = self._sim_running
        if last is None:
            rest = running
        elif last.status is _RUNNING:
            rest = running[running.index(last) + 1 :]
        else:
            return  # `last` was preempted, and everything after it before it
        explicit = self._explicit
        for seq in rest:
            if seq.implicit_from >= 0:
                self._catch_up(seq)
                insort(explicit, seq, key=by_order)

    def _catch_up(self, seq: SimSequence) -> None:
        """Bring an implicit sequence's tokens, times and computed count up to the last completed
        tick and make it explicit (the caller puts it in `_explicit` if it stays running)."""
        start = seq.implicit_from
        token_ids = seq.token_ids
        num_known = len(token_ids)
        self._num_implicit -= 1
        self._implicit_base -= seq.implicit_offset
        seq.implicit_from = -1
        seq.implicit_needs_block = False
        clock = self._clock
        gained = len(clock) - start
        if gained > 0:
            token_ids.extend(repeat(self._token, gained))
            seq.token_times_s.extend(clock[start:])
            seq.num_computed_tokens = num_known - 1 + gained
            if seq.unique_chain:  # else update() published each block as it filled
                if len(clock) <= seq.implicit_finish:
                    self.block_manager.commit_computed_blocks(seq)  # it lives on: the blocks it filled
                else:
                    # Past its finish tick it is finishing (update() finishes it at that tick, and
                    # nothing else catches one up there): no lookup will look for its blocks.
                    self.block_manager.commit_unreachable_blocks(seq)

    def _go_implicit(self, seq: SimSequence, tick: int, num_known: int) -> bool:
        """Run a running decode implicitly from `tick`, at which its context is `num_known`
        (its token count then), if that is steady: the implicit token cannot stop it, its blocks
        cover that context, and it would not wake at once. Called by update() after a sampled
        token (for the next tick) and by schedule() after a decode got its block (for this one)."""
        table_end = len(seq.block_table) * self.config.block_size
        if (
            num_known > table_end or num_known + 1 >= seq.implicit_limit  # also when the implicit token would stop it
        ):
            return False  # it needs a block or stops at this very step: the core loops handle that
        seq.implicit_from = tick
        seq.implicit_offset = offset = num_known - tick
        seq.implicit_finish = seq.implicit_limit - 1 - offset
        self._num_implicit += 1
        self._implicit_base += offset
        self._schedule_wake(seq)
        self._explicit.remove(seq)
        return True

    def quiet_steps(self) -> tuple[int, int, int] | None:
        """(decodes, their context tokens at the first, steps) of the next steps that are only
        implicit decodes and where nothing happens to any of them (no event at their ticks,
        nothing waiting or explicit, no admission booking that ages per step): schedule() would
        plan just that, the context growing by the decodes each step, and update() would only
        tick the clock (`tick_quiet`). Valid only while nothing else happens (an arrival ends
        it). None where the next step is not such a step: schedule() as usual."""
        count = self._num_implicit
        if (
            not count
            or self._explicit
            or self._needs_block
            or self.waiting
            or self._partial is not None
            or self._reservation is not None
            or count > self.config.max_num_batched_tokens
        ):
            return None
        tick = len(self._clock)
        # Every implicit decode is filed under its next event's tick (past ticks are popped).
        steps = min(self._wake, default=tick) - tick
        if steps <= 0:
            return None
        return count, self._implicit_base + count * tick, steps

    def tick_quiet(self, ends: list[float]) -> None:
        """schedule() and update() of quiet steps (`quiet_steps`), which ended at `ends`."""
        self._clock.extend(ends)

    def sync(self) -> None:
        """Bring every implicit decode up to date (tokens, times, computed counts) and make it
        explicit. For inspection and tests; the simulator never needs it."""
        running = self._sim_running
        for seq in running:
            if seq.implicit_from >= 0:
                self._catch_up(seq)
        self._explicit[:] = running
        self._wake.clear()
        self._needs_block.clear()
