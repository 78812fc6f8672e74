"""How much of a bench run the server's prefix cache served, from its Prometheus counters.

`servelab bench` reads `prefix_cache_hits` and `prefix_cache_queries` (servelab's or vLLM's,
in prompt tokens) from `GET /metrics` before and after the run and reports the difference. A
run that asked for no shared prefixes but was partly served from the cache measured the cache,
not the prefill: typically a second run with the same `--seed` against the same server, which
sends the same prompts again.
"""

from __future__ import annotations

from dataclasses import dataclass

# (hits, queries) counter names, with the `_total` suffix Prometheus text gives counters.
COUNTERS = (
    ("servelab:prefix_cache_hits_total", "servelab:prefix_cache_queries_total"),
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
)


@dataclass(frozen=True, slots=True)
class PrefixCacheCounters:
    hits: float
    queries: float


def parse_counters(metrics_text: str) -> PrefixCacheCounters | None:
    """The two counters summed over their label sets (engines, models); None when the server
    exports neither servelab's nor vLLM's."""
    values: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        # `name{labels} value [timestamp]` or `name value [timestamp]`
        if "{" in line:
            name, rest = line[: line.index("{")], line[line.rindex("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        if not any(name in pair for pair in COUNTERS):
            continue
        try:
            values[name] = values.get(name, 0.0) + float(rest.split()[0])
        except (ValueError, IndexError):
            continue
    for hits, queries in COUNTERS:
        if hits in values and queries in values:
            return PrefixCacheCounters(values[hits], values[queries])
    return None


@dataclass(frozen=True, slots=True)
class PrefixCacheReport:
    hit_tokens: int
    query_tokens: int
    shared_prefixes_asked: bool
    endpoint: str

    @classmethod
    def between(cls, before: PrefixCacheCounters | None, after: PrefixCacheCounters | None, *,
                shared_prefixes_asked: bool, endpoint: str) -> PrefixCacheReport | None:  # fmt: skip
        if before is None or after is None:
            return None
        return cls(int(after.hits - before.hits), int(after.queries - before.queries), shared_prefixes_asked, endpoint)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def unexpected(self) -> bool:
        """Cache hits the workload did not ask for. Chat prompts all open with the template's
        common text (a default system prompt), whose blocks are shared by design: only the
        completions endpoint, whose prompts are the workload's own text, can tell."""
        return self.hit_tokens > 0 and not self.shared_prefixes_asked and self.endpoint == "completions"

    def lines(self) -> list[str]:
        out = [f"{'Prefix cache (server)':<34}{self.hit_tokens:,} of {self.query_tokens:,} prompt tokens "
               f"served from cache ({self.hit_rate:.1%})"]  # fmt: skip
        if self.unexpected:
            out.append(
                f"warning: {self.hit_rate:.1%} of the prompt tokens came from the server's prefix cache though this "
                "run asked for no shared prefixes: the server has seen these prompts before (an earlier run with the "
                "same --seed?), so TTFT is lower than a fresh prompt's. Vary --seed between runs against one "
                "server, or restart it."
            )
        return out

    def to_dict(self) -> dict:
        return {"hit_tokens": self.hit_tokens, "query_tokens": self.query_tokens, "hit_rate": self.hit_rate,
                "unexpected": self.unexpected}  # fmt: skip
