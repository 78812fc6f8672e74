"""The tool-call parsers: each format read whole, and streamed in any pieces to the same calls."""

from __future__ import annotations

import itertools
import json
import keyword

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.server.tool_parsers import TOOL_CALL_PARSERS, JsonListParser, ToolCallParser


WEATHER = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "scale": {"type": "number"}, "options": {"type": "object"}, "tags": {"type": ["array", "null"]}}}}  # fmt: skip


def new(name: str, parameters: dict | None = None) -> ToolCallParser:
    return JsonListParser(None) if name == "required" else TOOL_CALL_PARSERS[name](parameters or WEATHER)


def parse(name: str, text: str, parameters: dict | None = None) -> tuple[str | None, list[tuple[str, str]]]:
    return new(name, parameters).parse(text)


def stream(name: str, pieces: list[str], parameters: dict | None = None) -> tuple[str, list[tuple[str, str]]]:
    """Streams `pieces`; checks each call's parts as a client reads them: named first, once."""
    parser, content, calls = new(name, parameters), "", {}
    for i, piece in enumerate(pieces):
        text, parts = parser.feed(piece, final=i == len(pieces) - 1)
        content += text
        for part in parts:
            if part.index not in calls:
                assert part.name is not None and part.index == len(calls)
                calls[part.index] = (part.name, "")
            else:
                assert part.name is None
            calls[part.index] = (calls[part.index][0], calls[part.index][1] + part.arguments)
    return content, [calls[i] for i in sorted(calls)]


def same_streamed(name: str, text: str, pieces: list[str], parameters: dict | None = None) -> None:
    assert "".join(pieces) == text
    content, calls = parse(name, text, parameters)
    assert stream(name, pieces, parameters) == ((content or ""), calls)


# ---------------------------------------------------------------------------- whole answers


def test_hermes():
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert parse("hermes", text) == ("Let me check.", [("f", '{"x": 1}'), ("g", "{}")])
    assert parse("hermes", "<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert parse("hermes", "just text") == ("just text", [])
    # text between and after calls; the closing tag may be missing at the end
    text = 'a <tool_call>{"name": "f", "arguments": {"x": "</tool_call>"}}</tool_call> b <tool_call>{"name": "g", "arguments": {}}'
    assert parse("hermes", text) == ("a  b", [("f", '{"x": "</tool_call>"}'), ("g", "{}")])
    # keys in another order, "parameters", and arguments sent as a JSON string
    assert parse("hermes", '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>') == (None, [("f", '{"x": 1}')])
    assert parse("hermes", '<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>') == (
        None,
        [("f", '{"x": 1}')],
    )
    assert parse("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>') == (
        None,
        [("f", '{"x": 1}')],
    )


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": {"x": tru}}</tool_call>',  # bad literal, found by json.loads
    '<tool_call>{"name": "f", "arguments": {"x": 1]}</tool_call>',  # mismatched bracket
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # a name that is not a string
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>["f"]</tool_call>',
])  # fmt: skip
def test_malformed_hermes_calls_stay_content(text):
    assert parse("hermes", "ok " + text) == ("ok " + text, [])


def test_llama3_json():
    text = '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": [1, {"z": null}]}}'
    assert parse("llama3_json", text) == (None, [("f", '{"x": 1}'), ("g", '{"y": [1, {"z": null}]}')])
    assert parse("llama3_json", ' {"name": "f", "parameters": {}}') == (None, [("f", "{}")])  # no tag
    assert parse("llama3_json", 'Sure. <|python_tag|>{"name": "f", "arguments": {}}') == ("Sure.", [("f", "{}")])
    assert parse("llama3_json", '{"name": "f", "parameters": {}} done') == ("done", [("f", "{}")])
    # JSON that is not a call, and an object mid-text without the tag, are content
    assert parse("llama3_json", '{"answer": 42}') == ('{"answer": 42}', [])
    assert parse("llama3_json", 'it is {"name": "f", "parameters": {}}') == (
        'it is {"name": "f", "parameters": {}}',
        [],
    )
    assert parse("llama3_json", '{"name": "f", "parameters": {x}}') == ('{"name": "f", "parameters": {x}}', [])


def test_mistral():
    text = 'ok [TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]'
    assert parse("mistral", text) == ("ok", [("f", '{"x": 1}'), ("g", "{}")])
    assert parse("mistral", "[TOOL_CALLS] no list") == ("[TOOL_CALLS] no list", [])
    assert parse("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {x}}]') == (
        '[TOOL_CALLS][{"name": "f", "arguments": {x}}]',
        [],
    )
    # the tag is a special token, which the detokenizer drops: a list opening the answer is read too
    assert parse("mistral", ' [{"name": "f", "arguments": {}}] ok') == ("ok", [("f", "{}")])
    assert parse("mistral", "[1] is a list") == ("[1] is a list", [])
    assert parse("mistral", 'see [{"name": "f", "arguments": {}}]') == ('see [{"name": "f", "arguments": {}}]', [])


def test_pythonic():
    text = "[get_weather(city='San Francisco', units=\"metric\"), f(x=1, y=[1, 'a)'], z={'k': None}, w=True), g()]"
    assert parse("pythonic", text) == (None, [
        ("get_weather", '{"city": "San Francisco", "units": "metric"}'),
        ("f", '{"x": 1, "y": [1, "a)"], "z": {"k": null}, "w": true}'),
        ("g", "{}"),
    ])  # fmt: skip
    assert parse("pythonic", "[f(a=1)] is the call") == ("is the call", [("f", '{"a": 1}')])


@pytest.mark.parametrize("text", [
    "[1, 2] are numbers",
    "[f(1)]",  # positional arguments have no names to send
    "[f(x=y)]",  # a name, not a literal: nothing is evaluated
    "[f(x=__import__('os').getcwd())]",
    "[f(x={1, 2})]",  # a set has no JSON form
    "[f(x=float('nan'))]",
    "the call: [f(x=1)]",  # the list must open the answer
])  # fmt: skip
def test_pythonic_reads_literals_only(text):
    assert parse("pythonic", text) == (text, [])


def test_qwen3_xml():
    text = (
        "Let me see.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=scale>\n2.0\n"
        '</parameter>\n<parameter=options>\n{"a": [1]}\n</parameter>\n<parameter=tags>\n["x"]\n</parameter>\n'
        "<parameter=code>\nif a < b:\n    pass\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=ping>\n</function>\n</tool_call> done"
    )
    args = {"city": "San Francisco", "days": 3, "metric": True, "scale": 2, "options": {"a": [1]}, "tags": ["x"],
            "code": "if a < b:\n    pass"}  # fmt: skip
    assert parse("qwen3_xml", text) == ("Let me see.\n\n done", [("get_weather", json.dumps(args)), ("ping", "{}")])
    # values that do not fit their type stay text; null is null; a missing </parameter> ends at the next tag
    text = "<tool_call><function=get_weather><parameter=days>three<parameter=scale>nan<parameter=city>null</function>"
    assert parse("qwen3_xml", text) == (None, [("get_weather", '{"days": "three", "scale": "nan", "city": null}')])


@pytest.mark.parametrize("text", [
    "<tool_call>\n<functio>\n</tool_call> x",
    "<tool_call>\n<function=f\n>\n</tool_call>",
    "<tool_call><function=f><param=x>1</param></function></tool_call>",
    "<tool_call><function=f><parameter=x>1",  # cut before its first argument went out
])  # fmt: skip
def test_malformed_qwen3_xml_calls_stay_content(text):
    assert parse("qwen3_xml", text) == (text.strip(), [])


def test_required_list():
    text = '[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]'
    assert parse("required", text) == (None, [("f", '{"x": 1}'), ("g", "{}")])
    assert parse("required", '[{"name"') == ('[{"name"', [])  # cut before the name: content


def test_a_call_cut_after_its_arguments_began_is_kept():
    assert parse("hermes", 'a <tool_call>{"name": "f", "arguments": {"x": 1') == ("a", [("f", '{"x": 1')])
    assert parse("required", '[{"name": "f", "arguments": {"q": "ab') == (None, [("f", '{"q": "ab')])
    assert parse("pythonic", "[f(a=1, b='x") == (None, [("f", '{"a": 1')])
    assert parse("hermes", 'a <tool_call>{"name": "f"') == ('a <tool_call>{"name": "f"', [])


def test_a_call_that_breaks_while_streaming_keeps_what_was_sent():
    # Sent arguments cannot be taken back; the whole answer reads the broken call as content.
    text = 'a <tool_call>{"name": "f", "arguments": {"x": <1}}</tool_call>'
    assert parse("hermes", text) == (text, [])
    content, calls = stream("hermes", list(text))
    assert calls == [("f", '{"x": ')] and content == "a <1}}</tool_call>"


# ---------------------------------------------------------------------------- any pieces


def _render(fmt: str, calls: list[tuple[str, dict]], before: str, after: str) -> str:
    if fmt == "hermes":
        body = "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>\n" for n, a in calls)
        return before + body + after
    if fmt == "llama3_json":
        return before + "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    if fmt in ("mistral", "required"):
        body = json.dumps([{"name": n, "arguments": a} for n, a in calls])
        return body if fmt == "required" else before + "[TOOL_CALLS]" + body + after
    if fmt == "qwen3_xml":
        return (
            before
            + "".join(
                f"<tool_call>\n<function={n}>\n"
                + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in a.items())
                + "</function>\n</tool_call>\n"
                for n, a in calls
            )
            + after
        )
    assert fmt == "pythonic"
    return "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls) + "]"


_identifier = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True).filter(lambda s: not keyword.iskeyword(s))
_scalar = (st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8)
           | st.floats(allow_nan=False, allow_infinity=False))  # fmt: skip
_value = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
_calls = st.lists(st.tuples(_identifier, st.dictionaries(_identifier, _value, max_size=3)), min_size=1, max_size=3)
_xml_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<"), max_size=12).filter(
    lambda s: s.lower() != "null"
)
_xml_calls = st.lists(
    st.tuples(_identifier, st.dictionaries(_identifier, _xml_text | st.integers(-(10**6), 10**6), max_size=3)),
    min_size=1, max_size=3, unique_by=lambda call: call[0],  # one schema per name
)  # fmt: skip
_prose = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="[{<"), max_size=12)


@st.composite
def _pieces(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    bounds = [0, *[c for c in cuts if c < len(text)], len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "pythonic", "required", "qwen3_xml"])
@settings(max_examples=60, deadline=None)
@given(data=st.data(), before=_prose, after=_prose)
def test_any_pieces_give_the_same_calls(fmt, data, before, after):
    calls = data.draw(_xml_calls if fmt == "qwen3_xml" else _calls)
    # the XML format's values are text: the schema says which are integers
    parameters = {n: {"properties": {k: {"type": "integer" if isinstance(v, int) else "string"} for k, v in a.items()}}
                  for n, a in calls}  # fmt: skip
    text = _render(fmt, calls, before, after)
    content, parsed = parse(fmt, text, parameters)
    between = "\n" * len(calls)
    expected_content = {"hermes": before + between + after, "mistral": before + after, "llama3_json": before,
                        "qwen3_xml": before + between + after}  # fmt: skip
    assert (content or "") == expected_content.get(fmt, "").strip()
    ascii_only = fmt not in ("pythonic", "qwen3_xml")
    assert parsed == [(n, json.dumps(a, ensure_ascii=ascii_only)) for n, a in calls]
    same_streamed(fmt, text, data.draw(_pieces(text)), parameters)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "pythonic", "required", "qwen3_xml"])
def test_every_split_point_gives_the_same_calls(fmt):
    calls = [("get_weather", {"city": "Paris", "days": 2}), ("f", {})]
    text = _render(fmt, calls, "Let me look <that> up. ", " Done.")
    for i in range(len(text) + 1):
        same_streamed(fmt, text, [text[:i], text[i:]])
    same_streamed(fmt, text, list(text))


@pytest.mark.parametrize("text", [
    'ok <tool_call>{not json}</tool_call> then',
    'ok <tool_call>{"nam": "f", "arguments": {}}</tool_call> then',
    "a <tool_ca b",
    'x <tool_call>{"name": "f", "arguments": {"x": 1',
    "<tool_call>",
])  # fmt: skip
def test_content_and_cut_calls_stream_as_they_parse(text):
    for i in range(len(text) + 1):
        same_streamed("hermes", text, [text[:i], text[i:]])


def test_arguments_stream_before_the_call_ends():
    text = '<tool_call>{"name": "f", "arguments": {"text": "a long answer"}}</tool_call>'
    parser = new("hermes")
    _, parts = parser.feed(text[: text.index("long")])
    assert [(p.index, p.name, p.arguments) for p in parts] == [(0, "f", '{"text": "a ')]
    _, parts = parser.feed(text[text.index("long") :], final=True)
    assert [(p.index, p.name, p.arguments) for p in parts] == [(0, None, 'long answer"}')]


_NOISE = {
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": ', "{", "}", '"', "\\", " ", "x", "1", ","],
    "llama3_json": ["<|python_tag|>", '{"name": "f", "parameters": ', "{", "}", ";", '"', " ", "x", "1", "[", "]"],
    "mistral": ["[TOOL_CALLS]", "[", '{"name": "f", "arguments": ', "{", "}", "]", ",", '"', " ", "1"],
    "pythonic": ["[", "f(", "x=", "1", "'a'", "(", ")", "]", ",", " ", "y", "=", "'", "\\", "{", "}", "1e999"],
    "required": ["[", '{"name": "f", "arguments": ', "{", "}", "]", ",", '"', " ", "1", "tru"],
    "qwen3_xml": [
        "<tool_call>",
        "</tool_call>",
        "<function=get_weather>",
        "<function=",
        "</function>",
        "<parameter=",
        "days>",
        "</parameter>",
        "<",
        ">",
        "\n",
        "3",
        "x",
        "null",
    ],
}


@pytest.mark.parametrize("fmt", list(_NOISE))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_text_is_read_without_error_and_streams_as_it_parses(fmt, data):
    text = "".join(data.draw(st.lists(st.sampled_from(_NOISE[fmt]), max_size=24)))
    parser = new(fmt)
    parser.parse(text)
    if any(call.broken_at is not None for call in parser.calls):
        stream(fmt, data.draw(_pieces(text)))  # sent arguments stay sent: only no error to check
    else:
        same_streamed(fmt, text, data.draw(_pieces(text)))
