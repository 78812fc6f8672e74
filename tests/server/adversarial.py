"""Adversarial clients for the server tests: a grammar compiler whose compiles take as long as
the constraint asks (what the size limits cannot foresee), an app whose engine has real logit
processors over the tiny model's tokenizer, connections that send their headers a byte at a time
or nothing at all, and a stopwatch for the plain request that must not wait behind them."""

from __future__ import annotations

import selectors
import socket
import threading
import time
from typing import Any

from servelab.core.structured_output import StructuredOutputSpec
from servelab.engine.structured_output import compile_spec

SLOW_PREFIX = "slow"


def slow_compile(compiler: Any, spec: StructuredOutputSpec) -> Any:
    """compile_spec, after sleeping N seconds for the regex `slowN` (runs in a grammar worker process)."""
    if spec.kind == "regex" and spec.value.startswith(SLOW_PREFIX):
        time.sleep(float(spec.value.removeprefix(SLOW_PREFIX)))
    return compile_spec(compiler, spec)


def slow_regex(seconds: float) -> dict:
    return {"structured_outputs": {"regex": f"{SLOW_PREFIX}{seconds:g}"}}


def engine_with_grammars(fake_engine, **kwargs: Any):
    """fake_engine's LLMEngine, with the logit processors (and so the grammar compiler) a real model has."""
    from servelab.engine.logits_processors import LogitsProcessors

    engine = fake_engine(**kwargs)
    engine.logits_processors = LogitsProcessors(engine.tokenizer, engine.vocab_size)
    return engine


def plain_completion_s(client: Any) -> float:
    """Seconds a 1-token completion takes, start to answer (asserted 200)."""
    t0 = time.perf_counter()
    resp = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    return time.perf_counter() - t0


def wait_until(predicate: Any, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


class ConnectionAttack:
    """Connections held open against a server on 127.0.0.1:`port` from each of `sources` (other
    loopback addresses, so the attack is several clients to the server): `slow` per source send
    a request's headers a byte every `drip_s` and never finish them (slowloris), `idle` per
    source send nothing. One the server closes is opened again at once, as an attacker would.
    Runs on a thread of its own between `start` and `stop`."""

    HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nX-Padding: "

    def __init__(self, port: int, sources: list[str], *, slow: int, idle: int, drip_s: float = 1.0):
        self.port, self.sources, self.drip_s = port, sources, drip_s
        self.plan = [(source, kind) for source in sources for kind in ["slow"] * slow + ["idle"] * idle]
        self.num_opened = 0
        self.num_closed_by_server = 0
        self.num_refused = 0  # connections the server would not take (its caps): tried again at the next drip
        self._refused: list[tuple[str, str]] = []
        self._selector = selectors.DefaultSelector()
        self._sent: dict[socket.socket, int] = {}  # a slow connection -> header bytes sent so far
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="connection-attack", daemon=True)

    def start(self) -> ConnectionAttack:
        for source, kind in self.plan:
            self._open(source, kind)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()

    @property
    def num_open(self) -> int:
        return len(self._selector.get_map())

    def _open(self, source: str, kind: str) -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=5, source_address=(source, 0))
        except OSError:
            self.num_refused += 1
            self._refused.append((source, kind))
            return
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, (source, kind))
        if kind == "slow":
            self._sent[sock] = 0
        self.num_opened += 1

    def _run(self) -> None:
        next_drip = time.monotonic()
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.05):
                sock = key.fileobj
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # closed by the server (a 408, or silently): open another
                    self._close(sock)
                    self.num_closed_by_server += 1
                    self._open(*key.data)
            if time.monotonic() >= next_drip:
                next_drip += self.drip_s
                for sock, sent in list(self._sent.items()):
                    byte = self.HEAD[sent : sent + 1] or b"a"
                    try:
                        sock.send(byte)
                        self._sent[sock] = sent + 1
                    except OSError:
                        pass  # the read side sees the close
                retry, self._refused = self._refused, []
                for source, kind in retry:
                    self._open(source, kind)

    def _close(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        self._sent.pop(sock, None)
        sock.close()


def rss_bytes(pid: int) -> int:
    """A process's resident set, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid}")
