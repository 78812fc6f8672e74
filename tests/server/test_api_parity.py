"""What a vLLM or OpenAI client expects beyond the basics: honest streaming, vLLM's
per-request metrics, usage details, and errors that name the field the client sent."""

from __future__ import annotations

import re

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from servelab.server.app import create_app
from servelab.server.metrics import buckets_1_2_5


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def _sse(resp) -> list:
    events = [block for block in resp.text.split("\n\n") if block]
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


@pytest.fixture
def engine(fake_engine):
    return fake_engine(max_model_len=128)


@pytest.fixture
def client(engine):
    with TestClient(create_app(engine)) as c:
        yield c


# ------------------------------------------------------------------------------- streaming


class _SlowPrefill:
    """Wraps an executor: a step with a prefill chunk takes `prefill_s`; records when the step
    that sampled a first token returned."""

    def __init__(self, inner, prefill_s: float):
        self.inner, self.prefill_s = inner, prefill_s
        self.vocab_size = inner.vocab_size
        self.first_token_returned_s: float | None = None

    def execute(self, plan):
        prefill = any(s.num_tokens > 1 for s in plan.scheduled)
        if prefill:
            time.sleep(self.prefill_s)
        result = self.inner.execute(plan)
        if prefill and self.first_token_returned_s is None:
            self.first_token_returned_s = time.perf_counter()
        return result


@pytest.fixture
def live_server(fake_engine):
    """A real uvicorn server on a free 127.0.0.1 port in a thread (TestClient may buffer a
    stream, which would hide when each chunk left)."""
    servers = []

    def start(engine) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append((server, thread, sock))
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread, sock in servers:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_the_first_chat_chunk_comes_with_the_first_token_and_carries_role_and_text(fake_engine, live_server):
    engine = fake_engine(max_model_len=128)
    slow = engine.executor = _SlowPrefill(engine.executor, prefill_s=0.6)
    url = live_server(engine)
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    chunks, times = [], []
    sent_s = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
                chunks.append(json.loads(line[6:]))
    assert slow.first_token_returned_s is not None
    # No chunk (role-only or otherwise) before the prefill has produced the first token.
    assert times[0] >= slow.first_token_returned_s and times[0] - sent_s >= 0.6
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"]
    # Later deltas omit the role (no "role": null) as OpenAI does.
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])
    assert all(v is not None for c in chunks if c["choices"] for v in c["choices"][0]["delta"].values())
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


def test_each_choice_opens_with_its_role_once(client):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "ignore_eos": True,
        "n": 3,
        "stream": True,
    }
    chunks = [c for c in _sse(client.post("/v1/chat/completions", json=body))[:-1] if c["choices"]]
    for index in range(3):
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == index]
        assert [("role" in d) for d in deltas] == [True] + [False] * (len(deltas) - 1)


# ------------------------------------------------------------------------------- usage


def test_continuous_usage_stats_put_usage_on_every_chunk(client):
    body = {"prompt": "hello world", "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    chunks = _sse(client.post("/v1/completions", json=body))[:-1]
    n_prompt = client.post("/tokenize", json={"prompt": "hello world"}).json()["count"]
    with_choices = [c for c in chunks if c["choices"]]
    completion = [c["usage"]["completion_tokens"] for c in with_choices]
    assert completion == sorted(completion) and completion[-1] == 5
    assert all(c["usage"]["prompt_tokens"] == n_prompt for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == n_prompt + 5
    # Without the option only the final chunk has usage.
    body["stream_options"] = {"include_usage": True}
    chunks = _sse(client.post("/v1/completions", json=body))[:-1]
    assert [c["usage"] is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_cached_tokens_report_the_prefix_cache_hits_of_the_request(client):
    prompt = list(range(20, 20 + 40))  # 40 tokens: two full blocks of 16 can be reused
    body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    first = client.post("/v1/completions", json=body).json()["usage"]
    second = client.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens_details"] == {"cached_tokens": 32}
    chat = {"messages": [{"role": "user", "content": "fox " * 30}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    client.post("/v1/chat/completions", json=chat)
    usage = _sse(client.post("/v1/chat/completions", json=chat))[-2]["usage"]
    # whole blocks, and at least one token is always recomputed (its logits are sampled)
    assert usage["prompt_tokens_details"]["cached_tokens"] == (usage["prompt_tokens"] - 1) // 16 * 16 > 0


# ------------------------------------------------------------------------------- errors


def test_top_logprobs_out_of_range_is_blamed_on_top_logprobs(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 25}
    err = _error(client.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == "top_logprobs" and err["message"].startswith("top_logprobs") and "25" in err["message"]
    err = _error(client.post("/v1/completions", json={"prompt": "x", "logprobs": 25}), 400)
    assert err["param"] == "logprobs"


def test_a_prompt_that_alone_exceeds_the_context_is_blamed_on_the_prompt(client):
    err = _error(client.post("/v1/completions", json={"prompt": list(range(10, 150)), "max_tokens": 1}), 400)
    assert err["param"] == "prompt" and "shorten the prompt" in err["message"] and "max_tokens" not in err["message"]
    assert "140" in err["message"] and "128" in err["message"]
    err = _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "fox " * 200}],
                                                           "max_tokens": 4}), 400)  # fmt: skip
    assert err["param"] == "messages" and "shorten the messages" in err["message"]


def test_prompt_plus_max_tokens_over_the_context_names_the_max_tokens_field_sent(client):
    err = _error(client.post("/v1/completions", json={"prompt": list(range(10, 110)), "max_tokens": 50}), 400)
    assert err["param"] == "max_tokens" and "150" in err["message"] and "at most 28" in err["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 500}
    err = _error(client.post("/v1/chat/completions", json=chat), 400)
    assert err["param"] == "max_completion_tokens" and "lower max_completion_tokens" in err["message"]
    err = _error(client.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 0}), 400)
    assert err["param"] == "max_completion_tokens" and err["message"].startswith("max_completion_tokens")


# ------------------------------------------------------------------------------- metrics


def test_vllm_parity_metrics_for_a_known_request(client, engine):
    names = ["request_time_per_output_token_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
             "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens",
             "request_params_max_tokens", "iteration_tokens_total"]  # fmt: skip
    before = _samples(client.get("/metrics").text)
    for name in names:  # exported (as zeros) from the start
        assert before[(f"servelab:{name}_count", ())] == 0
    n_prompt = client.post("/tokenize", json={"prompt": "hello world"}).json()["count"]
    body = client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 5, "ignore_eos": True}).json()
    seq = engine.scheduler.get(body["id"] + "-0")
    after = _samples(client.get("/metrics").text)

    def delta(name: str, suffix: str) -> float:
        return after[(f"servelab:{name}_{suffix}", ())] - before.get((f"servelab:{name}_{suffix}", ()), 0.0)

    t = seq.token_times_s
    expected = {
        "request_time_per_output_token_seconds": (t[-1] - seq.first_token_s) / 4,
        "request_prefill_time_seconds": seq.first_token_s - seq.first_scheduled_s,
        "request_decode_time_seconds": t[-1] - seq.first_token_s,
        "request_inference_time_seconds": t[-1] - seq.first_scheduled_s,
        "request_prompt_tokens": n_prompt,
        "request_generation_tokens": 5,
        "request_params_max_tokens": 5,
        # one prefill step of the whole prompt, then 4 decode steps of one token
        "iteration_tokens_total": n_prompt + 4,
    }
    for name, value in expected.items():
        assert delta(name, "count") == (5 if name == "iteration_tokens_total" else 1), name
        assert delta(name, "sum") == pytest.approx(value, rel=1e-9, abs=1e-12), name
    assert expected["request_time_per_output_token_seconds"] > 0
    # vLLM's buckets: 1-2-5 up to max_model_len for token counts
    assert ("servelab:request_prompt_tokens_bucket", (("le", "100.0"),)) in after
    assert ("servelab:request_prompt_tokens_bucket", (("le", "200.0"),)) not in after
    assert ("servelab:iteration_tokens_total_bucket", (("le", "16384.0"),)) in after


def test_one_token_requests_observe_a_tpot_of_zero_as_vllm_does(client):
    before = _samples(client.get("/metrics").text)
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    after = _samples(client.get("/metrics").text)
    key = "servelab:request_time_per_output_token_seconds"
    assert after[(f"{key}_count", ())] - before[(f"{key}_count", ())] == 1
    assert after[(f"{key}_sum", ())] == before[(f"{key}_sum", ())]


def test_1_2_5_buckets():
    assert buckets_1_2_5(128) == [1, 2, 5, 10, 20, 50, 100]
    assert buckets_1_2_5(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


# ------------------------------------------------------------------------------- small things


def test_version_docs_and_openapi_go_through_the_api_key(fake_engine):
    from servelab import __version__

    with TestClient(create_app(fake_engine(), api_key="sk-right")) as c:
        for path in ("/version", "/docs", "/openapi.json"):
            assert _error(c.get(path), 401)["type"] == "authentication_error", path
        auth = {"Authorization": "Bearer sk-right"}
        assert c.get("/version", headers=auth).json() == {"version": __version__}
        page = c.get("/docs", headers=auth).text
        assert "swagger" in page.lower()
        # Every file the page loads is served here (the machine may be offline): no CDN.
        assets = re.findall(r"""(?:src|href)=['"]([^'"]+)['"]""", page)
        assert assets and all(a.startswith("/docs/static/") for a in assets), assets
        for asset in assets:
            assert c.get(asset, headers=auth).status_code == 200, asset
            assert c.get(asset).status_code == 401, asset
        spec = c.get("/openapi.json", headers=auth).json()
        assert spec["info"]["version"] == __version__ and "/v1/chat/completions" in spec["paths"]
    with TestClient(create_app(fake_engine())) as c:
        assert c.get("/version").json() == {"version": __version__}


def test_a_request_without_sampling_fields_takes_the_models_generation_config(fake_engine):
    engine = fake_engine()
    engine.sampling_defaults = {"temperature": 0.25, "top_k": 7, "repetition_penalty": 1.1}
    seen = []
    inner = engine.executor.execute
    engine.executor.execute = lambda plan: (seen.extend(s.seq.params for s in plan.scheduled), inner(plan))[1]
    with TestClient(create_app(engine)) as c:
        c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        c.post("/v1/completions", json={"prompt": "y", "max_tokens": 1, "temperature": 0.9, "top_k": -1,
                                        "repetition_penalty": 1.0})  # fmt: skip
    assert (seen[0].temperature, seen[0].top_k, seen[0].top_p, seen[0].repetition_penalty) == (0.25, 7, 1.0, 1.1)
    assert (seen[-1].temperature, seen[-1].top_k, seen[-1].repetition_penalty) == (0.9, 0, 1.0)


def test_a_generation_config_top_k_written_as_a_float_samples_as_an_int(fake_engine):
    engine = fake_engine()
    engine.sampling_defaults = {"top_k": 20.0}  # json.load reads `"top_k": 20.0` as a float
    seen = []
    inner = engine.executor.execute
    engine.executor.execute = lambda plan: (seen.extend(s.seq.params for s in plan.scheduled), inner(plan))[1]
    with TestClient(create_app(engine)) as c:
        resp = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    assert seen[0].top_k == 20 and isinstance(seen[0].top_k, int)


def test_generation_config_defaults_are_read_from_the_model_dir(tmp_path):
    from servelab.engine.generation_config import load_sampling_defaults

    assert load_sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "do_sample": True,
                                                                 "max_new_tokens": 5, "repetition_penalty": 1.05}))  # fmt: skip
    assert load_sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text("{broken")
    assert load_sampling_defaults(tmp_path) == {}


# ------------------------------------------------------------------------------- honoured or refused

from servelab.server import fields as F  # noqa: E402
from servelab.server import protocol as P  # noqa: E402

# Each route's field table (server/fields.py) beside the request model that parses its body.
ROUTES = [("/v1/chat/completions", F.CHAT, P.ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
          ("/v1/completions", F.COMPLETIONS, P.CompletionRequest, {"prompt": "hi"})]  # fmt: skip


@pytest.mark.parametrize(("route", "table", "model", "base"), ROUTES)
def test_every_refused_field_is_a_400_naming_it(client, route, table, model, base):
    refused = [name for name, rule in table.items() if rule.status is F.Status.REFUSED]
    assert refused
    for name in refused:
        err = _error(client.post(route, json={**base, "max_tokens": 2, name: {"servelab": "test"}}), 400)
        assert err["param"] == name and name in err["message"] and table[name].note in err["message"], name
        for neutral in table[name].neutral:  # null or the default asks for nothing and passes
            assert client.post(route, json={**base, "max_tokens": 2, name: neutral}).status_code == 200, (name, neutral)


@pytest.mark.parametrize(("route", "table", "model", "base"), ROUTES)
def test_the_table_and_the_protocol_agree(route, table, model, base):
    declared = set(model.model_fields)
    assert declared <= set(table), f"fields the protocol takes but the table does not list: {declared - set(table)}"
    kept = {n for n, r in table.items() if r.status is F.Status.HONOURED}
    assert kept <= declared, f"honoured but not declared: {kept - declared}"
    assert not {n for n, r in table.items() if r.status is F.Status.REFUSED} & declared


def test_image_and_audio_parts_are_refused_text_parts_are_joined(client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]
    err = _error(client.post("/v1/chat/completions", json={"messages": messages}), 400)
    assert "text only" in err["message"] and err["param"] == "messages[0].content[1].type"
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}]
    assert client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}).status_code == 200


def test_readme_field_table_is_the_code_table():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert F.markdown_table() in readme


def test_stream_deltas_omit_absent_keys_at_every_depth():
    # A client that concatenates tool-call arguments must never meet a null.
    first = P.DeltaMessage(role="assistant", tool_calls=[
        P.ToolCallDelta(index=0, id="call_1", type="function", function=P.FunctionCallDelta(name="f"))])  # fmt: skip
    later = P.DeltaMessage(tool_calls=[P.ToolCallDelta(index=0, function=P.FunctionCallDelta(arguments='{"a"'))])
    assert P.dump(first) == {
        "role": "assistant",
        "tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}],
    }
    assert P.dump(later) == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    assert P.dump(P.DeltaMessage(content="")) == {"content": ""}
