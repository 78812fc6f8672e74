import pytest

from servelab.cost import MemoryPlan
from servelab.errors import DoesNotFit, InvalidArgument
from servelab.spec import get_hardware, get_model

H100 = get_hardware("h100-sxm")


def test_llama_8b_on_h100():
    plan = MemoryPlan(get_model("llama-3.1-8b"), H100)
    assert plan.weight_bytes_per_device == pytest.approx(16.06e9, rel=0.001)
    assert plan.kv_bytes_per_token_per_device == 131_072
    expected_tokens = int((0.9 * 80e9 - plan.weight_bytes_per_device) // 131_072)
    assert plan.kv_capacity_tokens == expected_tokens
    assert plan.max_batch(2048) == expected_tokens // 2048 == 208
    assert plan.fits(208, 2048) and not plan.fits(209, 2048)
    assert plan.kv_bytes(64, 2048) == 64 * 2048 * 131_072


def test_memory_fraction_changes_capacity():
    model = get_model("llama-3.1-8b")
    assert MemoryPlan(model, H100, memory_fraction=0.5).kv_capacity_tokens < MemoryPlan(model, H100).kv_capacity_tokens
    with pytest.raises(InvalidArgument, match="memory fraction"):
        MemoryPlan(model, H100, memory_fraction=1.2)


def test_smaller_dtypes_and_tp_leave_more_room():
    model = get_model("llama-3.1-70b")
    bf16 = MemoryPlan(model, H100)
    assert not bf16.weights_fit and bf16.kv_capacity_tokens == 0 and bf16.max_batch(1024) == 0
    fp8 = MemoryPlan(model, H100, weight_dtype="fp8")
    assert fp8.weights_fit and fp8.kv_capacity_tokens > 0
    tp4 = MemoryPlan(model, H100, tp=4)
    assert tp4.weight_bytes_per_device == pytest.approx(bf16.weight_bytes_per_device / 4)
    assert tp4.kv_bytes_per_token_per_device == bf16.kv_bytes_per_token_per_device / 4
    kv8 = MemoryPlan(model, H100, tp=4, kv_cache_dtype="fp8")
    assert kv8.max_batch(8192) >= 2 * tp4.max_batch(8192)


def test_does_not_fit_errors_name_the_limit():
    plan = MemoryPlan(get_model("llama-3.1-8b"), H100)
    plan.require_fit(208, 2048)
    with pytest.raises(DoesNotFit) as err:
        plan.require_fit(300, 2048)
    message = err.value.message
    assert "batch 300" in message and "context 2048" in message and "batch 208" in message
    with pytest.raises(DoesNotFit, match=r"weights take 811\.7 GB per device but only 72\.0 GB"):
        MemoryPlan(get_model("llama-3.1-405b"), H100).require_fit(1, 1024)


def test_tp_must_split_heads_evenly():
    with pytest.raises(InvalidArgument, match="tp=5 does not divide"):
        MemoryPlan(get_model("llama-3.1-8b"), H100, tp=5)
    with pytest.raises(InvalidArgument, match="positive"):
        MemoryPlan(get_model("llama-3.1-8b"), H100, tp=0)
    with pytest.raises(InvalidArgument, match="KV heads"):
        MemoryPlan(get_model("qwen2.5-7b"), H100, tp=7)  # 28 heads, 4 KV heads
