"""Model families served over HTTP through the in-process client, from their HF directory and
their GGUF file: Qwen3 (per-head q/k RMSNorm, off the native decode stack), Gemma 3 (8-token
sliding windows on five of six layers, soft-capped) and Mixtral (8 experts, top-2). Prefill in one
pass, chunked prefill (a 16-token step budget, so the 53-token prompt crosses chunks and every
window) and decodes past the window, against transformers' greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from servelab.server.app import create_app
from servelab.spec.kv_groups import KVGroups
from servelab.spec.model import ModelSpec
from tests.tiny_families import GEMMA_WINDOW, write_family, write_gguf

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

PROMPT = [int(t) for t in torch.randint(3, 500, (53,), generator=torch.Generator().manual_seed(7))]
MAX_TOKENS = 32
TOP = 5
assert len(PROMPT) > 6 * GEMMA_WINDOW and MAX_TOKENS > 2 * GEMMA_WINDOW  # crosses chunks and windows


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "mixtral"])
def family(request, tmp_path_factory):
    name = request.param
    path = write_family(tmp_path_factory.mktemp(name) / name, name, seed=3)
    gguf_path = write_gguf(path, path.parent / f"{name}.gguf")
    # eager attention: the implementation that soft-caps Gemma's scores
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = hf.eval().generate(
            torch.tensor([PROMPT]),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(PROMPT) :].tolist()
    # each step's five most likely tokens' logprobs: a tiny random model's greedy token can be so
    # sure that its own logprob (~0) would not show a wrong attention; the runners-up do
    top = [torch.log_softmax(step[0], -1).topk(TOP).values.tolist() for step in out.logits]
    return {"safetensors": path, "gguf": gguf_path}, tokens, top


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("budget", [2048, 16], ids=["one-pass-prefill", "chunked-prefill"])
def test_completions_match_transformers(family, fmt, budget):
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    paths, want, want_top = family
    # the memory of 64 blocks of every layer: Gemma 3's pages hold one KV group's layers (one in six)
    num_blocks = KVGroups.of_model(ModelSpec.from_gguf(paths["gguf"])).pages_in(64)
    engine = LLMEngine.from_args(
        EngineArgs.from_kwargs(
            model=str(paths[fmt]), dtype="float32", num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget
        )
    )
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": TOP}
    with TestClient(create_app(engine)) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPT), MAX_TOKENS)
        assert choice["text"] == engine.tokenizer.decode(want)
        assert choice["logprobs"]["tokens"] == [engine.tokenizer.decode([t]) for t in want]
        # (two ids that decode to one string share a key: a step may show fewer than TOP)
        for got, expected in zip(choice["logprobs"]["top_logprobs"], want_top, strict=True):
            assert got and all(min(abs(v - e) for e in expected) < 1e-4 for v in got.values()), (got, expected)
        streamed = ""
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    streamed += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        assert streamed == choice["text"]
    # Every request finished and gave its KV blocks back.
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
