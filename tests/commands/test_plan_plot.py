"""`servelab plan --plot`: the frontier chart is written in the format its extension names, from
the same curves the lab's capacity-pareto lesson draws for the command it shows."""

from __future__ import annotations

import json
import shlex

import pytest
from fastapi.testclient import TestClient

from servelab.cli import main
from servelab.lab.app import create_lab_app


@pytest.fixture(scope="module")
def lesson() -> dict:
    body = {"accelerators": "h100-sxm,a100-80gb", "tpot_ms": "30", "prompt_len": "512", "output_len": "32"}
    response = TestClient(create_lab_app()).post("/api/lessons/capacity-pareto", json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("suffix", ["svg", "png"])
def test_plot_is_written_from_the_lessons_data(lesson, tmp_path, capsys, suffix):
    (command,) = lesson["commands"]
    argv = shlex.split(command)[1:]
    out = tmp_path / f"frontier.{suffix}"
    argv[argv.index("--plot") + 1] = str(out)
    assert main([*argv, "--json", "--workers", "1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert out.stat().st_size > 5_000
    head = out.read_bytes()[:64]
    assert head.startswith(b"\x89PNG") if suffix == "png" else b"<svg" in out.read_bytes()[:2000] or b"<?xml" in head
    assert plan["frontier"] == lesson["curves"]  # one function draws both
    for curve in plan["frontier"]:
        config = next(c for c in plan["configs"] if c["hardware"] == curve["hardware"])
        assert curve["capacity"]["tokens_per_s_per_device"] == pytest.approx(
            config["output_tokens_per_s_per_device"], rel=0.02
        )
        assert curve["capacity"]["tokens_per_s_per_user"] >= 1000 / 30
        assert curve["capacity"]["usd_per_million_tokens"] == pytest.approx(config["cost_per_million_output_tokens"])


def test_plot_to_an_unknown_format_is_refused_before_planning(tmp_path, capsys):
    argv = ["plan", "--hardware", "h100-sxm", "--slo-tpot", "50ms", "--plot", str(tmp_path / "f.docx")]
    assert main(argv) == 2
    assert "format 'docx'" in capsys.readouterr().err
    assert not (tmp_path / "f.docx").exists()
