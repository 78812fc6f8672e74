"""/v1/embeddings in process over the tiny real model: vectors equal HF's one-pass final hidden
states pooled (short, chunked, prefix-cached, batched with generation), base64 decodes to the
same floats, every refusal is a 400 naming its field, and no KV block is left held."""

from __future__ import annotations

import base64
import concurrent.futures
import struct

import pytest
import torch
from fastapi.testclient import TestClient

from servelab.core.sequence import PoolingParams
from servelab.engine.llm_engine import EngineArgs, LLMEngine
from servelab.server.app import create_app

transformers = pytest.importorskip("transformers")

TOL = 1e-4


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def reference(hf, ids: list[int], pooling_type: str = "LAST", normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = hidden[-1] if pooling_type == "LAST" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def make_client(model_dir, pooler: PoolingParams | None = None, **knobs) -> tuple[TestClient, LLMEngine]:
    knobs = {"num_blocks": 64, "max_model_len": 512, "max_num_batched_tokens": 64, **knobs}
    engine = LLMEngine.from_args(EngineArgs.from_kwargs(model=str(model_dir), dtype="float32", **knobs))
    return TestClient(create_app(engine, pooler=pooler)), engine


def ids_of(n: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed))]


def assert_no_leak(engine: LLMEngine) -> None:
    bm = engine.scheduler.block_manager
    assert bm.num_used_blocks == 0 and engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0


def vectors(resp) -> list[torch.Tensor]:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return [torch.tensor(d["embedding"]) for d in body["data"]]


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_token_id_inputs_short_and_chunked_match_the_reference(tiny_model_dir, hf, pooling_type):
    client, engine = make_client(tiny_model_dir, PoolingParams(pooling_type))
    short, long = ids_of(20, 1), ids_of(300, 2)  # 300 tokens: 5 chunks of the 64-token budget
    with client:
        resp = client.post("/v1/embeddings", json={"input": [short, long], "model": engine.model_name})
        got = vectors(resp)
        assert resp.json()["usage"] == {"prompt_tokens": 320, "total_tokens": 320, "completion_tokens": 0}
        assert resp.json()["model"] == engine.model_name and resp.json()["id"].startswith("embd-")
        for vector, ids in zip(got, (short, long)):
            assert (vector - reference(hf, ids, pooling_type)).abs().max() <= TOL
            assert vector.norm() == pytest.approx(1.0, abs=1e-5)
        raw = client.post("/v1/embeddings", json={"input": long, "normalize": False}).json()["data"][0]["embedding"]
        assert (torch.tensor(raw) - reference(hf, long, pooling_type, normalize=False)).abs().max() <= TOL
    assert_no_leak(engine)


def test_text_inputs_base64_and_usage(tiny_model_dir, hf):
    client, engine = make_client(tiny_model_dir)
    texts = ["the cache is warm", "a much longer sentence about paged attention and the KV cache"]
    with client:
        ids = [client.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
        floats = vectors(client.post("/v1/embeddings", json={"input": texts}))
        body = client.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"}).json()
        assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
        for d, vector, one in zip(body["data"], floats, ids):
            raw = base64.b64decode(d["embedding"])
            decoded = torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw))
            assert decoded.shape == vector.shape
            assert (decoded - vector).abs().max() <= 1e-6  # float32 of the same vector (another run of it)
            assert (vector - reference(hf, one)).abs().max() <= TOL
        single = vectors(client.post("/v1/embeddings", json={"input": texts[0]}))[0]
        sagemaker = vectors(client.post("/invocations", json={"input": texts[0]}))[0]  # the body's shape picks the API
        assert (sagemaker - single).abs().max() <= TOL
        assert (single - floats[0]).abs().max() <= TOL  # alone, or batched with another: the same
    assert_no_leak(engine)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_prefix_caching_with_a_repeated_prefix(tiny_model_dir, hf, pooling_type):
    client, engine = make_client(tiny_model_dir, PoolingParams(pooling_type), enable_prefix_caching=True)
    prefix = ids_of(96, 3)
    inputs = [prefix + ids_of(10, 4), prefix + ids_of(30, 5)]
    with client:
        # a completion puts the prefix in the cache, then two embeddings share it
        assert client.post("/v1/completions", json={"prompt": prefix + [7], "max_tokens": 2}).status_code == 200
        hits_before = engine.scheduler.block_manager.prefix_cache_hits
        for one in inputs:
            assert (
                vectors(client.post("/v1/embeddings", json={"input": one}))[0] - reference(hf, one, pooling_type)
            ).abs().max() <= TOL
        hits = engine.scheduler.block_manager.prefix_cache_hits - hits_before
        assert hits == (0 if pooling_type == "MEAN" else 2 * 96)
    assert_no_leak(engine)


def test_batched_with_concurrent_generation(tiny_model_dir, hf):
    client, engine = make_client(tiny_model_dir, max_num_batched_tokens=48)
    prompt = ids_of(40, 6)
    completion = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    inputs = [ids_of(30 + 37 * i, 10 + i) for i in range(6)]
    with client:
        alone = client.post("/v1/completions", json=completion).json()["choices"][0]["text"]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            gens = [pool.submit(client.post, "/v1/completions", json=completion) for _ in range(2)]
            embs = [pool.submit(client.post, "/v1/embeddings", json={"input": one}) for one in inputs]
            for gen in gens:
                assert gen.result().json()["choices"][0]["text"] == alone
            for emb, one in zip(embs, inputs):
                assert (vectors(emb.result())[0] - reference(hf, one)).abs().max() <= TOL
    assert_no_leak(engine)


def _error(resp, status: int, param: str) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def test_refusals_name_the_field_and_leak_nothing(tiny_model_dir):
    client, engine = make_client(tiny_model_dir, max_model_len=128)
    with client:
        assert "dimensions" in _error(
            client.post("/v1/embeddings", json={"input": "hi", "dimensions": 8}), 400, "dimensions"
        )
        message = _error(client.post("/v1/embeddings", json={"input": ids_of(129, 7)}), 400, "input")
        assert "128" in message and "truncate_prompt_tokens" in message
        _error(client.post("/v1/embeddings", json={"input": [5, 100000]}), 400, "input")
        _error(client.post("/v1/embeddings", json={"input": []}), 400, "input")
        _error(client.post("/v1/embeddings", json={"input": "hi", "encoding_format": "int8"}), 400, "encoding_format")
        _error(client.post("/v1/embeddings", json={"input": "hi", "truncate_prompt_tokens": 129}), 400,
               "truncate_prompt_tokens")  # fmt: skip
        assert client.post("/v1/embeddings", json={"input": "hi", "model": "other"}).status_code == 404
        # truncation keeps the last tokens, as vLLM does
        long = ids_of(200, 8)
        truncated = vectors(client.post("/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 50}))[0]
        tail = vectors(client.post("/v1/embeddings", json={"input": long[-50:]}))[0]
        assert (truncated - tail).abs().max() <= TOL
        whole = client.post("/v1/embeddings", json={"input": ids_of(128, 9), "truncate_prompt_tokens": -1})
        assert whole.status_code == 200 and whole.json()["usage"]["prompt_tokens"] == 128
    assert_no_leak(engine)


def test_pooler_config_flag_parses_as_vllm_spells_it():
    from servelab.errors import InvalidArgument
    from servelab.server.embeddings import parse_pooler_config

    assert parse_pooler_config('{"pooling_type": "mean", "normalize": false}') == PoolingParams("MEAN", False)
    assert parse_pooler_config("{}") == PoolingParams("LAST", True)
    for bad, words in (('{"pooling_type": "CLS"}', "LAST, MEAN"), ('{"dimensions": 3}', "unknown key"),
                       ("MEAN", "not valid JSON"), ('{"normalize": "yes"}', "true or false")):  # fmt: skip
        with pytest.raises(InvalidArgument, match=words):
            parse_pooler_config(bad)


def test_unserved_pooling_routes_are_404s_naming_what_exists(tiny_model_dir):
    client, _ = make_client(tiny_model_dir)
    with client:
        for path in ("/score", "/rerank", "/v1/rerank", "/pooling", "/classify"):
            resp = client.post(path, json={"text_1": "a", "text_2": "b"})
            assert resp.status_code == 404
            assert "/v1/embeddings" in resp.json()["error"]["message"]
