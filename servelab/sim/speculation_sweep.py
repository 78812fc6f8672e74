"""Speculative decoding against plain decoding over concurrencies, on the simulator: where it
stops paying (`servelab sim --compare-speculation`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from servelab.errors import InvalidArgument
from servelab.metrics import Summary
from servelab.sim.runner import SimConfig, SimResult, simulate
from servelab.workload import WorkloadSpec

MIN_REQUESTS_PER_CLIENT = 4  # measured requests per client at each level, after its start-up wave


@dataclass(slots=True)
class ComparedLevel:
    """One concurrency run twice, on the same requests: plain and speculative."""

    concurrency: int
    plain: Summary
    spec: Summary
    tokens_per_verification: float | None  # realised, per verification entry

    @property
    def speedup(self) -> float:
        """Mean TPOT plain / speculative: above 1, speculation pays."""
        plain, spec = self.plain.tpot_s.mean, self.spec.tpot_s.mean
        assert plain is not None and spec is not None  # _steady requires TPOTs
        return plain / spec

    @property
    def throughput_ratio(self) -> float:
        """Output tokens/s speculative / plain."""
        return self.spec.output_throughput / self.plain.output_throughput

    @property
    def pays(self) -> bool:
        """Faster per user without fewer tokens in total. Past the token budget's room for K + 1
        tokens per sequence, a speculative run holds fewer sequences in a step: their TPOT
        recovers while the total falls."""
        return self.speedup >= 1.0 and self.throughput_ratio >= 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "plain_tpot_s": self.plain.tpot_s.mean,
            "spec_tpot_s": self.spec.tpot_s.mean,
            "plain_tpot_p50_s": self.plain.tpot_s.p50,
            "spec_tpot_p50_s": self.spec.tpot_s.p50,
            "plain_tpot_p90_s": self.plain.tpot_s.p90,
            "spec_tpot_p90_s": self.spec.tpot_s.p90,
            "plain_output_throughput": self.plain.output_throughput,
            "spec_output_throughput": self.spec.output_throughput,
            "speedup": self.speedup,
            "throughput_ratio": self.throughput_ratio,
            "pays": self.pays,
            "tokens_per_verification": self.tokens_per_verification,
        }


def _steady(result: SimResult) -> Summary:
    summary = result.steady_or_whole
    if summary.failed:
        raise InvalidArgument(f"{summary.failed} request(s) failed in a comparison run; the deployment cannot serve it")
    if summary.tpot_s.mean is None:
        raise InvalidArgument("--compare-speculation compares TPOT, which needs outputs of 2 or more tokens")
    return summary


def compare_speculation(
    config: SimConfig,
    workload: WorkloadSpec,
    concurrencies: list[int],
    check: Callable[[], None] | None = None,
) -> list[ComparedLevel]:
    """Each concurrency as a closed loop, with `config`'s speculation and without it. A level
    sends its start-up wave (left out of the summary) and at least MIN_REQUESTS_PER_CLIENT
    measured requests per client, or the workload's `num_requests` if more. `check` is
    `simulate`'s: called as the runs go, it may raise to end them (a deadline, a stopping server)."""
    if config.speculative is None:
        raise InvalidArgument("comparing speculation needs a speculative config", param="speculative_config")
    if workload.rate is not None or workload.trace is not None:
        raise InvalidArgument("--compare-speculation runs closed loops at its concurrencies; drop --rate/--trace")
    if not concurrencies or min(concurrencies) < 1:
        raise InvalidArgument(f"--compare-speculation needs concurrencies >= 1, got {concurrencies}")
    plain_config = replace(config, speculative=None, spec_acceptance=None)
    levels = []
    for c in concurrencies:
        n = max(workload.num_requests or 0, MIN_REQUESTS_PER_CLIENT * c) + c
        level = replace(workload, concurrency=c, num_requests=n)
        plain = simulate(plain_config, level, check=check)
        spec = simulate(config, level, check=check)
        realised = (spec.speculation or {}).get("realised", {})
        levels.append(ComparedLevel(c, _steady(plain), _steady(spec), realised.get("tokens_per_verification")))
    return levels


def crossover_concurrency(levels: list[ComparedLevel]) -> int | None:
    """The first concurrency at which speculation stops paying (`ComparedLevel.pays`), or None."""
    return next((level.concurrency for level in levels if not level.pays), None)
