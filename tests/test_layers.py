"""The package's layers (docs/architecture.md): each package imports only the ones below it, and no
modules import each other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "servelab"
BASE = {"errors", "units", "logs"}
# package -> the packages it may import (besides BASE); DESIGN.md's layer table
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "units": set(),
    "logs": set(),
    "spec": set(),
    "core": set(),
    "workload": set(),
    "metrics": set(),
    "cost": {"spec"},
    "engine": {"core", "spec"},
    "sim": {"core", "cost", "spec", "workload", "metrics"},
    "server": {"core", "engine", "spec", "metrics", "<top>"},
    # data-parallel workers: the engine in each, its client interface and core's router at the front
    "cluster": {"core", "engine", "spec"},
    # the load generator builds exact-length prompts with the engine's tokenizer (imported lazily)
    "bench": {"core", "workload", "metrics", "sim", "cost", "spec", "engine"},
    # and the server's HTTP guards and JSON decoder (server.guards, server.http_errors: no engine, no torch)
    "lab": {"core", "bench", "sim", "cost", "spec", "workload", "metrics", "server"},
    "commands": {"bench", "cluster", "core", "cost", "engine", "lab", "metrics", "server", "sim", "spec",
                 "workload", "<top>"},
    "cli": {"<top>", "commands"},
    "__main__": {"cli"},
    "<top>": {"engine"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<top>"


def _imports(path: Path, module_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree)
    if module_level_only:  # what runs at import time: the module body and `if TYPE_CHECKING:` blocks
        nodes = [n for top in tree.body for n in ([top] if not isinstance(top, ast.If) else ast.walk(top))]
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("import_module", "find_spec"):
            names |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return {n for n in names if n.split(".")[0] == "servelab"}


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """`servelab.a.b.Name` -> the module it lives in (`servelab.a.b`)."""
    while name not in modules:
        name = name.rsplit(".", 1)[0]
    return name


def test_no_package_imports_a_layer_above_it():
    wrong = []
    modules = _modules()
    assert len(modules) > 50  # the walk found the package
    for module, path in modules.items():
        pkg = _package(module)
        for target in _imports(path, module_level_only=False):
            dep = _package(_resolve(target, modules))
            if dep != pkg and dep not in BASE and dep not in ALLOWED[pkg]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circles():
    modules = _modules()
    graph = {m: {t for t in _imports(p, module_level_only=True) if t in modules and t != m}
             for m, p in modules.items()}
    # a package's __init__ re-exporting its submodules is not a circle with them
    graph = {m: {t for t in ts if not (m.startswith(t + ".") and modules[t].name == "__init__.py")}
             for m, ts in graph.items()}
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(stack[stack.index(nxt):] + [node, nxt]) if nxt in stack
                               else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not circles, "\n".join(circles)


def test_the_lab_loads_without_the_engine_or_torch():
    """The lab may use the server's HTTP guards and JSON decoder, but never through the engine:
    `servelab lab` starts without torch."""
    import subprocess
    import sys

    code = "import sys, servelab.lab.app; print(sorted(m for m in ('torch', 'servelab.engine') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
