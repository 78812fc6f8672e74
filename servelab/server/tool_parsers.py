"""Parsers that read tool calls out of a model's text: one per model family's format, chosen by
`serve --tool-call-parser` for tool_choice "auto" (vLLM's names), and the JSON list that
tool_choice "required" constrains the answer to.

A parser is fed the answer in pieces and says, piece by piece, what is known: text that cannot
open a call goes out as content, a call goes out once its name is known, and its arguments as
they arrive. Fed the whole answer at once (`parse`), it is the non-streamed parser, so both
modes read the same calls whatever the pieces. A call whose text is malformed stays content; one
whose arguments had already started streaming when it broke cannot be taken back, so there the
streamed answer keeps the call. A call cut off by the end of the answer (max_tokens) once its
arguments began is kept with the arguments so far, as a named function's is. Light: the CLI
imports the names.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_WS = " \t\r\n"
_CLOSER = {"}": "{", "]": "["}
_JSON_BARE = frozenset(_WS + ",:0123456789+-.eEtrufalsn")  # outside strings: structure, numbers, literals
# `{"name": "f", "arguments": ` with the value's first character present (so no chunking can
# move where the value starts): the name is known before its arguments, which can then stream.
_JSON_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
_PY_HEAD = re.compile(r"([A-Za-z_][\w.]*)\s*\(")
_PY_HEAD_PART = re.compile(r"(?:[A-Za-z_][\w.]*\s*)?")
_PY_KWARG = re.compile(r"([A-Za-z_]\w*)\s*=\s*(?=\S)")
_PY_KWARG_PART = re.compile(r"(?:[A-Za-z_]\w*\s*(?:=\s*)?)?")


@dataclass(slots=True)
class CallDelta:
    """Part of call `index`: its first part names it; every part adds to its arguments."""

    index: int
    name: str | None
    arguments: str


@dataclass(slots=True)
class _Call:
    name: str
    arguments: str = ""
    broken_at: tuple[int, int] | None = None  # (start, end) of its text, where it broke after streaming began


class _JsonSpan:
    """Where the JSON object or array starting at `start` ends, read on from where it stopped.
    It checks the brackets, strings and bare characters; json.loads checks the rest at the end."""

    __slots__ = ("start", "pos", "stack", "in_string", "escape", "end", "bad")

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self.stack: list[str] = []
        self.in_string = self.escape = False
        self.end: int | None = None  # index after the closing bracket
        self.bad: int | None = None  # index of a character no JSON text has there

    def scan(self, text: str) -> None:
        i, n = self.pos, len(text)
        while i < n and self.end is None and self.bad is None:
            c = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                elif c < " ":
                    self.bad = i
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.stack.append(c)
            elif c in "}]":
                if not self.stack or self.stack.pop() != _CLOSER[c]:
                    self.bad = i
                elif not self.stack:
                    self.end = i + 1
            elif c not in _JSON_BARE:
                self.bad = i
            i += 1
        self.pos = i


class _PyValue:
    """Where a Python literal argument starting at `start` ends: at the `,` or `)` after it,
    outside brackets and strings."""

    __slots__ = ("pos", "depth", "quote", "escape", "end", "bad")

    def __init__(self, start: int) -> None:
        self.pos, self.depth = start, 0
        self.quote: str | None = None
        self.escape = False
        self.end: int | None = None
        self.bad: int | None = None

    def scan(self, text: str) -> None:
        i, n = self.pos, len(text)
        while i < n and self.end is None and self.bad is None:
            c = text[i]
            if self.quote is not None:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == self.quote:
                    self.quote = None
            elif c in "'\"":
                self.quote = c
            elif c in "([{":
                self.depth += 1
            elif c in ")]}":
                if self.depth == 0:
                    if c == ")":
                        self.end = i
                    else:
                        self.bad = i
                    break
                self.depth -= 1
            elif c == "," and self.depth == 0:
                self.end = i
                break
            i += 1
        self.pos = i


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _json_string(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except json.JSONDecodeError:  # an escape JSON does not have
        return None


def _arguments_text(obj: object) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a parsed call object; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


class ToolCallParser:
    """Reads the calls of one answer, fed in pieces. `_step` (one per format) moves `pos` over
    the text as far as it is decided, and says whether it moved; content is sent without the
    answer's leading and trailing whitespace, as the non-streamed answer strips it."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # the text before pos is decided: content, or part of a call
        self.calls: list[_Call] = []
        self.state = "start"
        self._segments: list[str | int] = []  # content and call indices, in order
        self._frame = 0  # where the call being read began: its tag, or its first character
        self._index: int | None = None  # the call being read, once it has gone out
        self._json: tuple[_JsonSpan, _JsonSpan | None] | None = None
        self._sent = 0  # arguments text before this index has gone out (JSON formats)
        self._out: list[str] = []
        self._deltas: list[CallDelta] = []
        self._held_ws = ""
        self._content_started = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        """(content, call parts) that `delta` makes known; `final`: the answer ends with it."""
        self.text += delta
        self._out, self._deltas = [], []
        while self._step(final):
            pass
        if final and self.pos < len(self.text):
            self._content(len(self.text))
        return "".join(self._out), self._deltas

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """(content, [(name, arguments JSON)]) of a whole answer: what streaming it sends, with
        the text of any call that broke after its arguments began given back as content."""
        self.feed(text, final=True)
        pieces: list[str] = []
        calls: list[tuple[str, str]] = []
        for segment in self._segments:
            if isinstance(segment, str):
                pieces.append(segment)
                continue
            call = self.calls[segment]
            if call.broken_at is None:
                calls.append((call.name, call.arguments))
            else:
                pieces.append(self.text[call.broken_at[0] : call.broken_at[1]])
        content = "".join(pieces).strip()
        return content or None, calls

    def _step(self, final: bool) -> bool:
        raise NotImplementedError

    # ---------------------------------------------------------------- what goes out

    def _content(self, end: int) -> None:
        piece, self.pos = self.text[self.pos : end], max(self.pos, end)
        if not piece:
            return
        self._segments.append(piece)
        piece = self._held_ws + piece
        if not self._content_started:
            piece = piece.lstrip()
        body = piece.rstrip()
        self._held_ws = piece[len(body) :]
        if body:
            self._content_started = True
            self._out.append(body)

    def _begin_call(self, name: str) -> None:
        self._index = len(self.calls)
        self.calls.append(_Call(name))
        self._segments.append(self._index)
        self._deltas.append(CallDelta(self._index, name, ""))

    def _arguments(self, fragment: str) -> None:
        if fragment and self._index is not None:
            self.calls[self._index].arguments += fragment
            self._deltas[-1:] = _append(self._deltas[-1:], self._index, fragment)

    def _fail(self, bad: int) -> None:
        """The call being read is malformed at `bad`: its text is content; reading goes on there."""
        if self._index is None:
            self.pos = self._frame
            self._content(bad)
        else:
            self.calls[self._index].broken_at = (self._frame, bad)
        self._index, self._json, self.pos, self.state = None, None, bad, "content"

    def _cut(self) -> None:
        """The answer ended inside a call: kept if its arguments began, else content."""
        if self._index is None:
            self.pos = self._frame
            self._content(len(self.text))
        self._index, self._json, self.pos, self.state = None, None, len(self.text), "content"

    # ---------------------------------------------------------------- JSON call objects

    def _open_json_call(self, final: bool) -> bool:
        """At pos: whitespace, then the `{` of a `{"name": ..., "arguments": {...}}` object."""
        i = _skip_ws(self.text, self.pos)
        if i == len(self.text):
            if final:
                self._cut()
                return True
            return False
        if self.text[i] != "{":
            self._fail(i)
            return True
        self._json, self.pos, self.state = (_JsonSpan(i), None), i, "call"
        return True

    def _read_json_call(self, final: bool) -> bool:
        """Reads on in the call object; True once it is done (state "after") or failed."""
        assert self._json is not None
        obj, args = self._json
        text = self.text
        if self._index is None:
            m = _JSON_HEAD.match(text, obj.start)
            name = _json_string(m.group(1)) if m is not None and text[m.end()] == "{" else None
            if m is not None and name is not None:
                self._begin_call(name)
                args, self._sent = _JsonSpan(m.end()), m.end()
                self._json = (obj, args)
        obj.scan(text)
        if args is not None:
            args.scan(text)
            stop = args.end if args.end is not None else len(text)
            stop = min(stop, obj.bad) if obj.bad is not None else stop
            self._arguments(text[self._sent : stop])
            self._sent = max(self._sent, stop)
        if obj.bad is not None:
            self._fail(obj.bad)
            return True
        if obj.end is None:
            if final:
                self._cut()
                return True
            return False
        try:
            call = _arguments_text(json.loads(text[obj.start : obj.end]))
        except (json.JSONDecodeError, RecursionError):
            call = None
        if call is None or (self._index is not None and call[0] != self.calls[self._index].name):
            self._fail(obj.end)
            return True
        if self._index is None:
            self._begin_call(call[0])
            self._arguments(call[1])
        self._index, self._json, self.pos, self.state = None, None, obj.end, "after"
        return True

    def _content_until(self, tag: str, then: str, final: bool) -> bool:
        """Content up to `tag` (a call opens there) or, without it, up to a possible start of it."""
        i = self.text.find(tag, self.pos)
        if i < 0:
            self._content(len(self.text) if final else len(self.text) - _partial_suffix(self.text, tag))
            return False
        self._content(i)
        self._frame, self.pos, self.state = i, i + len(tag), then
        return True


def _append(last: list[CallDelta], index: int, fragment: str) -> list[CallDelta]:
    if last and last[0].index == index:
        return [CallDelta(index, last[0].name, last[0].arguments + fragment)]
    return [*last, CallDelta(index, None, fragment)]


class HermesParser(ToolCallParser):
    """Hermes / Qwen2.5: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
    with text around them. The closing tag may be missing at the end of the answer."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _step(self, final: bool) -> bool:
        if self.state in ("start", "content"):
            return self._content_until(self.OPEN, "open", final)
        if self.state == "open":
            return self._open_json_call(final)
        if self.state == "call":
            return self._read_json_call(final)
        i = _skip_ws(self.text, self.pos)  # "after": the closing tag
        if self.text.startswith(self.CLOSE, i):
            self.pos, self.state = i + len(self.CLOSE), "content"
            return True
        if not final and self.CLOSE.startswith(self.text[i:]):
            return False
        self.state = "content"
        return True


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x JSON calls: `<|python_tag|>` (optional), then `{"name": ..., "parameters": {...}}`
    objects separated by `;`. Without the tag, the object must open the answer."""

    TAG = "<|python_tag|>"

    def _step(self, final: bool) -> bool:
        text = self.text
        if self.state == "start":
            i = _skip_ws(text, 0)
            if i == len(text):
                return False
            self._frame, self.state = i, "open" if text[i] == "{" else "content"
            return True
        if self.state == "content":
            return self._content_until(self.TAG, "open", final)
        if self.state == "open":
            return self._open_json_call(final)
        if self.state == "call":
            return self._read_json_call(final)
        i = _skip_ws(text, self.pos)  # "after": `;` and the next call, or the end of the calls
        if i == len(text) and not final:
            return False
        if i < len(text) and text[i] == ";":
            self._frame, self.pos, self.state = i, i + 1, "open"
        else:
            self.state = "content"
        return True


class JsonListParser(ToolCallParser):
    """A JSON list of `{"name": ..., "arguments": {...}}` objects: after `tag` (Mistral's
    `[TOOL_CALLS]`) or opening the answer (where the detokenizer dropped the tag, a special
    token), or with no tag as the whole answer (tool_choice "required")."""

    def __init__(self, tag: str | None) -> None:
        super().__init__()
        self.tag = tag
        self._first_item = True

    def _step(self, final: bool) -> bool:
        text = self.text
        if self.state == "start":
            i = _skip_ws(text, 0)
            if self.tag is not None and self.tag.startswith(text[i : i + len(self.tag)]):
                if len(text) - i < len(self.tag) and not final:
                    return False  # the tag itself, maybe
                self.state = "content"
                return True
            self._frame, self.state = i, "list" if self.tag is None or text[i] == "[" else "content"
            return True
        if self.state == "content":
            if self.tag is None:
                self._content(len(text))
                return False
            return self._content_until(self.tag, "list", final)
        if self.state == "call":
            done = self._read_json_call(final)
            self._first_item = self._first_item and self.state == "call"
            return done
        i = _skip_ws(text, self.pos)
        if i == len(text):
            if not final:
                return False
            if self.state == "list" or (self.state == "item" and self._first_item):
                self._cut()
            else:  # the list is cut after a whole call
                self.pos, self.state = i, "content"
            return True
        c = text[i]
        if self.state == "list":
            if c != "[":
                self._fail(i)
                return True
            self.pos, self.state = i + 1, "item"
        elif self.state == "item":
            if c == "]":
                self.pos, self.state = i + 1, "content"
                return True
            if not self._first_item:
                self._frame = i
            self.pos = i
            return self._open_json_call(final)
        elif c == ",":  # "after"
            self.pos, self.state = i + 1, "item"
        else:
            self.pos, self.state = (i + 1, "content") if c == "]" else (self.pos, "content")
        return True


class _KeywordCallParser(ToolCallParser):
    """Formats that write a call's arguments one name=value at a time: each goes out as a piece
    of a JSON object once its value is whole. A call goes out with its first piece, so one that
    breaks before it stays content."""

    def __init__(self) -> None:
        super().__init__()
        self._name: str | None = None  # the call being read, before its first argument goes out
        self._num_args = 0

    def _open_call(self, name: str) -> None:
        self._name, self._num_args = name, 0

    def _argument(self, key: str, value_json: str) -> None:
        self._emit(("{" if self._num_args == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": " + value_json)
        self._num_args += 1

    def _close_call(self) -> None:
        self._emit("}" if self._num_args else "{}")
        self._index, self._name = None, None

    def _emit(self, fragment: str) -> None:
        if self._index is None:
            assert self._name is not None
            self._begin_call(self._name)
        self._arguments(fragment)

    def _fail(self, bad: int) -> None:
        self._name = None
        super()._fail(bad)


class PythonicParser(_KeywordCallParser):
    """Llama 3.2 / Llama 4 pythonic calls: the answer is a Python list of calls with keyword
    arguments, `[get_weather(city='SF'), f(x=1)]`. Each value is read by ast.literal_eval
    (literals only, nothing is run); the arguments go out as JSON, one argument at a time."""

    def __init__(self) -> None:
        super().__init__()
        self._value: tuple[str, int, _PyValue] | None = None  # (keyword, value start, scanner)

    def _step(self, final: bool) -> bool:
        text = self.text
        if self.state == "start":
            i = _skip_ws(text, 0)
            if i == len(text):
                return False
            if text[i] == "[":
                self._frame, self.pos, self.state = i, i + 1, "head"
            else:
                self.state = "content"
            return True
        if self.state == "content":
            self._content(len(text))
            return False
        i = _skip_ws(text, self.pos)
        if i == len(text) and self._value is None:
            if final:
                self._cut() if self.state != "after" else setattr(self, "state", "content")
                return True
            return False
        if self.state == "head":
            m = _PY_HEAD.match(text, i)
            if m is None:
                return self._no_match(_PY_HEAD_PART, i, final)
            self._open_call(m.group(1))
            self.pos, self.state = m.end(), "args"
            return True
        if self.state == "args":
            return self._read_argument(i, final)
        if text[i] == ",":  # "after"
            self._frame, self.pos, self.state = i + 1, i + 1, "head"
        elif text[i] == "]":
            self.pos, self.state = i + 1, "content"
        else:
            self.state = "content"
        return True

    def _no_match(self, part: re.Pattern[str], i: int, final: bool) -> bool:
        if not final and part.fullmatch(self.text, i):
            return False  # still a possible start of what should come
        self._fail(i)
        return True

    def _read_argument(self, i: int, final: bool) -> bool:
        text = self.text
        if self._value is None:
            if text[i] == ")":
                self._close_call()
                self.pos, self.state = i + 1, "after"
                return True
            m = _PY_KWARG.match(text, i)
            if m is None:
                return self._no_match(_PY_KWARG_PART, i, final)
            self._value = (m.group(1), m.end(), _PyValue(m.end()))
        keyword, start, value = self._value
        value.scan(text)
        if value.bad is not None:
            self._value = None
            self._fail(value.bad)
            return True
        if value.end is None:
            if final:
                self._value = None
                self._cut()
                return True
            return False
        self._value = None
        try:
            as_json = json.dumps(ast.literal_eval(text[start : value.end].strip()), ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            self._fail(start)
            return True
        self._argument(keyword, as_json)
        self.pos = value.end + 1 if text[value.end] == "," else value.end
        return True


class Qwen3XmlParser(_KeywordCallParser):
    """Qwen3-Coder's XML calls: `<tool_call><function=f><parameter=city>SF</parameter>
    </function></tool_call>`, text around them. A value is text, typed by the tool's schema as
    vLLM types it (`_typed_value`); the newline after `>` and before `</parameter>` is layout."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    FUNCTION, END_FUNCTION = "<function=", "</function>"
    PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"

    def __init__(self, parameters: dict[str, dict[str, Any]]) -> None:
        super().__init__()
        self.parameters = parameters  # function name -> its parameters' JSON schema

    def _step(self, final: bool) -> bool:
        text = self.text
        if self.state in ("start", "content"):
            return self._content_until(self.OPEN, "function", final)
        i = _skip_ws(text, self.pos)
        rest = text[i:]
        if self.state == "function":
            if rest.startswith(self.FUNCTION):
                end = text.find(">", i)
                name = text[i + len(self.FUNCTION) : end if end >= 0 else len(text)]
                if any(c in name for c in "<\n") or (end >= 0 and not name):
                    self._fail(i)
                elif end >= 0:
                    self._open_call(name)
                    self.pos, self.state = end + 1, "parameters"
                elif final:
                    self._cut()
                else:
                    return False
                return True
            if _could_start(rest, self.FUNCTION, final):
                return False
            if final and not rest:
                self._cut()
            else:
                self._fail(i)
            return True
        if self.state == "parameters":
            if rest.startswith(self.END_FUNCTION):
                self._close_call()
                self.pos, self.state = i + len(self.END_FUNCTION), "close"
                return True
            if rest.startswith(self.PARAMETER):
                return self._read_parameter(i, final)
            if _could_start(rest, self.END_FUNCTION, final) or _could_start(rest, self.PARAMETER, final):
                return False
            if final and not rest:
                self._cut()
            else:
                self._fail(i)
            return True
        if rest.startswith(self.CLOSE):  # "close"
            self.pos, self.state = i + len(self.CLOSE), "content"
            return True
        if _could_start(rest, self.CLOSE, final):
            return False
        self.state = "content"
        return True

    def _read_parameter(self, i: int, final: bool) -> bool:
        text = self.text
        key_end = text.find(">", i)
        # Its end: the closing tag, or (as vLLM reads a missing one) the next parameter or function end.
        ends = [j for j in (text.find(t, key_end + 1) for t in (self.END_PARAMETER, self.PARAMETER, self.END_FUNCTION))
                if key_end > 0 and j >= 0]  # fmt: skip
        if not ends:
            if final:
                self._cut()
                return True
            return False
        key, end = text[i + len(self.PARAMETER) : key_end], min(ends)
        raw = text[key_end + 1 : end]
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        if not key or "<" in key or "\n" in key:
            self._fail(i)
            return True
        properties = self.parameters.get(self._name or "", {}).get("properties", {})
        self._argument(key, _typed_value(raw, properties.get(key) if isinstance(properties, dict) else None))
        self.pos = end + len(self.END_PARAMETER) if text.startswith(self.END_PARAMETER, end) else end
        return True


def _could_start(rest: str, tag: str, final: bool) -> bool:
    """More text may still make `rest` start with `tag`."""
    return not final and len(rest) < len(tag) and tag.startswith(rest)


def _typed_value(raw: str, schema: object) -> str:
    """A Qwen3 XML parameter's text as JSON, typed as its schema says (vLLM's rules): text where
    the schema has no type for it, or the text does not fit the type."""
    kinds = schema.get("type", "string") if isinstance(schema, dict) else "string"
    kinds = [kinds] if isinstance(kinds, str) else [k for k in kinds if isinstance(k, str) and k != "null"]
    kind = kinds[0].lower() if kinds else "string"
    value: Any = raw
    if raw.lower() == "null":
        value = None
    elif kind == "integer":
        value = _or_text(int, raw)
    elif kind == "number":
        number = _or_text(float, raw)
        value = int(number) if isinstance(number, float) and number.is_integer() and abs(number) < 2**53 else number
    elif kind == "boolean":
        value = raw.strip().lower() == "true" if raw.strip().lower() in ("true", "false") else raw
    elif kind in ("object", "array"):
        value = _or_text(json.loads, raw)
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:  # nan or inf from float()
        return json.dumps(raw, ensure_ascii=False)


def _or_text(convert: Callable[[str], Any], raw: str) -> Any:
    try:
        return convert(raw)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return raw


# name (vLLM's) -> a new parser for one answer, given each tool's parameters' JSON schema by name
TOOL_CALL_PARSERS: dict[str, Callable[[dict[str, dict[str, Any]]], ToolCallParser]] = {
    "hermes": lambda parameters: HermesParser(),
    "llama3_json": lambda parameters: Llama3JsonParser(),
    "mistral": lambda parameters: JsonListParser("[TOOL_CALLS]"),
    "pythonic": lambda parameters: PythonicParser(),
    "qwen3_xml": Qwen3XmlParser,
}
