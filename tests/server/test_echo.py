"""Completions' echo + logprobs and vLLM's prompt_logprobs over HTTP, on a real tiny model in fp32:
the way evaluation harnesses score a continuation's loglikelihood."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from servelab.server.app import create_app

pytestmark = pytest.mark.slow  # loads a real (tiny) model


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine.from_args(EngineArgs.from_kwargs(model=str(tiny_model_dir), dtype="float32", num_blocks=64,
                                            max_num_batched_tokens=16))  # chunked prefill  # fmt: skip
    with TestClient(create_app(engine)) as client:
        yield client, engine


def _reference(engine, ids: list[int]) -> torch.Tensor:
    from tests.tiny_models import prefill_logits

    return torch.log_softmax(prefill_logits(engine.executor.model, ids).float(), dim=-1)


PROMPT = "The quick brown fox jumps over the lazy dog and the cache is fast"


def test_echo_with_max_tokens_0_scores_the_prompt(served):
    client, engine = served
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    body = client.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 0}).json()
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    assert lp["tokens"] == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = _reference(engine, ids)
    want = [ref[p, ids[p + 1]].item() for p in range(len(ids) - 1)]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    # the prompt's own token with its logprob, then the top 2: up to 3 entries (OpenAI, vLLM)
    assert all(
        len(top) <= 3 and top[t] == v
        for t, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:])
    )
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # the loglikelihood of a continuation: the sum over its tokens
    assert sum(lp["token_logprobs"][-5:]) == pytest.approx(sum(want[-5:]), abs=1e-4)


def test_echo_with_generation_streams_the_prompt_first(served):
    client, _ = served
    body = {
        "prompt": PROMPT,
        "echo": True,
        "logprobs": 0,
        "max_tokens": 3,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    resp = client.post("/v1/completions", json=body)
    chunks = [json.loads(e[6:]) for e in resp.text.split("\n\n") if e.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    plain = client.post("/v1/completions", json={**body, "stream": False}).json()["choices"][0]
    assert text.startswith(PROMPT) and text == plain["text"]
    n_prompt = client.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == n_prompt + 3 == len(plain["logprobs"]["tokens"])


def test_vllm_prompt_logprobs_on_completions_and_chat(served):
    client, engine = served
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1}).json()
    plp = body["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    ref = _reference(engine, ids)
    for p, entry in enumerate(plp[1:]):
        own = entry[str(ids[p + 1])]
        assert own["logprob"] == pytest.approx(ref[p, ids[p + 1]].item(), abs=1e-4)
        assert own["rank"] == int((ref[p] > ref[p, ids[p + 1]]).sum()) + 1
        assert any(v["rank"] == 1 for v in entry.values())
    messages = [{"role": "user", "content": "hello there"}]
    n_chat = client.post("/tokenize", json={"messages": messages}).json()["count"]
    chat = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "prompt_logprobs": 0}
    ).json()
    assert len(chat["prompt_logprobs"]) == n_chat and chat["prompt_logprobs"][0] is None


def test_scoring_errors_name_the_field(served):
    client, _ = served
    err = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}).json()["error"]
    assert err["param"] == "max_tokens" and "echo" in err["message"]
    err = client.post("/v1/completions", json={"prompt": "x", "prompt_logprobs": 1, "stream": True}).json()["error"]
    assert err["param"] == "prompt_logprobs"
    err = client.post("/v1/completions", json={"prompt": "x", "prompt_logprobs": 30}).json()["error"]
    assert err["param"] == "prompt_logprobs" and "30" in err["message"]


def test_echo_with_max_tokens_0_finishes_with_length_even_if_the_dropped_token_is_eos(served):
    client, engine = served
    eos = engine.tokenizer.eos_token_ids[0]
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logit_bias": {str(eos): 100}}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"


def _post(client, body: dict) -> dict:
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(client, body: dict) -> dict[int, dict]:
    """Per choice: its text and its logprobs lists, concatenated over the stream."""
    resp = client.post("/v1/completions", json={**body, "stream": True})
    out: dict[int, dict] = {}
    for event in resp.text.split("\n\n"):
        if not event.startswith("data: {"):
            continue
        for c in json.loads(event[6:])["choices"]:
            acc = out.setdefault(c["index"], {"text": "", "tokens": [], "token_logprobs": [], "text_offset": []})
            acc["text"] += c["text"]
            for key in ("tokens", "token_logprobs", "text_offset"):
                acc[key] += (c["logprobs"] or {}).get(key, [])
    return out


def test_n_choices_score_their_prompt_once(served, monkeypatch):
    from servelab.engine import model_executor

    client, _ = served
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    scored_rows: list[int] = []
    real = model_executor._score_prompt

    def counting(logits, entries, scored):
        scored_rows.append(sum(n for _, _, n in scored))
        return real(logits, entries, scored)

    monkeypatch.setattr(model_executor, "_score_prompt", counting)
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 2, "temperature": 1.0, "seed": 5}
    one = _post(client, {**body, "prompt_logprobs": 1})["choices"][0]
    assert sum(scored_rows) == len(ids) - 1
    scored_rows.clear()
    three = _post(client, {**body, "prompt_logprobs": 1, "n": 3})["choices"]
    assert sum(scored_rows) == len(ids) - 1  # once, not once per choice
    # the same values, to fp32 noise (the batches differ)
    want = [{t: v["logprob"] for t, v in entry.items()} for entry in one["prompt_logprobs"][1:]]
    for c in three:
        assert c["prompt_logprobs"][0] is None
        got = [{t: v["logprob"] for t, v in entry.items()} for entry in c["prompt_logprobs"][1:]]
        assert [sorted(g) for g in got] == [sorted(w) for w in want]
        assert [g[t] for g in got for t in sorted(g)] == pytest.approx(
            [w[t] for w in want for t in sorted(w)], abs=1e-4
        )
        for key in ("tokens", "text_offset"):
            assert c["logprobs"][key][: len(ids)] == one["logprobs"][key][: len(ids)]
        assert c["logprobs"]["token_logprobs"][1 : len(ids)] == pytest.approx(
            one["logprobs"]["token_logprobs"][1 : len(ids)], abs=1e-4
        )
    scored_rows.clear()
    streamed = _streamed(client, {**body, "n": 3})
    assert sum(scored_rows) == len(ids) - 1 and sorted(streamed) == [0, 1, 2]
    for c in streamed.values():
        assert c["tokens"][: len(ids)] == one["logprobs"]["tokens"][: len(ids)]
        assert c["token_logprobs"][1 : len(ids)] == pytest.approx(
            one["logprobs"]["token_logprobs"][1 : len(ids)], abs=1e-4
        )


def test_text_offsets_agree_between_stream_and_whole_answer_across_split_characters(served):
    client, engine = served
    prompt = "Smile \U0001f642 ok \u00e9t\u00e9"
    ids = client.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    pieces = [engine.tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in piece for piece in pieces), "the prompt should split a character over tokens"
    answer = "\U0001f642\u00e9\U0001f642"
    body = {"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 16, "temperature": 0,
            "structured_outputs": {"choice": [answer]}}  # fmt: skip
    whole = _post(client, body)["choices"][0]
    streamed = _streamed(client, body)[0]
    text, lp = whole["text"], whole["logprobs"]
    assert text == prompt + answer == streamed["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert streamed[key] == lp[key], key
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[len(ids)] == len(prompt)
    assert all(0 <= o <= len(text) for o in offsets)
    for token, offset in zip(lp["tokens"], offsets):  # a whole token's text starts at its offset
        if "\ufffd" not in token and token not in engine.tokenizer.special_token_ids:  # the EOS adds no text
            assert text[offset : offset + len(token)] == token


def _generation_tokens(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("servelab:generation_tokens_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no servelab:generation_tokens_total in /metrics")


def test_echo_with_max_tokens_0_counts_no_generated_token(served):
    client, _ = served
    before = _generation_tokens(client)
    _post(client, {"prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 0})
    assert _generation_tokens(client) == before
    _post(client, {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True})
    assert _generation_tokens(client) == before + 2


@pytest.mark.parametrize("k", [0, 1])
def test_a_sampled_token_is_always_among_its_top_logprobs(served, k):
    # OpenAI's legacy completions (and vLLM) return the sampled token's logprob at every position,
    # with the top k beside it: a harness indexes top_logprobs[i][tokens[i]].
    client, _ = served
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.5, "seed": 3, "logprobs": k, "ignore_eos": True}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert all(
        top[t] == v and len(top) <= k + 1 for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])
    )
    assert any(max(top.values()) > v for v, top in zip(lp["token_logprobs"], lp["top_logprobs"])) or k == 0
