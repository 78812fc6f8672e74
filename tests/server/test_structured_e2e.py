"""End to end on the bundled model: a real `servelab serve`, the official `openai` client, and
logit_bias, json_schema, tool calls and structured_outputs. Every JSON answer is parsed and
validated against its schema."""

from __future__ import annotations

import json
import re

import openai
import pytest

pytestmark = pytest.mark.slow
jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}}, "required": ["tz"]}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server_launcher) -> openai.OpenAI:
    from servelab.engine.bundled import bundled_model_path

    try:
        path = bundled_model_path()
    except Exception as e:
        pytest.skip(f"bundled model unavailable: {e}")
    server = server_launcher(path, "--max-model-len", "512", "--dtype", "float32")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def model(client) -> str:
    return client.models.list().data[0].id


def test_logit_bias_bans_and_forces_tokens(client):
    prompt = "The capital of France is"
    plain = client.completions.create(model=model(client), prompt=prompt, max_tokens=3, temperature=0)
    assert plain.choices[0].text.startswith(" Paris")
    paris = str(7042)  # " Paris" in SmolLM2's vocabulary
    banned = client.completions.create(
        model=model(client), prompt=prompt, max_tokens=3, temperature=0, logit_bias={paris: -100}
    )
    assert "Paris" not in banned.choices[0].text
    forced = client.chat.completions.create(model=model(client), messages=ASK, max_tokens=2, temperature=0,
                                            logit_bias={"33": 100})  # fmt: skip
    assert forced.choices[0].message.content == "11"  # token 33 is "1"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model(client), prompt=prompt, max_tokens=1, logit_bias={paris: 101})
    assert e.value.body["param"] == "logit_bias" and "[-100, 100]" in e.value.body["message"]


def test_allowed_token_ids_and_bad_words(client):
    prompt = "The capital of France is"
    paris, one = 7042, 33  # " Paris" and "1" in SmolLM2's vocabulary
    r = client.completions.create(model=model(client), prompt=prompt, max_tokens=4, temperature=1.0, seed=2,
                                  extra_body={"allowed_token_ids": [paris, one], "ignore_eos": True})  # fmt: skip
    assert re.fullmatch(r"( Paris|1)+", r.choices[0].text), r.choices[0].text
    r = client.completions.create(model=model(client), prompt=prompt, max_tokens=3, temperature=0,
                                  extra_body={"bad_words": ["Paris"]})  # fmt: skip
    assert "Paris" not in r.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model(client), prompt=prompt, max_tokens=1, extra_body={"allowed_token_ids": []}
        )
    assert e.value.body["param"] == "allowed_token_ids"
    with pytest.raises(openai.BadRequestError) as e:  # "1" alone allowed, and "11" bans it after one "1"
        client.completions.create(model=model(client), prompt=prompt, max_tokens=4,
                                  extra_body={"allowed_token_ids": [one], "bad_words": ["11"]})  # fmt: skip
    assert e.value.body["code"] == "unsatisfiable_constraints" and "output token 2" in e.value.body["message"]


def test_json_schema_answers_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=model(client), messages=[{"role": "user", "content": "A person as JSON."}],
                                       max_tokens=60, temperature=0.7, seed=1, n=3, response_format=fmt)  # fmt: skip
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PERSON)
    cut = client.chat.completions.create(model=model(client), messages=[{"role": "user", "content": "JSON please"}],
                                         max_tokens=3, temperature=0, response_format={"type": "json_object"})  # fmt: skip
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content.startswith("{")


def test_required_tool_calls_in_both_modes(client):
    kwargs = {"model": model(client), "messages": ASK, "max_tokens": 80, "temperature": 0, "tools": TOOLS,
              "tool_choice": "required"}  # fmt: skip
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls  # one or more
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == calls
    one = client.chat.completions.create(**kwargs, parallel_tool_calls=False).choices[0]
    assert len(one.message.tool_calls) == 1


def test_named_tool_call_streams_its_arguments(client):
    stream = client.chat.completions.create(model=model(client), messages=ASK, max_tokens=40, temperature=0, stream=True,
                                            tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})  # fmt: skip
    names, arguments, finish = [], "", None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                assert d.index == 0
                names += [d.function.name] if d.function.name else []
                arguments += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert names == ["get_time"] and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), TOOLS[1]["function"]["parameters"])


def test_auto_tool_choice_without_a_parser_is_refused_and_none_is_text(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model(client), messages=ASK, max_tokens=4, tools=TOOLS)
    assert e.value.body["param"] == "tool_choice" and "--tool-call-parser" in e.value.body["message"]
    r = client.chat.completions.create(
        model=model(client), messages=ASK, max_tokens=4, temperature=0, tools=TOOLS, tool_choice="none"
    )
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_structured_outputs_extras(client):
    r = client.completions.create(model=model(client), prompt="The capital of France is", max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["Lyon", "Marseille"]}})  # fmt: skip
    assert r.choices[0].text in ("Lyon", "Marseille") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=model(client), prompt="Zip code:", max_tokens=8, temperature=1.0, seed=3,
                                  extra_body={"guided_regex": "[0-9]{5}"})  # fmt: skip
    assert r.choices[0].text.isdigit() and len(r.choices[0].text) == 5
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model(client), prompt="x", max_tokens=4, extra_body={"guided_regex": "[a-"})
    assert e.value.body["param"] == "guided_regex" and "does not compile" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model(client), prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "a", "structured_outputs": {"regex": "b"}})  # fmt: skip
    assert "only one output constraint" in e.value.body["message"]


def test_a_named_call_cut_by_max_tokens_through_the_openai_client(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model=model(client), messages=ASK, max_tokens=3, temperature=0, tools=TOOLS,
                                           tool_choice=named).choices[0]  # fmt: skip
    assert whole.finish_reason == "length" and whole.message.content is None
    (call,) = whole.message.tool_calls
    arguments = ""
    for chunk in client.chat.completions.create(model=model(client), messages=ASK, max_tokens=3, temperature=0,
                                                tools=TOOLS, tool_choice=named, stream=True):  # fmt: skip
        for c in chunk.choices:
            arguments += "".join(d.function.arguments or "" for d in c.delta.tool_calls or [])
    assert call.function.name == "get_weather" and call.function.arguments == arguments
