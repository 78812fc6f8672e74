"""OpenAI's Responses API over the chat path: a Responses request becomes a chat completion
request (messages, sampling fields, function tools), runs through the same templating,
admission and rendering, and its outputs are answered as a Response object or as the Responses
stream's events. Stored responses live in a bounded in-memory LRU store, so that
`previous_response_id` can continue a conversation.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError

from servelab.errors import InvalidArgument, ServelabError
from servelab.server import protocol as p
from servelab.engine.client import RequestStream
from servelab.server.http_errors import validation_message
from servelab.server.protocol import _Request
from servelab.server.render import ChatRenderer
from servelab.server.response_store import ResponseStore


class ResponsesRequest(_Request):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    # Refused unless left at their defaults (see refuse_unsupported):
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None


def refuse_unsupported(req: ResponsesRequest) -> None:
    refused = {
        "background": (req.background, "responses run in the foreground; leave it out or false"),
        "reasoning": (req.reasoning, "this model has no reasoning mode"),
        "include": (req.include, "no extra output (reasoning, logprobs, tool results) is available"),
        "conversation": (req.conversation, "conversations are not stored; use previous_response_id"),
        "prompt": (req.prompt, "stored prompt templates are not available; send input"),
        "max_tool_calls": (req.max_tool_calls, "not available"),
        "top_logprobs": (req.top_logprobs, "logprobs are served by /v1/chat/completions"),
    }
    for name, (value, why) in refused.items():
        if value:
            raise InvalidArgument(f"{name} is not supported: {why}", param=name)
    if req.truncation not in (None, "disabled"):
        raise InvalidArgument(
            f"truncation {req.truncation!r} is not supported: only 'disabled' (a too-long input is refused with a 400)",
            param="truncation",
        )


# ----------------------------------------------------------------------------------- input


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or input_text (output_text for earlier assistant turns) parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(f"{where}.content must be a string or a list of input_text parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise InvalidArgument(
                f"{where}.content[{j}]: part type {kind!r} is not supported; this model reads text only "
                f"(input_text parts)",
                param="input",
            )
        texts.append(part["text"])
    return "".join(texts)


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidArgument(f"{where}.{key} must be a string, got {value!r}", param="input")
    return value


def input_messages(input: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `input` as chat messages: messages (role + content), function calls and
    their outputs (assistant tool calls and tool messages in chat's terms)."""
    if isinstance(input, str):
        return [{"role": "user", "content": input}]
    if not input:
        raise InvalidArgument("input is empty: send a string or a list of message items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidArgument(
                    f"{where}.role must be one of user, system, developer, assistant, got {role!r}", param="input"
                )
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}  # fmt: skip
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)  # parallel calls are one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where)
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": text})
        else:
            raise InvalidArgument(
                f"{where}: item type {kind!r} is not supported (supported: message, function_call, "
                f"function_call_output)",
                param="input",
            )
    return out


def chat_tools(req: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    """Responses' function tools and tool_choice in chat's shape; built-in tools are refused."""
    tools = None
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.get("type") != "function":
                raise InvalidArgument(
                    f"tools[{i}]: tool type {tool.get('type')!r} is not supported; only function tools are "
                    f"(built-in tools such as web_search and file_search run nowhere here)",
                    param="tools",
                )
            function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            tools.append({"type": "function", "function": function})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise InvalidArgument(f"tool_choice type {choice.get('type')!r} is not supported", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tools, choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (json_schema and json_object constrain the output)."""
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidArgument(f"text.format type {fmt.get('type')!r} is not supported", param="text")


# Chat's field names in errors, as this API names them.
_AS_SENT = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}


@contextmanager
def fields_as_sent() -> Iterator[None]:
    """Errors of the chat path name the Responses request's fields (input, max_output_tokens)."""
    try:
        yield
    except ServelabError as exc:
        param = exc.param
        name = _AS_SENT.get(param) if param is not None else None
        if param is not None and name is not None:
            exc.message = exc.message.replace(param, name)
            exc.args = (exc.message,)
            exc.param = name
        raise


def chat_request(
    req: ResponsesRequest, history: list[dict[str, Any]], messages: list[dict[str, Any]]
) -> p.ChatCompletionRequest:
    """The chat completion request this Responses request is: instructions (never carried over
    from a previous response, as OpenAI does), the stored history, then the new input."""
    tools, tool_choice = chat_tools(req)
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    body: dict[str, Any] = {"messages": system + history + messages, "model": req.model, "stream": req.stream,
                            "temperature": req.temperature, "top_p": req.top_p,
                            "max_completion_tokens": req.max_output_tokens, "user": req.user}  # fmt: skip
    if tools is not None:
        body["tools"] = tools
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    fmt = response_format(req.text)
    if fmt is not None:
        body["response_format"] = fmt
    try:
        return p.ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise InvalidArgument(message, param=_AS_SENT.get(param or "", param)) from None


# ----------------------------------------------------------------------------------- output


class ResponseRenderer:
    """One Responses request's answer, from the chat renderer's view of its engine outputs."""

    def __init__(self, req: ResponsesRequest, chat: ChatRenderer, model: str, store: ResponseStore,
                 history: list[dict[str, Any]]):  # fmt: skip
        self.req = req
        self.chat = chat
        self.model = model
        self.store = store
        self.history = history  # what a later response continues from: stored history + this input
        self.id = "resp_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.sequence_number = 0

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict | None = None,
                  incomplete: str | None = None) -> dict[str, Any]:  # fmt: skip
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None, "incomplete_details": None if incomplete is None else {"reason": incomplete},
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "reasoning": None, "store": req.store,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "truncation": "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {},
        }  # fmt: skip

    def _message_item(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [self._text_part(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def _text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _usage(self) -> dict[str, Any]:
        u = self.chat.usage()
        cached_tokens = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details is not None else 0
        return {"input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached_tokens},
                "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.total_tokens}  # fmt: skip

    def _final(self) -> tuple[dict[str, Any], list[dict[str, Any]], str | None]:
        """The finished response, its output items (the message, then any function calls), and
        the finish reason; stored if asked."""
        choice = self.chat.response()["choices"][0]
        message = choice["message"]
        text = message.get("content") or ""
        calls = message.get("tool_calls") or []
        output: list[dict[str, Any]] = []
        if text or not calls:
            output.append(self._message_item(text, "completed"))
        for call in calls:
            output.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"],
                           "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                           "status": "completed"})  # fmt: skip
        reason = choice["finish_reason"]
        incomplete = "max_output_tokens" if reason == "length" else None
        response = self._response("incomplete" if incomplete else "completed", output, self._usage(), incomplete)
        if self.req.store:
            assistant: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                assistant["tool_calls"] = calls
            self.store.put(response, self.history + [assistant])
        return response, output, reason

    async def collect(self, stream: RequestStream) -> dict[str, Any]:
        try:
            async for out in stream:
                self.chat.update(out)
        finally:
            stream.close()
        return self._final()[0]

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"

    async def stream(self, stream: RequestStream) -> AsyncIterator[str]:
        """response.created, response.in_progress, the message item's events with a text delta
        per engine output, then each function call's item, and response.completed (or
        response.incomplete at max_output_tokens)."""
        started = self._response("in_progress", [])
        yield self._event("response.created", response=started)
        yield self._event("response.in_progress", response=started)
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        opened = False
        try:
            async for out in stream:
                choice = self.chat.update(out)
                chunk = self.chat.chunk(choice, out)
                delta = chunk["choices"][0]["delta"].get("content") if chunk else None
                if not delta:
                    continue
                if not opened:
                    yield self._event(
                        "response.output_item.added", output_index=0, item=self._message_item("", "in_progress")
                    )
                    yield self._event("response.content_part.added", **where, part=self._text_part(""))
                    opened = True
                yield self._event("response.output_text.delta", **where, delta=delta, logprobs=[])
        except ServelabError as exc:
            yield self._event("error", code=exc.code or exc.error_type, message=exc.message, param=exc.param)
            return
        finally:
            stream.close()
        response, output, _ = self._final()
        for index, item in enumerate(output):
            if item["type"] == "message":
                if not opened:
                    yield self._event(
                        "response.output_item.added", output_index=0, item=self._message_item("", "in_progress")
                    )
                    yield self._event("response.content_part.added", **where, part=self._text_part(""))
                full = item["content"][0]["text"]
                yield self._event("response.output_text.done", **where, text=full, logprobs=[])
                yield self._event("response.content_part.done", **where, part=item["content"][0])
            else:
                yield self._event(
                    "response.output_item.added", output_index=index, item={**item, "status": "in_progress"}
                )
                yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"])  # fmt: skip
            yield self._event("response.output_item.done", output_index=index, item=item)
        final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield self._event(final, response=response)


__all__ = [
    "ResponseRenderer",
    "ResponseStore",
    "ResponsesRequest",
    "chat_request",
    "fields_as_sent",
    "input_messages",
    "refuse_unsupported",
]
