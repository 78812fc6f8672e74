"""Client-side stream results -> the shared `RequestRecord`s, plus the checks a load generator
owes its reader: where token counts came from and whether they agree, how late requests left,
and why failures failed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servelab.bench.client import StreamResult
from servelab.metrics import RequestRecord


@dataclass(slots=True)
class ClientReport:
    """What the bench client knows beyond the shared summary."""

    output_tokens_from_usage: int = 0  # requests whose output count is the server's usage
    output_tokens_from_tokenizer: int = 0  # ... is the client tokenizer's count of the text
    output_tokens_from_chunks: int = 0  # ... is the number of content chunks (no usage, no tokenizer)
    output_mismatch: int = 0  # usage completion_tokens != client tokenizer count of the text
    output_mismatch_max: int = 0
    output_short: int = 0  # usage < max_tokens sent (the server stopped early: EOS honoured, limits)
    prompt_mismatch: int = 0  # usage prompt_tokens != planned prompt length
    prompt_mismatch_max: int = 0
    send_lag_s: dict[str, float | None] = field(default_factory=dict)  # open loop: actual - planned
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count

    def to_dict(self) -> dict[str, Any]:
        return {
            "output_tokens_source": {
                "usage": self.output_tokens_from_usage,
                "tokenizer": self.output_tokens_from_tokenizer,
                "chunks": self.output_tokens_from_chunks,
            },
            "output_tokens_mismatch": {"requests": self.output_mismatch, "max_abs_diff": self.output_mismatch_max},
            "output_shorter_than_requested": self.output_short,
            "prompt_tokens_mismatch": {"requests": self.prompt_mismatch, "max_abs_diff": self.prompt_mismatch_max},
            "send_lag_s": self.send_lag_s,
            "failures": self.failures,
        }

    def lines(self) -> list[str]:
        out: list[str] = []
        n = self.output_tokens_from_usage + self.output_tokens_from_tokenizer + self.output_tokens_from_chunks
        if n:
            src = f"usage {self.output_tokens_from_usage}"
            if self.output_tokens_from_tokenizer:
                src += f", client tokenizer {self.output_tokens_from_tokenizer}"
            if self.output_tokens_from_chunks:
                src += f", chunk count {self.output_tokens_from_chunks}"
            out.append(f"{'Output token counts from':<34}{src}")
        if self.output_mismatch:
            out.append(
                f"{'Usage vs tokenizer disagree':<34}{self.output_mismatch} requests (max {self.output_mismatch_max} tokens)"
            )
        if self.output_short:
            out.append(f"{'Shorter than max_tokens':<34}{self.output_short} requests (server ignored ignore_eos?)")
        if self.prompt_mismatch:
            out.append(
                f"{'Prompt tokens differ from plan':<34}{self.prompt_mismatch} requests "
                f"(max {self.prompt_mismatch_max}; server tokenizer or template differs)"
            )
        p50, p99, peak = (self.send_lag_s.get(k) for k in ("p50", "p99", "max"))
        if p50 is not None and p99 is not None and peak is not None:
            out.append(f"{'Send lag vs plan (ms)':<34}p50 {p50 * 1e3:.2f}, p99 {p99 * 1e3:.2f}, max {peak * 1e3:.2f}")
        for reason, count in sorted(self.failures.items(), key=lambda kv: -kv[1]):
            out.append(f"{'Failed':<34}{count} x {reason}")
        return out


def _spread_times(chunk_times_s: Sequence[float], n_tokens: int) -> list[float]:
    """One time per token. A chunk that carried several tokens repeats its time (as the metrics
    expect); without per-chunk counts the tokens are spread evenly over the chunks."""
    m = len(chunk_times_s)
    if m == n_tokens or m == 0:
        return list(chunk_times_s)
    bounds = np.round(np.linspace(0, n_tokens, m + 1)).astype(int)
    counts = np.diff(bounds)
    if n_tokens >= m:
        return [t for t, c in zip(chunk_times_s, counts) for _ in range(int(c))]
    # Fewer tokens than chunks (a server that splits a token across chunks): keep the first and
    # the last chunk times, so TTFT and E2E stay exact.
    idx = np.round(np.linspace(0, m - 1, n_tokens)).astype(int)
    return [chunk_times_s[i] for i in idx]


def to_records(
    results: Sequence[StreamResult],
    start_s: float,
    count_tokens: Callable[[str], int] | None,
    *,
    check_prompt_tokens: bool = True,
) -> tuple[list[RequestRecord], ClientReport]:
    """Times become relative to `start_s`; TTFT, TPOT and E2E are from the actual send time."""
    report = ClientReport()
    records: list[RequestRecord] = []
    failures: Counter[str] = Counter()
    lags: list[float] = []
    for r in results:
        if r.send_lag_s is not None:
            lags.append(r.send_lag_s)
        if not r.success:
            failures[r.error or "unknown error"] += 1
        tokenizer_count = count_tokens(r.text) if (count_tokens is not None and r.text) else None
        if r.usage_output_tokens is not None:
            output = r.usage_output_tokens
            report.output_tokens_from_usage += r.success
            if tokenizer_count is not None and r.success and tokenizer_count != output:
                report.output_mismatch += 1
                report.output_mismatch_max = max(report.output_mismatch_max, abs(tokenizer_count - output))
            if r.success and output < r.output_tokens_planned:
                report.output_short += 1
        elif tokenizer_count is not None:
            output = tokenizer_count
            report.output_tokens_from_tokenizer += r.success
        else:
            output = len(r.token_times_s)
            report.output_tokens_from_chunks += r.success
        if check_prompt_tokens and r.success and r.usage_prompt_tokens is not None:
            diff = abs(r.usage_prompt_tokens - r.prompt_tokens_planned)
            if diff:
                report.prompt_mismatch += 1
                report.prompt_mismatch_max = max(report.prompt_mismatch_max, diff)
        times = [t - start_s for t in r.token_times_s]
        records.append(
            RequestRecord(
                request_id=str(r.index),
                arrival_s=r.send_s - start_s,
                first_scheduled_s=None,  # not visible from outside the server
                first_token_s=None if r.first_token_s is None else r.first_token_s - start_s,
                token_times_s=_spread_times(times, output) if r.success else times,
                end_s=r.end_s - start_s,
                prompt_tokens=r.usage_prompt_tokens if r.usage_prompt_tokens is not None else r.prompt_tokens_planned,
                output_tokens=output if r.success else len(r.token_times_s),
                success=r.success,
                error=r.error,
                num_cached_tokens=r.usage_cached_tokens or 0,
            )
        )
    report.failures = dict(failures)
    if lags:
        arr = np.asarray(lags)
        p50, p99 = np.percentile(arr, [50, 99])
        report.send_lag_s = {"mean": float(arr.mean()), "p50": float(p50), "p99": float(p99), "max": float(arr.max())}
    return records, report
