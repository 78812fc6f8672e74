"""What calibrate --base-url learns from its bursts' first waves: the sequence limit at the
shortest prompts, and the KV cache's size where longer prompts ran fewer at a time."""

from __future__ import annotations

import pytest

from servelab.bench import blackbox as bb
from servelab.bench.blackbox import Results, ServerInfo, infer_kv_tokens, infer_max_seqs, server_settings

OUT = 32


def _burst(target: int, batch: int, wave: int, prompt_tokens: int | None = None, repeat: int = 0) -> dict:
    """`batch` requests of `target` prompt tokens (as the server counted them: `prompt_tokens`): `wave`
    run at once (0.1 s to 1.0 s, a step taking longer the more run), the rest start once the first
    of them ends."""
    requests = []
    step = (0.9 + 0.01 * wave) / (OUT - 1)
    for i in range(batch):
        start = 0.1 if i < wave else 1.2
        times = [start + k * step for k in range(OUT)]
        requests.append({"prompt_tokens": prompt_tokens or target, "tokens_from": "usage", "send_s": 0.0,
                         "output_tokens": OUT, "chunk_times_s": times})  # fmt: skip
    return {"phase": "burst", "batch": batch, "target": target, "repeat": repeat, "requests": requests}


def _results(waves: dict[tuple[int, int], int]) -> Results:
    return Results(None, [_burst(t, b, w) for (t, b), w in waves.items()])


def _server() -> ServerInfo:
    return ServerInfo("http://x/v1", "m", "unknown", None, 1024, {}, False)


def test_long_prompts_that_run_fewer_at_a_time_give_the_kv_size():
    # 8 slots; the KV holds 2 requests of 320 + 32 tokens but all 8 of 64 + 32.
    results = _results({(64, 4): 4, (64, 8): 8, (320, 4): 2, (320, 8): 2})
    assert infer_max_seqs(results)["value"] == 8  # the short prompts: KV never bound them
    kv = infer_kv_tokens(results, OUT)
    assert kv["value"] == 2 * (320 + OUT) and kv["at_most"] == 3 * (320 + OUT)
    settings = server_settings(_server(), {"value": None, "why": "-"}, infer_max_seqs(results), 400, kv)
    blocks = settings["num_blocks"]
    assert blocks["source"] == "inferred" and blocks["value"] == -(-2 * (320 + OUT) // 16)
    assert "filled the KV cache" in blocks["why"]


def test_without_a_kv_limit_it_says_what_the_cache_held_at_least():
    results = _results({(64, 4): 4, (320, 4): 4})
    kv = infer_kv_tokens(results, OUT)
    assert kv["value"] is None and kv["at_least"] == 4 * (320 + OUT)
    settings = server_settings(_server(), {"value": None, "why": "-"}, infer_max_seqs(results), 400, kv)
    assert settings["num_blocks"]["source"] == "assumed"
    assert f"it holds at least {4 * (320 + OUT)} tokens" in settings["num_blocks"]["why"]


def test_a_slot_limit_is_not_read_as_a_kv_limit():
    # 4 slots bind both prompt lengths alike: nothing about the KV.
    results = _results({(64, 8): 4, (320, 8): 4})
    assert infer_max_seqs(results)["value"] == 4
    assert infer_kv_tokens(results, OUT)["value"] is None


def test_no_bursts_no_inference():
    assert bb.infer_kv_tokens(Results(None, []), OUT)["value"] is None


def test_repeats_that_ran_different_waves_are_not_averaged_into_one_no_burst_ran():
    # Two repeats of a burst of 8: one ran all 8 at once, one 4 and then 4. No repeat ran 6.
    results = Results(None, [_burst(64, 8, 8), _burst(64, 8, 4, repeat=1)])
    assert infer_max_seqs(results)["value"] == 8  # a repeat showed the server running 8
    (decode,) = bb.observations(results, 0.0, None)
    assert decode.detail["wave"] == 8 and decode.detail["repeats"] == 1
    assert decode.time_s == pytest.approx((0.9 + 0.08) / (OUT - 1))  # the 8-wide repeat's step, alone
    # where most repeats agree, theirs is the wave
    results = Results(None, [_burst(64, 8, 4), _burst(64, 8, 4, repeat=1), _burst(64, 8, 8, repeat=2)])
    assert infer_max_seqs(results)["value"] == 4


def test_the_kv_size_counts_the_prompts_the_server_saw():
    # Prompts written for 320 tokens came out at 300: 2 requests of 300 + 32 filled the cache.
    results = Results(None, [_burst(64, 4, 4), _burst(64, 8, 8), _burst(320, 4, 2, 300), _burst(320, 8, 2, 300)])
    kv = infer_kv_tokens(results, OUT)
    assert kv["value"] == 2 * (300 + OUT) and kv["at_most"] == 3 * (300 + OUT), kv
    assert "requests of 332 tokens" in kv["why"]
