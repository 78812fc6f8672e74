"""Request fields that edit logits or constrain the output, and tool calls in the answer.

`sampling_kwargs` turns logit_bias, allowed_token_ids, bad_words, response_format, vLLM's
structured_outputs (and its older guided_* names) and tools/tool_choice into SamplingParams
fields. `tool_plan` says how a chat answer becomes tool calls: forced (a named function, or
"required": a JSON list of calls, generated under the tools' schemas) or "auto" (the model
decides; a parser for the model's tool-call format reads them out of the text). `ToolCallStream`
streams them as vLLM does: a call's name first, then its arguments as they are generated.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from servelab.core.structured_output import StructuredOutputSpec
from servelab.errors import InvalidArgument
from servelab.server import protocol as p
from servelab.server.tool_parsers import TOOL_CALL_PARSERS, JsonListParser, ToolCallParser


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
        given = [
            k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(so, k) not in (None, False)
        ]
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
    arguments); `forced_any`: "required" (the output is a list of {"name", "arguments"});
    otherwise "auto" with a parser. `max_calls`: 1 for parallel_tool_calls false. `parameters`:
    each tool's parameters' schema by name (a parser that reads values as text types them)."""

    forced_name: str | None = None
    forced_any: bool = False
    parser: str | None = None
    max_calls: int | None = None
    parameters: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False, hash=False)

    def new_parser(self) -> ToolCallParser:
        """A parser for one answer (not for a named function, whose whole answer is its arguments)."""
        if self.forced_any:
            return JsonListParser(None)
        assert self.parser is not None, "tool_plan gives a parser to every plan for tool_choice 'auto'"
        return TOOL_CALL_PARSERS[self.parser](self.parameters)


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
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputSpec.json_schema(schema, "tool_choice")
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
    max_calls = 1 if req.parallel_tool_calls is False else None
    if choice == "required":
        return ToolPlan(forced_any=True, max_calls=max_calls)
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
    parameters = {t.function.name: _parameters(t) for t in req.tools}
    return ToolPlan(parser=parser, max_calls=max_calls, parameters=parameters)


def _call(name: str, arguments: Any) -> p.ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return p.ToolCall(id="call_" + uuid.uuid4().hex[:24], function=p.FunctionCall(name=name, arguments=text))


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[p.ToolCall]]:
    """(content, tool calls) of a finished answer. A named function's answer is its call whatever
    its arguments' completeness (as vLLM; cut by max_tokens, finish_reason says "length"); other
    calls are read by the plan's parser (tool_parsers.py says what it keeps)."""
    if plan.forced_name is not None:
        return None, [_call(plan.forced_name, text)]
    content, calls = plan.new_parser().parse(text)
    return content, [_call(name, arguments) for name, arguments in calls[: plan.max_calls]]


@dataclass
class ToolCallStream:
    """One choice's streamed answer under a tool plan, as vLLM streams it: a call's first delta
    carries its index, id, type and name (and the first arguments, if any); later ones its index
    and the next arguments. Text goes out as content once it cannot be part of a call."""

    plan: ToolPlan
    num_calls: int = 0
    parser: ToolCallParser | None = None
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def __post_init__(self) -> None:
        if self.plan.forced_name is None:
            self.parser = self.plan.new_parser()

    def feed(self, delta: str, finished: bool) -> p.DeltaMessage | None:
        plan = self.plan
        if self.parser is None:  # a named function: the answer is its arguments
            assert plan.forced_name is not None
            calls = []
            if self.num_calls == 0:
                self.num_calls = 1
                calls.append(p.ToolCallDelta(index=0, id=self.id, type="function",
                                             function=p.FunctionCallDelta(name=plan.forced_name, arguments=delta)))  # fmt: skip
            elif delta:
                calls.append(p.ToolCallDelta(index=0, function=p.FunctionCallDelta(arguments=delta)))
            return p.DeltaMessage(tool_calls=calls) if calls else None
        content, parts = self.parser.feed(delta, finished)
        calls = []
        for part in parts:
            if plan.max_calls is not None and part.index >= plan.max_calls:
                continue  # parallel_tool_calls false: the first call only
            if part.name is not None:
                self.num_calls += 1
                call_id = "call_" + uuid.uuid4().hex[:24]
                function = p.FunctionCallDelta(name=part.name, arguments=part.arguments)
                calls.append(p.ToolCallDelta(index=part.index, id=call_id, type="function", function=function))
            else:
                function = p.FunctionCallDelta(arguments=part.arguments)
                calls.append(p.ToolCallDelta(index=part.index, function=function))
        if not content and not calls:
            return None
        return p.DeltaMessage(content=content or None, tool_calls=calls or None)
