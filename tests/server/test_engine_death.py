"""If the engine thread dies of something that is not an ordinary exception, no client waits
forever: every open stream gets an error event and [DONE] within a second, /health turns 503,
and new requests are refused at once."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from servelab.server.app import create_app


class _Fatal(BaseException):
    """Not an Exception: what `except Exception` in the step loop does not catch."""


def _rank_failed() -> Exception:
    from servelab.runtime.parallel.group import RankFailed

    return RankFailed("tensor-parallel rank failure: rank 1 exited with code -9")


# RankFailed is an Exception, but no step can run after it: the engine stops as for the others
@pytest.mark.parametrize("fatal", [_Fatal("injected"), SystemExit(3), KeyboardInterrupt(), _rank_failed()])
def test_engine_thread_death_ends_every_stream_and_turns_health_503(fake_engine, fatal):
    engine = fake_engine(step_sleep_s=0.005)
    step = engine.step
    die = threading.Event()

    def dying_step():
        if die.is_set():
            raise fatal
        return step()

    engine.step = dying_step
    body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with TestClient(create_app(engine)) as client:
        assert client.get("/health").status_code == 200
        events: list[str] = []
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = (line for line in r.iter_lines() if line)
            events.append(next(lines))
            die.set()
            t0 = time.monotonic()
            events.extend(lines)
            elapsed_s = time.monotonic() - t0
        assert elapsed_s < 1.0
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["type"] == "internal_server_error" and "engine stopped" in error["message"]
        health = client.get("/health")
        assert health.status_code == 503 and health.headers["retry-after"] == "1"
        late = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert late.status_code == 503, late.text
        assert client.app.state.servelab.client.num_in_flight == 0
