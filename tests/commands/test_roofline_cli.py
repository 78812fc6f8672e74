import json
import subprocess
import sys
from pathlib import Path

import pytest

from servelab.cli import main

SEED = ["roofline", "--model", "llama-3.1-8b", "--hardware", "h100-sxm"]


def run_json(capsys, *extra: str) -> list[dict]:
    assert main([*SEED, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_done_command_prints_the_seed_numbers(capsys):
    assert main([*SEED, "--batch", "1,64", "--context", "2048"]) == 0
    out = capsys.readouterr().out
    assert "4.79 ms" in out  # the weights streamed once at peak
    assert "0.0152 ms" in out  # one token's compute at peak
    assert "ridge 295" in out
    table = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["64"])}
    step_ms, per_user, total, bound = (
        float(table["1"][1]),
        float(table["1"][2]),
        float(table["1"][3].replace(",", "")),
        table["1"][4],
    )
    assert 135 <= per_user <= 165 and total == pytest.approx(per_user, rel=0.01) and bound == "memory"
    assert step_ms == pytest.approx(1000 / per_user, rel=0.01)
    assert 63 <= float(table["64"][2]) <= 77
    assert 4000 <= float(table["64"][3].replace(",", "")) <= 5000
    assert table["64"][-1] == "yes"
    assert "never compute-bound at context 2048" in out


def test_json_rows(capsys):
    rows = run_json(capsys, "--batch", "1,8,64", "--context", "2048")
    assert [r["batch"] for r in rows] == [1, 8, 64]
    required = {
        "batch",
        "context",
        "step_time_s",
        "tokens_per_s_per_user",
        "tokens_per_s_total",
        "bound",
        "arithmetic_intensity",
        "weight_bytes",
        "kv_bytes",
        "fits",
    }
    for row in rows:
        assert required <= set(row) and "prefill_time_s" not in row
        assert row["bound"] in ("memory", "compute") and row["fits"] is True
        assert row["tokens_per_s_total"] == pytest.approx(row["batch"] * row["tokens_per_s_per_user"])
        assert row["kv_bytes"] == row["batch"] * 2048 * 131_072
    assert 0.8 <= rows[0]["arithmetic_intensity"] <= 1.2
    assert rows[0]["tokens_per_s_total"] < rows[1]["tokens_per_s_total"] < rows[2]["tokens_per_s_total"]


def test_prompt_len_adds_the_prefill_time(capsys):
    rows = run_json(capsys, "--batch", "1,4", "--prompt-len", "2048")
    assert all(r["prefill_time_s"] == rows[0]["prefill_time_s"] for r in rows)
    # a 2K-token prefill is compute-bound: ~2048 × 16 GFLOP at 60% of 989 TFLOPS ≈ 50 ms
    assert 0.03 < rows[0]["prefill_time_s"] < 0.08
    assert main([*SEED, "--prompt-len", "2048"]) == 0
    assert "prefill of a 2,048-token prompt" in capsys.readouterr().out


def test_compute_bound_batch_is_reported(capsys):
    rows = run_json(capsys, "--batch", "64,1024", "--context", "128")
    assert [r["bound"] for r in rows] == ["memory", "compute"]
    assert main([*SEED, "--batch", "64,1024", "--context", "128"]) == 0
    assert "compute-bound from batch" in capsys.readouterr().out


def test_efficiency_flags(capsys):
    default = run_json(capsys, "--batch", "1")[0]
    slower = run_json(capsys, "--batch", "1", "--bandwidth-fraction", "0.35", "--step-overhead", "0")[0]
    assert slower["step_time_s"] > 1.9 * default["step_time_s"]


def test_no_fit_check_shows_oversized_batches(capsys):
    rows = run_json(capsys, "--batch", "64,512", "--no-fit-check")
    assert [r["fits"] for r in rows] == [True, False]


def test_plot_writes_a_png(tmp_path: Path, capsys):
    path = tmp_path / "batching.png"
    assert main([*SEED, "--batch", "1,8,64", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*SEED, "--plot", str(tmp_path / "missing" / "x.png")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_model_from_an_hf_config_file(tmp_path: Path, capsys):
    config = {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert (
        main(["roofline", "--model", str(tmp_path / "config.json"), "--hardware", "h100-sxm", "--json", "--batch", "1"])
        == 0
    )
    from_file = json.loads(capsys.readouterr().out)[0]
    assert from_file["step_time_s"] == pytest.approx(run_json(capsys, "--batch", "1")[0]["step_time_s"])
    # sim and plan take the same --model forms (spec.model.resolve_model), plan's worker processes too
    load = ["--hardware", "h100-sxm", "--num-requests", "20", "--input-len", "128", "--output-len", "16", "--json"]
    assert main(["sim", "--model", str(tmp_path), *load, "--rate", "4"]) == 0
    by_path = json.loads(capsys.readouterr().out)
    assert main(["sim", "--model", "llama-3.1-8b", *load, "--rate", "4"]) == 0
    assert by_path["summary"] == json.loads(capsys.readouterr().out)["summary"]
    assert main(["plan", "--model", str(tmp_path / "config.json"), *load, "--slo-tpot", "50ms", "--workers", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["configs"][0]["output_tokens_per_s_per_device"] > 0


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "llama-9b", "--hardware", "h100-sxm"], "unknown model 'llama-9b'; choose one of: llama-3.1-8b"),
        (["--model", "llama-3.1-8b", "--hardware", "h900"], "unknown hardware 'h900'; choose one of: h100-sxm"),
        (
            ["--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--batch", "1,300"],
            "the limit at this context is batch 208",
        ),
        (["--model", "llama-3.1-405b", "--hardware", "h100-sxm"], "weights take 811.7 GB per device"),
        (["--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--tp", "3"], "tp=3 does not divide"),
        (["--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--batch", "1,x"], "--batch: 'x' is not an integer"),
        (["--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--context", "200000"], "maximum context of 131072"),
        (["--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--dtype", "fp4"], "unknown weight dtype 'fp4'"),
        (["--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--kv-cache-dtype", "int4"], "unknown KV-cache dtype"),
        (["--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--bandwidth-fraction", "2"], "bandwidth_fraction"),
        (["--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--batch", "1,,2"], "--batch: empty item in '1,,2'"),
        (
            ["--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--step-overhead=-1ms"],
            "--step-overhead: must be >= 0, got '-1ms'",
        ),
        (
            ["--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--engine-profile", "vlm"],
            "unknown engine profile 'vlm'",
        ),
        (
            ["--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--engine-profile", "trtllm", "--measured-kernels"],
            "--engine-profile and --measured-kernels each choose the end-to-end terms",
        ),
    ],
)
def test_bad_input_is_a_one_line_error_with_status_2(capsys, args, needle):
    assert main(["roofline", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("servelab roofline: error: ")
    assert needle in lines[0]


@pytest.mark.parametrize(
    "flag, content, needle",
    [
        (
            "--model",
            json.dumps(
                {
                    "model_type": "llama",
                    "hidden_size": 4096,
                    "intermediate_size": 14336,
                    "num_attention_heads": 0,
                    "num_hidden_layers": 32,
                    "vocab_size": 128256,
                    "max_position_embeddings": 131072,
                }
            ),
            "num_attention_heads must be a positive integer, got 0",
        ),
        ("--model", "[1]", "expected a JSON object"),
        ("--model", b"\xff\xfe\x00binary", "cannot read"),
        ("--profile", b"\xff\xfe\x00binary", "not JSON"),
    ],
)
def test_malformed_input_files_are_one_line_errors(tmp_path: Path, capsys, flag, content, needle):
    path = tmp_path / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    args = {"--model": "llama-3.1-8b", "--hardware": "h100-sxm", flag: str(path)}
    assert main(["roofline", *(x for item in args.items() for x in item)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("servelab roofline: error: ") and needle in lines[0]


def test_subprocess_exit_status_and_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "servelab", "roofline", "--model", "gpt-5", "--hardware", "h100-sxm"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "smollm2-135m" in proc.stderr


def test_catalog_commands_start_without_torch_or_numpy():
    code = (
        "import sys, io, contextlib\n"
        "from servelab.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    for argv in (['roofline', '--model', 'llama-3.1-8b', '--hardware', 'h100-sxm'], ['models'], ['hardware']):\n"
        "        assert main(argv) == 0\n"
        "print(sorted(m for m in ('torch', 'numpy', 'matplotlib') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_models_command(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "llama-3.1-8b" in out and "8.03 B" in out and "12.88 B" in out and "134.5 M" in out
    assert main(["models", "--json"]) == 0
    models = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert models["llama-3.1-70b"]["num_params"] == pytest.approx(70.6e9, rel=0.005)
    assert models["llama-3.1-8b"]["kv_bytes_per_token_bf16"] == 131_072
    assert models["mixtral-8x7b"]["num_experts"] == 8


def test_hardware_command(capsys):
    assert main(["hardware"]) == 0
    out = capsys.readouterr().out
    h100 = next(line for line in out.splitlines() if line.startswith("h100-sxm"))
    assert h100.split()[1:5] == ["80", "3.35", "989", "1,979"]
    assert main(["hardware", "--json"]) == 0
    hardware = {h["name"]: h for h in json.loads(capsys.readouterr().out)}
    assert hardware["h200"]["memory_bytes"] == 141e9
    assert 280 <= hardware["h100-sxm"]["ridge_flops_per_byte_bf16"] <= 310


def test_by_operator_splits_each_step(capsys):
    rows = run_json(capsys, "--batch", "1,128", "--context", "2048", "--prompt-len", "2048", "--by-operator")
    names = [o["name"] for o in rows[0]["operators"]]
    assert names == ["qkv_proj", "attention", "o_proj", "mlp", "lm_head"]
    for row in rows:
        assert sum(o["flops"] for o in row["operators"]) == pytest.approx(row["flops"], rel=1e-9)
        attention = row["operators"][1]
        assert attention["bound"] == "memory"
    # The matmuls' intensity grows with the batch; decode attention's does not.
    one, many = rows[0]["operators"], rows[1]["operators"]
    assert many[3]["arithmetic_intensity"] > 100 * one[3]["arithmetic_intensity"]
    assert many[1]["arithmetic_intensity"] == pytest.approx(one[1]["arithmetic_intensity"])
    assert all(o["bound"] == "compute" for o in rows[0]["prefill_operators"][:4])
    assert main([*SEED, "--batch", "1", "--by-operator"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(line.startswith("decode batch 1") and "attention" in line for line in lines)
    assert not any(line.startswith("prefill ") for line in lines)


def test_an_engine_profile_prices_with_its_presets_terms(capsys):
    """`roofline --engine-profile` reads the same terms `sim` and `plan` do with the same flag."""
    from servelab.cost import Efficiency, Roofline
    from servelab.sim.engine_profiles import engine_profile
    from servelab.spec import get_hardware, get_model

    def step_s(eff):
        return Roofline(get_model("llama-3.1-8b"), get_hardware("h100-sxm"), efficiency=eff).decode(64, 2048).time_s

    plain = run_json(capsys, "--batch", "64")[0]["step_time_s"]
    for name in ("servelab", "vllm", "trtllm"):
        row = run_json(capsys, "--batch", "64", "--engine-profile", name)[0]
        assert row["step_time_s"] == pytest.approx(step_s(engine_profile(name).efficiency() or Efficiency()), rel=1e-12)
    assert run_json(capsys, "--batch", "64", "--engine-profile", "servelab")[0]["step_time_s"] == plain
    assert run_json(capsys, "--batch", "64", "--engine-profile", "trtllm")[0]["step_time_s"] != plain


def test_the_gemm_tile_is_printed_where_the_part_measured_one(capsys):
    """H200's FP8 GEMMs compute 128-row tiles (a MoE expert's few rows round up to one); H100's
    BF16 fit found no step, so neither the line nor --json names a tile beyond 1."""
    moe = ["roofline", "--model", "mixtral-8x7b", "--hardware", "h200", "--dtype", "fp8", "--tp", "2", "--batch", "1"]
    assert main(moe) == 0
    assert "linear layers in tiles of 128 rows" in capsys.readouterr().out
    assert main([*moe, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["gemm_tile_tokens"] == 128
    assert main([*SEED, "--batch", "1"]) == 0
    assert "tiles of" not in capsys.readouterr().out
    assert run_json(capsys, "--batch", "1")[0]["gemm_tile_tokens"] == 1
