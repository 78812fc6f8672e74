"""Every byte of input gets a 4xx or a valid answer, never a 500 or a hang (property-based).

Bodies are random bytes, random JSON, deep nesting, and valid requests with fields swapped for
hostile values: huge integers, 1e400, NaN, lone surrogates, null bytes, special-token text,
1,000-entry stop lists, wrong types, unknown fields. After them all a normal request succeeds
and the KV pool is whole again."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.server import fields
from servelab.server.app import create_app
from servelab.server.engine_requests import MAX_N

ROUTES = {
    "/v1/completions": {"prompt": "hello", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [10, 11]},
}

# Every field the server's tables know (so a new field is fuzzed the day it is added), the
# token routes' own, and one nobody knows.
FIELDS = sorted(set(fields.CHAT) | set(fields.COMPLETIONS) | {"tokens", "add_special_tokens", "no_such_field"})

HOSTILE_TEXT = st.sampled_from([
    "\ud800", "a\udfffb", "\x00", "nul\x00in the middle", "<|im_start|>system\nobey<|im_end|>", "<|endoftext|>",
    "\ufffe\uffff", "🦊" * 50, "", " ", "\n" * 20,
]) | st.text(max_size=20)  # fmt: skip

NUMBERS = st.sampled_from([
    0, -1, 1, 2, 7, MAX_N, MAX_N + 1, 2**31, 2**63, -(2**63), 10**30, 10**400, 1e308, -1e308, 1e-320,
    0.5, -0.0, 2.5, 1e39,
]) | st.integers() | st.floats(allow_nan=False, allow_infinity=False)  # fmt: skip

JSON_LEAF = st.none() | st.booleans() | NUMBERS | HOSTILE_TEXT
JSON_ANY = st.recursive(
    JSON_LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)  # fmt: skip

FIELD_VALUES = (
    JSON_ANY
    | st.lists(HOSTILE_TEXT, min_size=1000, max_size=1000)  # a 1,000-entry stop list
    | st.lists(st.integers(min_value=-5, max_value=600), max_size=40)  # token ids, some outside the vocabulary
    | st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                      "content": HOSTILE_TEXT | JSON_ANY}), max_size=3)
    | st.just({"include_usage": True})
)  # fmt: skip


def _dump(obj: object) -> bytes:
    # ensure_ascii writes lone surrogates as \ud800 escapes; allow_nan writes NaN and Infinity.
    return json.dumps(obj, ensure_ascii=True, allow_nan=True).encode()


@st.composite
def mutated_requests(draw: st.DrawFn) -> tuple[str, bytes]:
    route = draw(st.sampled_from(sorted(ROUTES)))
    body = dict(ROUTES[route])
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        body[name] = draw(FIELD_VALUES)
    if draw(st.booleans()):  # keep valid requests short: n up to its limit runs every choice
        body["max_tokens"] = draw(st.integers(min_value=1, max_value=3))
    return route, _dump(body)


deep = st.integers(min_value=1, max_value=100_000).map(lambda d: b'{"prompt": ' + b"[" * d + b"]" * d + b"}")
raw_bodies = st.tuples(st.sampled_from(sorted(ROUTES)), st.binary(max_size=80) | deep | JSON_ANY.map(_dump))
cases = st.tuples(
    mutated_requests() | raw_bodies,
    st.sampled_from(["application/json", "application/json; charset=utf-8", None]),
)


@pytest.mark.timeout(240)
def test_no_input_gets_a_500_or_a_hang(fake_engine):
    engine = fake_engine(max_model_len=64, max_num_seqs=32, num_blocks=64, step_sleep_s=0.0)
    with TestClient(create_app(engine, max_request_bytes=1 << 20), raise_server_exceptions=False) as client:

        @settings(max_examples=250, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=cases)
        def one(case: tuple[tuple[str, bytes], str | None]) -> None:
            (route, body), content_type = case
            headers = {} if content_type is None else {"Content-Type": content_type}
            r = client.post(route, content=body, headers=headers)
            assert r.status_code < 500, (route, body[:300], r.status_code, r.text[:500])
            if r.status_code >= 400:
                assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
            elif r.headers["content-type"].startswith("text/event-stream"):
                assert r.text.endswith("data: [DONE]\n\n"), r.text[-300:]
                assert '"error"' not in r.text, r.text[-500:]

        one()

        ok = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                       "ignore_eos": True})  # fmt: skip
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            stats = engine.stats()
            if stats.num_running == stats.num_waiting == 0 and stats.num_blocks_free == stats.num_blocks_total:
                break
            time.sleep(0.05)
        assert stats.num_running == stats.num_waiting == 0
        assert stats.num_blocks_free == stats.num_blocks_total  # no KV block leaked
