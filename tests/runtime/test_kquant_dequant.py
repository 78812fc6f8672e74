"""Q4_K and Q6_K weights dequantize as ggml defines them (llama.cpp's dequantize_row_q4_K /
dequantize_row_q6_K), through our GGUF reader and loader path, checked against a reference
written here from the block layouts rather than against the gguf package that does the work."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from servelab.runtime.loader import read_gguf_tensors  # noqa: E402
from servelab.runtime.weight_layout import GGUFTensor, dequantize_gguf_tensor  # noqa: E402

QK_K = 256


def _random_blocks(rng: np.random.Generator, num_blocks: int, block_bytes: int, f16_at: list[int]) -> np.ndarray:
    """Random block bytes with sane fp16 scales (random bits could be inf/NaN) at `f16_at`."""
    raw = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    for offset in f16_at:
        scale = rng.uniform(0.001, 0.05, size=num_blocks).astype(np.float16)
        raw[:, offset : offset + 2] = scale.view(np.uint8).reshape(num_blocks, 2)
    return raw


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    # ggml get_scale_min_k4: eight 6-bit (scale, min) pairs packed into 12 bytes.
    if j < 4:
        return int(q[j] & 63), int(q[j + 4] & 63)
    return int((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)), int((q[j + 4] >> 4) | ((q[j] >> 6) << 4))


def reference_q4_k(raw: np.ndarray) -> np.ndarray:
    # block_q4_K: d (f16), dmin (f16), scales[12], qs[128] -> 256 values.
    out = []
    for block in raw:
        d = float(block[0:2].view(np.float16)[0])
        dmin = float(block[2:4].view(np.float16)[0])
        scales, qs = block[4:16], block[16:144]
        y = np.empty(QK_K, dtype=np.float64)
        for j in range(4):  # 64 values per pair of sub-blocks
            sc1, m1 = _scale_min_k4(2 * j, scales)
            sc2, m2 = _scale_min_k4(2 * j + 1, scales)
            q = qs[32 * j : 32 * j + 32].astype(np.int64)
            y[64 * j : 64 * j + 32] = d * sc1 * (q & 0xF) - dmin * m1
            y[64 * j + 32 : 64 * j + 64] = d * sc2 * (q >> 4) - dmin * m2
        out.append(y)
    return np.concatenate(out)


def reference_q6_k(raw: np.ndarray) -> np.ndarray:
    # block_q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d (f16).
    out = []
    for block in raw:
        ql, qh = block[0:128].astype(np.int64), block[128:192].astype(np.int64)
        sc = block[192:208].view(np.int8).astype(np.int64)
        d = float(block[208:210].view(np.float16)[0])
        y = np.empty(QK_K, dtype=np.float64)
        for half in range(2):  # 128 values each
            lo, hi, s, base = ql[64 * half :], qh[32 * half :], sc[8 * half :], 128 * half
            for i in range(32):
                k = i // 16
                q1 = ((lo[i] & 0xF) | ((hi[i] & 3) << 4)) - 32
                q2 = ((lo[i + 32] & 0xF) | (((hi[i] >> 2) & 3) << 4)) - 32
                q3 = ((lo[i] >> 4) | (((hi[i] >> 4) & 3) << 4)) - 32
                q4 = ((lo[i + 32] >> 4) | (((hi[i] >> 6) & 3) << 4)) - 32
                y[base + i] = d * s[k] * q1
                y[base + i + 32] = d * s[k + 2] * q2
                y[base + i + 64] = d * s[k + 4] * q3
                y[base + i + 96] = d * s[k + 6] * q4
        out.append(y)
    return np.concatenate(out)


CASES = {
    "Q4_K": (144, [0, 2], reference_q4_k),
    "Q6_K": (210, [208], reference_q6_k),
}


@pytest.mark.parametrize("qtype", sorted(CASES))
def test_k_quant_blocks_dequantize_as_ggml_defines_them(qtype, tmp_path):
    block_bytes, f16_at, reference = CASES[qtype]
    qt = gguf.GGMLQuantizationType[qtype]
    assert gguf.GGML_QUANT_SIZES[qt] == (QK_K, block_bytes)
    rows, cols = 3, 2 * QK_K  # two blocks a row
    raw = _random_blocks(np.random.default_rng(len(qtype) + block_bytes), rows * cols // QK_K, block_bytes, f16_at)
    expected = reference(raw).reshape(rows, cols)

    # Straight from bytes, as the loader sees a tensor (ggml's shape: row length first).
    ours = dequantize_gguf_tensor(GGUFTensor("w", (cols, rows), int(qt), raw.reshape(-1)))
    assert tuple(ours.shape) == (rows, cols)
    np.testing.assert_allclose(ours.numpy(), expected, rtol=1e-6, atol=1e-7)

    # And through a GGUF file and our reader.
    path = tmp_path / f"{qtype}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", raw.reshape(rows, -1), raw_dtype=qt)  # bytes [rows, row bytes]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _, tensors = read_gguf_tensors(path)
    loaded = dequantize_gguf_tensor(tensors["blk.0.ffn_down.weight"])
    np.testing.assert_allclose(loaded.numpy(), expected, rtol=1e-6, atol=1e-7)
