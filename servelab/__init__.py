"""servelab: an LLM serving engine that knows its own economics."""

import os

__version__ = "0.1.0"

# The engine's C kernels run their own thread pool beside torch's OpenMP threads, and libgomp's
# default keeps an idle thread spinning on the core that pool needs next (figures in
# docs/benchmarks.md, "Our own thread pool for the kernels"). The runtime reads this when torch
# loads, so it is set before servelab imports torch; a value already in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def __getattr__(name: str):
    # The engine pulls in torch; keep `import servelab` light for the simulator and bench client.
    if name in ("LLM", "SamplingParams"):
        from servelab.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'servelab' has no attribute {name!r}")
