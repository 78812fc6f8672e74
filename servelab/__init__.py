"""servelab: an LLM serving engine that knows its own economics."""

import os

__version__ = "0.1.0"

# The engine's C kernels split their work over a thread pool of their own (engine/csrc/parallel.c)
# next to torch's OpenMP threads. Left to its default, libgomp keeps an idle thread spinning for a
# while after each parallel region, on the core our pool's worker needs next. At --threads 2 on
# the 2-core development machine (int8, fp16 KV cache) batch-1 decode ran 41 tok/s with the
# default against 58-63 with passive waiting, a 512-token prefill 428-459 against 650-680 tok/s,
# 32 sequences 258-314 against 300-371. The runtime reads this when it loads, so it is set here,
# before anything in servelab imports torch; a value already in the environment wins, and a
# program that imported torch first keeps torch's default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def __getattr__(name: str):
    # The engine pulls in torch; keep `import servelab` light for the simulator and bench client.
    if name in ("LLM", "SamplingParams"):
        from servelab.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'servelab' has no attribute {name!r}")
