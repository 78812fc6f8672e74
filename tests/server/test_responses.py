"""/v1/responses through the openai client (in process): create, streamed with the Responses
event sequence, previous_response_id from the bounded store, GET and DELETE, function tools on
the chat path's machinery, refusals naming their field; and SageMaker's /ping and /invocations,
and /tokenizer_info."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from servelab.server.app import create_app
from servelab.server.response_store import ResponseStore


@pytest.fixture
def http(fake_engine):
    with TestClient(create_app(fake_engine(max_model_len=256))) as c:
        yield c


@pytest.fixture
def client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def _chat_text(http, messages: list[dict], max_tokens: int) -> tuple[str, dict]:
    body = http.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens, "ignore_eos": True}
    ).json()
    return body["choices"][0]["message"]["content"], body["usage"]


def test_create_is_the_chat_completion_of_the_same_messages(client, http):
    resp = client.responses.create(model="fake-model", input="hello there", instructions="be brief", max_output_tokens=6,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    text, usage = _chat_text(
        http, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}], 6
    )
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == "fake-model"
    assert resp.output_text == text
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (usage["prompt_tokens"], 6)
    assert resp.usage.total_tokens == usage["prompt_tokens"] + 6
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"


def test_message_items_with_input_text_parts(client, http):
    items = [{"role": "developer", "content": "system words"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "part one, "},
                                                              {"type": "input_text", "text": "part two"}]}]  # fmt: skip
    resp = client.responses.create(input=items, max_output_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    text, _ = _chat_text(http, [{"role": "system", "content": "system words"},
                                {"role": "user", "content": "part one, part two"}], 5)  # fmt: skip
    assert resp.output_text == text


def test_stream_has_the_responses_event_sequence(client):
    stream = client.responses.create(
        input="stream me", max_output_tokens=8, stream=True, extra_body={"ignore_eos": True}
    )
    events = list(stream)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert set(kinds[4 : 4 + len(deltas)]) == {"response.output_text.delta"} and deltas
    assert kinds[4 + len(deltas) :] == ["response.output_text.done", "response.content_part.done",
                                        "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == "".join(deltas)
    final = events[-1].response
    assert final.output_text == done.text and final.usage.output_tokens == 8
    assert client.responses.retrieve(final.id).output_text == done.text  # stored when it completed


def test_previous_response_id_continues_the_conversation(client, http):
    first = client.responses.create(input="first question", max_output_tokens=4, extra_body={"ignore_eos": True})
    second = client.responses.create(input="second question", previous_response_id=first.id, max_output_tokens=4,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    messages = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "second question"}]  # fmt: skip
    text, usage = _chat_text(http, messages, 4)
    assert second.output_text == text and second.usage.input_tokens == usage["prompt_tokens"]
    assert second.previous_response_id == first.id


def test_get_delete_and_unknown_ids(client):
    resp = client.responses.create(input="keep me", max_output_tokens=3)
    assert client.responses.retrieve(resp.id).id == resp.id
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(input="go on", previous_response_id=resp.id, max_output_tokens=3)
    assert info.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(input="forget me", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(("body", "param"), [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "web_search_call"}]}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
])  # fmt: skip
def test_unsupported_parameters_are_400s_naming_them(http, body, param):
    resp = http.post("/v1/responses", json={"input": "hi", **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_the_store_is_bounded_by_count_and_bytes_lru():
    store = ResponseStore(max_count=2, max_bytes=1000)
    for rid in ("a", "b"):
        store.put({"id": rid}, [])
    store.get("a")  # a is now the most recently used
    store.put({"id": "c"}, [])
    assert store.get("a") and store.get("c")
    with pytest.raises(Exception, match="evicted"):
        store.get("b")
    by_bytes = ResponseStore(max_count=100, max_bytes=200)
    turn = [{"role": "user", "content": "x" * 40}]  # about 75 bytes stored
    for rid in ("d", "e", "f"):
        assert by_bytes.put({"id": rid}, turn)
    assert len(by_bytes) == 2 and by_bytes.num_bytes <= 200  # d went to make room for f
    with pytest.raises(Exception, match="evicted"):
        by_bytes.get("d")
    assert not by_bytes.put({"id": "g"}, [{"content": "x" * 300}])  # larger than the store: not kept
    assert by_bytes.get("e") and by_bytes.get("f")


@pytest.mark.slow
def test_function_tools_map_to_chat_tools(tiny_model_dir):
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine.from_args(EngineArgs.from_kwargs(model=str(tiny_model_dir), dtype="float32", num_blocks=64))
    tool = {"type": "function", "name": "lookup", "description": "look it up",
            "parameters": {"type": "object", "properties": {"n": {"enum": ["one", "two"]}}, "required": ["n"]}}  # fmt: skip
    with TestClient(create_app(engine)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        resp = client.responses.create(input="find it", tools=[tool], tool_choice={"type": "function", "name": "lookup"},
                                       max_output_tokens=64, temperature=0)  # fmt: skip
        calls = [item for item in resp.output if item.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "lookup" and json.loads(calls[0].arguments)["n"] in ("one", "two")
        events = list(client.responses.create(input="find it", tools=[tool], tool_choice="required",
                                              max_output_tokens=64, temperature=0, stream=True))  # fmt: skip
        item = next(e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call")
        assert item.name == "lookup" and json.loads(item.arguments)["n"] in ("one", "two")
        # the call's output goes back as a function_call_output item
        follow = client.responses.create(previous_response_id=resp.id, max_output_tokens=4, input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "found"}])  # fmt: skip
        assert follow.status in ("completed", "incomplete")


def test_ping_invocations_and_tokenizer_info(http):
    for method in ("get", "post"):
        resp = getattr(http, method)("/ping")
        assert resp.status_code == 200 and resp.json() == http.get("/health").json()
    chat = http.post("/invocations", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.json()["object"] == "chat.completion"
    completion = http.post("/invocations", json={"prompt": "hi", "max_tokens": 2})
    assert completion.json()["object"] == "text_completion"
    unknown = http.post("/invocations", json={"nothing": 1})
    assert unknown.status_code == 400 and "'messages'" in unknown.json()["error"]["message"]
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast" and info["model_max_length"] == 256
    assert isinstance(info["added_tokens_decoder"], dict)


def test_ping_is_open_without_the_api_key(fake_engine):
    with TestClient(create_app(fake_engine(), api_key="secret")) as http:
        assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
        assert http.post("/invocations", json={"prompt": "hi"}).status_code == 401
