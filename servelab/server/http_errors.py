"""Every failure answers with OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}.

Clients (the official SDKs included) turn that shape into typed exceptions with the message
intact, so the message must name the input and the limit. Nothing here ever touches the engine:
a bad request is rejected before it reaches the step loop.
"""

from __future__ import annotations

import json
import logging
import math
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from servelab.errors import InvalidArgument, QueueFull, ServelabError

if TYPE_CHECKING:
    from servelab.server.offload import Offload

logger = logging.getLogger("servelab.server")

RETRY_AFTER_S = 1  # a full waiting queue drains in about one request's latency on this engine

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "internal_server_error",
    503: "server_overloaded",
}


class ServerDraining(ServelabError):
    """The server got SIGTERM: it finishes what it has and takes nothing new."""

    http_status = 503
    error_type = "server_overloaded"


def error_response(
    status: int,
    message: str,
    *,
    error_type: str | None = None,
    param: str | None = None,
    code: str | int | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": error_type or _TYPE_BY_STATUS.get(status, "invalid_request_error"),
            "param": param,
            "code": code if code is not None else status,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


def _code(exc: ServelabError) -> str | int:
    # A class-level code (RequestTooLong's "context_length_exceeded", as OpenAI names it) is
    # shadowed by the instance's None unless the raiser passed one.
    return exc.code if exc.code is not None else getattr(type(exc), "code", None) or exc.http_status


def error_json(exc: ServelabError) -> dict:
    """The same body, for an error that happens after a stream has started (sent as an SSE event)."""
    return {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": _code(exc)}}


def from_servelab_error(exc: ServelabError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.http_status == 503 else None
    return error_response(
        exc.http_status, exc.message, error_type=exc.error_type, param=exc.param, code=_code(exc), headers=headers
    )


def validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """pydantic's errors -> one readable line and the offending parameter."""
    errors = exc.errors()
    parts = []
    for err in errors[:3]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc) or "request body"
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {json.dumps(value, default=str)[:80]})"
        parts.append(f"{where}: {err.get('msg', 'invalid value')}{shown}")
    if len(errors) > 3:
        parts.append(f"... and {len(errors) - 3} more")
    first_loc = [str(p) for p in errors[0].get("loc", ()) if p != "body"] if errors else []
    return "; ".join(parts), (first_loc[0] if first_loc else None)


M = TypeVar("M", bound=BaseModel)


def _reject_non_finite(constant: str) -> float:
    # Python's json accepts NaN and Infinity, JSON does not; a NaN temperature passes every range
    # check (all comparisons are false) and would fail the step of every request in the batch.
    raise InvalidArgument(f"request body is not valid JSON: {constant} is not a JSON number; send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses as inf: the same hole as Infinity
        raise InvalidArgument(f"request body: the number {text[:40]} is out of range; send a finite number")
    return value


def _lone_surrogate(obj: Any) -> str | None:
    """Where the first string holding a lone UTF-16 surrogate is (JSON's \\ud800 escapes make
    them; they are not Unicode text, and the tokenizer cannot take them). Iterative: the body
    may be nested as deep as the JSON parser allows."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where or "request body"
        elif isinstance(value, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
    return None


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """Raw bytes -> UTF-8 -> JSON object, each step with its own 400 message (too deep, a huge
    integer, NaN or a lone surrogate included). Blocking: proportional to the body's size."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"request body is not valid UTF-8: byte {exc.start} ({raw[exc.start : exc.start + 1]!r})")
    try:
        obj = json.loads(text, parse_constant=_reject_non_finite, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")
    except RecursionError:
        raise InvalidArgument(
            "request body is nested too deeply to parse; no request needs more than a few levels"
        ) from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise InvalidArgument(f"request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise InvalidArgument(f"request body must be a JSON object, got {type(obj).__name__}")
    if "\\u" in text and (where := _lone_surrogate(obj)) is not None:
        raise InvalidArgument(
            f"{where}: contains a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is not Unicode text",
            param=where.partition(".")[0].partition("[")[0],
        )
    return obj


def decode_body(raw: bytes, model_cls: type[M]) -> M:
    """Raw bytes -> UTF-8 -> JSON -> model, each step with its own 400 message. Blocking:
    proportional to the body's size, so the app runs it off the event loop."""
    obj = decode_json_object(raw)
    try:
        return model_cls.model_validate(obj)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise InvalidArgument(message, param=param) from None
    except RecursionError:
        raise InvalidArgument("request body is nested too deeply to validate") from None


async def parse_body(request: Request, model_cls: type[M], offload: Offload | None = None) -> M:
    """Read the body on the loop; decode and validate it on `offload`'s lane for its size when given."""
    raw = await request.body()
    if offload is None:
        return decode_body(raw, model_cls)
    return await offload.lane(len(raw)).run(decode_body, raw, model_cls)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServelabError)
    async def _servelab(_: Request, exc: ServelabError) -> JSONResponse:
        return from_servelab_error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, _: ClientDisconnect) -> Response:
        # the client hung up before its body was read: its doing, and no one is left to answer
        logger.info("client disconnected before sending its whole request (%s %s)", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while handling a request")
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")


__all__ = [
    "QueueFull",
    "ServerDraining",
    "error_json",
    "error_response",
    "from_servelab_error",
    "decode_body",
    "decode_json_object",
    "install_error_handlers",
    "parse_body",
]
