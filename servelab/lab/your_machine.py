"""The "your machine" panel: prediction against measurement on the host the lab runs on.

Under `servelab serve` the page sends a short load to the server's own `/v1/completions` (the
same route, API key and limits as any client) and posts what it measured here: each request's
send, first-token and last-token times and its token counts. `predict` replays exactly that
traffic (a closed loop at the page's concurrency, the measured lengths) through the simulator,
set up as the server is (its /metrics publish the scheduler and KV pool) and priced by the
calibrated profile given with `--profile`, and answers both sides on the same bins. Without a
profile it answers the measurement alone and says how to get the prediction.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from servelab.errors import InvalidArgument, ServelabError
from servelab.lab.common import fmt, stat
from servelab.lab.limits import LIMITS
from servelab.metrics import RequestRecord, Summary, summarize

HIST_BINS = 12
# The panel's form. Each client pauses think_ms after a request, and the replay's clients do too:
# without a pause the simulator's follow-up joins the very next step, which the browser's, a
# round trip away, does not (docs/fidelity.md, "Closed loops: the client's round trip").
LOAD_DEFAULTS = {"requests": 16, "concurrency": 4, "prompt_words": 64, "max_tokens": 32, "think_ms": 20}


class PredictionBusy(ServelabError):
    http_status = 429
    error_type = "rate_limit_exceeded"


def _number(item: dict[str, Any], name: str, index: int) -> float:
    value = item.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"records[{index}].{name}: must be a finite number >= 0, got {value!r}", param=name)
    return float(value)


def _number_or_none(item: dict[str, Any], name: str, index: int) -> float | None:
    return None if item.get(name) is None else _number(item, name, index)


def parse_records(body: Any) -> tuple[list[RequestRecord], int, float]:
    """The page's measurements, checked: at most the panel's own request limit. Returns the
    records, the concurrency and each client's pause after a request in seconds (0 if not sent)."""
    if not isinstance(body, dict) or not isinstance(body.get("records"), list):
        raise InvalidArgument('body: expected {"concurrency": C, "records": [...]}', param="records")
    lo, hi = LIMITS["live"]["requests"]
    items = body["records"]
    if not lo <= len(items) <= hi:
        raise InvalidArgument(f"records: between {lo:g} and {hi:g} requests, got {len(items)}", param="records")
    c_lo, c_hi = LIMITS["live"]["concurrency"]
    concurrency = body.get("concurrency")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not c_lo <= concurrency <= c_hi:
        raise InvalidArgument(
            f"concurrency: must be an integer between {c_lo:g} and {c_hi:g}, got {concurrency!r}", param="concurrency"
        )
    t_lo, t_hi = LIMITS["live"]["think_ms"]
    think_ms = body.get("think_ms", 0)
    if isinstance(think_ms, bool) or not isinstance(think_ms, int | float) or not t_lo <= think_ms <= t_hi:
        raise InvalidArgument(
            f"think_ms: must be a number between {t_lo:g} and {t_hi:g}, got {think_ms!r}", param="think_ms"
        )
    records = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidArgument(f"records[{i}]: expected an object", param="records")
        ok = item.get("ok", True)
        if not isinstance(ok, bool):  # bool("no") is True: a string would count a failure as a success
            raise InvalidArgument(f"records[{i}].ok: must be true or false, got {ok!r}", param="ok")
        sent = _number(item, "sent_s", i)
        # a failed request may have no first or last token
        first = _number(item, "first_token_s", i) if ok else _number_or_none(item, "first_token_s", i)
        last = _number(item, "last_token_s", i) if ok else _number_or_none(item, "last_token_s", i)
        prompt = int(_number(item, "prompt_tokens", i))
        output = int(_number(item, "output_tokens", i))
        if ok and (first is None or last is None or not sent <= first <= last):
            raise InvalidArgument(
                f"records[{i}]: times must run sent_s <= first_token_s <= last_token_s", param="records"
            )
        records.append(
            RequestRecord(
                request_id=str(i),
                arrival_s=sent,
                first_scheduled_s=None,
                first_token_s=first,
                token_times_s=(),
                end_s=last,
                prompt_tokens=prompt,
                output_tokens=output,
                success=ok,
            )
        )
    return records, concurrency, think_ms / 1e3


def _bins(*series: list[float]) -> list[float]:
    values = [v for s in series for v in s if v > 0]
    if not values:
        return []
    lo, hi = min(values), max(values)
    if hi <= lo * 1.01:
        lo, hi = lo / 1.2, hi * 1.2
    return np.geomspace(lo / 1.05, hi * 1.05, HIST_BINS + 1).tolist()


def _hist(values: list[float], edges: list[float]) -> list[int]:
    return np.histogram(values, bins=edges)[0].astype(int).tolist() if edges else []


def _ms_values(records: list[RequestRecord], attr: str) -> list[float]:
    return [v * 1e3 for r in records if r.success and (v := getattr(r, attr)) is not None]


class Predictor:
    """Replays measured traffic through the simulator; one replay at a time (429 beyond)."""

    def __init__(
        self,
        profile: dict[str, Any] | None,
        profile_path: str | None,
        metrics_text: Callable[[], str] | None,
        served_model: Callable[[], str | None] | None = None,
    ):
        self.profile = profile
        self.profile_path = profile_path
        self._metrics_text = metrics_text
        self._served_model = served_model or (lambda: None)
        self._lock = threading.Lock()  # the profile and its path change together
        self._replaying = threading.Lock()

    def set_profile(self, profile: dict[str, Any], path: str) -> None:
        """A profile that finished calibrating while the lab runs: later predictions use it."""
        with self._lock:
            self.profile, self.profile_path = profile, path

    def describe(self) -> dict[str, Any]:
        """What the panel can do here, for the page (shown before any load is sent)."""
        return {"engine": self._metrics_text is not None, "profile": self.profile_summary(), "defaults": LOAD_DEFAULTS}

    def profile_summary(self) -> dict[str, Any] | None:
        """The loaded profile as the panel shows it: its fit, its held-out error and how noisy the
        host was while it was measured (None where the profile does not say)."""
        profile = self.profile
        if profile is None:
            return None
        fit = profile.get("fit") or {}
        host = profile.get("host")
        return {
            "path": self.profile_path,
            "model": profile.get("model"),
            "source": profile.get("source", "engine"),
            "host": host.get("cpu") if isinstance(host, dict) else host,
            "coefficients": fit.get("coefficients", {}),
            "held_out": fit.get("heldout") or None,
            "noise": noise_of(profile),
        }

    def predict(self, body: Any) -> dict[str, Any]:
        records, concurrency, think_s = parse_records(body)
        if not self._replaying.acquire(blocking=False):
            raise PredictionBusy("the lab is already replaying a load through the simulator; retry in a second")
        try:
            return self._predict(records, concurrency, think_s)
        finally:
            self._replaying.release()

    def _predict(self, records: list[RequestRecord], concurrency: int, think_s: float) -> dict[str, Any]:
        ok = [r for r in records if r.success]
        start = min(r.arrival_s for r in records)
        end = max((r.end_s or r.arrival_s) for r in records)
        measured = summarize(records, end - start)
        with self._lock:
            profile, profile_path = self.profile, self.profile_path
        predicted = None
        why_not = None
        if profile is None:
            why_not = (
                "no profile loaded: press Calibrate (about two minutes, against this server), or run "
                "`servelab calibrate --out profile.json` on this host and `servelab serve --profile profile.json`, "
                "to overlay the simulator's prediction"
            )
        elif self._metrics_text is None:
            why_not = "no engine here: the prediction replays a measured load, which needs `servelab serve`"
        elif not ok:
            why_not = "no request succeeded: nothing to replay"
        elif not _replayable(records):
            why_not = "no request that succeeded produced a token: nothing to replay"
        else:
            predicted, why_not = self._replay(profile, self._metrics_text, records, concurrency, think_s)
        out_ttft, out_tpot = _ms_values(records, "ttft_s"), _ms_values(records, "tpot_s")
        sim_ttft = [] if predicted is None else _ms_values(predicted.records, "ttft_s")
        sim_tpot = [] if predicted is None else _ms_values(predicted.records, "tpot_s")
        ttft_edges, tpot_edges = _bins(out_ttft, sim_ttft), _bins(out_tpot, sim_tpot)
        rows = []
        if predicted is not None:
            from servelab.bench.fidelity import compare

            rows = [r.to_dict() for r in compare(measured, predicted.summary)]
        side_by_side = percentile_table(measured, None if predicted is None else predicted.summary)
        stats = [stat("requests (ok / sent)", f"{len(ok)} / {len(records)}")]
        for metric in ("TTFT", "TPOT"):
            m, sim = side_by_side[metric]["measured_ms"], side_by_side[metric]["predicted_ms"]
            value = " / ".join(fmt(v) for v in m) + " ms"
            if predicted is not None:
                value += " measured, " + " / ".join(fmt(v) for v in sim) + " ms predicted"
            stats.append(stat(f"{metric} p50 / p90 / p99", value))
        if profile is not None:
            summary = self.profile_summary() or {}
            stats += profile_stats(summary)
        if predicted is not None:
            notice = (
                f"the simulator, priced by {profile_path}, predicts TTFT {_pcts(side_by_side, 'TTFT')} and TPOT "
                f"{_pcts(side_by_side, 'TPOT')} off the measurement at p50 / p90 / p99 for this load ({len(ok)} requests at "
                f"concurrency {concurrency}, each client pausing {fmt(think_s * 1e3)} ms after a request, as the "
                "replay's do)."
            )
            noise = noise_of(profile or {})
            if noise is not None and noise["noisy"]:
                notice += (
                    " The profile was measured on a noisy host: its step times carry other processes' "
                    "interference, so expect errors of that size; recalibrate on a quiet host."
                )
        else:
            p50 = {k: _ms(getattr(measured, f"{k}_s").p50) for k in ("ttft", "tpot")}
            notice = (
                f"measured {len(ok)} requests at concurrency {concurrency}: p50 TTFT {fmt(p50['ttft'])} ms, "
                f"p50 TPOT {fmt(p50['tpot'])} ms; {why_not}."
            )
        return {
            "config": {
                "concurrency": concurrency,
                "requests": len(records),
                "think_ms": think_s * 1e3,
                "profile": profile_path,
            },
            "ttft": {
                "edges_ms": ttft_edges,
                "measured": _hist(out_ttft, ttft_edges),
                "predicted": _hist(sim_ttft, ttft_edges),
            },
            "tpot": {
                "edges_ms": tpot_edges,
                "measured": _hist(out_tpot, tpot_edges),
                "predicted": _hist(sim_tpot, tpot_edges),
            },
            "percentiles": side_by_side,
            "has_prediction": predicted is not None,
            "why_no_prediction": why_not,
            "comparison": rows,
            "measured": measured.to_dict(),
            "predicted": None if predicted is None else predicted.summary.to_dict(),
            "stats": stats,
            "notice": notice,
        }

    def _replay(
        self,
        profile: dict[str, Any],
        metrics_text: Callable[[], str],
        records: list[RequestRecord],
        concurrency: int,
        think_s: float,
    ) -> tuple[Any, str | None]:
        from servelab.bench.fidelity import replay_trace, server_config, sim_config
        from servelab.cost.profile import catalog_model_for
        from servelab.sim import simulate

        server = server_config(metrics_text())
        missing = [
            k
            for k in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
            if not server.get(k, "").isdigit()
        ]
        if missing:
            return None, f"the server's /metrics do not publish {', '.join(missing)}: cannot set up the simulator"
        model = catalog_model_for(profile, self._served_model())
        if model is None:
            return None, f"no catalog model matches the profile's model {profile.get('model')!r}"
        trace = replay_trace(records, closed_loop=True, think_s=think_s)
        return simulate(sim_config(profile, server, model, None), trace, concurrency=concurrency), None


def _replayable(records: list[RequestRecord]) -> bool:
    from servelab.bench.fidelity import replayed

    return bool(replayed(records))


def _ms(seconds: float | None) -> float:
    return math.nan if seconds is None else seconds * 1e3  # fmt() prints nan as "n/a"; 0 stays 0


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.0f}%"


def _pcts(table: dict[str, dict[str, list[Any]]], metric: str) -> str:
    return " / ".join(_pct(e) for e in table[metric]["error_pct"])


PERCENTILES = ("p50", "p90", "p99")


def percentile_table(measured: Summary, predicted: Summary | None) -> dict[str, dict[str, list[Any]]]:
    """TTFT and TPOT at p50, p90 and p99 in ms, measured beside predicted (None without a
    prediction), with the prediction's error in %: the chart's bars and the stat tiles."""
    table: dict[str, dict[str, list[Any]]] = {}
    for metric in ("TTFT", "TPOT"):
        name = f"{metric.lower()}_s"
        m = [getattr(getattr(measured, name), p) for p in PERCENTILES]
        sim = (
            [None] * len(PERCENTILES)
            if predicted is None
            else [getattr(getattr(predicted, name), p) for p in PERCENTILES]
        )
        table[metric] = {
            "percentiles": list(PERCENTILES),
            "measured_ms": [None if v is None else v * 1e3 for v in m],
            "predicted_ms": [None if v is None else v * 1e3 for v in sim],
            "error_pct": [None if a is None or b is None or a == 0 else (b - a) / a * 100.0 for a, b in zip(m, sim)],
        }
    return table


def noise_of(profile: dict[str, Any]) -> dict[str, Any] | None:
    """The profile's own verdict on its host (`host_noise`, written by `servelab calibrate` in the
    engine and from outside); None for a profile that does not record one."""
    noise = profile.get("host_noise")
    if not isinstance(noise, dict) or "noisy" not in noise:
        return None
    thresholds = noise.get("thresholds") or {}
    return {
        "noisy": noise["noisy"],
        "spread_median_pct": noise.get("spread_median_pct"),
        "other_cpus": noise.get("other_cpus"),
        "rule": f"noisy when a step's median repeat is over {thresholds.get('spread_median_pct', 10):g}% slower "
        "than its fastest"
        + (
            ""
            if thresholds.get("other_cpus") is None or noise.get("other_cpus") is None  # unmeasured from outside
            else f", or other processes kept over {thresholds['other_cpus']:g} CPUs busy"
        ),
        "describe": noise.get("describe"),
    }


def profile_stats(summary: dict[str, Any]) -> list[dict[str, str]]:
    """The profile's held-out error and noise flag, as stat tiles."""
    held, noise = summary.get("held_out"), summary.get("noise")
    out = []
    if held:
        out.append(
            stat(
                "profile's held-out error (median / max)",
                f"{fmt(held.get('median_abs_pct'))}% / {fmt(held.get('max_abs_pct'))}% over {held.get('count')} steps",
            )
        )
    else:
        out.append(stat("profile's held-out error", "not recorded in the profile"))
    if noise is None:
        out.append(stat("host while calibrating", "not recorded in the profile"))
    else:
        verdict = "unknown" if noise["noisy"] is None else "NOISY" if noise["noisy"] else "quiet"
        spread = noise.get("spread_median_pct")
        out.append(
            stat(
                "host while calibrating",
                verdict + ("" if spread is None else f" (median repeat {fmt(spread)}% over its fastest)"),
            )
        )
    return out
