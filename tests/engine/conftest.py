# The engine runs the model runtime: its tests build the same tiny model and kernels.
from tests.runtime.conftest import kernel, tiny_engine_factory, tiny_llama  # noqa: F401
