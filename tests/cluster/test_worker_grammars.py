"""A cluster worker compiles grammars as the single-engine server does: in its own grammar worker
processes, under the compile timeout the front end's flags set, so a slow constraint parks only
its own request; a compile past the timeout is a 400 naming the field, and an abort kills it.
In a cluster in one process (tests/cluster/memory_cluster.py), the front end's own compile
bypassed: these requests go straight to the worker."""

from __future__ import annotations

import asyncio
import time

import pytest

from servelab.core.sequence import FinishReason, SamplingParams
from servelab.core.structured_output import StructuredOutputSpec
from servelab.engine.grammar_workers import GrammarConfig, GrammarWorkers
from servelab.errors import InvalidArgument
from servelab.engine.client import EngineRequest
from tests.cluster.memory_cluster import memory_cluster
from tests.server.adversarial import SLOW_PREFIX, slow_compile, wait_until

PROMPT = list(range(20, 40))
TIMEOUT_S = 2.0


def _req(rid: str, max_tokens: int, spec: StructuredOutputSpec | None = None) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=spec is None, structured_output=spec)
    return EngineRequest(rid, PROMPT, params)


def _slow(seconds: float) -> StructuredOutputSpec:
    return StructuredOutputSpec("regex", f"{SLOW_PREFIX}{seconds:g}", source="response_format")


@pytest.fixture
def grammar_cluster(tiny_engine_factory):
    """One worker whose grammar workers run `slow_compile` under a 2 s timeout, made as
    `servelab worker` makes them: (cluster, the worker's engine, its GrammarWorkers)."""
    made: list[GrammarWorkers] = []

    def make_grammars(engine):
        grammars = GrammarWorkers(engine.logits_processors.structured,
                                  GrammarConfig(compile_timeout_s=TIMEOUT_S, num_workers=1), slow_compile)  # fmt: skip
        made.append(grammars)
        return grammars

    cluster, engines, _ = memory_cluster(tiny_engine_factory, 1, make_grammars=make_grammars, num_blocks=64,
                                         max_model_len=256)  # fmt: skip
    return cluster, engines[1], made[0]


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.mark.slow  # 6 s: the grammar worker's start, a 2 s timeout, its replacement's start
def test_a_compile_past_the_timeout_is_refused_while_a_plain_request_on_the_worker_completes(grammar_cluster):
    cluster, engine, grammars = grammar_cluster
    _run(grammars.compile(StructuredOutputSpec("regex", "[a-z]{2}")))  # its process starts with a first compile
    assert len(grammars.worker_pids()) == 1
    pid = grammars.worker_pids()[0]

    async def main(driver):
        driver.start()
        slow = asyncio.ensure_future(driver.submit([_req("slow", 4, _slow(60))]))
        await asyncio.sleep(0.3)  # its compile is running on the worker
        t0 = time.perf_counter()
        plain = [out async for out in await driver.submit([_req("plain", 1)])]
        plain_s = time.perf_counter() - t0
        assert not slow.done(), "the slow compile should still be running"
        with pytest.raises(InvalidArgument) as refused:
            await slow
        refused_s = time.perf_counter() - t0
        # a cached grammar needs no compile; a fresh one compiles in the replacement worker
        ok = [out async for out in await driver.submit([_req("ok", 8, StructuredOutputSpec("regex", "[a-z]{3}"))])]
        await driver.stop()
        return plain, plain_s, refused.value, refused_s, ok

    plain, plain_s, error, refused_s, ok = _run(main(cluster))
    assert plain[-1].finish_reason is FinishReason.LENGTH and plain_s < 1.0, plain_s
    assert error.param == "response_format"
    assert (
        f"did not compile within {TIMEOUT_S:g} s" in error.message
        and "--structured-output-compile-timeout" in error.message
    )
    assert refused_s < TIMEOUT_S + 2.0
    assert wait_until(lambda: grammars.num_killed == 1, 5), "the runaway compile's process was not killed"
    assert pid not in grammars.worker_pids()
    assert ok[-1].finish_reason is FinishReason.STOP and ok[-1].num_output_tokens >= 1
    assert not cluster._remote and not cluster._admissions and cluster.workers[0].outstanding == 0
    assert not engine.core._requests


@pytest.mark.slow  # 4 s: the grammar worker's start, and its replacement's after the kill
def test_an_abort_during_its_compile_kills_the_compile_and_admits_nothing(grammar_cluster):
    cluster, engine, grammars = grammar_cluster
    _run(grammars.compile(StructuredOutputSpec("regex", "[a-z]{2}")))  # its process up: the abort meets a compile

    async def main(driver):
        driver.start()
        slow = asyncio.ensure_future(driver.submit([_req("gone", 4, _slow(60))]))
        await asyncio.sleep(0.5)
        slow.cancel()  # the client left: the front end aborts the request on its worker
        with pytest.raises(asyncio.CancelledError):
            await slow
        assert await asyncio.to_thread(wait_until, lambda: grammars.num_killed == 1, 5)
        assert await asyncio.to_thread(wait_until, lambda: not driver._remote and not driver._admissions, 5)
        plain = [out async for out in await driver.submit([_req("plain", 2)])]
        await driver.stop()
        return plain

    plain = _run(main(cluster))
    assert plain[-1].finish_reason is FinishReason.LENGTH
    assert cluster.workers[0].outstanding == 0 and not engine.core._requests
