"""Connection-level limits, below the ASGI app: how long a client may take to send a request's
headers and body, how many connections may be open (in all, and from one client address), and how
many requests one keep-alive connection may carry.

uvicorn gives an idle keep-alive timeout (`timeout_keep_alive`) and a header size cap (h11's
`max_incomplete_event_size`, 16 KiB), but nothing bounds the time a client takes to send the
headers or the body, and `limit_concurrency` counts only after a request's headers arrived, so a
client that never finishes its headers (slowloris) holds its socket for ever. `LimitedH11Protocol`
is uvicorn's h11 protocol with those limits, passed to uvicorn as `http=`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.flow_control import CLOSE_HEADER
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("servelab.server")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0  # a full 4 MiB body at ~70 kB/s
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0  # uvicorn's own default
DEFAULT_MAX_CONNECTIONS = 2048
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 512
DEFAULT_MAX_REQUESTS_PER_CONNECTION = 10_000
RETRY_AFTER_S = 1
# A refused connection stays open this long at most after its 503 (or until the client closes),
# so that the request the client sends meanwhile does not make the kernel reset the connection
# and destroy the answer before the client reads it.
REFUSED_LINGER_S = 2.0


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """None lifts a cap."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    max_connections: int | None = DEFAULT_MAX_CONNECTIONS
    max_connections_per_client: int | None = DEFAULT_MAX_CONNECTIONS_PER_CLIENT
    max_requests_per_connection: int | None = DEFAULT_MAX_REQUESTS_PER_CONNECTION


class ConnectionCounts:
    """Open connections, in all and by client address, of one server (touched on its event loop
    thread only)."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.total = 0
        self.by_client: Counter[str] = Counter()

    def admit(self, client: str) -> str | None:
        """Counts the connection in and returns None, or returns why it is refused (not counted)."""
        limits = self.limits
        if limits.max_connections is not None and self.total >= limits.max_connections:
            return f"the server has {self.total} connections open, its limit (--max-connections)"
        held = self.by_client[client]
        if limits.max_connections_per_client is not None and held >= limits.max_connections_per_client:
            return (
                f"this client address has {held} connections open, the limit per address (--max-connections-per-client)"
            )
        self.total += 1
        self.by_client[client] += 1
        return None

    def release(self, client: str) -> None:
        self.total -= 1
        self.by_client[client] -= 1
        if self.by_client[client] <= 0:
            del self.by_client[client]


def _raw_error(status: int, reason: str, message: str, error_type: str, extra: tuple[str, ...] = ()) -> bytes:
    """A whole HTTP/1.1 answer with OpenAI's error JSON, for a connection h11 cannot answer on
    (no request head yet); the connection closes after it."""
    body = json.dumps({"error": {"message": message, "type": error_type, "param": None, "code": status}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
            *extra, "connection: close"]  # fmt: skip
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under ConnectionLimits. Pass it to uvicorn as
    `http=http_protocol(limits)`."""

    def __init__(self, *args: Any, counts: ConnectionCounts, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.counts = counts
        self.limits = counts.limits
        # uvicorn types its keep-alive timeout int; it only reaches loop.call_later, which takes float seconds
        self.timeout_keep_alive = self.limits.keep_alive_timeout_s  # type: ignore[assignment]
        self._client_key: str | None = None  # set once counted in
        self._refused = False
        self._timer: asyncio.TimerHandle | None = None  # the header or the body deadline
        self._timer_kind: str | None = None
        self._head_bytes = False  # bytes of a request head arrived since the last response
        self._num_requests = 0
        self._current_cycle: Any = None

    # ---- connection life -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn narrows it too
        super().connection_made(transport)
        client = self.client[0] if self.client else "unknown"
        why = self.counts.admit(client)
        if why is not None:
            self._refuse(why)
            return
        self._client_key = client
        self._arm("header")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._client_key is not None:
            self.counts.release(self._client_key)
            self._client_key = None
        super().connection_lost(exc)

    def _refuse(self, why: str) -> None:
        self._refused = True
        logger.warning("servelab: refused a connection from %s: %s", self.client[0] if self.client else "?", why)
        message = f"too many connections: {why}; retry in {RETRY_AFTER_S} s"
        self.transport.write(_raw_error(503, "Service Unavailable", message, "server_overloaded",
                                        (f"retry-after: {RETRY_AFTER_S}",)))  # fmt: skip
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._timer = self.loop.call_later(REFUSED_LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the answer is already out; the request is not read
        if self.conn.their_state is h11.IDLE:
            self._head_bytes = True
        super().data_received(data)

    def eof_received(self) -> None:
        if self._refused:
            return  # asyncio closes the transport
        super().eof_received()

    def handle_events(self) -> None:
        super().handle_events()
        if self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle is not self._current_cycle:
            self._current_cycle = self.cycle
            self._on_request_head()
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._timer_kind != "body":
                self._arm("body")
        elif state is not h11.IDLE:
            self._disarm()  # the whole request is in: the app's time is not the client's

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE and self._timer_kind is None:
            self._head_bytes = False
            self._arm("header")

    def _on_request_head(self) -> None:
        self._num_requests += 1
        limit = self.limits.max_requests_per_connection
        if limit is not None and self._num_requests >= limit:
            # The last one this connection carries: the response says so and the connection closes after it.
            self.cycle.keep_alive = False
            self.cycle.default_headers = [*self.cycle.default_headers, CLOSE_HEADER]

    # ---- deadlines ---------------------------------------------------------------------------

    def _arm(self, kind: str) -> None:
        self._disarm()
        timeout_s = self.limits.header_timeout_s if kind == "header" else self.limits.body_timeout_s
        self._timer_kind = kind
        self._timer = self.loop.call_later(timeout_s, self._expired, kind)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_kind = None

    def _expired(self, kind: str) -> None:
        self._timer = None
        self._timer_kind = None
        if self.transport.is_closing():
            return
        if kind == "header":
            if self._head_bytes:  # a request started and did not finish its headers in time
                message = (f"the request headers did not arrive within {self.limits.header_timeout_s:g} s "
                           "(--header-timeout)")  # fmt: skip
                logger.warning(
                    "servelab: closed a connection from %s: %s", self.client[0] if self.client else "?", message
                )
                self.transport.write(_raw_error(408, "Request Timeout", message, "invalid_request_error"))
        else:
            message = f"the request body did not arrive within {self.limits.body_timeout_s:g} s (--body-timeout)"
            logger.warning("servelab: closed a connection from %s: %s", self.client[0] if self.client else "?", message)
            if self.cycle is not None and not self.cycle.response_started:
                self.transport.write(_raw_error(408, "Request Timeout", message, "invalid_request_error"))
            if self.cycle is not None:
                self.cycle.disconnected = True  # the app's receive() answers http.disconnect; its sends go nowhere
                self.cycle.message_event.set()
        self.transport.close()


def http_protocol(limits: ConnectionLimits) -> type[LimitedH11Protocol]:
    """uvicorn's `http=` for one server under `limits` (with uvicorn's `ws="none"`: a connection
    handed to a WebSocket protocol would leave the counts). A class, as uvicorn's Config expects,
    whose connections share one server's counts."""
    counts = ConnectionCounts(limits)

    class CountedH11Protocol(LimitedH11Protocol):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, counts=counts, **kwargs)

    return CountedH11Protocol


__all__ = [
    "DEFAULT_BODY_TIMEOUT_S", "DEFAULT_HEADER_TIMEOUT_S", "DEFAULT_KEEP_ALIVE_TIMEOUT_S", "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_CONNECTIONS_PER_CLIENT", "DEFAULT_MAX_REQUESTS_PER_CONNECTION", "ConnectionCounts",
    "ConnectionLimits", "LimitedH11Protocol", "http_protocol",
]  # fmt: skip
