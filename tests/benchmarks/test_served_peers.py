"""benchmarks/served_peers.py on a tiny random model: servelab's own server started, benched at
two concurrencies and stopped; the peers' servers are named, and skipped without their Pythons."""

import json
import sys
from pathlib import Path

import pytest

from tests.tiny_models import write_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import served_peers  # noqa: E402


@pytest.mark.slow
def test_quick_run_benches_servelab_at_each_level(tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny")
    assert served_peers.main(["--quick", "--model", str(model), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = out["results"]["servelab"]
    assert set(rows) == {"1", "2"}
    for r in rows.values():
        assert r["completed"] > 0 and r["failed"] == 0
        # a tiny model's tokens may reach the client in one chunk (TPOT 0) on a busy host
        assert r["output_tok_s"] > 0 and 0 <= r["tpot_p50_s"] < 1 and r["ttft_p50_s"] > 0


def test_a_peer_without_its_python_is_skipped_by_name(monkeypatch, tmp_path):
    monkeypatch.delenv("SERVELAB_LLAMA_CPP_PYTHON", raising=False)
    with pytest.raises(ImportError, match="SERVELAB_LLAMA_CPP_PYTHON"):
        served_peers.server_command("llama.cpp", 1, None, 2, tmp_path)


def test_unknown_servers_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        served_peers.main(["--servers", "servelab,tgi"])
    assert e.value.code == 2 and "tgi" in capsys.readouterr().err
