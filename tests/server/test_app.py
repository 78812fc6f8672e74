"""The HTTP layer in process (FastAPI TestClient), over a real LLMEngine with a fake executor:
protocol shapes, every error answer, auth, draining, and surviving a failing step."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from servelab.server.app import create_app


@pytest.fixture
def client(fake_engine):
    with TestClient(create_app(fake_engine(max_model_len=128))) as c:
        yield c


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _sse(resp) -> list:
    """The `data:` payloads of an SSE body, `[DONE]` kept as a string."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [block for block in resp.text.split("\n\n") if block]
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def _metric(text: str, name: str, sample: str | None = None, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


# ------------------------------------------------------------------------------- happy paths


def test_completion_usage_and_length_finish(client):
    prompt_ids = client.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    resp = client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 7, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 7,
        "total_tokens": len(prompt_ids) + 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_stop_string_finishes_with_stop_and_is_cut(client):
    body = {"prompt": "hello world", "max_tokens": 12, "ignore_eos": True}
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = next(ch for ch in full[len(full) // 2 :] if ch.isalnum())
    resp = client.post("/v1/completions", json={**body, "stop": [stop]}).json()
    assert resp["choices"][0]["finish_reason"] == "stop"
    assert resp["choices"][0]["text"] == full[: full.index(stop)]
    assert resp["usage"]["completion_tokens"] < 12


def test_no_max_tokens_means_the_rest_of_the_context(client):
    n_prompt = client.post("/tokenize", json={"prompt": "hello world"}).json()["count"]
    body = client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": None, "ignore_eos": True}).json()
    assert body["usage"]["completion_tokens"] == 128 - n_prompt
    assert body["choices"][0]["finish_reason"] == "length"
    err = _error(client.post("/v1/completions", json={"prompt": list(range(10, 138)), "max_tokens": None}), 400)
    assert "128" in err["message"] and err["param"] == "prompt"


def test_n_choices_and_prompt_lists(client):
    resp = client.post("/v1/completions", json={"prompt": ["hello", "the quick brown fox"], "n": 2, "max_tokens": 3,
                                                "ignore_eos": True, "seed": 1})  # fmt: skip
    body = resp.json()
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2, 3]
    p1 = client.post("/tokenize", json={"prompt": "hello"}).json()["count"]
    p2 = client.post("/tokenize", json={"prompt": "the quick brown fox"}).json()["count"]
    # A prompt counts once however many choices share it, as OpenAI counts it.
    assert {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
        "prompt_tokens": p1 + p2,
        "completion_tokens": 12,
        "total_tokens": p1 + p2 + 12,
    }


def test_chat_streaming_events_end_in_done_with_usage(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    prompt_tokens = client.post("/tokenize", json={"messages": messages}).json()["count"]
    resp = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "ignore_eos": True,
                                                     "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    events = _sse(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"  # with the first token (test_api_parity)
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 5,
        "total_tokens": prompt_tokens + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert all(c["usage"] is None for c in chunks[:-1])

    plain = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "ignore_eos": True}).json()
    assert plain["usage"] == {
        **usage_chunk["usage"],
        "prompt_tokens_details": {"cached_tokens": 16},
    }  # the same prompt again
    assert plain["choices"][0]["message"]["role"] == "assistant"


def test_completion_stream_without_usage_has_no_usage_chunk(client):
    events = _sse(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True}))
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop")


def test_tokenize_detokenize_round_trip_and_models(client):
    text = "the quick brown fox jumps over the lazy dog"
    ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": text}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
    assert models["data"][0]["max_model_len"] == 128
    assert client.get("/health").status_code == 200
    head = client.head("/health")
    assert head.status_code == 200 and head.content == b""


# ------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"prompt": "x", "max_tokens": -3}, "max_tokens", "-3"),
        ({"prompt": "x", "temperature": -0.5}, "temperature", "-0.5"),
        ({"prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
        ({"prompt": "x", "top_p": 1.5}, "top_p", "1.5"),
        ({"prompt": "x", "n": 0}, "n", "got 0"),
        ({"prompt": "x", "temperature": "hot"}, "temperature", "hot"),
        ({"prompt": "x", "max_tokens": 2.5}, "max_tokens", "2.5"),
        ({"prompt": 5}, "prompt", "prompt"),
        ({"max_tokens": 3}, "prompt", "prompt"),
        ({"prompt": "x", "stream": "yes"}, "stream", "stream"),
        ({"prompt": [1, 99999]}, "prompt", "99999"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ],
)
def test_bad_values_answer_400_naming_the_parameter(client, body, param, needle):
    err = _error(client.post("/v1/completions", json=body), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert needle in err["message"]


def test_prompt_over_the_context_names_both_numbers(client):
    long_prompt = list(range(10, 10 + 120))
    err = _error(client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 20}), 400)
    assert "128" in err["message"] and "140" in err["message"] and "120" in err["message"]
    assert err["code"] == "context_length_exceeded"  # as OpenAI names it
    err = _error(client.post("/v1/completions", json={"prompt": list(range(10, 150)), "max_tokens": 1}), 400)
    assert "128" in err["message"] and "140" in err["message"]
    err = _error(
        client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "fox " * 200}]}), 400
    )
    assert "128" in err["message"]


def test_malformed_json_wrong_shape_and_invalid_utf8(client):
    headers = {"content-type": "application/json"}
    err = _error(client.post("/v1/completions", content=b'{"prompt": "x",', headers=headers), 400)
    assert "not valid JSON" in err["message"]
    err = _error(client.post("/v1/completions", content=b'["prompt"]', headers=headers), 400)
    assert "JSON object" in err["message"]
    err = _error(client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}',
                             headers=headers), 400)  # fmt: skip
    assert "UTF-8" in err["message"]
    err = _error(client.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "hi"}]}), 400)
    assert err["param"] == "messages"
    err = _error(client.post("/v1/chat/completions", json={"messages": []}), 400)
    assert err["param"] == "messages"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_not_json(client, constant):
    # A NaN temperature passes every range check (comparisons with NaN are false) and used to
    # fail the step, and with it every other request in the batch.
    body = '{"prompt": "x", "max_tokens": 2, "temperature": ' + constant + "}"
    err = _error(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400)
    assert constant in err["message"] and "not a JSON number" in err["message"]
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_unknown_model_and_route_answer_404(client):
    err = _error(client.post("/v1/completions", json={"prompt": "x", "model": "gpt-9"}), 404)
    assert "gpt-9" in err["message"] and "fake-model" in err["message"] and err["code"] == "model_not_found"
    _error(
        client.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}), 404
    )
    _error(client.get("/v1/nothing"), 404)
    _error(client.get("/v1/completions"), 405)


def test_api_key(fake_engine):
    with TestClient(create_app(fake_engine(), api_key="sk-right")) as c:
        body = {"prompt": "x", "max_tokens": 2}
        assert _error(c.post("/v1/completions", json=body), 401)["type"] == "authentication_error"
        _error(c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-wrong"}), 401)
        _error(c.get("/v1/models"), 401)
        _error(c.post("/tokenize", json={"prompt": "x"}), 401)
        assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-right"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_draining_server_answers_503_with_retry_after(fake_engine):
    app = create_app(fake_engine())
    with TestClient(app) as c:
        app.state.servelab.begin_drain()
        resp = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        err = _error(resp, 503)
        assert "shutting down" in err["message"] and resp.headers["retry-after"] == "1"
        assert c.get("/health").status_code == 503


def test_a_failing_step_answers_500_and_the_next_request_succeeds(fake_engine):
    app = create_app(fake_engine(fail_steps={2}))
    with TestClient(app) as c:
        err = _error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5}), 500)
        assert "injected failure" in err["message"]
        events = _sse(
            c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True, "ignore_eos": True})
        )
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert c.get("/health").status_code == 200


def test_metrics_count_every_request(client):
    before = client.get("/metrics").text
    ttft0 = _metric(before, "servelab:time_to_first_token_seconds", "servelab:time_to_first_token_seconds_count")
    gen0 = _metric(before, "servelab:generation_tokens", "servelab:generation_tokens_total")
    for max_tokens in (2, 3, 4):
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True})
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2, "ignore_eos": True})
    after = client.get("/metrics").text
    assert (
        _metric(after, "servelab:time_to_first_token_seconds", "servelab:time_to_first_token_seconds_count")
        == ttft0 + 5
    )
    assert _metric(after, "servelab:generation_tokens", "servelab:generation_tokens_total") == gen0 + 2 + 3 + 4 + 4
    assert _metric(after, "servelab:request_success", "servelab:request_success_total", finished_reason="length") >= 5
    assert _metric(after, "servelab:num_requests_running") == 0
    assert _metric(after, "servelab:kv_cache_usage_perc") == 0
    # no KV cache behind the fake executor: the configuration still names the pool
    assert _metric(after, "servelab:cache_config_info", block_size="16", num_blocks="64", cache_dtype="none") == 1


@pytest.mark.slow
def test_engine_args_load_the_model_at_startup(tiny_model_dir):
    from servelab.engine.llm_engine import EngineArgs

    app = create_app(EngineArgs.from_kwargs(model=str(tiny_model_dir), num_blocks=64, max_model_len=256))
    assert not app.state.servelab.is_attached  # nothing loads until the server starts
    with TestClient(app) as c:
        body = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True}).json()
        assert body["model"] == tiny_model_dir.name and body["usage"]["completion_tokens"] == 3
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 256


def test_logprobs_keep_the_eos_that_ends_a_choice(tiny_model_dir):
    """As vLLM: the EOS that ends a choice has its logprobs entry (its token text is the EOS
    token's string) though the content skips it, so the entries count completion_tokens."""
    from servelab.engine.llm_engine import EngineArgs

    with TestClient(
        create_app(EngineArgs.from_kwargs(model=str(tiny_model_dir), num_blocks=64, max_model_len=256))
    ) as c:
        tokenizer = c.app.state.servelab.front.tokenizer
        eos = tokenizer.eos_token_ids[0]
        eos_text = tokenizer.decode([eos], skip_special_tokens=False)
        # +100 on EOS: the third token is EOS once min_tokens lets it through.
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "min_tokens": 2, "temperature": 0,
                "logprobs": True, "logit_bias": {str(eos): 100}}  # fmt: skip
        answer = c.post("/v1/chat/completions", json=body).json()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop"
        tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
        assert len(tokens) == 3 == answer["usage"]["completion_tokens"]
        assert tokens[-1] == eos_text and "".join(tokens[:-1]) == choice["message"]["content"]
        events = _sse(c.post("/v1/chat/completions", json={**body, "stream": True}))
        streamed = [
            e for ev in events[:-1] for ch in ev["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]
        ]
        assert [e["token"] for e in streamed] == tokens
        completion = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "min_tokens": 2, "temperature": 0,
                                                      "logprobs": 0, "logit_bias": {str(eos): 100}}).json()  # fmt: skip
        lp, text = completion["choices"][0]["logprobs"], completion["choices"][0]["text"]
        assert len(lp["tokens"]) == 3 == completion["usage"]["completion_tokens"]
        assert lp["tokens"][-1] == eos_text and "".join(lp["tokens"][:-1]) == text
        assert lp["text_offset"][-1] == len(text)  # where the EOS would start: the end of the text


def test_constraints_that_leave_no_token_are_the_clients_error(tiny_model_dir):
    """allowed_token_ids, bad_words and min_tokens that leave nothing to sample: a 400 naming the
    field at admission where that can be told, else a 400 (an error event, streamed) when the
    step finds it; never a 500, and the server serves on."""
    from servelab.engine.llm_engine import EngineArgs

    with TestClient(
        create_app(EngineArgs.from_kwargs(model=str(tiny_model_dir), num_blocks=64, max_model_len=256))
    ) as c:
        tok = c.app.state.servelab.front.tokenizer
        bang = tok.encode("!")
        assert tok.encode("!!") == bang * 2
        refused = c.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "allowed_token_ids": bang, "bad_words": ["!"]}
        )
        assert _error(refused, 400)["param"] == "bad_words"
        eos = tok.eos_token_ids[0]
        refused = c.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "allowed_token_ids": [eos], "min_tokens": 2}
        )
        assert _error(refused, 400)["param"] == "min_tokens"
        # "!" is allowed alone; after one "!" the bad word "!!" bans it: found at the second token
        body = {"prompt": "hi", "max_tokens": 4, "allowed_token_ids": bang, "bad_words": ["!!"]}
        err = _error(c.post("/v1/completions", json=body), 400)
        assert err["code"] == "unsatisfiable_constraints" and "output token 2" in err["message"]
        events = _sse(c.post("/v1/completions", json={**body, "stream": True}))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "unsatisfiable_constraints"
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        assert c.app.state.servelab.client.engine.scheduler.block_manager.num_free_blocks == 64


def test_min_tokens_holds_back_stop_strings_too(tiny_model_dir):
    """As vLLM: a stop string ends a choice only once it has more than min_tokens tokens."""
    from servelab.engine.llm_engine import EngineArgs

    with TestClient(
        create_app(EngineArgs.from_kwargs(model=str(tiny_model_dir), num_blocks=64, max_model_len=256))
    ) as c:
        body = {"prompt": "the model", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        free = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stop = free[len(free) // 4 : len(free) // 4 + 2]  # text the greedy answer reaches early
        early = c.post("/v1/completions", json={**body, "stop": [stop]}).json()
        assert early["choices"][0]["finish_reason"] == "stop"
        n = early["usage"]["completion_tokens"] + 1
        held = c.post("/v1/completions", json={**body, "stop": [stop], "min_tokens": n}).json()
        assert held["usage"]["completion_tokens"] >= n, held
        assert held["choices"][0]["text"].startswith(early["choices"][0]["text"] + stop)
