"""ggml's type table: the same blocks as the gguf package, the same kernel codes as our C kernels,
and the views the cost model and the engine take of it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from servelab.spec.dtypes import GGUF_WEIGHT_FORMATS
from servelab.spec.ggml_types import GGML_TYPE_BY_ID, GGML_TYPE_BY_NAME, GGML_TYPES, Kernel

KERNEL_SOURCE = Path(__file__).parents[2] / "servelab" / "runtime" / "csrc" / "block_quant_linear.c"


def test_the_type_table_agrees_with_the_gguf_package():
    """Every format both know has the same block; gguf-py has Q8_1 at 40 bytes (two fp32), while
    ggml's block_q8_1 holds two fp16 (36 bytes)."""
    gguf = pytest.importorskip("gguf")
    known = {t.value: size for t, size in gguf.GGML_QUANT_SIZES.items()}
    assert len(GGML_TYPE_BY_ID) == len(GGML_TYPES) and len(GGML_TYPE_BY_NAME) == len(GGML_TYPES)
    for t in GGML_TYPES:
        if t.type_id in known and t.name != "Q8_1":
            assert (t.block_weights, t.block_bytes) == known[t.type_id], t.name
            assert gguf.GGMLQuantizationType(t.type_id).name == t.name


def test_the_type_table_names_the_kernels_formats():
    """Kernel codes are the C kernels' enum; each code names one type."""
    enum = re.search(r"enum \{([^}]*)\};", KERNEL_SOURCE.read_text()).group(1)
    codes = {name.strip(): int(value) for name, value in (item.split("=") for item in enum.split(","))}
    with_kernel = {t.name: t.kernel_code for t in GGML_TYPES if t.kernel_code is not None}
    assert with_kernel == codes
    assert all((t.kernel is Kernel.NONE) == (t.kernel_code is None) for t in GGML_TYPES)


def test_the_regrouped_q4_1_layout_has_the_same_code_in_c_and_python():
    pytest.importorskip("torch")
    from servelab.runtime import block_quant

    assert re.search(r"enum \{ Q4_1_G16 = (\d+) \};", KERNEL_SOURCE.read_text()).group(1) == str(block_quant.Q4_1_G16)
    assert block_quant.Q4_1_G16 not in {t.kernel_code for t in GGML_TYPES}


def test_the_cost_models_weight_formats_are_the_weight_block_formats():
    # Q8_1 and Q8_K are ggml's activation formats; the IQ/TQ families are not priced.
    assert GGUF_WEIGHT_FORMATS == ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")


def test_the_engines_block_formats_are_the_table_rows_with_a_kernel():
    pytest.importorskip("torch")
    from servelab.runtime import block_quant

    assert block_quant.GGUF_BLOCK_FORMATS == {
        2: (1, 32, 18),
        3: (2, 32, 20),
        8: (0, 32, 34),
        12: (3, 256, 144),
        14: (4, 256, 210),
    }
    # and Q4_1 regrouped (a layout of Q4_1's blocks, the in-register kernel's too)
    assert block_quant.FORMAT_NAMES == {0: "Q8_0", 1: "Q4_0", 2: "Q4_1", 3: "Q4_K", 4: "Q6_K", 5: "F32", 6: "Q4_1"}
    assert sorted(block_quant._FUSED_FORMATS) == [0, 1, 2, 6] and block_quant._F32 == 5


def test_row_bytes_are_whole_blocks():
    q4_k = GGML_TYPE_BY_NAME["Q4_K"]
    assert q4_k.row_bytes(512) == 288 and 8 * q4_k.bytes_per_weight == 4.5
    with pytest.raises(ValueError, match="whole blocks of 256"):
        q4_k.row_bytes(300)
