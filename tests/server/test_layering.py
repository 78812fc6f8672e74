"""The HTTP server is a layer below the lab and the CLI: `servelab serve` mounts the lab on the
app the server package builds, so nothing in servelab/server imports either of them."""

from __future__ import annotations

import ast
from pathlib import Path

import servelab.server

SERVER_DIR = Path(servelab.server.__file__).parent
ABOVE_THE_SERVER = ("servelab.lab", "servelab.commands", "servelab.cli")


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):  # function-level imports too
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("import_module", "find_spec"):
            names.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return names


def test_the_server_package_imports_nothing_above_it():
    sources = sorted(SERVER_DIR.rglob("*.py"))
    assert len(sources) > 10  # the walk found the package
    upward = {
        str(path.relative_to(SERVER_DIR)): sorted(m for m in _imported_modules(path) if m.startswith(ABOVE_THE_SERVER))
        for path in sources
    }
    assert not {k: v for k, v in upward.items() if v}
