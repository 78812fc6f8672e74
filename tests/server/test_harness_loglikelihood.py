"""lm-evaluation-harness's `local-completions` loglikelihood requests, replayed over HTTP and
compared with the engine's own offline scoring of the same tokens.

The harness sends prompt = context + continuation (token ids, or text), echo=true,
max_tokens=1, logprobs=1, temperature=0; it takes sum(token_logprobs[ctxlen:-1]) and is_greedy
from top_logprobs over the same slice. The slice assumes prompt_len + 1 entries: the prompt's
and the one generated token's, whatever that token is, EOS included.
"""

from __future__ import annotations

import json
from operator import itemgetter

import pytest
import torch
from fastapi.testclient import TestClient

from servelab.server.app import create_app

pytestmark = pytest.mark.slow  # loads a real (tiny) model

CONTEXTS = [
    ("The capital of france is", " paris"),
    ("One two three", " four five"),
    ("The quick brown fox jumps over the", " lazy dog"),
    ("Hello world what is the", " cache"),
]


def _engine(model_dir):
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    return LLMEngine.from_args(EngineArgs.from_kwargs(model=str(model_dir), dtype="float32", num_blocks=64))


def _log_softmax(engine, ids: list[int]) -> torch.Tensor:
    from tests.tiny_models import prefill_logits

    return torch.log_softmax(prefill_logits(engine.executor.model, ids).float(), dim=-1)


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """A tiny model whose greedy next token after CONTEXTS[0]'s context + continuation is EOS:
    its EOS row of lm_head is twice the row of the token that wins there, so EOS wins instead."""
    from safetensors.torch import load_file, save_file

    from tests.tiny_models import write_tiny_llama

    model_dir = write_tiny_llama(tmp_path_factory.mktemp("eos-model") / "tiny-llama")
    engine = _engine(model_dir)
    context, continuation = CONTEXTS[0]
    ids = engine.tokenizer.encode_prompt(context + continuation)
    logits = _log_softmax(engine, ids)[-1]
    winner = int(logits.argmax())
    eos = engine.tokenizer.eos_token_ids[0]
    tensors = load_file(str(model_dir / "model.safetensors"))
    raw = tensors["lm_head.weight"]
    tensors["lm_head.weight"] = raw.clone()
    tensors["lm_head.weight"][eos] = 2.0 * raw[winner]
    save_file(tensors, str(model_dir / "model.safetensors"))
    return model_dir


@pytest.fixture(scope="module")
def served(eos_model):
    engine = _engine(eos_model)
    with TestClient(create_app(engine)) as client:
        yield client, engine


def _harness_requests(tokenizer) -> list[tuple[list[int], list[int]]]:
    # As the harness encodes them: the context alone, and the continuation as the rest of the whole.
    out = []
    for context, continuation in CONTEXTS:
        whole = tokenizer.encode_prompt(context + continuation)
        context_ids = tokenizer.encode_prompt(context)
        assert whole[: len(context_ids)] == context_ids
        out.append((context_ids, whole[len(context_ids) :]))
    return out


def _parse_logprobs(body: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's LocalCompletionsAPI.parse_logprobs, as it reads the answer."""
    res = []
    for choice, ctxlen in zip(sorted(body["choices"], key=itemgetter("index")), ctxlens):
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = True
        for tok, top in zip(tokens_logprobs, top_logprobs):
            if tok != max(top.values()):
                is_greedy = False
                break
        res.append((logprobs, is_greedy))
    return res


def _offline(engine, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The engine's own scoring: each continuation token's logprob after everything before it."""
    ids = context + continuation
    logprobs = _log_softmax(engine, ids)
    positions = range(len(context) - 1, len(ids) - 1)
    total = sum(logprobs[p, ids[p + 1]].item() for p in positions)
    greedy = all(int(logprobs[p].argmax()) == ids[p + 1] for p in positions)
    return total, greedy


def _harness_body(prompt) -> dict:
    return {"model": "tiny-llama", "prompt": prompt, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}  # fmt: skip


def test_the_model_stops_after_the_first_request(served):
    """The premise: greedy decoding after CONTEXTS[0] is EOS."""
    client, engine = served
    context, continuation = _harness_requests(engine.tokenizer)[0]
    logprobs = _log_softmax(engine, context + continuation)
    assert int(logprobs[-1].argmax()) in engine.tokenizer.eos_token_ids
    body = client.post("/v1/completions", json={"prompt": context + continuation, "max_tokens": 4, "temperature": 0})
    assert body.json()["choices"][0]["finish_reason"] == "stop"


def test_token_prompts_score_as_the_engine_does(served):
    client, engine = served
    requests = _harness_requests(engine.tokenizer)
    body = client.post("/v1/completions", json=_harness_body([c + x for c, x in requests])).json()
    for choice, (context, continuation) in zip(sorted(body["choices"], key=itemgetter("index")), requests):
        assert len(choice["logprobs"]["token_logprobs"]) == len(context) + len(continuation) + 1
    got = _parse_logprobs(body, [len(c) for c, _ in requests])
    for (total, greedy), (context, continuation) in zip(got, requests):
        want_total, want_greedy = _offline(engine, context, continuation)
        assert total == pytest.approx(want_total, abs=1e-4) and greedy == want_greedy
    assert got[0][1] is not None and body["choices"][0]["logprobs"]["tokens"][-1] == engine.tokenizer.eos_token


def test_text_prompts_score_as_the_engine_does(served):
    client, engine = served
    requests = _harness_requests(engine.tokenizer)
    for (context_text, continuation_text), (context, continuation) in zip(CONTEXTS, requests):
        body = client.post("/v1/completions", json=_harness_body(context_text + continuation_text)).json()
        [(total, greedy)] = _parse_logprobs(body, [len(context)])
        want_total, want_greedy = _offline(engine, context, continuation)
        assert total == pytest.approx(want_total, abs=1e-4) and greedy == want_greedy


def test_streamed_echo_logprobs_stay_aligned(served):
    """Streamed: the same entries, text offsets, tokens and top logprobs as the one answer."""
    client, engine = served
    context, continuation = _harness_requests(engine.tokenizer)[0]
    body = _harness_body(context + continuation)
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    resp = client.post("/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(e[6:]) for e in resp.text.split("\n\n") if e.startswith("data: {")]
    merged: dict[str, list] = {"text_offset": [], "tokens": [], "token_logprobs": [], "top_logprobs": []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for key in merged:
                merged[key] += (choice["logprobs"] or {}).get(key, [])
    assert merged == whole["logprobs"]
    n = len(context) + len(continuation) + 1
    assert all(len(v) == n for v in merged.values())
    assert merged["text_offset"][-1] == len(whole["text"])  # the EOS adds no text
