"""Which limit set a planned capacity: the SLO itself (latency grows with the batch), the
scheduler's `--max-num-seqs`, or the KV cache (no room for more sequences)?

Judged on the simulated level that decided the search: the first failing load above the capacity,
or the capacity itself when the search stopped at its maximum without failing. A level is bound
by max-num-seqs when its running batch reached that cap (extra clients queued for a slot), and by
the KV cache when, below the cap, clients waited while the pool had no room for one more request
(or sequences were preempted). A search that never failed is bound by its own maximum.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from servelab.bench.capacity import CapacityResult

if TYPE_CHECKING:
    from servelab.sim import SimResult

Limit = Literal["slo", "max-num-seqs", "kv-cache", "search-maximum"]


@dataclass(frozen=True, slots=True)
class Observed:
    """What one simulated level did beyond its latencies."""

    peak_running: int
    peak_kv_usage: float
    preemptions: int
    kv_capacity_tokens: int


def observe(result: SimResult) -> Observed:
    return Observed(result.peak_running, result.peak_kv_usage, result.summary.preemptions,
                    int(result.config["kv_capacity_tokens"]))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Binding:
    limit: Limit
    at_concurrency: int  # the level judged
    peak_running: int
    max_num_seqs: int
    peak_kv_usage: float
    kv_capacity_tokens: int
    preemptions: int
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def binding_limit(
    result: CapacityResult, observed: dict[int, Observed], *, max_num_seqs: int, request_tokens: int
) -> Binding | None:
    """`request_tokens`: the longest request's prompt + output, what one more sequence needs in
    the KV cache. None when no load met the SLO (nothing was bound)."""
    if result.best is None:
        return None
    level = result.first_failing if result.first_failing is not None else result.best
    load = int(level.load)
    seen = observed[load]
    if load > max_num_seqs and seen.peak_running >= max_num_seqs:
        limit: Limit = "max-num-seqs"
        detail = (
            f"--max-num-seqs {max_num_seqs}: at concurrency {load} the running batch peaked at "
            f"{seen.peak_running} sequences and the other clients queued for a slot"
        )
    elif seen.preemptions > 0 or (
        seen.peak_running < load and (1.0 - seen.peak_kv_usage) * seen.kv_capacity_tokens < request_tokens
    ):
        limit = "kv-cache"
        detail = (
            f"the KV cache ({seen.kv_capacity_tokens:,} tokens, {request_tokens:,} per request): at "
            f"concurrency {load} it peaked at {seen.peak_kv_usage:.0%} with {seen.peak_running} sequences "
            f"running (< --max-num-seqs {max_num_seqs}), {seen.preemptions} preemptions"
        )
    elif level is result.best:
        limit = "search-maximum"
        detail = (
            f"the search's maximum: concurrency {load} still meets the SLO with {seen.peak_running} "
            f"sequences running, KV {seen.peak_kv_usage:.0%}"
        )
    else:
        limit = "slo"
        detail = (
            f"the SLO: at concurrency {load} the batch ({seen.peak_running} sequences, KV "
            f"{seen.peak_kv_usage:.0%}) was below --max-num-seqs {max_num_seqs} and the KV cache"
        )
    if level is result.first_failing:
        detail += f"; {level.reason}"
    elif limit != "search-maximum":
        detail += " (still passing at the search's maximum)"
    return Binding(
        limit,
        load,
        seen.peak_running,
        max_num_seqs,
        seen.peak_kv_usage,
        seen.kv_capacity_tokens,
        seen.preemptions,
        detail,
    )


__all__ = ["Binding", "Observed", "binding_limit", "observe"]
