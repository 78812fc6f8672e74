"""Speculative decoding through the HTTP API (tiny real model): OpenAI's `prediction` on both
endpoints, its usage details (also in the streamed usage chunk), malformed predictions refused
naming the field, and vLLM's spec-decode families on /metrics."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from servelab.engine.llm_engine import EngineArgs, LLMEngine
from servelab.server.app import create_app

PROMPT = "the quick brown fox jumps over the lazy dog. the quick brown fox"


def _app(tiny_model_dir, spec: str | None = None, **kwargs):
    args = EngineArgs.from_kwargs(model=str(tiny_model_dir), dtype="float32", deterministic=True,
                                  speculative_config=spec)  # fmt: skip
    return create_app(LLMEngine.from_args(args), **kwargs)


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    with TestClient(_app(tiny_model_dir)) as c:
        yield c


def _completion(client, **body):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prediction_changes_no_text_and_reports_its_tokens_in_usage(client):
    plain = _completion(client)
    # only a request with a prediction has them, on a server that does not speculate otherwise
    assert "completion_tokens_details" not in plain["usage"] and "spec_decode" not in plain["usage"]
    text = plain["choices"][0]["text"]
    predicted = _completion(client, prediction={"type": "content", "content": text})
    assert predicted["choices"][0]["text"] == text
    details = predicted["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0
    assert details["rejected_prediction_tokens"] >= 0
    own = predicted["usage"]["spec_decode"]  # the request's verifications, in vLLM's counter terms
    assert own["num_accepted_tokens"] == sum(own["accepted_per_position"]) == details["accepted_prediction_tokens"]
    assert 0 < own["num_drafts"] <= own["num_decode_steps"] < predicted["usage"]["completion_tokens"]
    # a structured-output request never drafts, so it carries no counts
    constrained = _completion(client, prediction={"type": "content", "content": text},
                              response_format={"type": "json_object"})  # fmt: skip
    assert "spec_decode" not in constrained["usage"]
    wrong = _completion(client, prediction={"type": "content", "content": "cheese wine music art history"})
    assert wrong["choices"][0]["text"] == text
    assert wrong["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0


def test_chat_takes_a_prediction_as_text_parts_and_streams_its_usage(client):
    messages = [{"role": "user", "content": PROMPT}]
    plain = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 16, "temperature": 0})
    text = plain.json()["choices"][0]["message"]["content"]
    prediction = {"type": "content", "content": [{"type": "text", "text": text}]}
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "prediction": prediction, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert streamed == text
    usage = events[-1]["usage"]
    assert usage["completion_tokens_details"]["accepted_prediction_tokens"] > 0


@pytest.mark.parametrize(
    "prediction, param",
    [
        ({"type": "file", "content": "x"}, "prediction.type"),
        ({"type": "content"}, "prediction.content"),
        ({"type": "content", "content": 3}, "prediction.content"),
        ("just text", "prediction"),
    ],
)
def test_a_malformed_prediction_is_a_400_naming_the_field(client, prediction, param):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "prediction": prediction})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prediction" and err["message"].startswith(param), err


def test_spec_decode_metrics_use_vllms_names(tiny_model_dir):
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    with TestClient(_app(tiny_model_dir, spec, metrics_namespace="vllm")) as c:
        # a prompt the tiny random model goes on repeating, so that prompt lookup hits
        body = {"prompt": "hello hello hello hello hello", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200
        text = c.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    drafts = next(v for k, v in values.items() if k.startswith("vllm:spec_decode_num_drafts_total{"))
    draft_tokens = next(v for k, v in values.items() if k.startswith("vllm:spec_decode_num_draft_tokens_total{"))
    accepted = next(v for k, v in values.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total{"))
    per_pos = {k: v for k, v in values.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")}
    assert drafts > 0 and draft_tokens >= drafts and 0 < accepted <= draft_tokens
    assert any('position="0"' in k for k in per_pos)
    assert sum(per_pos.values()) == accepted
    # the one request's own counts, in its usage, are the server's
    usage = r.json()["usage"]
    own = usage["spec_decode"]
    assert (own["num_drafts"], own["num_draft_tokens"], own["num_accepted_tokens"]) == (drafts, draft_tokens, accepted)
    # every token after the prefill's came from a decode step: one a step, plus the drafts it kept
    assert own["num_decode_steps"] == usage["completion_tokens"] - 1 - accepted >= own["num_drafts"]
    assert own["accepted_per_position"] == [per_pos[k] for k in sorted(per_pos, key=lambda k: k.split('position="')[1])]
