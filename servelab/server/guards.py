"""The checks every HTTP request passes before any route sees it: the Host it was sent to, the
API key, the content type of a POST (JSON only), and the size of the body.

One ASGI middleware, in front of the whole app (the lab and any other mount included), so that
no route can forget a check. Each refusal is OpenAI-style error JSON that names the limit or the
header to send.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from servelab.errors import ServelabError
from servelab.server.http_errors import error_response

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # 4 MiB: ~1M tokens of text, far past any context we serve

# Routes a load balancer or Prometheus reaches without the key (documented in limits-and-safety.md).
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})


# What a loopback-bound server answers by default: a web page whose DNS name was rebound to
# 127.0.0.1 still sends its own name as Host, so it is refused (421) and cannot drive the API.
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback_address(host: str) -> bool:
    """Whether a bind address (`--host`) is this machine only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """A Host header's name, lowercased, without its port or IPv6 brackets: '[::1]:8000' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def host_allowed(name: str, allowed: frozenset[str]) -> bool:
    """`allowed` holds names ('[::1]' and '::1' alike) and '*.example.com' wildcards, which match
    subdomains only."""
    name = name.rstrip(".")
    for entry in allowed:
        entry = entry.strip("[]")
        if entry == name or (entry.startswith("*.") and name.endswith(entry[1:])):
            return True
    return False


def is_json_media_type(media_type: str) -> bool:
    """application/json or a structured-syntax +json type (RFC 6839), lowercased, without
    parameters. Browsers POST text/plain, forms and a Blob without a type (no Content-Type at
    all) cross-site without a CORS preflight; a JSON API that took them would serve any web page
    its user opens, so everything but JSON is refused."""
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class RequestTooLarge(ServelabError):
    http_status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


def _authorised(headers: dict[str, str], api_key: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def _too_large_message(limit: int) -> str:
    return (
        f"request body is larger than this server's limit of {limit:,} bytes (--max-request-bytes); "
        "send a shorter prompt"
    )


class RequestGuard:
    """421 for a Host outside `allowed_hosts` (None: any), the API key (all routes but OPEN_PATHS),
    415 for a POST body that is not JSON, and the body limit: 413 from Content-Length before a
    byte of the body is read, or, for a chunked upload, as soon as the bytes read pass the limit
    (raised from `receive`, so the route answers it)."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_request_bytes: int,
                 allowed_hosts: frozenset[str] | None = None):  # fmt: skip
        self.app = app
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> Any:
        if self.allowed_hosts is not None:
            host = headers.get("host", "")
            if not host_allowed(host_name(host), self.allowed_hosts):
                sent = f"Host {host!r} is" if host else "a request without a Host header is"
                return error_response(
                    421, f"{sent} not served here: this server answers only "
                         f"{', '.join(sorted(self.allowed_hosts))} (--allowed-hosts)",
                    code="misdirected_request",
                )  # fmt: skip
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not _authorised(headers, self.api_key):
            return error_response(
                401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                error_type="authentication_error",
            )  # fmt: skip
        if scope["method"] in ("POST", "PUT", "PATCH") and scope["path"] not in OPEN_PATHS:  # probes send no body
            content_type = headers.get("content-type")
            if not is_json_media_type((content_type or "").partition(";")[0].strip().lower()):
                sent = (
                    f"Content-Type {content_type!r} is not accepted"
                    if content_type
                    else "this request has no Content-Type"
                )
                return error_response(
                    415, f"{sent}: the body must be JSON, sent with the header 'Content-Type: application/json'",
                    code="unsupported_media_type",
                )  # fmt: skip
        length = headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_request_bytes:
            return error_response(413, _too_large_message(self.max_request_bytes), code=RequestTooLarge.code)
        return None

    def _counting(self, receive: Receive) -> Receive:
        limit = self.max_request_bytes
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise RequestTooLarge(_too_large_message(limit))
            return message

        return counted


__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "LOOPBACK_HOSTS",
    "OPEN_PATHS",
    "RequestGuard",
    "RequestTooLarge",
    "host_allowed",
    "host_name",
    "is_json_media_type",
    "is_loopback_address",
]
