"""The Responses API's memory: responses created with store=true, for previous_response_id and
GET / DELETE /v1/responses/{id}, bounded by count and by bytes."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from servelab.errors import NotFound

DEFAULT_MAX_STORED = 1024  # responses kept for previous_response_id and GET
DEFAULT_MAX_STORED_BYTES = 64 << 20


@dataclass(slots=True)
class _Stored:
    response: dict[str, Any]
    history: list[dict[str, Any]]  # the conversation up to and including this response's output, as chat messages
    num_bytes: int


class ResponseStore:
    """The last responses created with store=true, bounded by count and by bytes; the least
    recently used goes first. Thread-safe (the routes' event loop and worker threads)."""

    def __init__(self, max_count: int = DEFAULT_MAX_STORED, max_bytes: int = DEFAULT_MAX_STORED_BYTES):
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, response: dict[str, Any], history: list[dict[str, Any]]) -> bool:
        """False, storing nothing, for one response larger than the whole store."""
        size = len(json.dumps([response, history], separators=(",", ":")))
        if size > self.max_bytes:
            return False
        with self._lock:
            self._drop(response["id"])
            self._items[response["id"]] = _Stored(response, history, size)
            self._bytes += size
            while len(self._items) > self.max_count or self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))
        return True

    def get(self, response_id: str, param: str | None = None) -> _Stored:
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
                return item
        raise NotFound(
            f"response {response_id!r} not found: it was not stored (store=false), was deleted, or was evicted from "
            f"this server's in-memory store (the last {self.max_count} responses, up to {self.max_bytes >> 20} MiB)",
            param=param,
        )

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self._lock:
            self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        item = self._items.pop(response_id, None)
        if item is not None:
            self._bytes -= item.num_bytes
