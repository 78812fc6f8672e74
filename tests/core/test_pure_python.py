"""servelab.core must stay importable where no model runs: no torch, no numpy."""

from __future__ import annotations

import subprocess
import sys


def test_core_imports_neither_torch_nor_numpy():
    code = (
        "import sys, servelab.core, servelab.core.scheduler;"
        "heavy = [m for m in ('torch', 'numpy') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_slots_follow_the_block_table():
    from servelab.core.plan import ScheduledSeq
    from servelab.core.sequence import SamplingParams, Sequence

    seq = Sequence("a", list(range(10)), SamplingParams())
    seq.block_table = [7, 2, 5]
    # positions 6..9: block 2 offsets 2, 3, then block 5 offsets 0, 1
    assert ScheduledSeq(seq, 4, 6, False).slots(4) == [10, 11, 20, 21]
