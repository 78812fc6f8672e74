"""benchmarks/vidur_extract.py on a small git repository laid out like microsoft/vidur (a few rows
of each CSV it reads, at two commits as upstream): the rows it keeps, converted to seconds."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vidur_extract  # noqa: E402

MODEL = {"n_head": 32, "n_kv_head": 32, "n_embd": 4096, "n_expanded_embd": 11008, "vocab_size": 32768}
OPS = vidur_extract.LINEAR_OPS
TOPOLOGIES = ("a100_pairwise_nvlink", "a100_dgx", "h100_pairwise_nvlink", "h100_dgx")


def _csv(root: Path, path: str, rows: list[dict]) -> None:
    out = root / path
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _commit(root: Path, message: str) -> str:
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", message], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()


def _mlp_row(tokens: int, tp: int, ms: float) -> dict:
    # Vidur's columns: min/median per op, the model's dimensions, the step's tokens and TP
    times = {f"time_stats.{op}.{s}": ms * (i + 1) for i, op in enumerate(OPS) for s in ("min", "median")}
    return {**times, **MODEL, "use_gated_mlp": "True", "num_tokens": tokens, "num_tensor_parallel_workers": tp}


@pytest.fixture
def clone(tmp_path) -> tuple[Path, str, str]:
    root = tmp_path / "vidur"
    root.mkdir()
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    attention = [
        {"batch_size": 1, "kv_cache_size": 0, "is_prefill": "True", "prefill_chunk_size": 512,
         "time_stats.attn_prefill.median": 0.5, "time_stats.attn_decode.median": "", "n_embd": 4096,
         "n_q_head": 32, "n_kv_head": 32, "num_tensor_parallel_workers": 1},
        {"batch_size": 1, "kv_cache_size": 0, "is_prefill": "True", "prefill_chunk_size": 500,
         "time_stats.attn_prefill.median": 0.49, "time_stats.attn_decode.median": "", "n_embd": 4096,
         "n_q_head": 32, "n_kv_head": 32, "num_tensor_parallel_workers": 1},
        {"batch_size": 8, "kv_cache_size": 1024, "is_prefill": "False", "prefill_chunk_size": 0,
         "time_stats.attn_prefill.median": "", "time_stats.attn_decode.median": 0.125, "n_embd": 4096,
         "n_q_head": 32, "n_kv_head": 32, "num_tensor_parallel_workers": 1},
        {"batch_size": 7, "kv_cache_size": 1024, "is_prefill": "False", "prefill_chunk_size": 0,
         "time_stats.attn_prefill.median": "", "time_stats.attn_decode.median": 0.12, "n_embd": 4096,
         "n_q_head": 32, "n_kv_head": 32, "num_tensor_parallel_workers": 1},
    ]  # fmt: skip
    _csv(root, vidur_extract.ATTENTION_AT[1], attention)
    overheads = [
        {"model_name": "meta-llama/Llama-2-7b-hf", "batch_size": b, "tensor_parallel_degree": 1,
         "schedule_median": 0.25 * b, "sampler_e2e_median": 0.5, "prepare_inputs_e2e_median": 1.0,
         "process_model_outputs_median": 0.125}
        for b in (1, 32)
    ]  # fmt: skip
    _csv(root, vidur_extract.CPU_OVERHEADS_AT[1], overheads)
    old = _commit(root, "attention and host overheads")
    for gpu in ("a100", "h100", "a40"):  # a40 is not kept
        rows = [_mlp_row(1, 1, 0.01), _mlp_row(3, 1, 0.02), _mlp_row(128, 2, 0.05)]
        _csv(root, f"data/profiling/compute/{gpu}/meta-llama/Llama-2-7b-hf/mlp.csv", rows)
    for topology in TOPOLOGIES:
        for op in ("all_reduce", "send_recv"):
            rows = [
                {"num_workers": 2, "devices_per_node": 2, "size": size, f"time_stats.{op}.median": ms}
                for size, ms in ((1024, 0.01), (1536, 0.011), (2048, 0.012), (2048, 0.012), (3072, 0.02))
            ]
            _csv(root, f"data/profiling/network/{topology}/{op}.csv", rows)
    new = _commit(root, "compute and network")
    return root, old, new


def test_vidur_extract_keeps_the_subsample_in_seconds(clone, tmp_path, capsys):
    root, old, new = clone
    out = tmp_path / "vidur_profiles.json"
    vidur_extract.main([str(root), "--attention-commit", old, "--cpu-overheads-commit", old, "--out", str(out)])
    assert f"wrote {out}" in capsys.readouterr().out
    data = json.loads(out.read_text())
    linear = data["linear"]
    assert [(t["gpu"], t["model"]) for t in linear] == [("a100", "meta-llama/Llama-2-7b-hf"),
                                                         ("h100", "meta-llama/Llama-2-7b-hf")]  # fmt: skip
    assert linear[0]["source"] == {
        "repo": "microsoft/vidur",
        "commit": new,
        "path": "data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv",
    }
    # (N, K) per device from the model's dimensions; 3 tokens is off the geometric subsample
    shapes = {1: {"attn_pre_proj": (12288, 4096), "attn_post_proj": (4096, 4096), "mlp_up_proj": (22016, 4096),
                  "mlp_down_proj": (4096, 11008)},
              2: {"attn_pre_proj": (6144, 4096), "attn_post_proj": (4096, 2048), "mlp_up_proj": (11008, 4096),
                  "mlp_down_proj": (4096, 5504)}}  # fmt: skip
    expected = sorted(
        [op, m, *shapes[tp][op], tp, pytest.approx(ms * (i + 1) * 1e-3)]
        for m, tp, ms in ((1, 1, 0.01), (128, 2, 0.05))
        for i, op in enumerate(OPS)
    )
    assert linear[0]["rows"] == expected and linear[1]["rows"] == expected
    (attention,) = data["attention"]
    assert attention["source"]["commit"] == old and attention["config"] == {
        "n_embd": 4096, "n_q_head": 32, "n_kv_head": 32, "num_tensor_parallel_workers": 1}  # fmt: skip
    assert attention["rows"] == [["decode", 8, 1, 1024, pytest.approx(0.125e-3)],
                                 ["prefill", 1, 512, 0, pytest.approx(0.5e-3)]]  # fmt: skip
    network = data["network"]
    assert [(t["topology"], t["op"]) for t in network] == [
        (t, op) for t in TOPOLOGIES for op in ("all_reduce", "send_recv")
    ]
    for table in network:  # powers of two (and 2048) only, each once
        assert table["rows"] == [[2, 2, 1024, pytest.approx(0.01e-3)], [2, 2, 2048, pytest.approx(0.012e-3)]]
    (overheads,) = data["cpu_overheads"]
    assert overheads["columns"] == ["model", "batch", "tp", "schedule_s", "sampler_e2e_s", "prepare_inputs_e2e_s",
                                    "process_model_outputs_s"]  # fmt: skip
    assert overheads["rows"] == [
        ["meta-llama/Llama-2-7b-hf", b, 1, pytest.approx(0.25e-3 * b), pytest.approx(0.5e-3), pytest.approx(1e-3),
         pytest.approx(0.125e-3)]
        for b in (1, 32)
    ]  # fmt: skip


def test_vidur_extract_names_what_a_clone_lacks(clone, tmp_path):
    root, old, new = clone
    with pytest.raises(
        SystemExit, match=r"has no data/profiling/a100/attention.csv at .* \(a clone of microsoft/vidur\?\)"
    ):
        vidur_extract.main([str(root), "--out", str(tmp_path / "x.json")])  # upstream's commits are not here
    assert not (tmp_path / "x.json").exists()
