import pytest

from tests.tiny_models import write_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_llama):
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    def make(**kwargs):
        kwargs.setdefault("dtype", "float32")
        return LLMEngine.from_args(EngineArgs.from_kwargs(model=str(tiny_llama), **kwargs))

    return make
