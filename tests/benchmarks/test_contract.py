"""Every script in benchmarks/ is run or imported by a test, or is listed below with the reason it
is not: a script that nothing runs rots silently when the APIs it uses move."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Scripts no test runs, and why. Remove an entry when a test starts running that script; a new
# script gets a test with a `--quick` run, not an entry here.
EXEMPT = {
    # Shell drivers of long server loads (minutes each, servers on real ports).
    "disagg_runs.sh": "drives serve --disagg and bench for minutes",
}


def _scripts() -> list[str]:
    return sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))


def _is_run_by(script: str, text: str) -> bool:
    stem = Path(script).stem
    return bool(
        re.search(rf"^\s*(import {stem}\b|from {stem} import )", text, re.M)
        or re.search(rf"[\"']{re.escape(script)}[\"']", text)
    )


def test_every_benchmark_is_run_by_a_test_or_exempt():
    tests = [p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.resolve() != Path(__file__).resolve()]
    untested = [s for s in _scripts() if s not in EXEMPT and not any(_is_run_by(s, t) for t in tests)]
    assert not untested, f"benchmarks with no test and no entry in EXEMPT: {untested}"


def test_exemptions_name_scripts_that_exist_and_need_them():
    tests = [p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.resolve() != Path(__file__).resolve()]
    scripts = _scripts()
    assert not [s for s in EXEMPT if s not in scripts], "EXEMPT names a script that is gone"
    assert not [s for s in EXEMPT if any(_is_run_by(s, t) for t in tests)], "EXEMPT names a script a test runs"


def test_the_check_sees_imports_and_paths_only():
    assert _is_run_by("soak.py", "import soak  # noqa: E402\n")
    assert _is_run_by("soak.py", "script = ROOT / 'benchmarks' / 'soak.py'\n")
    assert not _is_run_by("soak.py", '"""as benchmarks/soak.py showed"""\n')
    assert not _is_run_by("soak.py", "import soaked\n")
