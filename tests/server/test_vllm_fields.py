"""Every field of vLLM's CompletionRequest and ChatCompletionRequest (tests/server/vllm_fields.py)
is in servelab's table and does what the table says: honoured or informational fields are
accepted, refused ones are a 400 naming the field, and every field sent at vLLM's default is
accepted. Then the behaviour of the vLLM fields servelab implements, on a real tiny model."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from servelab.server import fields as F
from servelab.server.app import create_app
from tests.server.vllm_fields import (
    CHAT_COMPANIONS,
    CHAT_FIELDS,
    COMPLETION_COMPANIONS,
    COMPLETION_FIELDS,
)

pytestmark = pytest.mark.slow  # loads a real (tiny) model

MESSAGES = [{"role": "user", "content": "hi"}]
ENDPOINTS = [
    ("/v1/completions", COMPLETION_FIELDS, F.COMPLETIONS, {"prompt": "The model is fast"}, COMPLETION_COMPANIONS),
    ("/v1/chat/completions", CHAT_FIELDS, F.CHAT, {"messages": MESSAGES}, CHAT_COMPANIONS),
]
IDS = ["completions", "chat"]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    # --order priority: a request's priority is honoured (under fcfs it is refused: see below)
    engine = LLMEngine.from_args(EngineArgs.from_kwargs(model=str(tiny_model_dir), dtype="float32", num_blocks=64,
                                                        max_model_len=256, order="priority"))  # fmt: skip
    with TestClient(create_app(engine, trust_request_chat_template=True)) as client:
        yield client, engine


def test_a_priority_is_refused_where_the_queue_would_ignore_it(tiny_model_dir):
    from servelab.engine.llm_engine import EngineArgs

    args = EngineArgs.from_kwargs(model=str(tiny_model_dir), num_blocks=64, max_model_len=256)  # order fcfs
    with TestClient(create_app(args)) as client:
        body = {"prompt": "hello", "max_tokens": 2}
        assert client.post("/v1/completions", json={**body, "priority": 0}).status_code == 200
        err = _error(client.post("/v1/completions", json={**body, "priority": 1}), 400)
        assert err["param"] == "priority" and "--order priority" in err["message"]


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def _sse(resp) -> list[dict]:
    return [json.loads(e[6:]) for e in resp.text.split("\n\n") if e.startswith("data: {")]


@pytest.mark.parametrize(("route", "vllm", "table", "base", "companions"), ENDPOINTS, ids=IDS)
def test_every_vllm_field_is_in_the_table(route, vllm, table, base, companions):
    missing = [f.name for f in vllm if f.name not in table]
    assert not missing, f"vLLM fields that {route} neither implements nor refuses: {missing}"


@pytest.mark.parametrize(("route", "vllm", "table", "base", "companions"), ENDPOINTS, ids=IDS)
def test_every_vllm_field_is_honoured_or_refused_by_name(served, route, vllm, table, base, companions):
    client, _ = served
    for field in vllm:
        rule = table[field.name]
        example = engine_name = client.app.state.servelab.model_name if field.name == "model" else field.example
        body = {**base, "max_tokens": 3, **companions.get(field.name, {}), field.name: example}
        resp = client.post(route, json=body)
        if rule.status is F.Status.REFUSED:
            err = _error(resp, 400)
            assert err["param"] == field.name and rule.note in err["message"], field.name
        else:
            assert resp.status_code == 200, (field.name, resp.text)
        if field.default is not None or field.name == "model":  # vLLM's default asks for nothing: accepted
            default = engine_name if field.name == "model" else field.default
            resp = client.post(route, json={**base, "max_tokens": 3, field.name: default})
            assert resp.status_code == 200, (field.name, field.default, resp.text)


def test_the_readme_table_lists_every_vllm_field():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for field in {f.name for f in COMPLETION_FIELDS + CHAT_FIELDS}:
        assert f"| `{field}` |" in readme, field


# ------------------------------------------------------------------------------- behaviour


def _completion(client, **body) -> dict:
    resp = client.post("/v1/completions", json={"prompt": "The model is fast", "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_repetition_penalty_changes_greedy_output_and_is_checked(served):
    client, _ = served
    plain = _completion(client, max_tokens=12, ignore_eos=True)["choices"][0]["text"]
    favoured = _completion(client, max_tokens=12, ignore_eos=True, repetition_penalty=0.3)["choices"][0]["text"]
    assert favoured != plain
    for bad in (0, -1.0, 1000.0):
        err = _error(client.post("/v1/completions", json={"prompt": "x", "repetition_penalty": bad}), 400)
        assert err["param"] == "repetition_penalty"


def test_include_stop_str_in_output_keeps_the_stop_string(served):
    client, _ = served
    text = _completion(client, max_tokens=20, ignore_eos=True)["choices"][0]["text"]
    stop = text[6:9]
    cut = _completion(client, max_tokens=20, ignore_eos=True, stop=[stop])["choices"][0]
    kept = _completion(client, max_tokens=20, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)["choices"][
        0
    ]
    assert cut["text"] == text[: text.index(stop)] and kept["text"] == text[: text.index(stop) + len(stop)]
    assert cut["finish_reason"] == kept["finish_reason"] == "stop"


def test_skip_special_tokens_false_keeps_special_tokens(served):
    client, engine = served
    tok = engine.tokenizer
    im_start, eos = tok.special_token_ids["<|im_start|>"], tok.eos_token_ids[0]
    body = {"max_tokens": 6, "min_tokens": 2, "allowed_token_ids": [im_start, eos],
            "logit_bias": {str(im_start): 50, str(eos): 100}}  # fmt: skip
    assert _completion(client, **body)["choices"][0]["text"] == ""
    assert _completion(client, **body, skip_special_tokens=False)["choices"][0]["text"] == "<|im_start|>" * 2
    both = _completion(client, **body, skip_special_tokens=False, include_stop_str_in_output=True)["choices"][0]
    assert both["text"] == "<|im_start|>" * 2 + "<|im_end|>"
    chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, **body, "skip_special_tokens": False}).json()
    assert chat["choices"][0]["message"]["content"] == "<|im_start|>" * 2


def test_truncate_prompt_tokens_keeps_the_last_tokens(served):
    client, engine = served
    prompt = "The quick brown fox jumps over the lazy dog and the cache is fast"
    ids = engine.tokenizer.encode_prompt(prompt)
    body = _completion(client, prompt=prompt, max_tokens=1, truncate_prompt_tokens=4, echo=True, logprobs=0)
    choice = body["choices"][0]
    assert body["usage"]["prompt_tokens"] == 4
    assert choice["text"].startswith(engine.tokenizer.decode(ids[-4:]))
    assert len(choice["logprobs"]["tokens"]) == 4 + 1
    chat = client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "truncate_prompt_tokens": 3}
    )
    assert chat.json()["usage"]["prompt_tokens"] == 3
    # longer than the context, served once truncated; -1 keeps the last max_model_len tokens
    long_prompt = " ".join(["cache"] * 400)
    assert (
        _completion(client, prompt=long_prompt, max_tokens=1, truncate_prompt_tokens=200)["usage"]["prompt_tokens"]
        == 200
    )
    resp = client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert _error(resp, 400)["param"] == "prompt"  # the last 256 tokens leave no room for the completion
    for bad in (0, -2, 257):
        err = _error(client.post("/v1/completions", json={"prompt": "x", "truncate_prompt_tokens": bad}), 400)
        assert err["param"] == "truncate_prompt_tokens" and "256" in err["message"]


def test_return_tokens_as_token_ids(served):
    client, engine = served
    prompt = "The model is fast"
    ids = engine.tokenizer.encode_prompt(prompt)
    body = _completion(client, prompt=prompt, max_tokens=3, logprobs=2, echo=True, return_tokens_as_token_ids=True)
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"][: len(ids)] == [f"token_id:{t}" for t in ids]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in lp["tokens"])
    assert all(re.fullmatch(r"token_id:\d+", t) for top in lp["top_logprobs"][1:] for t in top)
    for streamed in (False, True):
        resp = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3, "logprobs": True,
                                                         "top_logprobs": 2, "return_tokens_as_token_ids": True,
                                                         "stream": streamed})  # fmt: skip
        if streamed:
            entries = [
                e for c in _sse(resp) for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]
            ]
        else:
            entries = resp.json()["choices"][0]["logprobs"]["content"]
        assert len(entries) == 3
        for entry in entries:
            assert re.fullmatch(r"token_id:\d+", entry["token"]) and entry["bytes"] == list(entry["token"].encode())
            assert all(re.fullmatch(r"token_id:\d+", t["token"]) for t in entry["top_logprobs"])


def test_request_id_names_the_answer(served):
    client, _ = served
    assert _completion(client, max_tokens=1, request_id="abc")["id"] == "cmpl-abc"
    assert _completion(client, max_tokens=1, request_id="abc")["id"] == "cmpl-abc"  # reused: no clash in the engine
    chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "request_id": "xyz"})
    assert chat.json()["id"] == "chatcmpl-xyz"


# ------------------------------------------------------------------------------- chat templates


def _chat(client, **body) -> dict:
    resp = client.post("/v1/chat/completions", json={"max_tokens": 3, "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


PREFILL = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The cache"}]


def test_chat_echo_starts_the_answer_with_the_last_message(served):
    client, _ = served
    plain = _chat(client, messages=PREFILL, add_generation_prompt=False, continue_final_message=True)
    echoed = _chat(client, messages=PREFILL, add_generation_prompt=False, continue_final_message=True, echo=True)
    assert echoed["choices"][0]["message"]["content"] == "The cache" + plain["choices"][0]["message"]["content"]
    stream = client.post("/v1/chat/completions", json={"messages": PREFILL, "max_tokens": 3, "temperature": 0, "echo": True,
                                                       "add_generation_prompt": False, "continue_final_message": True,
                                                       "stream": True})  # fmt: skip
    content = "".join(ch["delta"].get("content") or "" for c in _sse(stream) for ch in c["choices"])
    assert content == echoed["choices"][0]["message"]["content"]
    # the last message is the user's, the answer the assistant's: nothing to echo
    user_last = _chat(client, messages=MESSAGES, echo=True)["choices"][0]["message"]["content"]
    assert user_last == _chat(client, messages=MESSAGES)["choices"][0]["message"]["content"]


def test_continue_final_message_leaves_the_last_message_open(served):
    client, engine = served
    body = _chat(client, messages=PREFILL, add_generation_prompt=False, continue_final_message=True, prompt_logprobs=0)
    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nThe cache"
    want = engine.tokenizer.encode_chat(PREFILL, add_generation_prompt=False, add_special_tokens=False,
                                        continue_final_message=True)  # fmt: skip
    assert engine.tokenizer.decode(want, skip_special_tokens=False) == rendered
    assert body["usage"]["prompt_tokens"] == len(want)
    assert [int(next(iter(e))) for e in body["prompt_logprobs"][1:]] == want[1:]
    err = _error(client.post("/v1/chat/completions", json={"messages": PREFILL, "continue_final_message": True}), 400)
    assert err["param"] == "continue_final_message" and "add_generation_prompt" in err["message"]


def test_a_request_chat_template_with_documents_and_kwargs(served):
    client, engine = served
    template = ("{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ greeting }}"
                "{% if add_generation_prompt %}assistant:{% endif %}")  # fmt: skip
    body = _chat(client, messages=MESSAGES, chat_template=template, documents=[{"title": "T", "text": "the cache"}],
                 chat_template_kwargs={"greeting": "hello"}, prompt_logprobs=0)  # fmt: skip
    want = engine.tokenizer.encode_prompt("[T: the cache]user: hi\nhelloassistant:", add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(want)
    assert [int(next(iter(e))) for e in body["prompt_logprobs"][1:]] == want[1:]
    # the model's own template sees documents and kwargs too, and still renders the same without them
    assert (
        _chat(client, messages=MESSAGES, chat_template_kwargs={"x": 1})["usage"]
        == _chat(client, messages=MESSAGES)["usage"]
    )


@pytest.mark.parametrize(("template", "words"), [
    ("{% for m in messages %}{{ m.content }", "not a valid Jinja template"),
    ("{{ raise_exception('no system prompt') }}", "no system prompt"),
    ("{{ messages.__class__.__mro__ }}", "chat_template"),  # the sandbox refuses it
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("x" * 70000, "at most"),
])  # fmt: skip
def test_a_bad_request_chat_template_is_a_400_naming_it(served, template, words):
    client, _ = served
    err = _error(client.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template": template}), 400)
    assert err["param"] in ("chat_template", "messages") and words in err["message"]
    assert _chat(client, messages=MESSAGES)["choices"]  # the server serves on


def test_a_request_chat_template_needs_the_server_to_trust_it(tiny_model_dir):
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine.from_args(EngineArgs.from_kwargs(model=str(tiny_model_dir), dtype="float32", num_blocks=64,
                                                        max_model_len=256))  # fmt: skip
    with TestClient(create_app(engine)) as client:
        template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        err = _error(client.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template": template}), 400)
        assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]
        ok = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    assert engine.scheduler.block_manager.num_free_blocks == 64


def test_chat_template_kwargs_set_template_variables_and_nothing_else(served):
    client, _ = served
    messages = [{"role": "user", "content": "hi"}]

    def prompt_tokens(**body) -> int:
        resp = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **body})
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens"]

    # as vLLM, a template flag among the kwargs wins over the request's field
    assert (
        prompt_tokens(chat_template_kwargs={"add_generation_prompt": False})
        == prompt_tokens(add_generation_prompt=False)
        < prompt_tokens()
    )
    for key in ("chat_template", "messages", "add_special_tokens"):
        body = {"messages": messages, "max_tokens": 1, "chat_template_kwargs": {key: "x"}}
        err = _error(client.post("/v1/chat/completions", json=body), 400)
        assert err["param"] == "chat_template_kwargs" and repr(key) in err["message"]


def test_tokenize_counts_a_chat_as_the_chat_endpoint_runs_it(served):
    client, _ = served
    for body in (
        {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"add_generation_prompt": False}},
    ):
        used = client.post("/v1/chat/completions", json={**body, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
        assert client.post("/tokenize", json=body).json()["count"] == used, body
