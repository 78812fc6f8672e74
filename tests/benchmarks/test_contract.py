"""Every script in benchmarks/ is run or imported by a test, and reaches servelab through its public
names only: a script that nothing runs rots silently when the APIs it uses move."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _scripts() -> list[str]:
    return sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))


def _is_run_by(script: str, text: str) -> bool:
    stem = Path(script).stem
    return bool(
        re.search(rf"^\s*(import {stem}\b|from {stem} import )", text, re.M)
        or re.search(rf"[\"']{re.escape(script)}[\"']", text)
    )


def test_every_benchmark_is_run_by_a_test():
    tests = [p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.resolve() != Path(__file__).resolve()]
    untested = [s for s in _scripts() if not any(_is_run_by(s, t) for t in tests)]
    assert not untested, f"benchmarks no test runs (give each a --quick mode and a test): {untested}"


def test_the_check_sees_imports_and_paths_only():
    assert _is_run_by("soak.py", "import soak  # noqa: E402\n")
    assert _is_run_by("soak.py", "script = ROOT / 'benchmarks' / 'soak.py'\n")
    assert not _is_run_by("soak.py", '"""as benchmarks/soak.py showed"""\n')
    assert not _is_run_by("soak.py", "import soaked\n")


def _private_uses(source: str) -> list[str]:
    """servelab names a script reaches that start with an underscore: imported from a private module
    or by a private name, or an attribute of a name imported from servelab (`module._x`, `Class._x`)."""
    tree = ast.parse(source)
    bound: set[str] = set()  # local names bound by servelab imports
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "servelab":
                    bound.add(alias.asname or alias.name.split(".")[0])
                    found += [alias.name for part in alias.name.split(".") if part.startswith("_")][:1]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "servelab":
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            bound.update(a.asname or a.name for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                found.append(ast.unparse(node))
    return found


def test_benchmarks_use_servelab_s_public_names_only():
    private = {
        p.name: uses for p in sorted((ROOT / "benchmarks").glob("*.py")) if (uses := _private_uses(p.read_text()))
    }
    assert not private, f"benchmarks reaching into servelab's private names: {private}"


def test_the_private_check_sees_each_way_in():
    assert _private_uses("from servelab.commands._outputs import check\n") == ["servelab.commands._outputs"]
    assert _private_uses("from servelab.cost.profile import _fit, fit\n") == ["servelab.cost.profile._fit"]
    assert _private_uses("import servelab.cost.profile as p\np._fit()\n") == ["p._fit"]
    assert _private_uses("import servelab\nservelab.cost._x\n") == ["servelab.cost._x"]
    assert _private_uses("from servelab.engine import llm_engine\nllm_engine._step\n") == ["llm_engine._step"]
    assert _private_uses("import servelab\nfrom servelab.cost import fit\nself._x = fit\n") == []
