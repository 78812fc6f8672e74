"""A servelab server whose steps take a set time: a real engine and HTTP server over an executor
that sleeps per step, per query token and per sequence. Run as
`python -m tests.bench.timed_server MODEL_DIR` (a tiny HF model dir); it prints its URL.
Its own process: a server in the test's process would share the GIL with the client and add
its waits to every time measured."""

from __future__ import annotations

import socket
import sys
import time

STEP_S, TOKEN_S, SEQ_S = 0.008, 40e-6, 400e-6
CHUNK, MAX_SEQS, MAX_MODEL_LEN, NUM_BLOCKS = 128, 4, 1024, 512


class TimedExecutor:
    def __init__(self, vocab_size: int) -> None:
        from tests.fake_executor import FakeExecutor

        self.inner = FakeExecutor(vocab_size=vocab_size, token_offset=10)
        self.vocab_size = vocab_size

    def execute(self, plan):  # noqa: ANN001, ANN201
        time.sleep(STEP_S + TOKEN_S * plan.num_batched_tokens + SEQ_S * len(plan.scheduled))
        return self.inner.execute(plan)


def main(model_dir: str) -> None:
    import uvicorn

    from servelab.core.config import SchedulerConfig
    from servelab.engine.llm_engine import LLMEngine
    from servelab.engine.tokenizer import Tokenizer
    from servelab.server.app import create_app

    tokenizer = Tokenizer.from_hf_dir(model_dir)
    config = SchedulerConfig(num_blocks=NUM_BLOCKS, block_size=16, max_num_seqs=MAX_SEQS,
                             max_num_batched_tokens=CHUNK, max_model_len=MAX_MODEL_LEN,
                             enable_prefix_caching=False)  # fmt: skip
    engine = LLMEngine(TimedExecutor(tokenizer.vocab_size), tokenizer, config, "timed-model")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio sets TCP_NODELAY
    sock.bind(("127.0.0.1", 0))
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    main(sys.argv[1])
