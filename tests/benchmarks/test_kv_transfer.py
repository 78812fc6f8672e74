"""benchmarks/kv_transfer.py in its `--quick` mode: two gloo ranks move one request's KV, by layer
and by block, and the receiver reports the bytes of the bundled model's cache shape."""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import kv_transfer  # noqa: E402


@pytest.mark.slow
def test_kv_transfer_quick_moves_one_requests_kv_both_ways(capsys):
    kv_transfer.main(["--quick"])
    (row,) = [line.split() for line in capsys.readouterr().out.splitlines() if re.match(r"\s*float32 ", line)]
    dtype, tokens, mib, layer_ms, block_ms, _, gbps = row
    assert (dtype, tokens) == ("float32", "128")
    # 128 tokens x 30 layers x K and V x 3 KV heads x 64 x 4 bytes
    assert float(mib) == pytest.approx(128 * 30 * 2 * 3 * 64 * 4 / 2**20, abs=0.05)
    assert float(layer_ms) > 0 and float(block_ms) > 0 and float(gbps) > 0
