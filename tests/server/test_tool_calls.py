"""Tool calls through a tool plan: the streamed rendering of each plan, and the server's answers
(the parsers themselves: test_tool_parsers.py)."""

from __future__ import annotations

import json

import pytest

from servelab.server import protocol as p
from servelab.server.structured import ToolCallStream, ToolPlan, output_spec, parse_tool_calls


def feed_all(plan: ToolPlan, pieces: list[str]) -> tuple[str, list[dict]]:
    stream = ToolCallStream(plan)
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, finished=i == len(pieces) - 1)
        if delta is None:
            continue
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.index not in calls:  # a call's first delta says what it is
                assert d.id.startswith("call_") and d.type == "function" and d.function.name
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.type is None and d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)]


def test_streamed_auto_holds_back_a_split_tag():
    text = 'Sure. <tool_call>{"name": "f", "arguments": {"a": "b"}}</tool_call>'
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]  # the tag arrives in pieces
    content, calls = feed_all(ToolPlan(parser="hermes"), pieces)
    assert content == "Sure."
    assert calls == [{"name": "f", "arguments": '{"a": "b"}'}]
    assert feed_all(ToolPlan(parser="hermes"), ["a <", "b"]) == ("a <b", [])  # a '<' that opened nothing


def test_streamed_forced_calls_match_the_whole_answer():
    args = '{"city": "Paris"}'
    assert feed_all(ToolPlan(forced_name="w"), list(args)) == ("", [{"name": "w", "arguments": args}])
    whole = json.dumps([{"name": "w", "arguments": {"city": "Paris"}}, {"name": "t", "arguments": {}}])
    both = [{"name": "w", "arguments": args}, {"name": "t", "arguments": "{}"}]
    assert feed_all(ToolPlan(forced_any=True), list(whole)) == ("", both)
    content, calls = parse_tool_calls(ToolPlan(forced_any=True), whole)
    assert content is None and [c.function.model_dump() for c in calls] == both
    # cut by max_tokens before a name: no call, the text stays content
    assert parse_tool_calls(ToolPlan(forced_any=True), whole[:8]) == (whole[:8], [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    for plan in (ToolPlan(parser="hermes", max_calls=1), ToolPlan(forced_any=True, max_calls=1)):
        answer = text if plan.parser else json.dumps([{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}])
        assert feed_all(plan, list(answer)) == ("", [{"name": "f", "arguments": "{}"}])
        assert [c.function.name for c in parse_tool_calls(plan, answer)[1]] == ["f"]


def _request(**fields) -> p.ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": n}} for n in ("a", "b")]
    return p.ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": tools, **fields}
    )


def test_required_builds_a_list_of_calls_over_the_tools():
    schema = json.loads(output_spec(_request(tool_choice="required")).value)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [s["properties"]["name"] for s in schema["items"]["anyOf"]] == [{"const": "a"}, {"const": "b"}]
    schema = json.loads(output_spec(_request(tool_choice="required", parallel_tool_calls=False)).value)
    assert schema["maxItems"] == 1


# ------------------------------------------------------------------------------ through the server


def scripted_app(tiny_model_dir, text: str, **app_kwargs):
    """The server over a fake executor whose every answer is `text`, then EOS. Grammars are
    compiled (so a constraint that does not compile is refused) but the script is not masked:
    for tool_choice "required", script an answer the grammar allows."""
    from servelab.core.config import SchedulerConfig
    from servelab.engine.llm_engine import LLMEngine
    from servelab.engine.logits_processors import LogitsProcessors
    from servelab.engine.tokenizer import Tokenizer
    from servelab.server.app import create_app
    from tests.fake_executor import FakeExecutor

    tokenizer = Tokenizer.from_hf_dir(tiny_model_dir)
    script = tokenizer.encode(text)
    assert tokenizer.decode(script) == text

    def token_fn(seq, position):
        i = position - seq.num_prompt_tokens
        return script[i] if i < len(script) else tokenizer.eos_token_id

    executor = FakeExecutor(vocab_size=tokenizer.vocab_size, token_fn=token_fn)
    config = SchedulerConfig(
        num_blocks=128, block_size=16, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024
    )
    processors = LogitsProcessors(tokenizer, tokenizer.vocab_size)
    return create_app(LLMEngine(executor, tokenizer, config, "fake-model", logits_processors=processors), **app_kwargs)


def _chunks(client, body: dict) -> list[dict]:
    events = [line[6:] for line in client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    return [json.loads(e)["choices"][0] for e in events]


def _streamed_choice(client, body: dict) -> dict:
    """A streamed chat answer put together as the non-streamed one reads."""
    chunks = _chunks(client, body)
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


WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}, "hours": {"type": "integer"}}, "required": ["tz"]}}},
]  # fmt: skip
TWO_CALLS = [
    ("get_weather", '{"city": "Paris, France", "unit": "C"}'),
    ("get_time", '{"tz": "Europe/Paris", "hours": 24}'),
]


def _body(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "weather and time?"}], "max_tokens": 600, "tools": WEATHER_TOOLS,
            **fields}  # fmt: skip


def test_auto_tool_choice_with_the_hermes_parser(tiny_model_dir):
    from fastapi.testclient import TestClient

    answer = 'ok <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    body = _body()
    with TestClient(scripted_app(tiny_model_dir, answer)) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        scripted_app(tiny_model_dir, answer, tool_call_parser="qwen2")
    with TestClient(scripted_app(tiny_model_dir, answer, tool_call_parser="hermes")) as c:
        whole = _whole_choice(c, body)
        assert whole == {"content": "ok", "calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}],
                         "finish_reason": "tool_calls"}  # fmt: skip
        assert _streamed_choice(c, body) == whole


@pytest.mark.parametrize("parser, answer", [
    ("hermes", "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>\n' for n, a in TWO_CALLS)),
    ("llama3_json", "<|python_tag|>" + "; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in TWO_CALLS)),
    ("mistral", "[TOOL_CALLS][" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in TWO_CALLS) + "]"),
    ("pythonic", "[get_weather(city='Paris, France', unit='C'), get_time(tz='Europe/Paris', hours=24)]"),
    ("qwen3_xml", "".join(f"<tool_call>\n<function={n}>\n" + "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in json.loads(a).items()) + "</function>\n</tool_call>\n"
        for n, a in TWO_CALLS)),  # "hours" is an integer in the tool's schema
    (None, json.dumps([{"name": n, "arguments": json.loads(a)} for n, a in TWO_CALLS])),  # tool_choice "required"
])  # fmt: skip
def test_several_calls_stream_their_arguments_as_generated(tiny_model_dir, parser, answer):
    from fastapi.testclient import TestClient

    body = _body(tool_choice="required") if parser is None else _body()
    with TestClient(scripted_app(tiny_model_dir, answer, tool_call_parser=parser)) as c:
        whole = _whole_choice(c, body)
        expected = [{"name": n, "arguments": a} for n, a in TWO_CALLS]
        assert whole == {"content": None, "calls": expected, "finish_reason": "tool_calls"}
        assert _streamed_choice(c, body) == whole
        deltas = [d for ch in _chunks(c, body) for d in ch["delta"].get("tool_calls") or []]
        for index in (0, 1):
            first, *rest = [d for d in deltas if d["index"] == index]
            assert first["id"].startswith("call_") and first["type"] == "function"
            assert first["function"]["name"] == expected[index]["name"] and "arguments" in first["function"]
            assert rest, "the arguments come in several deltas, as they are generated"
            assert all(d.keys() == {"index", "function"} and d["function"].keys() == {"arguments"} for d in rest)


def test_parallel_tool_calls_false_answers_one_call(tiny_model_dir):
    from fastapi.testclient import TestClient

    answer = "".join(f'<tool_call>{{"name": "{n}", "arguments": {a}}}</tool_call>' for n, a in TWO_CALLS)
    body = _body(parallel_tool_calls=False)
    with TestClient(scripted_app(tiny_model_dir, answer, tool_call_parser="hermes")) as c:
        whole = _whole_choice(c, body)
        assert whole == {"content": None, "calls": [{"name": n, "arguments": a} for n, a in TWO_CALLS[:1]],
                         "finish_reason": "tool_calls"}  # fmt: skip
        assert _streamed_choice(c, body) == whole
        assert len(_whole_choice(c, _body())["calls"]) == 2
    one = json.dumps([{"name": "get_time", "arguments": {"tz": "UTC"}}])
    with TestClient(scripted_app(tiny_model_dir, one)) as c:  # "required": the grammar allows one call
        body = _body(tool_choice="required", parallel_tool_calls=False)
        assert _whole_choice(c, body)["calls"] == [{"name": "get_time", "arguments": '{"tz": "UTC"}'}]


def test_a_call_cut_by_max_tokens_keeps_its_arguments_so_far_in_both_modes(tiny_model_dir):
    from fastapi.testclient import TestClient

    from servelab.engine.tokenizer import Tokenizer

    answer = 'ok <tool_call>{"name": "get_weather", "arguments": {"city": "Paris, France"}}</tool_call>'
    tokenizer = Tokenizer.from_hf_dir(tiny_model_dir)
    script = tokenizer.encode(answer)
    texts = [tokenizer.decode(script[:n]) for n in range(len(script))]
    n = max(n for n, text in enumerate(texts) if '{"city": "Paris' in text and "}}" not in text)  # inside the arguments
    cut = texts[n]
    with TestClient(scripted_app(tiny_model_dir, answer, tool_call_parser="hermes")) as c:
        body = _body(max_tokens=n)
        whole = _whole_choice(c, body)
        assert whole == {"content": "ok", "calls": [{"name": "get_weather", "arguments": cut[cut.index('{"city"') :]}],
                         "finish_reason": "length"}  # fmt: skip
        assert _streamed_choice(c, body) == whole


def test_the_openai_client_accumulates_the_streamed_calls(tiny_model_dir):
    import openai
    from fastapi.testclient import TestClient

    answer = 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    with TestClient(scripted_app(tiny_model_dir, answer, tool_call_parser="hermes")) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        kwargs = {"model": "fake-model", "messages": [{"role": "user", "content": "weather?"}], "tools": WEATHER_TOOLS}
        whole = client.chat.completions.create(**kwargs).choices[0]
        with client.chat.completions.stream(**kwargs) as stream:
            streamed = stream.get_final_completion().choices[0]
        for choice in (whole, streamed):
            assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
            (call,) = choice.message.tool_calls
            assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Oslo"}')
            assert call.id.startswith("call_") and call.type == "function"


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
    # Which function was meant is not known before its name is whole: the text stays content.
    body = {"messages": [{"role": "user", "content": "find it"}], "max_tokens": 3, "temperature": 0,
            "tools": CUT_TOOLS, "tool_choice": "required"}  # fmt: skip
    whole, streamed = _whole_choice(tiny_client, body), _streamed_choice(tiny_client, body)
    assert whole["finish_reason"] == "length" and whole["calls"] == [] and whole["content"].startswith("[")
    assert streamed == whole
