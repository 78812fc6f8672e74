"""Which limit set a planned capacity: a latency target (TTFT or TPOT: latency grows with the
batch, and TTFT with any wait for a slot), the scheduler's `--max-num-seqs`, the KV cache (no
room for one more request at its full length), or the token budget (`--max-num-batched-tokens`:
each step's tokens carry only so many decodes beside the prompts joining them)?

The planner's search stops at the most sequences that can run at once (the lowest of the three),
so a search that never failed is bound by that ceiling, measured at the ceiling itself; clients
beyond it would only queue. A search that failed is judged on its first
failing level: bound by max-num-seqs, the KV cache or the token budget when clients waited for a
slot, for memory or for admission there (with think time a level can offer more clients than
run), else by the target it missed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from servelab.bench.capacity import CapacityResult, missed_targets

if TYPE_CHECKING:
    from servelab.sim import SimResult

# "slo": the level failed on failed requests, not on a latency percentile.
Limit = Literal["ttft", "tpot", "e2e", "slo", "max-num-seqs", "kv-cache", "max-num-batched-tokens", "search-maximum"]
Ceiling = Literal["max-num-seqs", "kv-cache", "max-num-batched-tokens", "search-maximum"]
_TARGET_LIMIT: dict[str, Limit] = {"TTFT": "ttft", "TPOT": "tpot", "E2E": "e2e"}


@dataclass(frozen=True, slots=True)
class Observed:
    """What one simulated level did beyond its latencies."""

    peak_running: int
    peak_kv_usage: float
    preemptions: int
    kv_capacity_tokens: int


def observe(result: SimResult) -> Observed:
    # Preemptions in the steady stretch (the whole run's where there is none): the start-up wave's
    # burst can preempt where the sustained load does not.
    return Observed(result.peak_running, result.peak_kv_usage, result.steady_or_whole.preemptions,
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
    result: CapacityResult,
    observed: dict[int, Observed],
    *,
    max_num_seqs: int,
    request_tokens: int,
    ceiling: Ceiling = "search-maximum",
    budget_tokens: int | None = None,
    budget_running: int | None = None,
) -> Binding | None:
    """`request_tokens`: the longest request's prompt + output, what one more sequence needs in
    the KV cache; `ceiling`: what set the search's maximum load; `budget_tokens`: the
    scheduler's --max-num-batched-tokens, and `budget_running` what it keeps running (the mean
    request, by Little's law: `SchedulerConfig.budget_running`). None when no load met the
    targets (nothing was bound)."""
    if result.best is None:
        return None
    level = result.first_failing if result.first_failing is not None else result.best
    load = int(level.load)
    seen = observed[load]
    kv = f"the KV cache ({seen.kv_capacity_tokens:,} tokens, {request_tokens:,} per request)"
    limit: Limit
    if level is result.best:
        limit = ceiling
        if ceiling == "max-num-seqs":
            detail = (
                f"--max-num-seqs {max_num_seqs}: concurrency {load} meets the targets with {seen.peak_running} "
                f"sequences running; more clients would only queue for a slot"
            )
        elif ceiling == "kv-cache":
            detail = (
                f"{kv}: {load} requests fill it at full length, and concurrency {load} meets the targets "
                f"(peak {seen.peak_running} sequences running, KV {seen.peak_kv_usage:.0%}, {seen.preemptions} "
                f"preemptions); more clients would queue for memory"
            )
        elif ceiling == "max-num-batched-tokens":
            detail = (
                f"the token budget (--max-num-batched-tokens {budget_tokens}): concurrency {load} meets the targets "
                f"with {seen.peak_running} sequences running at the peak, about as many as its tokens per step carry "
                f"beside the prompts joining them (the mean request, by Little's law); more clients would only wait "
                f"for admission"
            )
        else:
            detail = (
                f"the search's maximum: concurrency {load} still meets the targets with {seen.peak_running} "
                f"sequences running, KV {seen.peak_kv_usage:.0%}"
            )
        return Binding(limit, load, seen.peak_running, max_num_seqs, seen.peak_kv_usage,
                       seen.kv_capacity_tokens, seen.preemptions, detail)  # fmt: skip
    if load > max_num_seqs and seen.peak_running >= max_num_seqs:
        limit = "max-num-seqs"
        detail = (
            f"--max-num-seqs {max_num_seqs}: at concurrency {load} the running batch peaked at "
            f"{seen.peak_running} sequences and the other clients queued for a slot"
        )
    elif seen.preemptions > 0 or (
        seen.peak_running < load and (1.0 - seen.peak_kv_usage) * seen.kv_capacity_tokens < request_tokens
    ):
        limit = "kv-cache"
        detail = (
            f"{kv}: at concurrency {load} it peaked at {seen.peak_kv_usage:.0%} with {seen.peak_running} "
            f"sequences running (< --max-num-seqs {max_num_seqs}), {seen.preemptions} preemptions"
        )
    elif budget_running is not None and load > budget_running and seen.peak_running >= budget_running:
        # The running count moves around the budget's: a batch that reached it saturated the budget.
        limit = "max-num-batched-tokens"
        detail = (
            f"the token budget (--max-num-batched-tokens {budget_tokens}): at concurrency {load} the running batch "
            f"peaked at {seen.peak_running} sequences, past the {budget_running} its tokens per step carry beside the "
            f"prompts joining them, and the other clients' prompts waited for admission"
        )
    else:
        missed = missed_targets(level.summary, result.slo, result.percentile)
        # Both missed: the one missed by the larger factor.
        worst = max(missed, key=lambda m: m[1] / m[2], default=None)
        limit = "slo" if worst is None else _TARGET_LIMIT[worst[0]]
        name = "the targets" if worst is None else f"the {worst[0]} target"
        detail = (
            f"{name}: at concurrency {load} the batch ({seen.peak_running} sequences, KV "
            f"{seen.peak_kv_usage:.0%}) was below --max-num-seqs {max_num_seqs} and the KV cache"
        )
    detail += f"; {level.reason}"
    return Binding(limit, load, seen.peak_running, max_num_seqs, seen.peak_kv_usage,
                   seen.kv_capacity_tokens, seen.preemptions, detail)  # fmt: skip


__all__ = ["Binding", "Ceiling", "Limit", "Observed", "binding_limit", "observe"]
