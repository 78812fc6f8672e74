"""A Qwen3 model (per-head q/k RMSNorm, off the native decode stack) served over HTTP: prefill in
one pass, chunked prefill (a 16-token step budget) and decodes, against transformers' greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from servelab.server.app import create_app
from tests.tiny_families import write_family

pytestmark = pytest.mark.slow  # loads a real (tiny) model
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = write_family(tmp_path_factory.mktemp("qwen3") / "qwen3", "qwen3", seed=3)
    return path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("budget", [2048, 16], ids=["one-pass-prefill", "chunked-prefill"])
def test_qwen3_completions_match_transformers(qwen3, budget):
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    path, hf = qwen3
    engine = LLMEngine.from_args(
        EngineArgs.from_kwargs(model=str(path), dtype="float32", num_blocks=64, max_num_batched_tokens=budget)
    )
    prompt = [int(t) for t in torch.randint(3, 500, (53,), generator=torch.Generator().manual_seed(7))]
    want = _hf_greedy(hf, prompt, 32)
    with TestClient(create_app(engine)) as client:
        body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        usage = r.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (53, 32)
        assert choice["text"] == engine.tokenizer.decode(want)
        streamed = ""
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    streamed += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        assert streamed == choice["text"]
