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
    "cost": {"core", "spec"},  # core: the configurations it prices (SpeculativeConfig)
    # the model, its weights and kernels: never the step loop, the tokenizer or sampling
    "runtime": {"spec"},
    "engine": {"core", "spec", "runtime"},
    "sim": {"core", "cost", "spec", "workload", "metrics"},
    "server": {"core", "engine", "spec", "metrics", "<top>"},
    # data-parallel workers: the engine in each, its client interface and core's router at the front
    "cluster": {"core", "engine", "runtime", "spec"},
    # the load generator builds exact-length prompts with the engine's tokenizer (imported lazily)
    "bench": {"core", "workload", "metrics", "sim", "cost", "spec", "engine"},
    # and the server's HTTP guards and JSON decoder (server.guards, server.http_errors: no engine, no torch)
    # and `servelab plan`'s flags and job building, so each capacity bar is the command it shows
    "lab": {"core", "bench", "sim", "cost", "spec", "workload", "metrics", "server", "commands"},
    "commands": {
        "bench",
        "cluster",
        "core",
        "cost",
        "engine",
        "lab",
        "metrics",
        "runtime",
        "server",
        "sim",
        "spec",
        "workload",
        "<top>",
    },
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


def _imports(path: Path) -> set[str]:
    """Every servelab module `path` imports: at module level, under `if TYPE_CHECKING:`, and inside
    functions (an import delayed to a call still makes the two modules depend on each other)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
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
        for target in _imports(path):
            dep = _package(_resolve(target, modules))
            if dep != pkg and dep not in BASE and dep not in ALLOWED[pkg]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {m: {_resolve(t, modules) for t in _imports(p)} - {m} for m, p in modules.items()}
    # a package's __init__ re-exporting its submodules is not a circle with them
    return {m: {t for t in ts if not (m.startswith(t + ".") and modules[t].name == "__init__.py")}
            for m, ts in graph.items()}  # fmt: skip


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            nxt = next(targets, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle through the component's first module, as a path that ends where it starts."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to the start
        node = frontier.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                frontier.append(nxt)
    raise AssertionError(f"no circle through {start}")


def test_strongly_connected_finds_circles_and_only_them():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _strongly_connected(graph) == [["a", "b", "c"]]
    assert _a_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_no_import_circles():
    """No two modules import each other, directly or around a circle, whether the import is at
    module level or inside a function: a function-level import may delay a heavy dependency
    (torch, fastapi, xgrammar), never hide a circle."""
    graph = _import_graph()
    circles = [" -> ".join(_a_cycle(graph, c)) + f"   (all of: {', '.join(c)})" for c in _strongly_connected(graph)]
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_lab_loads_without_the_engine_or_torch():
    """The lab may use the server's HTTP guards and JSON decoder, but never through the engine:
    `servelab lab` starts without torch."""
    import subprocess
    import sys

    code = "import sys, servelab.lab.app; print(sorted(m for m in ('torch', 'servelab.engine') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
