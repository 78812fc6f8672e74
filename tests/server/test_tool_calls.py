"""Tool calls read out of text: the Hermes parser and the streamed rendering of each tool plan."""

from __future__ import annotations

import json

import pytest

from servelab.server import protocol as p
from servelab.server.structured import ToolCallStream, ToolPlan, output_spec, parse_tool_calls
from servelab.server.tool_parsers import parse_hermes


def test_hermes_calls_and_content():
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "Let me check." and calls == [("f", '{"x": 1}'), ("g", "{}")]
    assert parse_hermes("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert parse_hermes("just text") == ("just text", [])


def feed_all(plan: ToolPlan, pieces: list[str]) -> tuple[str, list[dict]]:
    stream = ToolCallStream(plan)
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, finished=i == len(pieces) - 1)
        if delta is None:
            continue
        content += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)]


def test_streamed_auto_holds_back_a_split_tag():
    text = 'Sure. <tool_call>{"name": "f", "arguments": {"a": "b"}}</tool_call>'
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]  # the tag arrives in pieces
    content, calls = feed_all(ToolPlan(parser="hermes"), pieces)
    assert content.strip() == "Sure." and "<" not in content
    assert calls == [{"name": "f", "arguments": '{"a": "b"}'}]
    assert feed_all(ToolPlan(parser="hermes"), ["a <", "b"]) == ("a <b", [])  # a '<' that opened nothing


def test_streamed_forced_calls_match_the_whole_answer():
    args = '{"city": "Paris"}'
    assert feed_all(ToolPlan(forced_name="w"), list(args)) == ("", [{"name": "w", "arguments": args}])
    whole = json.dumps({"name": "w", "arguments": {"city": "Paris"}})
    assert feed_all(ToolPlan(forced_any=True), [whole[:5], whole[5:]]) == ("", [{"name": "w", "arguments": args}])
    # cut by max_tokens: no call, the text stays content
    assert parse_tool_calls(ToolPlan(forced_any=True), whole[:7]) == (whole[:7], [])


def test_required_builds_an_any_of_over_the_tools():
    req = p.ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": n}} for n in ("a", "b")],
    })  # fmt: skip
    schema = json.loads(output_spec(req).value)
    assert [s["properties"]["name"] for s in schema["anyOf"]] == [{"const": "a"}, {"const": "b"}]


# ------------------------------------------------------------------------------ through the server


def scripted_app(tiny_model_dir, text: str, **app_kwargs):
    """The server over a fake executor whose every answer is `text`, then EOS."""
    from servelab.core.config import SchedulerConfig
    from tests.fake_executor import FakeExecutor
    from servelab.engine.llm_engine import LLMEngine
    from servelab.engine.tokenizer import Tokenizer
    from servelab.server.app import create_app

    tokenizer = Tokenizer.from_hf_dir(tiny_model_dir)
    script = tokenizer.encode(text)
    assert tokenizer.decode(script) == text

    def token_fn(seq, position):
        i = position - seq.num_prompt_tokens
        return script[i] if i < len(script) else tokenizer.eos_token_id

    executor = FakeExecutor(vocab_size=tokenizer.vocab_size, token_fn=token_fn)
    config = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256)
    return create_app(LLMEngine(executor, tokenizer, config, "fake-model"), **app_kwargs)


def test_auto_tool_choice_with_the_hermes_parser(tiny_model_dir):
    from fastapi.testclient import TestClient

    answer = 'ok <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    body = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 100,
            "tools": [{"type": "function", "function": {"name": "get_weather"}}]}  # fmt: skip
    with TestClient(scripted_app(tiny_model_dir, answer)) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    with TestClient(scripted_app(tiny_model_dir, answer, tool_call_parser="hermes")) as c:
        choice = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "ok"
        (call,) = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        events = [line[6:] for line in c.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip
        chunks = [json.loads(e)["choices"][0] for e in events]
        content = "".join(ch["delta"].get("content") or "" for ch in chunks)
        calls = [d for ch in chunks for d in ch["delta"].get("tool_calls") or []]
        assert content.strip() == "ok" and [d["function"]["name"] for d in calls] == ["get_weather"]
        assert chunks[-1]["finish_reason"] == "tool_calls"


# ------------------------------------------------------------- forced calls cut by max_tokens


@pytest.fixture(scope="module")
def tiny_client(tiny_model_dir):
    """The server over the tiny real model (its logits go through the grammar)."""
    from fastapi.testclient import TestClient

    from servelab.engine.llm_engine import EngineArgs, LLMEngine
    from servelab.server.app import create_app

    engine = LLMEngine.from_args(EngineArgs.from_kwargs(model=str(tiny_model_dir), dtype="float32", num_blocks=64))
    with TestClient(create_app(engine)) as client:
        yield client


def _streamed_choice(client, body: dict) -> dict:
    """A streamed chat answer put together as the non-streamed one reads."""
    events = [line[6:] for line in client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    chunks = [json.loads(e)["choices"][0] for e in events]
    content = "".join(ch["delta"].get("content") or "" for ch in chunks) or None
    calls: dict[int, dict] = {}
    for d in (d for ch in chunks for d in ch["delta"].get("tool_calls") or []):
        call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
        call["name"] += d["function"].get("name") or ""
        call["arguments"] += d["function"].get("arguments") or ""
    finish = [ch["finish_reason"] for ch in chunks if ch["finish_reason"]]
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish_reason": finish[-1]}


def _whole_choice(client, body: dict) -> dict:
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    calls = [c["function"] for c in choice["message"].get("tool_calls") or []]
    return {"content": choice["message"]["content"], "calls": calls, "finish_reason": choice["finish_reason"]}


CUT_TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]  # fmt: skip


@pytest.mark.slow
def test_a_named_call_cut_by_max_tokens_is_a_call_in_both_modes(tiny_client):
    # As vLLM: the named function's call, its arguments whatever was generated, finish "length".
    body = {"messages": [{"role": "user", "content": "find it"}], "max_tokens": 3, "temperature": 0,
            "tools": CUT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "lookup"}}}  # fmt: skip
    whole, streamed = _whole_choice(tiny_client, body), _streamed_choice(tiny_client, body)
    assert whole["finish_reason"] == "length" and whole["content"] is None
    (call,) = whole["calls"]
    assert call["name"] == "lookup" and call["arguments"].startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(call["arguments"])  # really cut
    assert streamed == whole


@pytest.mark.slow
def test_a_required_call_cut_by_max_tokens_is_content_in_both_modes(tiny_client):
    # Which function was meant is not known before the JSON is whole: the text stays content.
    body = {"messages": [{"role": "user", "content": "find it"}], "max_tokens": 3, "temperature": 0,
            "tools": CUT_TOOLS, "tool_choice": "required"}  # fmt: skip
    whole, streamed = _whole_choice(tiny_client, body), _streamed_choice(tiny_client, body)
    assert whole["finish_reason"] == "length" and whole["calls"] == [] and whole["content"].startswith("{")
    assert streamed == whole
