"""benchmarks/accuracy.py on a tiny random model: every path scored against the fp32 reference,
with metrics that hold for any two distributions, and the shipped text long enough for the
default run."""

import sys
from pathlib import Path

import pytest
import torch

from tests.tiny_models import write_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import accuracy  # noqa: E402


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    model = write_tiny_llama(tmp_path_factory.mktemp("acc") / "tiny")
    return accuracy.run(
        str(model), list(accuracy.PATHS), tokens=64, window=64, llama_python=None, threads=1, quiet=True
    )


def test_every_path_is_scored_on_the_same_tokens(result):
    paths = result["paths"]
    assert list(paths) == list(accuracy.PATHS) and result["scored_tokens"] == 64
    assert all(p["tokens"] == 64 and p["perplexity"] > 1 for p in paths.values())
    ref = paths["fp32"]
    assert "kl_mean" not in ref
    for name, p in paths.items():
        if name == "fp32":
            continue
        assert 0 <= p["kl_median"] <= p["kl_p99"] <= p["kl_max"] and p["kl_mean"] <= p["kl_max"]
        assert 0 < p["top1_agreement"] <= 1
        assert p["perplexity_delta_pct"] == pytest.approx(100 * (p["perplexity"] / ref["perplexity"] - 1))


def test_lossier_paths_diverge_more(result):
    paths = result["paths"]
    # fp16 keeps 3 more mantissa bits than bf16 in the cache; int8 rounds weights and activations.
    assert paths["kv-fp16"]["kl_mean"] < paths["kv-bf16"]["kl_mean"] < paths["quant-int8"]["kl_mean"]


def test_the_reference_scored_against_itself_is_exact():
    s = accuracy.Score()
    logp = torch.log_softmax(torch.randn(8, 32), -1)
    s.add(logp, logp, torch.randint(0, 32, (8,)))
    r = s.summary(ref_ppl=1.0)
    assert r["kl_max"] == 0 and r["top1_agreement"] == 1


def test_the_text_covers_the_default_run():
    from servelab.engine.bundled import bundled_model_path

    if not bundled_model_path().exists():
        pytest.skip("the bundled model is not installed")
    from servelab.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(bundled_model_path())
    assert len(tok.encode(accuracy.TEXT.read_text())) >= 20000 + 512  # 79 windows of 512, half of each scored


def test_an_unknown_path_is_refused_by_name(capsys):
    assert accuracy.main(["--paths", "fp64"]) == 2
    assert "unknown path(s) fp64" in capsys.readouterr().err
