import pytest

from servelab.runtime import native
from tests.runtime.isa_levels import fail_if_the_code_does_not_build, kernels_at
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


@pytest.fixture(scope="session")
def kernel():
    """The native C kernels (runtime/native.py); tests that need them skip where they cannot build."""
    from servelab.runtime import native

    fn = native.native_kernels()
    if fn is None:
        fail_if_the_code_does_not_build(native.load_error)
        pytest.skip(f"native kernels unavailable here: {native.load_error}")
    return fn


@pytest.fixture(scope="session", params=[level.name for level in native.ISA_LEVELS])
def isa_kernels(request):
    """(level name, the native kernels built for it) for every ISA level: native where this CPU
    has it, on SIMDe where it lacks it and SIMDe is found (tests/runtime/isa_levels.py), else the
    test skips, saying why."""
    kernels, how = kernels_at(request.param)
    if kernels is None:
        pytest.skip(f"ISA level {request.param}: {how}")
    return request.param, kernels
