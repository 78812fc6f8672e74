"""`ModelExecutor`: the core's Executor carried out by the real model.

A step is four methods, as in nano-vllm's ModelRunner: `prepare_decode` and `prepare_prefill` lay
the StepPlan out as one flat batch (tokens, positions, KV slots, per-sequence context slots),
`run_model` runs one forward pass over it, and `sample` picks each sampling row's token. Decodes
go first in the flat batch so they attend together (from their block tables, or in one padded
SDPA); prefill chunks follow, each on its own.

A model with several KV groups (spec/kv_groups.py) gets the slot-dependent tensors once per
group, from that group's block tables (AttentionMetadata.by_group). A windowed group's entries
freed out of the window (NULL_BLOCK) read as block 0: only masked keys, outside every query's
window, point there.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass, field, replace
from typing import overload

import torch

from servelab.core.block_manager import NULL_BLOCK
from servelab.core.plan import ScheduledSeq, StepPlan, StepResult, TokenLogprobs
from servelab.core.sequence import Sequence
from servelab.engine.row_isolation import sample_isolated
from servelab.engine.sampler import NON_FINITE_LOGITS, Sampler
from servelab.engine.verification import VerificationRows, accepted_length, verification_rows
from servelab.runtime.kv_cache import PagedKVCache
from servelab.runtime.model import AttentionMetadata, LlamaModel

logger = logging.getLogger("servelab.engine")
NON_FINITE_HINT = " (an fp16 KV cache holds values up to 65504: try --kv-cache-dtype bfloat16)"


@dataclass(slots=True)
class StepBatch:
    """A step's flat batch as prepare_decode and prepare_prefill lay it out: the decodes' rows
    first, then each prefill chunk's rows."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)
    row_of_last: dict[int, int] = field(default_factory=dict)  # entry -> the row of its last token
    ids: torch.Tensor | None = None  # a decode-only CPU step's ids, already in its one buffer
    num_decodes: int = 0
    decode_block_table: torch.Tensor | None = None
    decode_ctx_lens: torch.Tensor | None = None
    decode_max_ctx: int = 0
    decode_ctx_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[tuple[int, int, int, torch.Tensor | None]] = field(default_factory=list)


class ModelExecutor:
    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, *, seed: int = 0, sampler: Sampler | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler or Sampler(seed)
        self.block_size = kv_cache.block_size
        self.device = model.device
        self._offsets = torch.arange(self.block_size, dtype=torch.int64)
        self._decode_ints = _DecodeInts()
        self.groups = kv_cache.groups
        self._windowed = any(w is not None for w in self.groups.windows)  # tables may hold NULL_BLOCK

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        if plan.block_size != self.block_size:
            raise ValueError(f"plan block_size {plan.block_size} != KV cache block_size {self.block_size}")
        entries = plan.scheduled
        # A verification entry (a decode and its drafts) runs as decode rows, one per position,
        # each attending to its own context: the kernels, and so the bits, of plain decodes.
        decodes = [i for i, s in enumerate(entries) if s.num_tokens - s.num_draft == 1]
        prefills = [i for i, s in enumerate(entries) if s.num_tokens - s.num_draft > 1]
        batch = StepBatch()
        if decodes:
            self.prepare_decode(entries, decodes, batch, decode_only=not prefills)
        self.prepare_prefill(entries, prefills, batch)

        sampling = [i for i in range(len(entries)) if entries[i].samples]  # pooling entries never sample
        rows = verification_rows(entries, sampling, batch.row_of_last)
        scored, scored_rows = _prompt_rows(entries, batch.row_of_last)
        meta = self._attention_metadata(batch, rows.logit_rows + scored_rows, rows.seqs)
        if self.groups.num_groups > 1:
            meta.by_group = [meta] + [self._group_metadata(entries, decodes, prefills, g, meta)
                                      for g in range(1, self.groups.num_groups)]  # fmt: skip
        pool_spans = None
        if plan.pooled:
            pool_spans, pool_rows = _pooled_rows(entries, plan.pooled, batch.row_of_last)
            meta.pooled_indices = torch.tensor(pool_rows, dtype=torch.int64, device=self.device)

        out = self.run_model(batch, meta)
        pooled = None
        if isinstance(out, tuple):  # a pooling step's forward returns the hidden states too
            logits, hidden = out
            assert pool_spans is not None
            pooled = _pool(entries, pool_spans, hidden)
        else:
            logits = out
        prompt_logprobs = None
        if scored:
            prompt_logprobs = _score_prompt(logits[len(rows.seqs) :], entries, scored)
            logits = logits[: len(rows.seqs)]
        sampled, logprobs, accepted = self.sample(entries, rows, logits, meta.argmax)
        return StepResult(sampled, time.perf_counter() - t0, logprobs, prompt_logprobs, pooled, accepted)

    def prepare_decode(self, entries: list[ScheduledSeq], decodes: list[int], batch: StepBatch, *,
                       decode_only: bool, group: int = 0) -> None:  # fmt: skip
        """Lays out the decode rows: each sequence's one new token, its slot, and the block table
        its attention reads (KV group `group`'s). A verification entry has a row per position: row j
        holds its j-th token and attends to the context up to it, drafts before it included (each
        layer stores the step's keys before any row attends)."""
        bs = self.block_size
        ctx_lens: list[int] = []
        for i in decodes:
            s = entries[i]
            ctx_lens += range(s.start_pos + 1, s.start_pos + s.num_tokens + 1)
        B = len(ctx_lens)
        max_ctx = max(ctx_lens)
        max_blocks = -(-max_ctx // bs)
        # Built as Python lists, then one tensor each (decodes only: one buffer): not a few calls a row.
        rows_bt, decode_slots = [], []
        for i in decodes:
            s = entries[i]
            bt = self._table(s.seq, group)[: -(-s.context_len // bs)]
            padded = bt + [0] * (max_blocks - len(bt))
            for p in range(s.start_pos, s.context_len):
                rows_bt.append(padded)
                decode_slots.append(bt[p // bs] * bs + p % bs)  # the new token's slot
            batch.input_ids += s.token_ids() if s.num_draft else [s.seq.token_ids[s.start_pos]]
            batch.row_of_last[i] = len(batch.input_ids) - 1
        if not decode_only or self.device.type != "cpu":
            table = torch.tensor(rows_bt, dtype=torch.int64)
            ctx = torch.tensor(ctx_lens, dtype=torch.int64)
            batch.positions.append(ctx - 1)
            batch.slots.append(torch.tensor(decode_slots, dtype=torch.int64))
        else:  # decodes only: no torch op (_DecodeInts)
            flat = batch.input_ids + [c - 1 for c in ctx_lens] + decode_slots + ctx_lens
            for bt in rows_bt:
                flat += bt
            batch.ids, pos, decode_slot_t, ctx, table = self._decode_ints.fill(B, max_blocks, flat)
            batch.positions.append(pos)
            batch.slots.append(decode_slot_t)
        batch.num_decodes = B
        batch.decode_block_table, batch.decode_ctx_lens, batch.decode_max_ctx = table, ctx, max_ctx
        if not self.model.ops.reads_block_tables:  # gather + SDPA wants flat slots and a mask
            all_slots = (table[:, :, None] * bs + self._offsets).view(B, -1)[:, :max_ctx]
            # Padded keys point at slot 0 (a real slot of some block) and are masked out.
            batch.decode_mask = (torch.arange(max_ctx)[None, :] < ctx[:, None]).view(B, 1, 1, max_ctx)
            batch.decode_ctx_slots = all_slots * batch.decode_mask.view(B, max_ctx)

    def prepare_prefill(self, entries: list[ScheduledSeq], prefills: list[int], batch: StepBatch,
                        group: int = 0) -> None:  # fmt: skip
        """Appends each prefill chunk's rows: its tokens, positions and KV slots (KV group
        `group`'s), and the slots of the context before it that its attention reads. A
        verification entry (a decode and its drafts) is such a chunk."""
        offset = len(batch.input_ids)
        for i in prefills:
            s = entries[i]
            n, start = s.num_tokens, s.start_pos
            batch.input_ids.extend(s.token_ids())
            seq_slots = self._slots(self._table(s.seq, group), start + n)
            batch.positions.append(torch.arange(start, start + n, dtype=torch.int64))
            batch.slots.append(seq_slots[start:])
            batch.prefills.append((offset, n, start, None if start == 0 else seq_slots.to(self.device)))
            batch.row_of_last[i] = offset + n - 1
            offset += n

    def _table(self, seq: Sequence, group: int) -> list[int]:
        """seq's block table of KV group `group`, freed entries (NULL_BLOCK) read as block 0."""
        table = seq.block_table if group == 0 else seq.group_tables[group - 1]
        if self._windowed and table and table[0] == NULL_BLOCK:
            freed = table.count(NULL_BLOCK)  # they lead the table
            return [0] * freed + table[freed:]
        return table

    def _group_metadata(
        self, entries: list[ScheduledSeq], decodes: list[int], prefills: list[int], group: int, meta: AttentionMetadata
    ) -> AttentionMetadata:
        """`meta` with the slot-dependent tensors of KV group `group`."""
        batch = StepBatch()
        if decodes:
            self.prepare_decode(entries, decodes, batch, decode_only=False, group=group)
        self.prepare_prefill(entries, prefills, batch, group)
        slots = batch.slots
        return replace(
            meta,
            slots=self._to_device(slots[0] if len(slots) == 1 else torch.cat(slots)),
            decode_block_table=self._to_device(batch.decode_block_table),
            decode_ctx_slots=self._to_device(batch.decode_ctx_slots),
            decode_mask=self._to_device(batch.decode_mask),
            prefills=batch.prefills,
        )

    def run_model(self, batch: StepBatch, meta: AttentionMetadata) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One forward pass over the flat batch: the logits of meta's rows (and, when it pools, the
        pooled rows' hidden states with them)."""
        ids = batch.ids
        if ids is None:
            ids = torch.tensor(batch.input_ids, dtype=torch.int64, device=self.device)
        return self.model.forward(ids, meta, self.kv_cache.k_layers, self.kv_cache.v_layers)

    def sample(
        self, entries: list[ScheduledSeq], rows: VerificationRows, logits: torch.Tensor, argmax: bool
    ) -> tuple[list[int | None], list[TokenLogprobs | None] | None, list[tuple[int, list[int], list | None]] | None]:
        """One token per sampling entry (None for the others and for a row that failed, which
        ends its request with an error), their logprobs when any asked for them, and each
        verification entry's accepted drafts (StepResult.accepted)."""
        sampled: list[int | None] = [None] * len(entries)
        if not rows.seqs:
            return sampled, None, None
        greedy = self.model.greedy_tokens(logits) if argmax else None
        cpu_logits = logits.cpu() if self.device.type != "cpu" else logits
        drafts = rows.drafts if rows.any_drafts else None
        out = sample_isolated(self.sampler, cpu_logits, rows.seqs, self.vocab_size, greedy, drafts)
        logprobs: list[TokenLogprobs | None] | None = None if out.logprobs is None else [None] * len(entries)
        accepted: list[tuple[int, list[int], list | None]] = []
        for i, first, k in rows.spans:
            seq = entries[i].seq
            kept = (
                seq.draft_token_ids[: accepted_length(out.tokens, first, rows.drafts[first : first + k])] if k else []
            )
            row = first + len(kept)  # the token after the accepted drafts; rows past it are discarded
            reason = out.errors.get(row)
            if reason is not None:  # the scheduler ends this request with finish reason "error"
                hint = NON_FINITE_HINT if reason == NON_FINITE_LOGITS and self.kv_cache.dtype == torch.float16 else ""
                seq.error = reason
                logger.warning("request %s: %s; ending it with an error%s", seq.request_id, reason, hint)
            sampled[i] = out.tokens[row]
            row_logprobs = None if out.logprobs is None else out.logprobs[first : row + 1]
            if logprobs is not None and row_logprobs is not None:
                logprobs[i] = row_logprobs[-1]
            if k:
                draft_lps = row_logprobs[:-1] if row_logprobs and row_logprobs[0] is not None else None
                accepted.append((i, kept, draft_lps))
        return sampled, logprobs, accepted or None

    def _attention_metadata(
        self, batch: StepBatch, logit_rows: list[int], sampled_seqs: list[Sequence]
    ) -> AttentionMetadata:
        n_rows = len(batch.input_ids)  # every row samples, in order: a decode step without prompt scoring
        every_row = len(logit_rows) == n_rows and logit_rows == list(range(n_rows))
        positions, slots = batch.positions, batch.slots
        return AttentionMetadata(
            positions=self._to_device(positions[0] if len(positions) == 1 else torch.cat(positions)),
            slots=self._to_device(slots[0] if len(slots) == 1 else torch.cat(slots)),
            num_decodes=batch.num_decodes,
            block_size=self.block_size,
            decode_block_table=self._to_device(batch.decode_block_table),
            decode_ctx_lens=self._to_device(batch.decode_ctx_lens),
            decode_max_ctx=batch.decode_max_ctx,
            decode_ctx_slots=self._to_device(batch.decode_ctx_slots),
            decode_mask=self._to_device(batch.decode_mask),
            prefills=batch.prefills,
            logits_indices=None if every_row else torch.tensor(logit_rows, dtype=torch.int64, device=self.device),
            argmax=every_row and bool(sampled_seqs) and self.sampler.plain_greedy(sampled_seqs),
        )

    @overload
    def _to_device(self, t: torch.Tensor) -> torch.Tensor: ...
    @overload
    def _to_device(self, t: None) -> None: ...
    def _to_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        # .to() is a dispatched op even when a no-op
        return t if t is None or self.device.type == "cpu" else t.to(self.device)

    def _slots(self, block_table: list[int], num_positions: int) -> torch.Tensor:
        """Flat KV slots of positions 0..num_positions-1 of one sequence."""
        nb = -(-num_positions // self.block_size)
        bt = torch.tensor(block_table[:nb], dtype=torch.int64)
        return (bt[:, None] * self.block_size + self._offsets).view(-1)[:num_positions]


def _prompt_rows(
    entries: list[ScheduledSeq], row_of_last: dict[int, int]
) -> tuple[list[tuple[int, int, int]], list[int]]:
    """The rows whose logits score prompt tokens (vLLM's prompt_logprobs): the row of position p
    predicts token p + 1. Positions already scored (before a preemption) are skipped. Returns
    (entry, first position, number of rows) per scored entry, and the rows."""
    scored: list[tuple[int, int, int]] = []
    rows: list[int] = []
    for i, s in enumerate(entries):
        seq = s.seq
        if seq.needs_prompt_logprobs:
            lo = max(s.start_pos, len(seq.prompt_logprobs))
            hi = min(s.start_pos + s.num_tokens, seq.num_prompt_tokens - 1)
            if lo < hi:
                first_row = row_of_last[i] - (s.num_tokens - 1)
                scored.append((i, lo, hi - lo))
                rows.extend(range(first_row + lo - s.start_pos, first_row + hi - s.start_pos))
    return scored, rows


class _DecodeInts:
    """A decode-only step's int64 inputs (token ids, positions, new KV slots, context lengths, the
    block table) in one buffer, written through ctypes, so that a steady decode step makes no torch
    op before its forward: after the last step's weight stream each op runs cold, 10-70 us
    (docs/benchmarks.md, "Batch 1: cold caches after the weights' stream"). The views are kept
    while the batch's shape holds, and the buffer is rewritten every step: they are the step's."""

    def __init__(self) -> None:
        self._shape: tuple[int, int] | None = None

    def fill(self, rows: int, width: int, values: list[int]) -> tuple[torch.Tensor, ...]:
        """ids, positions, slots, context lengths [rows] and the block table [rows, width], from
        `values`: those five, flat and in that order."""
        if (rows, width) != self._shape:
            buf = torch.empty(rows * (4 + width), dtype=torch.int64)
            self._array = (ctypes.c_int64 * buf.numel()).from_address(buf.data_ptr())
            self._views = (*buf[: 4 * rows].view(4, rows).unbind(0), buf[4 * rows :].view(rows, width))
            self._buf, self._shape = buf, (rows, width)
        self._array[:] = values  # type: ignore[assignment]  # typeshed: a ctypes slice takes only c_int64 | int lists
        return self._views


def _pooled_rows(
    entries: list, pooled: list[int], row_of_last: dict[int, int]
) -> tuple[list[tuple[int, int, int]], list[int]]:
    """The hidden-state rows the pooling entries need: every row of a MEAN chunk, the last
    row of a LAST sequence's final chunk. Returns (entry, first row in the pooled output, number
    of rows) per entry, and the rows."""
    spans: list[tuple[int, int, int]] = []
    rows: list[int] = []
    for i in pooled:
        s = entries[i]
        last = row_of_last[i]
        if s.seq.pooling.pools_every_position:
            spans.append((i, len(rows), s.num_tokens))
            rows.extend(range(last - s.num_tokens + 1, last + 1))
        elif s.context_len == s.seq.num_prompt_tokens:
            spans.append((i, len(rows), 1))
            rows.append(last)
    return spans, rows


def _pool(entries: list, spans: list[tuple[int, int, int]], hidden: torch.Tensor) -> list[tuple[int, list[float]]]:
    """Pool each entry's rows into its sequence; a sequence whose prompt ended this step gets its
    vector. MEAN keeps a running fp32 sum across chunks on the sequence (restarted by a chunk at
    position 0, as after a preemption), so a chunked prompt pools exactly as one pass would."""
    out = []
    for i, first, n in spans:
        s = entries[i]
        seq = s.seq
        if seq.pooling.pools_every_position:
            chunk_sum = hidden[first : first + n].sum(dim=0)
            seq.pooling_sum = chunk_sum if s.start_pos == 0 else seq.pooling_sum + chunk_sum
            if s.context_len < seq.num_prompt_tokens:
                continue
            vector = seq.pooling_sum / seq.num_prompt_tokens
            seq.pooling_sum = None
        else:
            vector = hidden[first]
        if seq.pooling.normalize:
            vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
        out.append((i, vector.cpu().tolist()))
    return out


_SCORE_SLICE_ROWS = 256


def _score_prompt(
    logits: torch.Tensor, entries: list, scored: list[tuple[int, int, int]]
) -> list[tuple[int, list[TokenLogprobs]]]:
    """Logprob, rank and top alternatives of each scored prompt token, from the model's raw
    distribution (as vLLM reports prompt logprobs)."""
    targets = torch.tensor(
        [entries[i].seq.token_ids[p + 1] for i, lo, n in scored for p in range(lo, lo + n)], dtype=torch.int64
    )
    top_n = min(max(entries[i].seq.params.prompt_logprobs for i, _, _ in scored), logits.shape[1])
    chosen_list: list[float] = []
    ranks: list[int] = []
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    # In slices of rows: a 2,048-token chunk's full-vocabulary log-softmax and comparison would
    # each be another copy of its logits (~400 MB at a 49k vocabulary).
    for start in range(0, logits.shape[0], _SCORE_SLICE_ROWS):
        stop = start + _SCORE_SLICE_ROWS
        logprobs = torch.log_softmax(logits[start:stop].float().cpu(), dim=-1)
        chosen = logprobs.gather(1, targets[start:stop, None])
        ranks += ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        chosen_list += chosen.squeeze(1).tolist()
        if top_n > 0:
            values, ids = torch.topk(logprobs, top_n, dim=-1)
            top_values += values.tolist()
            top_ids += ids.tolist()
        else:
            top_values += [[] for _ in range(logprobs.shape[0])]
            top_ids += [[] for _ in range(logprobs.shape[0])]
    out = []
    row = 0
    for i, _, n in scored:
        k = entries[i].seq.params.prompt_logprobs
        items = []
        for r in range(row, row + n):
            items.append(
                TokenLogprobs(int(targets[r]), chosen_list[r], list(zip(top_ids[r][:k], top_values[r][:k])), ranks[r])
            )
        out.append((i, items))
        row += n
    return out
