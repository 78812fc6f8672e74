"""The KV pool's memory: lazily touched by default, resident from the start when prefaulted."""

from __future__ import annotations

import ctypes
import mmap
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from servelab.spec.model import ModelSpec

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) residency is read on Linux")

CONFIG = ModelSpec("tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64, ffn_size=128,
                   vocab_size=64, tie_embeddings=False, max_context=2048, rope_theta=10000.0)  # fmt: skip


def resident_fraction(t: torch.Tensor) -> float:
    """The share of the tensor's pages that are in RAM, by mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.nbytes - start
    pages = -(-length // page)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / pages


# 2 x 32 MiB per pool: above glibc's initial mmap threshold, so each pool is a fresh mapping.
NUM_BLOCKS = 32 * 2**20 // (CONFIG.num_layers * CONFIG.num_kv_heads * 16 * CONFIG.head_dim * 4)


def _in_a_fresh_process(check: str) -> None:
    """Run `check` in a new interpreter: in a long test process, earlier tests' large frees move
    glibc's mmap threshold and a pool may then reuse pages already touched."""
    script = textwrap.dedent(f"""
        import torch
        from tests.runtime.test_kv_cache import CONFIG, NUM_BLOCKS, resident_fraction
        from servelab.runtime.kv_cache import PagedKVCache
        {check}
    """)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_prefaulted_pool_is_resident_from_the_start():
    _in_a_fresh_process("""
        kv = PagedKVCache(CONFIG, NUM_BLOCKS, 16, dtype=torch.float32, prefault=True)
        assert resident_fraction(kv.k) == 1.0 and resident_fraction(kv.v) == 1.0, "not resident"
        assert not kv.k.any() and not kv.v.any()
    """)


def test_a_lazy_pool_touches_little_and_keeps_slot_0_finite():
    _in_a_fresh_process("""
        kv = PagedKVCache(CONFIG, NUM_BLOCKS, 16, dtype=torch.float32)
        assert resident_fraction(kv.k) < 0.1, resident_fraction(kv.k)
        assert not kv.k[:, :, :16].any() and not kv.v[:, :, :16].any()
    """)
