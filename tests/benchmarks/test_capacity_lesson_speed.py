"""benchmarks/capacity_lesson_speed.py: the pool's makespan by hand, and its quick set end to end."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import capacity_lesson_speed  # noqa: E402


def test_makespan_hands_each_job_to_the_first_free_worker():
    assert capacity_lesson_speed.makespan([3.0, 1.0, 1.0, 1.0], 2) == 3.0  # 3 | 1+1+1
    assert capacity_lesson_speed.makespan([1.0, 1.0, 3.0], 2) == 4.0  # 1+3 | 1
    assert capacity_lesson_speed.makespan([2.0, 2.0], 1) == 4.0


def test_quick_set_plans_every_accelerator(capsys):
    assert capacity_lesson_speed.main(["--quick"]) == 0
    line = capsys.readouterr().out.strip()
    assert "CPU" in line and "h100-sxm" in line and "on 2 workers" in line
