"""Request fields that edit logits or constrain the output, and tool calls in the answer.

`sampling_kwargs` turns logit_bias, allowed_token_ids, bad_words, response_format, vLLM's
structured_outputs (and its older guided_* names) and tools/tool_choice into SamplingParams
fields. `tool_plan` says how a chat answer becomes tool calls: forced (a named function or
"required", generated under the tools' schemas) or "auto" (the model decides; a parser for the
model's tool-call format reads them out of the text). `ToolCallStream` renders them as OpenAI does.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from servelab.core.structured_output import StructuredOutputSpec
from servelab.errors import InvalidArgument
from servelab.server import protocol as p
from servelab.server.tool_parsers import TOOL_CALL_PARSERS



def sampling_kwargs(req: p.CompletionRequest | p.ChatCompletionRequest) -> dict[str, Any]:
    """SamplingParams fields from the request (their ranges are checked by SamplingParams)."""
    out: dict[str, Any] = {}
    if req.logit_bias:
        bias = {}
        for key, value in req.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise InvalidArgument(f"logit_bias: key {key!r} is not a token id", param="logit_bias") from None
        out["logit_bias"] = bias
    if req.allowed_token_ids is not None:
        out["allowed_token_ids"] = list(req.allowed_token_ids)
    if req.bad_words:
        out["bad_words"] = list(req.bad_words)
    spec = output_spec(req)
    if spec is not None:
        out["structured_output"] = spec
    return out


def output_spec(req: p.CompletionRequest | p.ChatCompletionRequest) -> StructuredOutputSpec | None:
    """The one output constraint the request asks for, from whichever field it used."""
    found: list[StructuredOutputSpec] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(StructuredOutputSpec("json_object", source="response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise InvalidArgument("response_format: type json_schema needs json_schema.schema", param="response_format")
        found.append(StructuredOutputSpec.json_schema(rf.json_schema.json_schema, "response_format"))
    so = req.structured_outputs
    if so is not None:
        given = [k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(so, k) not in (None, False)]
        if len(given) != 1:
            names = ", ".join(k.rstrip("_") for k in given) or "none"
            raise InvalidArgument(
                f"structured_outputs: send exactly one of json, regex, choice, grammar, json_object (got {names})",
                param="structured_outputs",
            )
        found.append(_spec(given[0].rstrip("_"), getattr(so, given[0]), "structured_outputs"))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append(_spec(kind, value, f"guided_{kind}"))
    tool_spec = _tool_spec(req) if isinstance(req, p.ChatCompletionRequest) else None
    if tool_spec is not None:
        found.append(tool_spec)
    if len(found) > 1:
        raise InvalidArgument(
            f"only one output constraint per request; got {', '.join(s.source for s in found)}", param=found[1].source
        )
    return found[0] if found else None


def _spec(kind: str, value: Any, source: str) -> StructuredOutputSpec:
    if kind == "json":
        return StructuredOutputSpec.json_schema(value, source)
    if kind == "json_object":
        return StructuredOutputSpec("json_object", source=source)
    if kind == "choice":
        return StructuredOutputSpec("choice", tuple(value), source=source)
    return StructuredOutputSpec(kind, value, source=source)


# -------------------------------------------------------------------------------- tools


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a chat answer becomes tool calls. `forced_name`: the named function (the output is its
    arguments); `forced_any`: "required" (the output is {"name", "arguments"}); otherwise "auto"
    with a parser."""

    forced_name: str | None = None
    forced_any: bool = False
    parser: str | None = None


def _parameters(tool: p.Tool) -> dict[str, Any]:
    # No parameters: the function takes none (an empty object), as OpenAI reads it.
    return tool.function.parameters or {"type": "object", "properties": {}}


def _tool_spec(req: p.ChatCompletionRequest) -> StructuredOutputSpec | None:
    choice, tools = req.tool_choice, req.tools or []
    if isinstance(choice, p.NamedToolChoice):
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise InvalidArgument(
                f"tool_choice names the function {choice.function.name!r}, which is not in tools", param="tool_choice"
            )
        return StructuredOutputSpec.json_schema(_parameters(tool), "tool_choice")
    if choice == "required":
        if not tools:
            raise InvalidArgument("tool_choice 'required' needs at least one tool in tools", param="tool_choice")
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
                "required": ["name", "arguments"],
            }
            for t in tools
        ]
        return StructuredOutputSpec.json_schema({"anyOf": calls}, "tool_choice")
    return None


def tool_plan(req: p.ChatCompletionRequest, parser: str | None) -> ToolPlan | None:
    """None: answer in text. Raises for "auto" where the server has no tool-call parser."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise InvalidArgument("tool_choice needs tools: send the functions in 'tools'", param="tool_choice")
        return None
    choice = req.tool_choice
    if isinstance(choice, p.NamedToolChoice):
        return ToolPlan(forced_name=choice.function.name)
    if choice == "required":
        return ToolPlan(forced_any=True)
    if choice == "none":
        return None
    if parser is None:  # "auto", OpenAI's default when tools are given
        raise InvalidArgument(
            "tool_choice 'auto' needs a tool-call parser for this model's output format, and this server has none: "
            "send tool_choice 'required' or a named function (generation is then constrained to the tools' schemas), "
            f"or start the server with --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)}) for a model that writes "
            "that format",
            param="tool_choice",
        )
    return ToolPlan(parser=parser)


def _call(name: str, arguments: Any) -> p.ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return p.ToolCall(id="call_" + uuid.uuid4().hex[:24], function=p.FunctionCall(name=name, arguments=text))


def _parse_auto(parser: str, text: str) -> tuple[str | None, list[p.ToolCall]]:
    content, calls = TOOL_CALL_PARSERS[parser][0](text)
    return content, [_call(name, arguments) for name, arguments in calls]


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[p.ToolCall]]:
    """(content, tool calls) of a finished answer. A named function's answer is its call whatever
    its arguments' completeness (as vLLM; cut by max_tokens, finish_reason says "length"); any
    other output that does not parse stays content, with no calls."""
    if plan.parser is not None:
        return _parse_auto(plan.parser, text)
    if plan.forced_name is not None:
        return None, [_call(plan.forced_name, text)]
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return text, []
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return text, []  # the grammar makes this shape; stay safe if a client's schema allowed another
    return None, [_call(obj["name"], obj["arguments"])]


@dataclass
class ToolCallStream:
    """One choice's streamed answer under a tool plan: text is held until it is known to be
    content or a call. A named function streams its arguments as they come; "required" and
    parsed calls go out whole when complete (their name is only known then)."""

    plan: ToolPlan
    text: str = ""
    sent_content: int = 0  # characters of `text` already sent as content (auto)
    num_calls: int = 0
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def feed(self, delta: str, finished: bool) -> p.DeltaMessage | None:
        self.text += delta
        plan = self.plan
        if plan.forced_name is not None:
            calls = []
            if self.num_calls == 0:
                self.num_calls = 1
                calls.append(p.ToolCallDelta(index=0, id=self.id, type="function",
                                             function=p.FunctionCallDelta(name=plan.forced_name, arguments=delta)))  # fmt: skip
            elif delta:
                calls.append(p.ToolCallDelta(index=0, function=p.FunctionCallDelta(arguments=delta)))
            return p.DeltaMessage(tool_calls=calls) if calls else None
        if plan.forced_any:
            if not finished:
                return None
            content, calls = parse_tool_calls(plan, self.text)
            return self._message(content, calls)
        # auto: send content up to a possible start of a call; the rest once the answer is done
        opening = TOOL_CALL_PARSERS[plan.parser][1]
        hold = self.text.find(opening, self.sent_content)
        if hold < 0:
            hold = len(self.text) - _partial_suffix(self.text, opening)
        if not finished:
            content = self.text[self.sent_content : hold] if hold > self.sent_content else ""
            self.sent_content = max(self.sent_content, hold)
            return p.DeltaMessage(content=content) if content else None
        rest = self.text[self.sent_content :]
        content, calls = _parse_auto(plan.parser, rest)
        if not calls:
            content = rest or None
        return self._message(content, calls)

    def _message(self, content: str | None, calls: list[p.ToolCall]) -> p.DeltaMessage | None:
        deltas = [
            p.ToolCallDelta(index=self.num_calls + i, id=c.id, type="function",
                            function=p.FunctionCallDelta(name=c.function.name, arguments=c.function.arguments))  # fmt: skip
            for i, c in enumerate(calls)
        ]
        self.num_calls += len(calls)
        if content is None and not deltas:
            return None
        return p.DeltaMessage(content=content, tool_calls=deltas or None)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
