"""Over HTTP: one request that fails inside the engine gets an error event on its own stream,
while 4 concurrent streams sharing its steps finish as they would have without it."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from servelab.engine.sampler import Sampler
from servelab.server.app import create_app

BAD_SEED = 666  # marks the request whose sampling fails (its tokens are greedy anyway)


def _events(text: str) -> list:
    blocks = [b[len("data: ") :] for b in text.split("\n\n") if b]
    return [b if b == "[DONE]" else json.loads(b) for b in blocks]


def _body(i: int, **extra) -> dict:
    return {"prompt": f"the quick brown fox {i} jumps", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": True, **extra}  # fmt: skip


@pytest.mark.slow
def test_four_streams_survive_one_failing_request(tiny_model_dir, monkeypatch):
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine.from_args(
        EngineArgs.from_kwargs(model=str(tiny_model_dir), dtype="float32", num_blocks=64, max_model_len=256)
    )
    real = Sampler.sample
    shared_steps = []  # batch sizes of the steps in which the bad request failed
    failing = threading.Event()  # set once the bad request has shared a step with another

    def sample(self, logits, seqs, argmax=None):
        bad = [s for s in seqs if s.params.seed == BAD_SEED]
        if bad and len(seqs) > 1:
            failing.set()
        if bad and failing.is_set():
            shared_steps.append(len(seqs))
            raise RuntimeError("injected fault in one request's sampling")
        if bad:
            time.sleep(0.01)  # alone: slow its steps so the others surely join it
        return real(self, logits, seqs, argmax)

    with TestClient(create_app(engine)) as c:
        expected = [_events(c.post("/v1/completions", json=_body(i)).text) for i in range(4)]
        monkeypatch.setattr(Sampler, "sample", sample)
        started = threading.Event()

        def post_bad() -> str:
            # the bad request is in flight (one token streamed) before the others are sent, and
            # cannot finish alone (200 tokens at >= 10 ms each), so it fails in a shared step
            chunks = []
            with c.stream("POST", "/v1/completions", json=_body(9, seed=BAD_SEED, max_tokens=200)) as r:
                for chunk in r.iter_text():
                    started.set()
                    chunks.append(chunk)
            return "".join(chunks)

        with ThreadPoolExecutor(5) as pool:
            bad_future = pool.submit(post_bad)
            assert started.wait(60)
            futures = [pool.submit(lambda b: c.post("/v1/completions", json=b).text, _body(i)) for i in range(4)]
            results = [_events(f.result(timeout=120)) for f in [*futures, bad_future]]

        assert shared_steps and max(shared_steps) > 1, "the bad request never shared a step with the others"
        for got, want in zip(results[:4], expected):
            text = "".join(e["choices"][0]["text"] for e in got[:-1])
            assert text == "".join(e["choices"][0]["text"] for e in want[:-1])
            assert got[-1] == "[DONE]" and got[-2]["choices"][0]["finish_reason"] == "length"
        bad = results[4]
        assert bad[-1] == "[DONE]" and set(bad[-2]) == {"error"}
        assert bad[-2]["error"]["type"] == "internal_server_error"
        assert "failed while generating this request" in bad[-2]["error"]["message"]
        resp = c.post("/v1/completions", json=_body(9, seed=BAD_SEED, stream=False))  # not streamed: a 500
        assert resp.status_code == 500 and "failed while generating this request" in resp.json()["error"]["message"]
        assert c.get("/health").status_code == 200
        assert engine.stats().num_blocks_free == engine.stats().num_blocks_total
