import pytest

from servelab.engine.testing import write_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_llama):
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    def make(**kwargs):
        kwargs.setdefault("dtype", "float32")
        return LLMEngine.from_args(EngineArgs(model=str(tiny_llama), **kwargs))

    return make


@pytest.fixture(scope="session")
def kernel():
    """The native C kernels (engine/native.py); tests that need them skip where they cannot build."""
    from servelab.engine import native

    fn = native.native_kernels()
    if fn is None:
        pytest.skip(f"native kernels unavailable here: {native.load_error}")
    return fn
