"""Adversarial clients for the server tests: a grammar compiler whose compiles take as long as
the constraint asks (what the size limits cannot foresee), an app whose engine has real logit
processors over the tiny model's tokenizer, and a stopwatch for the plain request that must not
wait behind them."""

from __future__ import annotations

import time
from typing import Any

from servelab.core.structured_output import StructuredOutputSpec
from servelab.engine.structured_output import compile_spec

SLOW_PREFIX = "slow"


def slow_compile(compiler: Any, spec: StructuredOutputSpec) -> Any:
    """compile_spec, after sleeping N seconds for the regex `slowN` (runs in a grammar worker process)."""
    if spec.kind == "regex" and spec.value.startswith(SLOW_PREFIX):
        time.sleep(float(spec.value.removeprefix(SLOW_PREFIX)))
    return compile_spec(compiler, spec)


def slow_regex(seconds: float) -> dict:
    return {"structured_outputs": {"regex": f"{SLOW_PREFIX}{seconds:g}"}}


def engine_with_grammars(fake_engine, **kwargs: Any):
    """fake_engine's LLMEngine, with the logit processors (and so the grammar compiler) a real model has."""
    from servelab.engine.logits_processors import LogitsProcessors

    engine = fake_engine(**kwargs)
    engine.logits_processors = LogitsProcessors(engine.tokenizer, engine.vocab_size)
    return engine


def plain_completion_s(client: Any) -> float:
    """Seconds a 1-token completion takes, start to answer (asserted 200)."""
    t0 = time.perf_counter()
    resp = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    return time.perf_counter() - t0


def wait_until(predicate: Any, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
