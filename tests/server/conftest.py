"""Fixtures for the server tests: a tiny real model on disk, an in-process engine whose model is
core's FakeExecutor (fast, for the HTTP layer), and real `python -m servelab serve` processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("server-model") / "tiny-llama")


class SleepyExecutor:
    """core's FakeExecutor, taking a little real time per step (so requests overlap as they do
    on a real model) and optionally raising on chosen steps (to show the server survives)."""

    def __init__(self, vocab_size: int, *, step_sleep_s: float = 0.002, fail_steps: set[int] | None = None):
        from tests.fake_executor import FakeExecutor

        # Tokens depend on the position only, not on the request id: a test can learn a
        # completion with one request and predict it in the next.
        span = vocab_size - 10
        self.inner = FakeExecutor(vocab_size=vocab_size, token_fn=lambda seq, pos: 10 + (pos * 7919) % span)
        self.vocab_size = vocab_size
        self.step_sleep_s = step_sleep_s
        self.fail_steps = fail_steps or set()
        self.num_calls = 0

    def execute(self, plan):
        self.num_calls += 1
        if self.num_calls in self.fail_steps:
            raise RuntimeError(f"injected failure on step {self.num_calls}")
        time.sleep(self.step_sleep_s)
        return self.inner.execute(plan)


@pytest.fixture
def fake_engine(tiny_model_dir: Path):
    """Factory: a real LLMEngine (scheduler, tokenizer, detokenizer) over a SleepyExecutor."""
    from servelab.core.config import SchedulerConfig
    from servelab.engine.llm_engine import LLMEngine
    from servelab.engine.tokenizer import Tokenizer

    def make(*, num_blocks: int = 64, max_num_seqs: int = 8, max_waiting: int | None = None,
             max_model_len: int = 256, step_sleep_s: float = 0.002, fail_steps: set[int] | None = None):  # fmt: skip
        tokenizer = Tokenizer.from_hf_dir(tiny_model_dir)
        executor = SleepyExecutor(tokenizer.vocab_size, step_sleep_s=step_sleep_s, fail_steps=fail_steps)
        config = SchedulerConfig(
            num_blocks=num_blocks, block_size=16, max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
            max_model_len=max_model_len, max_waiting=max_waiting,
        )  # fmt: skip
        return LLMEngine(executor, tokenizer, config, "fake-model")

    return make


# ------------------------------------------------------------------------------- real servers


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


_SERVING = re.compile(r"serving .* on http://127\.0\.0\.1:(\d+)")


def launch_server(
    model_dir: Path, log_dir: Path, *args: str, timeout_s: float = 180.0, lab: bool = False
) -> ServerProcess:
    """`python -m servelab serve --port 0 ...`: the OS picks a free port and the log names it.
    The lab stays unmounted unless `lab`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{time.monotonic_ns()}.log"
    log = open(log_path, "wb")
    cmd = [sys.executable, "-m", "servelab", "serve", "--model", str(model_dir), "--port", "0",
           "--no-access-log", *([] if lab else ["--no-lab"]), *args]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    log.close()
    deadline = time.monotonic() + timeout_s
    port = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}")
        if port is None:
            match = _SERVING.search(log_path.read_text(errors="replace"))
            port = int(match.group(1)) if match else None
        if port is not None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return ServerProcess(proc, port, log_path)
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not become healthy in {timeout_s} s:\n{log_path.read_text(errors='replace')}")


@pytest.fixture(scope="session")
def server_launcher(tmp_path_factory: pytest.TempPathFactory):
    """Starts servers on demand; whatever is still running at the end of the session is stopped."""
    started: list[ServerProcess] = []
    log_dir = tmp_path_factory.mktemp("server-logs")

    def launch(model_dir: Path, *args: str, lab: bool = False) -> ServerProcess:
        server = launch_server(model_dir, log_dir, *args, lab=lab)
        started.append(server)
        return server

    yield launch
    for server in started:
        server.stop()
