"""Length distributions for prompts and outputs, parsed from a CLI string.

Forms (tokens):
  "1024"                 fixed
  "512-2048"             uniform integer in [512, 2048]
  "uniform:512,2048"     the same
  "lognormal:1024,0.5"   lognormal with *mean* 1024 tokens and sigma 0.5 of the underlying
                         normal (the spread: 0 = fixed, 0.5 ≈ a factor-of-1.6 spread, 1 = heavy tail)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from servelab.errors import InvalidArgument

MAX_TOKENS = 10**9  # far past any model's context; beyond it numpy's int64 sampling and float means break

_FORMS = "'1024' (fixed), '512-2048' or 'uniform:512,2048' (uniform), 'lognormal:1024,0.5' (mean, sigma)"


@dataclass(frozen=True, slots=True)
class LengthDist:
    kind: str  # "fixed" | "uniform" | "lognormal"
    a: float  # fixed: the length; uniform: low; lognormal: mean
    b: float = 0.0  # uniform: high; lognormal: sigma
    min_len: int = 1

    @classmethod
    def parse(cls, text: str | int | LengthDist, *, name: str = "length") -> LengthDist:
        if isinstance(text, LengthDist):
            return text
        if isinstance(text, int):
            text = str(text)
        raw = text.strip().lower()
        try:
            if raw.startswith("uniform:"):
                low, high = (int(v) for v in raw[len("uniform:") :].split(","))
                dist = cls("uniform", low, high)
            elif raw.startswith("lognormal:"):
                mean, sigma = (float(v) for v in raw[len("lognormal:") :].split(","))
                dist = cls("lognormal", mean, sigma)
            elif "-" in raw:
                low, high = (int(v) for v in raw.split("-"))
                dist = cls("uniform", low, high)
            else:
                dist = cls("fixed", int(raw))
        except ValueError:
            raise InvalidArgument(f"{name}: cannot parse {text!r}; use {_FORMS}") from None
        dist._check(name, text)
        return dist

    def _check(self, name: str, text: str) -> None:
        if any(not math.isfinite(v) or v > MAX_TOKENS for v in (self.a, self.b if self.kind == "uniform" else 0)):
            raise InvalidArgument(
                f"{name}: lengths (and a lognormal's mean) must be finite and at most {MAX_TOKENS:,} tokens, "
                f"got {text!r}"
            )
        if self.kind == "fixed" and self.a < 1:
            raise InvalidArgument(f"{name}: length must be >= 1 token, got {text!r}")
        if self.kind == "uniform" and not 1 <= self.a <= self.b:
            raise InvalidArgument(f"{name}: uniform range needs 1 <= low <= high, got {text!r}")
        if self.kind == "lognormal" and (self.a < 1 or not 0 <= self.b <= 3 or not math.isfinite(self.a)):
            raise InvalidArgument(f"{name}: lognormal needs mean >= 1 and 0 <= sigma <= 3, got {text!r}")

    @property
    def mean(self) -> float:
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return float(self.a)

    @property
    def max_len(self) -> float:
        """The largest length it can produce (inf for the lognormal tail)."""
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return self.b
        return math.inf if self.b > 0 else self.a

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, int(self.a), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(int(self.a), int(self.b), endpoint=True, size=n)
        # E[exp(N(mu, s^2))] = exp(mu + s^2/2): pick mu so that the *mean* is the one asked for.
        mu = math.log(self.a) - self.b**2 / 2
        values = np.rint(rng.lognormal(mu, self.b, size=n)).astype(np.int64)
        return np.maximum(values, self.min_len)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"uniform:{int(self.a)},{int(self.b)}"
        return f"lognormal:{self.a:g},{self.b:g}"
