"""benchmarks/engine_cuda.py without a GPU: its pass/fail criteria on made-up answers, and the whole
script on the CPU (`--device cpu`) over a tiny random model, where the device engine is the
reference itself and must match it exactly."""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny_models import write_tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import engine_cuda  # noqa: E402


def _answer(logprobs, top1, tokens):
    return {"logprobs": logprobs, "top1": top1, "tokens": tokens}


REF = [_answer([-1.0, -2.0, -0.5, -3.0], [5, 6, 7, 8], [1, 2, 3, 4])]


def test_identical_answers_pass_the_exact_criteria():
    got = engine_cuda.compare(REF, REF, exact=True)
    assert got["passed"] and got["max_logprob_diff"] == 0 and got["greedy_tokens_same"] == [4]


def test_exact_criteria_fail_on_a_logprob_or_a_token():
    off = engine_cuda.compare(REF, [_answer([-1.0, -2.002, -0.5, -3.0], [5, 6, 7, 8], [1, 2, 3, 4])], exact=True)
    assert not off["passed"] and off["max_logprob_diff"] == pytest.approx(0.002)
    diverged = engine_cuda.compare(REF, [_answer([-1.0, -2.0, -0.5, -3.0], [5, 6, 7, 8], [1, 2, 9, 4])], exact=True)
    assert not diverged["passed"] and diverged["greedy_tokens_same"] == [2]


def test_sixteen_bit_criteria_allow_drift_but_not_disagreement():
    drift = _answer([-1.1, -2.2, -0.4, -3.3], [5, 6, 7, 8], [1, 2, 9, 9])  # diverges later: allowed
    assert engine_cuda.compare(REF, [drift], exact=False)["passed"]
    disagree = _answer([-1.1, -2.2, -0.4, -3.3], [5, 0, 7, 8], [1, 2, 3, 4])  # 75% top-1
    assert not engine_cuda.compare(REF, [disagree], exact=False)["passed"]
    far = _answer([-1.0, -2.0, -0.5, -4.0], [5, 6, 7, 8], [1, 2, 3, 4])  # one logprob 1.0 off
    assert not engine_cuda.compare(REF, [far], exact=False)["passed"]


def test_the_script_runs_on_the_cpu(tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny")
    rc = engine_cuda.main(
        [
            "--device",
            "cpu",
            "--model",
            str(model),
            "--batch",
            "4",
            "--new-tokens",
            "8",
            "--rounds",
            "1",
            "--probe-bytes",
            str(1 << 24),
            "--json",
        ]
    )
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert rc == 0 and "PASS" in out
    assert result["check"]["passed"] and result["check"]["max_logprob_diff"] == 0
    assert result["check"]["greedy_tokens_same"] == [16] * engine_cuda.PROMPTS
    for metric in ("decode_b1", "decode_b4"):
        m = result["metrics"][metric]
        assert m["tok_per_s"] > 0 and 0 < m["of_measured_bandwidth"] < 10 and m["of_datasheet_bandwidth"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_no_cuda_device_is_a_clear_error():
    with pytest.raises(SystemExit, match="sees no CUDA device"):
        engine_cuda.main(["--device", "cuda"])


def test_the_twin_has_the_models_tensors_and_runs(tmp_path, capsys):
    """--twin: the description's config and tokenizer, random weights of the very names and
    shapes the model's own checkpoint has (what a device machine runs on, without the GGUF)."""
    from safetensors import safe_open

    model = write_tiny_llama(tmp_path / "tiny", tie_embeddings=True)
    description = tmp_path / "description"
    description.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (description / name).write_bytes((model / name).read_bytes())
    twin = engine_cuda.write_twin(description, tmp_path / "twin")
    with (
        safe_open(str(model / "model.safetensors"), "pt") as real,
        safe_open(str(twin / "model.safetensors"), "pt") as ours,
    ):
        assert sorted(real.keys()) == sorted(ours.keys())
        for name in real.keys():
            assert real.get_slice(name).get_shape() == ours.get_slice(name).get_shape(), name
            assert ours.get_slice(name).get_dtype() == "BF16"
    rc = engine_cuda.main(
        [
            "--device",
            "cpu",
            "--twin",
            str(description),
            "--batch",
            "2",
            "--new-tokens",
            "4",
            "--rounds",
            "1",
            "--probe-bytes",
            str(1 << 24),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "a twin of" in out and "PASS" in out
