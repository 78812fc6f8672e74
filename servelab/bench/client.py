"""Streaming client for any OpenAI-compatible server: one request in, one timed `StreamResult` out.

Timing is taken with `time.perf_counter()` at the moment each server-sent-event line is handed to
us, so a chunk's time is the time its bytes were read, not the time some later code looked at it.
TTFT is the first chunk that carries text: a leading role-only chunk (`{"delta": {"role":
"assistant"}}`), which servers send before any work is done, would make TTFT look instantaneous.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from servelab.errors import InvalidArgument, ServelabError

Endpoint = Literal["completions", "chat"]
ENDPOINT_PATHS: dict[str, str] = {"completions": "/completions", "chat": "/chat/completions"}


@dataclass(slots=True)
class BenchRequest:
    """What the load generator sends. `planned_send_s` is relative to the start of the run; None
    means closed-loop (sent as soon as a concurrency slot frees up)."""

    index: int
    prompt: str
    prompt_tokens: int  # the length the workload asked for (by the client's tokenizer)
    output_tokens: int  # sent as max_tokens, with ignore_eos so the server produces exactly this many
    planned_send_s: float | None = None
    think_s: float = 0.0  # closed loop: the client's pause after this request ended, before taking its next


@dataclass(slots=True)
class StreamResult:
    """One request as the client saw it. Times are absolute `perf_counter` seconds."""

    index: int
    planned_send_s: float | None  # absolute; None for closed-loop requests
    send_s: float
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # one per content-bearing chunk
    end_s: float = 0.0
    prompt_tokens_planned: int = 0
    output_tokens_planned: int = 0
    usage_prompt_tokens: int | None = None
    usage_output_tokens: int | None = None
    usage_cached_tokens: int | None = None
    usage_spec_decode: dict[str, Any] | None = None  # servelab's usage.spec_decode, where the server sends it
    text: str = ""
    success: bool = False
    error: str | None = None
    http_status: int | None = None
    finish_reason: str | None = None

    @property
    def send_lag_s(self) -> float | None:
        """How late the request left compared with its plan (client-side scheduling error)."""
        return None if self.planned_send_s is None else self.send_s - self.planned_send_s


def normalize_base_url(base_url: str) -> str:
    """'http://h:8000', 'http://h:8000/', 'http://h:8000/v1' -> 'http://h:8000/v1'."""
    url = base_url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise InvalidArgument(f"--base-url: expected an http:// or https:// URL, got {base_url!r}")
    if not url.endswith("/v1"):
        url += "/v1"
    return url


class ServerUnreachable(ServelabError):
    """The server could not be reached at all (refused, DNS, TLS): nothing to measure."""


class OpenAIStreamClient:
    """An aiohttp session with a pool sized to the load, streaming one completion per call.

    aiohttp rather than httpx because it was measured to be the more accurate clock: against
    the mock server of tests/bench at 64 streams and 20 ms per token on 2 busy cores, httpx
    read chunks a mean 17-27 ms after the server wrote them (its per-chunk CPU cost saturated
    the event loop); aiohttp read them 0.7 ms after, using a third of the CPU.

    `max_connections` must be at least the number of requests in flight: a smaller pool would
    queue requests inside the client, and that wait would be billed to the server as TTFT.
    None means unbounded (open-loop rate mode without a concurrency cap).
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        endpoint: Endpoint = "completions",
        max_connections: int | None = None,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        ignore_eos: bool = True,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if endpoint not in ENDPOINT_PATHS:
            raise InvalidArgument(f"--endpoint: expected one of {sorted(ENDPOINT_PATHS)}, got {endpoint!r}")
        if max_connections is not None and max_connections < 1:
            raise InvalidArgument(f"max_connections must be >= 1, got {max_connections}")
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.endpoint: Endpoint = endpoint
        self.timeout_s = timeout_s
        self.ignore_eos = ignore_eos
        self.extra_body = dict(extra_body or {})
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        # Created on first use: an aiohttp session belongs to the running event loop.
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections or 0, limit_per_host=0)
            # No total timeout from aiohttp: the whole-request deadline in stream() is the one
            # that counts. A large read buffer keeps long chunks (logprobs, usage) in one read.
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(self.timeout_s, 30.0)),
                read_bufsize=1 << 20,
            )
        return self._session

    async def __aenter__(self) -> OpenAIStreamClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def list_models(self) -> list[str]:
        """GET /v1/models. Raises ServerUnreachable when nothing answers at the URL."""
        try:
            async with asyncio.timeout(10.0):
                async with self._http().get(self.base_url + "/models") as response:
                    if response.status != 200:
                        return []
                    body = await response.json(content_type=None)
        except (aiohttp.ClientConnectionError, TimeoutError, OSError) as exc:
            raise ServerUnreachable(f"cannot reach the server at {self.base_url}: {_describe(exc)}") from None
        except ValueError:
            return []
        try:
            return [m["id"] for m in body.get("data", [])]
        except (KeyError, TypeError, AttributeError):
            return []

    async def metrics_text(self) -> str | None:
        """GET /metrics at the server's root (Prometheus text), or None when it has none."""
        try:
            async with asyncio.timeout(10.0):
                async with self._http().get(self.base_url.removesuffix("/v1") + "/metrics") as response:
                    return await response.text() if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
            return None

    def payload(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.output_tokens,
            "stream": True,
            # The server's own token count is the authority; the client tokenizer is a fallback.
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
        }
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        if self.ignore_eos:
            # vLLM, SGLang and servelab honour it; it makes output lengths follow the workload.
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body

    async def stream(
        self,
        request: BenchRequest,
        *,
        planned_send_s: float | None = None,
        on_first_token: Callable[[float], None] | None = None,
    ) -> StreamResult:
        """Send one request and read its stream to the end. Never raises for a failed request:
        the failure and its reason are recorded in the result."""
        result = StreamResult(
            index=request.index,
            planned_send_s=planned_send_s,
            send_s=time.perf_counter(),
            prompt_tokens_planned=request.prompt_tokens,
            output_tokens_planned=request.output_tokens,
        )
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._stream_into(request, result, on_first_token)
        except TimeoutError:
            result.error = f"timeout: no complete response within {self.timeout_s:g}s"
        except (aiohttp.ClientError, OSError) as exc:
            started = result.first_token_s is not None
            result.error = ("stream dropped: " if started else "connection error: ") + _describe(exc)
        except asyncio.CancelledError:
            result.error = "cancelled"
            result.end_s = time.perf_counter()
            result.success = False
            raise
        finally:
            if result.end_s == 0.0:
                result.end_s = time.perf_counter()
        result.success = result.error is None
        return result

    async def _stream_into(
        self, request: BenchRequest, result: StreamResult, on_first_token: Callable[[float], None] | None
    ) -> None:
        url = self.base_url + ENDPOINT_PATHS[self.endpoint]
        pieces: list[str] = []
        done = False
        async with self._http().post(url, json=self.payload(request)) as response:
            result.http_status = response.status
            if response.status != 200:
                body = (await response.read()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status}: {_error_message(body)}"
                result.end_s = time.perf_counter()
                return
            async for line, now in _sse_lines(response):
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments (": ping"), event: lines
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    result.end_s = now
                    break
                try:
                    chunk = json.loads(data)
                    if not isinstance(chunk, dict):
                        raise TypeError("a chunk is a JSON object")
                    if not chunk.get("error"):
                        if chunk.get("usage"):
                            _read_usage(chunk["usage"], result)
                        text = _chunk_text(chunk, result)
                # Valid JSON of the wrong shape (a number, choices that are not objects ...) is as
                # broken as invalid JSON: a failure with its reason, never an exception that would
                # lose the request from the run.
                except (ValueError, TypeError, AttributeError):
                    result.error = f"malformed stream chunk: {data[:80].decode('utf-8', 'replace')!r}"
                    result.end_s = now
                    return
                if chunk.get("error"):
                    result.error = f"error in stream: {_error_message(json.dumps(chunk))}"
                    result.end_s = now
                    return
                if text:
                    if result.first_token_s is None:
                        result.first_token_s = now
                        if on_first_token is not None:
                            on_first_token(now)
                    result.token_times_s.append(now)
                    pieces.append(text)
        result.text = "".join(pieces)
        if not done:
            result.error = "stream dropped: ended without data: [DONE]"
            result.end_s = time.perf_counter()
        elif result.first_token_s is None:
            result.error = "empty response: the stream carried no text"
        else:
            # E2E is measured to the last token, not to [DONE], which may trail the usage chunk.
            result.end_s = result.token_times_s[-1]


async def _sse_lines(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[bytes, float]]:
    """Lines of the body, each with the time its last byte was read. Our own splitting over
    `iter_any()` rather than aiohttp's readline, whose line-length cap (the read buffer) once
    broke benchmark clients on long chunks."""
    pending = b""
    async for data in response.content.iter_any():
        now = time.perf_counter()
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r"), now
    if pending:
        yield pending.rstrip(b"\r"), time.perf_counter()


def _chunk_text(chunk: dict[str, Any], result: StreamResult) -> str:
    text = ""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if delta is not None:  # chat: role-only and empty deltas carry no token
            # reasoning models stream their thinking as `reasoning` (vLLM today) or `reasoning_content`
            text += (delta.get("content") or "") + (delta.get("reasoning") or delta.get("reasoning_content") or "")
        else:
            text += choice.get("text") or ""
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    return text


def _read_usage(usage: dict[str, Any], result: StreamResult) -> None:
    if isinstance(usage.get("prompt_tokens"), int):
        result.usage_prompt_tokens = usage["prompt_tokens"]
    if isinstance(usage.get("completion_tokens"), int):
        result.usage_output_tokens = usage["completion_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        result.usage_cached_tokens = details["cached_tokens"]
    if isinstance(usage.get("spec_decode"), dict):
        result.usage_spec_decode = usage["spec_decode"]


def _error_message(body: str) -> str:
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.strip()[:200] or "(empty body)"
    error = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)[:200]
    return str(error)[:200]


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
