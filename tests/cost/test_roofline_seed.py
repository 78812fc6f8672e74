"""The seed's figures for Llama 3.1 8B in BF16 on an H100 SXM, and its qualitative claims."""

from itertools import pairwise

import pytest

from servelab.cost import Roofline
from servelab.spec import get_hardware, get_model


@pytest.fixture(scope="module")
def roofline() -> Roofline:
    return Roofline(get_model("llama-3.1-8b"), get_hardware("h100-sxm"))


def test_streaming_the_weights_once_takes_4_8_ms_at_peak(roofline):
    assert roofline.weight_stream_time_s == pytest.approx(4.8e-3, rel=0.05)


def test_one_token_of_compute_at_batch_1_takes_0_016_ms_at_peak(roofline):
    assert roofline.token_compute_time_s == pytest.approx(0.016e-3, rel=0.10)
    # the step breakdown carries the same peak figure beside the predicted one
    step = roofline.decode(1, 128)
    assert step.peak_compute_time_s == pytest.approx(0.016e-3, rel=0.10)
    assert step.compute_time_s > step.peak_compute_time_s
    assert step.memory_time_s > step.peak_memory_time_s
    # the bytes a batch-1 step moves are the weights (less the gathered embedding table) plus a little KV
    assert step.peak_memory_time_s == pytest.approx(roofline.weight_stream_time_s, rel=0.07)


@pytest.mark.parametrize("context", [1, 128, 2048])
def test_batch_1_intensity_is_about_1_against_a_ridge_near_300(roofline, context):
    step = roofline.decode(1, context)
    assert 0.8 <= step.arithmetic_intensity <= 1.2
    assert 280 <= step.ridge_flops_per_byte <= 310
    assert step.bound == "memory"


@pytest.mark.parametrize("context", [1, 2048])
def test_batch_1_decode_predicts_about_150_tokens_per_s(roofline, context):
    assert 135 <= 1 / roofline.decode(1, context).time_s <= 165


def test_batch_64_at_2k_context(roofline):
    step = roofline.decode(64, 2048)
    assert 63 <= 1 / step.time_s <= 77
    assert 4000 <= 64 / step.time_s <= 5000
    assert step.kv_read_bytes == 64 * 2048 * 131_072


def test_batching_raises_total_throughput_and_lowers_per_user_speed(roofline):
    batches = [1, 2, 4, 8, 16, 32, 64, 128]
    times = [roofline.decode(b, 2048).time_s for b in batches]
    per_user = [1 / t for t in times]
    total = [b / t for b, t in zip(batches, times)]
    assert all(a < b for a, b in pairwise(total))
    assert all(a > b for a, b in pairwise(per_user))
    # "step time barely moves" at small batches: 8 users cost < 20% more than one
    assert times[3] < 1.2 * times[0]


def test_long_contexts_add_kv_bytes(roofline):
    short, long = roofline.decode(16, 1024), roofline.decode(16, 8192)
    assert long.kv_read_bytes == 8 * short.kv_read_bytes
    assert long.weight_bytes == short.weight_bytes
    assert long.time_s > short.time_s
    assert long.arithmetic_intensity < short.arithmetic_intensity


def test_past_some_batch_decode_becomes_compute_bound(roofline):
    context = 128
    batch = roofline.compute_bound_batch(context)
    assert batch is not None
    assert roofline.decode(batch - 1, context).bound == "memory"
    assert roofline.decode(batch, context).bound == "compute"
    assert roofline.decode(4 * batch, context).bound == "compute"
    assert batch <= roofline.memory.max_batch(context)  # reachable before memory runs out
    # The ridge in FLOPs per byte is near 300; with per-sequence KV the crossover batch is higher.
    assert batch > 250


def test_at_2k_context_memory_runs_out_before_compute_catches_up(roofline):
    # each sequence brings 268 MB of KV per step for ~16 GFLOP: ~60 FLOP/byte, below the ridge
    assert roofline.compute_bound_batch(2048) is None


def test_prefill_is_compute_bound_and_grows_with_prompt_length(roofline):
    short, long = roofline.prefill(512), roofline.prefill(4096)
    assert short.bound == long.bound == "compute"
    assert short.arithmetic_intensity > short.ridge_flops_per_byte
    # attention makes prefill FLOPs superlinear in the prompt length
    assert long.flops > 8 * short.flops
    # near-proportional to the tokens once compute-bound: the layers' fixed cost and the imperfect
    # overlap of a 512-token step's loads and math (H100's measured steps) keep it under 8x
    assert 6 * short.time_s < long.time_s < 8 * short.time_s
