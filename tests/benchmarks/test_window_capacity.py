"""benchmarks/window_capacity.py on a small pool: Gemma 3 1B's window layers free their pages, so
the same bytes decode more long sequences at once (fewer steps to finish them all)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import window_capacity  # noqa: E402


def test_kv_groups_decode_more_sequences_in_the_same_bytes(capsys):
    out = window_capacity.main(["--model", "gemma-3-1b", "--blocks", "200", "--requests", "8", "--prompt", "64",
                                "--output", "1000"])  # fmt: skip
    kept, grouped = out["every block kept"], out["KV groups"]
    assert grouped["pages"] > kept["pages"]  # a page holds one group's layers
    assert grouped["steps"] < kept["steps"]
    assert "KV groups" in capsys.readouterr().out
