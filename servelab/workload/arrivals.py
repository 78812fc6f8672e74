"""Arrival processes: when each request is sent.

Open loop (a rate): inter-arrival gaps are gamma-distributed with shape = burstiness and
scale = 1 / (rate × burstiness), as vLLM's `bench serve` defines it. The mean gap is always
1/rate; burstiness 1 is a Poisson process, < 1 is burstier, > 1 smoother, and infinity is a
constant rate. A rate of infinity sends every request at t = 0.

Closed loop (a concurrency): C clients each send their next request a think time after the
previous one ends (default 0: at once), so there are no arrival times to draw; the driver
(simulator or bench client) decides them as requests complete. A constant think time above the
client's round trip gives the bench and the simulator the same step structure (docs/fidelity.md,
"Closed loops: the client's round trip"). Clients started together stay in lockstep under a
constant think time, so a planner's "N users, each reading T seconds" wants an exponential one
(mean T, drawn per request from the seed): it spreads the users out as real readers are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from servelab.errors import InvalidArgument
from servelab.units import parse_duration_s

KINDS = ("poisson", "gamma", "constant", "closed")
THINK_DISTS = ("constant", "exponential")


@dataclass(frozen=True, slots=True)
class ArrivalProcess:
    kind: str
    rate_per_s: float = math.inf
    burstiness: float = 1.0
    concurrency: int | None = None  # closed loop: the number of clients
    think_time_s: float = 0.0  # closed loop: a client's pause between a request's end and its next send (mean)
    think_time_dist: str = "constant"  # or "exponential"

    @classmethod
    def create(
        cls,
        rate: float | None,
        concurrency: int | None = None,
        burstiness: float = 1.0,
        kind: str | None = None,
        think_time_s: float = 0.0,
        think_time_dist: str = "constant",
    ) -> ArrivalProcess:
        """Pick the process from the flags: a concurrency without a rate is closed loop; a rate
        with burstiness 1 is Poisson, infinite burstiness constant, anything else gamma. A think
        time belongs to a closed loop: with a rate it is refused."""
        if rate is not None and not rate > 0:
            raise InvalidArgument(f"rate must be > 0 requests/s, got {rate}", param="rate")
        if concurrency is not None and concurrency < 1:
            raise InvalidArgument(f"concurrency must be >= 1, got {concurrency}", param="concurrency")
        if not burstiness > 0:
            raise InvalidArgument(f"burstiness must be > 0, got {burstiness}", param="burstiness")
        if burstiness != 1.0 and rate is None:
            raise InvalidArgument(
                f"burstiness {burstiness:g} shapes the gaps between a rate's arrivals: give --rate R, or drop it",
                param="burstiness",
            )
        if not (math.isfinite(think_time_s) and think_time_s >= 0):
            raise InvalidArgument(
                f"think time must be a finite duration >= 0 s, got {think_time_s}", param="think_time"
            )
        if think_time_dist not in THINK_DISTS:
            raise InvalidArgument(
                f"think time distribution must be one of {', '.join(THINK_DISTS)}, got {think_time_dist!r}",
                param="think_time",
            )
        if think_time_s > 0 and rate is not None:
            raise InvalidArgument(
                "--think-time paces a closed loop (--concurrency C); --rate sends requests at the rate's own "
                "times, whatever finished: drop --think-time or --rate",
                param="think_time",
            )
        if kind is not None and kind not in KINDS:
            raise InvalidArgument(f"arrival process must be one of {', '.join(KINDS)}, got {kind!r}")
        if kind is None:
            if rate is None and concurrency is not None:
                kind = "closed"
            elif math.isinf(burstiness):
                kind = "constant"
            elif burstiness == 1.0:
                kind = "poisson"
            else:
                kind = "gamma"
        if kind == "closed" and concurrency is None:
            raise InvalidArgument("a closed-loop workload needs a concurrency (--concurrency C)")
        if kind == "poisson" and burstiness != 1.0:
            raise InvalidArgument(f"a Poisson process has burstiness 1, got {burstiness}; use gamma")
        return cls(
            kind,
            math.inf if rate is None else float(rate),
            float(burstiness),
            concurrency,
            float(think_time_s),
            think_time_dist,
        )

    @property
    def closed_loop(self) -> bool:
        return self.kind == "closed"

    def arrival_times_s(self, rng: np.random.Generator, n: int) -> np.ndarray | None:
        """Send times of n requests (the first gap is drawn too, as in vLLM); None in closed loop."""
        if self.kind == "closed":
            return None
        if math.isinf(self.rate_per_s):
            return np.zeros(n)
        if self.kind == "constant":
            gaps = np.full(n, 1.0 / self.rate_per_s)
        elif self.kind == "poisson":
            gaps = rng.exponential(1.0 / self.rate_per_s, size=n)
        else:
            gaps = rng.gamma(self.burstiness, 1.0 / (self.rate_per_s * self.burstiness), size=n)
        return np.cumsum(gaps)

    def think_times_s(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Each of n requests' think time: the pause its client takes after it ended (reading the
        answer), before taking and sending its next request."""
        if self.kind != "closed" or self.think_time_s == 0:
            return np.zeros(n)
        if self.think_time_dist == "exponential":
            return rng.exponential(self.think_time_s, size=n)
        return np.full(n, self.think_time_s)

    def describe(self) -> str:
        if self.kind == "closed":
            text = f"closed loop, concurrency {self.concurrency}"
            if not self.think_time_s:
                return text
            return text + f", think time {describe_think_time(self.think_time_s, self.think_time_dist)}"
        rate = "inf" if math.isinf(self.rate_per_s) else f"{self.rate_per_s:g}"
        text = f"{self.kind} at {rate} req/s"
        if self.kind == "gamma":
            text += f" (burstiness {self.burstiness:g})"
        if self.concurrency is not None:
            text += f", at most {self.concurrency} in flight"
        return text


def parse_think_time(text: str) -> tuple[float, str]:
    """'50ms' -> (0.05, 'constant'); 'exp:5s' or 'exponential:5s' -> (5.0, 'exponential')."""
    dist, sep, value = text.strip().rpartition(":")
    if not sep:
        dist = "constant"
    dist = {"exp": "exponential", "const": "constant"}.get(dist, dist)
    if dist not in THINK_DISTS:
        raise InvalidArgument(f"--think-time: expected DURATION or exp:DURATION (e.g. 50ms, exp:5s), got {text!r}")
    if value.strip().startswith("-"):
        raise InvalidArgument(f"--think-time must be >= 0, got {text!r}")
    return parse_duration_s(value, name="--think-time"), dist


def describe_think_time(seconds: float, dist: str = "constant") -> str:
    """'50 ms', 'exponential, mean 2.5 s': in the unit a reader would say."""
    value = f"{seconds * 1e3:.4g} ms" if seconds < 1 else f"{seconds:.4g} s"
    return f"exponential, mean {value}" if dist == "exponential" else value
