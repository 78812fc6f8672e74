"""servelab: an LLM serving engine that knows its own economics."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # The engine pulls in torch; keep `import servelab` light for the simulator and bench client.
    if name in ("LLM", "SamplingParams"):
        from servelab.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'servelab' has no attribute {name!r}")
