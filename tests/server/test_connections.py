"""Connection limits against a real uvicorn server on loopback: slow senders are cut off at their
deadline while plain requests are served, and past a connection cap the answer is 503 with
Retry-After. Counts and times are small and bounded."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from servelab.server.connections import ConnectionLimits, http_protocol


async def _echo_app(scope, receive, send):
    assert scope["type"] == "http"
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok %d" % len(body)})


@contextlib.contextmanager
def serving(limits: ConnectionLimits) -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(_echo_app, http=http_protocol(limits), ws="none", lifespan="off", log_level="error",
                            timeout_keep_alive=limits.keep_alive_timeout_s)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def test_slow_header_senders_are_closed_at_the_deadline_while_a_plain_request_is_served():
    limits = ConnectionLimits(header_timeout_s=0.5)
    with serving(limits) as port:
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        start = time.monotonic()
        for s in slow:
            s.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Drip: ")
        # a normal client is served meanwhile
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).text == "ok 0"
        for s in slow:
            with contextlib.suppress(OSError):
                s.sendall(b"a")  # one more byte: a dribble does not extend the deadline
        answers = [_read_until_closed(s, timeout_s=5) for s in slow]
        elapsed_s = time.monotonic() - start
        for s in slow:
            s.close()
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers[0]
    assert b"--header-timeout" in answers[0]
    assert elapsed_s < 3.0


def test_a_silent_connection_is_closed_at_the_header_deadline():
    with serving(ConnectionLimits(header_timeout_s=0.3)) as port, socket.create_connection(("127.0.0.1", port)) as s:
        start = time.monotonic()
        assert _read_until_closed(s, timeout_s=5) == b""  # closed, nothing said: it never asked anything
        assert time.monotonic() - start < 2.0


def test_a_slow_body_is_cut_off_with_408():
    with serving(ConnectionLimits(body_timeout_s=0.4)) as port, socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n0123456789")
        start = time.monotonic()
        answer = _read_until_closed(s, timeout_s=5)
        assert time.monotonic() - start < 2.0
    assert answer.startswith(b"HTTP/1.1 408 ") and b"--body-timeout" in answer


def test_a_full_body_in_time_is_served():
    limits = ConnectionLimits(header_timeout_s=0.3, body_timeout_s=0.3)
    with serving(limits) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        for _ in range(3):  # keep-alive: each request gets its own deadlines
            assert client.post("/", content=b"x" * 1000).text == "ok 1000"
            time.sleep(0.4)  # longer than either deadline, shorter than the keep-alive timeout


def test_the_per_address_cap_answers_503_with_retry_after():
    with serving(ConnectionLimits(max_connections_per_client=2)) as port:
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        time.sleep(0.1)  # the server has counted them
        refused = httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert "--max-connections-per-client" in error["message"] and error["type"] == "server_overloaded"
        for s in held:
            s.close()
        time.sleep(0.1)  # closing gives the slots back
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200


def test_the_total_cap_answers_503():
    with serving(ConnectionLimits(max_connections=1)) as port:
        with socket.create_connection(("127.0.0.1", port)):
            time.sleep(0.1)
            refused = httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
        assert refused.status_code == 503 and "--max-connections" in refused.json()["error"]["message"]


def test_a_connection_carries_at_most_max_requests_per_connection():
    limits = ConnectionLimits(max_requests_per_connection=2)
    with serving(limits) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        answers = [client.get("/") for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]  # the client reconnects for the third
    assert [a.headers.get("connection") for a in answers] == [None, "close", None]


def test_oversized_headers_get_400():
    # h11's own cap on an incomplete head (16 KiB) stays in force under the protocol.
    with serving(ConnectionLimits()) as port, socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"x" * 20_000)
        assert _read_until_closed(s, timeout_s=5).startswith(b"HTTP/1.1 400 ")


def test_counts_return_to_zero():
    from servelab.server.connections import ConnectionCounts

    counts = ConnectionCounts(ConnectionLimits(max_connections=2, max_connections_per_client=1))
    assert counts.admit("a") is None
    assert "per address" in counts.admit("a")
    assert counts.admit("b") is None
    assert "--max-connections)" in counts.admit("c")
    counts.release("a")
    counts.release("b")
    assert counts.total == 0 and not counts.by_client


@pytest.mark.slow
def test_servelab_serve_applies_the_limits_and_the_host_check(server_launcher, tiny_model_dir):
    server = server_launcher(tiny_model_dir, "--header-timeout", "1s", "--max-connections-per-client", "8")
    slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    for s in slow:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: local")
    ok = httpx.get(f"{server.url}/v1/models", headers={"Host": f"localhost:{server.port}"}, timeout=10)
    assert ok.status_code == 200
    rebound = httpx.get(f"{server.url}/v1/models", headers={"Host": "evil.example"}, timeout=10)
    assert rebound.status_code == 421 and "--allowed-hosts" in rebound.json()["error"]["message"]
    start = time.monotonic()
    answers = [_read_until_closed(s, timeout_s=10) for s in slow]
    assert time.monotonic() - start < 5.0
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers)
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
    time.sleep(0.2)
    refused = httpx.get(f"{server.url}/health", timeout=10)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    for s in [*slow, *held]:
        s.close()
    time.sleep(0.2)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
