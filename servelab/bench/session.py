"""One benchmark run against a server, end to end: workload -> prompts -> timed streams ->
shared summary. `BenchSession` keeps the client, tokenizer and prompt builder across the levels
of a capacity search, so connections and the tokenizer are set up once."""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from servelab.bench.capacity import LevelRun, certainly_fails
from servelab.bench.client import BenchRequest, OpenAIStreamClient, StreamResult
from servelab.bench.prompts import PromptBuilder
from servelab.bench.records import ClientReport, to_records
from servelab.bench.runner import AbortRule, InFlight, run_load
from servelab.errors import InvalidArgument
from servelab.metrics import (
    SLO,
    RequestRecord,
    Summary,
    steady_state_summary,
    summarize,
)
from servelab.workload import RequestSpec, WorkloadSpec
from servelab.workload.texts import TEXT_KINDS


@dataclass(slots=True)
class BenchRun:
    summary: Summary
    records: list[RequestRecord]
    results: list[StreamResult]
    report: ClientReport
    stopped_early: str = ""
    cancelled: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # Closed loop: the summary without the start-up wave (the first `startup_requests` requests,
    # sent by all clients at once); None for open loop or when nothing follows the wave.
    steady: Summary | None = None
    startup_requests: int = 0


class BenchSession:
    def __init__(
        self,
        client: OpenAIStreamClient,
        prompts: PromptBuilder,
        *,
        num_devices: int = 1,
        slo: SLO | None = None,
        progress: bool = False,
    ) -> None:
        self.client = client
        self.prompts = prompts
        self.num_devices = num_devices
        self.slo = slo
        self.progress = progress
        self._round = 0  # every run gets fresh prompt texts, so no prompt repeats across runs

    async def resolve_model(self) -> str:
        models = await self.client.list_models()  # raises ServerUnreachable
        if self.client.model is None:
            if not models:
                raise InvalidArgument(
                    f"the server at {self.client.base_url} lists no model at /v1/models; name one with --model"
                )
            self.client.model = models[0]
        return self.client.model

    def _requests(self, specs: list[RequestSpec], cycle: bool) -> Iterator[BenchRequest]:
        """BenchRequests for the specs; `cycle` repeats the specs with new prompt texts (for
        closed-loop runs bounded by a duration rather than a count)."""
        base_round = self._round
        rounds = itertools.count() if cycle else range(1)
        for r in rounds:
            for spec in specs:
                yield BenchRequest(
                    index=r * len(specs) + spec.index,
                    prompt=self.prompts.prompt_for(spec, base_round + r),
                    prompt_tokens=spec.prompt_tokens,
                    output_tokens=spec.output_tokens,
                    planned_send_s=spec.arrival_s,
                    think_s=spec.think_s,
                )

    async def run(
        self,
        workload: WorkloadSpec,
        *,
        duration_s: float | None = None,
        warmup: int = 0,
        early_stop: bool = False,
        percentile: int = 90,
        label: str = "",
        startup_wave_extra: bool = False,
    ) -> BenchRun:
        """Run the workload. Closed loop: the first `concurrency` requests (all clients at once) are
        the start-up wave; `BenchRun.steady` summarizes the rest. `startup_wave_extra` sends the
        wave on top of the workload's requests and keeps it out of the early-stop rule, so the
        steady summary covers `num_requests` requests (the capacity search's levels)."""
        # open loop: a rate, or a trace replayed at its own times (a trace with a concurrency is a
        # closed loop, with its start-up wave)
        open_loop = not workload.arrivals.closed_loop
        if not open_loop and workload.concurrency is None:
            raise InvalidArgument("give a load: --rate R (requests/s) or --concurrency C")
        wave = 0 if open_loop or workload.concurrency is None else workload.concurrency
        if startup_wave_extra and wave and workload.num_requests is not None:
            workload = replace_workload(workload, num_requests=workload.num_requests + wave)
        specs = workload.generate(tokenizer=self.prompts.count_tokens if self.prompts.exact else None)
        if warmup > 0:
            await self._warmup(self._warmup_specs(workload, specs, warmup), warmup, workload.concurrency)
        self._round += 1_000
        if open_loop:
            if duration_s is not None:
                first_s = min(s.arrival_s for s in specs if s.arrival_s is not None)
                specs = [s for s in specs if s.arrival_s is not None and s.arrival_s < duration_s]
                if not specs:
                    raise InvalidArgument(
                        f"no request arrives within --duration {duration_s:g} s (the first arrives at "
                        f"{first_s:.1f} s): give a longer --duration or a higher --rate"
                    )
            requests: list[BenchRequest] | Iterator[BenchRequest] = list(self._requests(specs, cycle=False))
            total: int | None = len(specs)
        else:
            requests = self._requests(specs, cycle=duration_s is not None)
            total = None if duration_s is not None else len(specs)
        # The early stop judges the requests that will be measured: without the wave when it is
        # sent on top of them, with it otherwise (then the whole run is what is reported).
        skip = wave if startup_wave_extra else 0
        rule = (
            _saturation_rule(self.slo, percentile, total - skip, skip_below=skip)
            if (early_stop and self.slo and total and total > skip)
            else None
        )
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(
                total=total, unit="req", desc=label or "benchmarking", file=sys.stderr, mininterval=0.25, leave=False
            )
        try:
            outcome = await run_load(
                self.client,
                requests,
                concurrency=workload.concurrency,
                duration_s=duration_s,
                should_abort=rule,
                on_result=None if bar is None else (lambda _r: bar.update(1)),
            )
        finally:
            if bar is not None:
                bar.close()
        records, report = to_records(
            outcome.results,
            outcome.start_s,
            self.prompts.count_tokens if self.prompts.exact else None,
            check_prompt_tokens=self.client.endpoint == "completions" and self.prompts.exact,
        )
        summary = summarize(records, outcome.duration_s, self.num_devices, self.slo)
        steady = (
            steady_state_summary(records, skip_first=wave, num_devices=self.num_devices, slo=self.slo) if wave else None
        )
        return BenchRun(summary, records, outcome.results, report, outcome.abort_reason, outcome.cancelled,
                        steady=steady, startup_requests=wave)  # fmt: skip

    def _warmup_specs(self, workload: WorkloadSpec, specs: list[RequestSpec], n: int) -> list[RequestSpec]:
        """The specs the warm-up cycles through. A text workload's prompts are fixed per request, so
        warming up on the measured ones would leave their passages in the server's prefix cache:
        it warms up on the requests that follow them instead."""
        if workload.kind not in TEXT_KINDS:
            return specs
        more = replace_workload(workload, num_requests=len(specs) + n)
        return more.generate(tokenizer=self.prompts.count_tokens if self.prompts.exact else None)[len(specs) :]

    async def _warmup(self, specs: list[RequestSpec], n: int, concurrency: int | None) -> None:
        """Requests that open the connections and wake the server; never measured."""
        self._round += 1
        warm = [replace(s, arrival_s=None, think_s=0.0) for s in itertools.islice(itertools.cycle(specs), n)]
        warm = [replace(s, index=i) for i, s in enumerate(warm)]
        width = min(n, concurrency or n)
        await run_load(self.client, self._requests(warm, cycle=False), concurrency=width)

    def measure_fn(
        self,
        loop: asyncio.AbstractEventLoop,
        base: WorkloadSpec,
        mode: str,
        percentile: int,
        *,
        warmup: int = 0,
        duration_s: float | None = None,
        runs: list[tuple[float, BenchRun]] | None = None,
    ) -> Callable[[float], LevelRun]:
        """A synchronous `measure(load) -> LevelRun` for the capacity search, driving `loop`:
        each level runs a workload like `base` at that load. Without --num-requests a level has
        max(64, 8 x concurrency) requests, or 30 s worth at a rate (a level's `duration_s` worth
        when one is given, as a plain run sizes it), so it reaches a steady state.
        At a concurrency C, a first wave of C requests (all clients at once) runs on top of those
        and is not measured: it only says how the server absorbs a burst of C prompts, and at 8
        requests per client it is 1/8 of the samples, enough to decide a p90 TTFT by itself."""

        def measure(load: float) -> LevelRun:
            if mode == "concurrency":
                n = base.num_requests or max(64, 8 * int(load))
                workload = replace_workload(base, concurrency=int(load), rate=None, num_requests=n)
            else:
                span_s = 30.0 if duration_s is None else duration_s * 1.5  # the surplus is never sent
                n = base.num_requests or max(64, math.ceil(span_s * load))
                workload = replace_workload(base, rate=float(load), num_requests=n)
            out = loop.run_until_complete(
                self.run(
                    workload,
                    duration_s=duration_s,
                    warmup=warmup,
                    early_stop=True,
                    percentile=percentile,
                    label=f"{mode} {load:g}",
                    startup_wave_extra=True,
                )
            )
            if runs is not None:
                runs.append((load, out))
            return LevelRun(out.summary if out.steady is None else out.steady, out.stopped_early)

        return measure


def replace_workload(base: WorkloadSpec, **changes: Any) -> WorkloadSpec:
    fields = {
        name: getattr(base, name)
        for name in (
            "num_requests",
            "rate",
            "concurrency",
            "burstiness",
            "input_len",
            "output_len",
            "shared_prefix_fraction",
            "num_prefix_groups",
            "seed",
            "dataset",
            "trace",
            "arrival",
            "think_time_s",
            "think_time_dist",
            "dataset_kind",
        )
    }
    fields.update(changes)
    return WorkloadSpec(**fields)


def _saturation_rule(slo: SLO, percentile: int, total: int, *, skip_below: int = 0) -> AbortRule:
    """Stop a level once it is certain to miss the percentile target (see certainly_fails):
    requests that finished over a target, plus requests still waiting for their first token
    past the TTFT target, are enough on their own. `total` counts the measured requests; those
    with an index below `skip_below` (the unmeasured start-up wave) are not looked at."""

    def rule(results: list[StreamResult], in_flight: list[InFlight], now: float) -> str:
        results = [r for r in results if r.index >= skip_below]
        in_flight = [f for f in in_flight if f.index >= skip_below]
        failures = sum(1 for r in results if not r.success)
        # Per target: a request over the TTFT target and another over the TPOT target do not
        # decide either percentile.
        over = {"TTFT": 0, "TPOT": 0, "E2E": 0}
        for r in results:
            if not r.success or r.first_token_s is None:
                continue
            if slo.ttft_s is not None and r.first_token_s - r.send_s > slo.ttft_s:
                over["TTFT"] += 1
            n = r.usage_output_tokens or len(r.token_times_s)
            if slo.tpot_s is not None and n > 1 and (r.token_times_s[-1] - r.first_token_s) / (n - 1) > slo.tpot_s:
                over["TPOT"] += 1
            if slo.e2e_s is not None and r.token_times_s[-1] - r.send_s > slo.e2e_s:
                over["E2E"] += 1
        for f in in_flight:
            waited_s = now - f.send_s
            if slo.ttft_s is not None and f.first_token_s is None and waited_s > slo.ttft_s:
                over["TTFT"] += 1
            if slo.e2e_s is not None and waited_s > slo.e2e_s:
                over["E2E"] += 1
        if certainly_fails(0, failures, total, percentile):
            return f"stopped early: {failures} of {total} requests failed already decide p{percentile}"
        for label, count in over.items():
            if count and certainly_fails(count, 0, total, percentile):
                return (
                    f"stopped early: {count} requests over the {label} target of {total} already decide p{percentile}"
                )
        return ""

    return rule
