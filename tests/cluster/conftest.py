"""The server tests' fixtures (a tiny model on disk, fake engines) for the cluster's tests, and
engines over that model for the disaggregation hand-off tests."""

import pytest

from tests.server.conftest import fake_engine, tiny_model_dir  # noqa: F401


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_model_dir):  # noqa: F811
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    def make(**kwargs):
        kwargs.setdefault("dtype", "float32")
        return LLMEngine.from_args(EngineArgs.from_kwargs(model=str(tiny_model_dir), **kwargs))

    return make


@pytest.fixture(autouse=True)
def _end_memory_workers():
    """Each test's in-memory workers end with it (a worker left running logs into later tests)."""
    from tests.cluster.memory_cluster import end_all

    yield
    end_all()
