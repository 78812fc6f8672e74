"""validate says how much CPU the hypervisor took (steal) while it measured, and warns when a
virtual machine's neighbours took enough to move the measured times."""

from __future__ import annotations

from servelab.commands.validate import STEAL_WARN_FRACTION, describe_steal
from servelab.runtime import host_probe


def test_the_meter_reads_steal_apart_from_other_processes(monkeypatch):
    clock = iter([100.0, 110.0])  # two readings 10 s apart: the meter's start, then steal_cpus()
    stat = iter([(50.0, 5.0), (62.0, 8.0)])  # (busy s, of which steal s)
    monkeypatch.setattr(host_probe.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(host_probe, "_host_cpu_s", lambda: next(stat))
    monkeypatch.setattr(host_probe, "_proc_tree_cpu_s", lambda pid: 0.0)
    assert abs(host_probe.OtherLoadMeter().steal_cpus() - 0.3) < 1e-9  # 3 s stolen in 10 s


def test_the_meter_is_none_without_proc_stat(monkeypatch):
    monkeypatch.setattr(host_probe, "_host_cpu_s", lambda: None)
    meter = host_probe.OtherLoadMeter()
    assert meter.steal_cpus() is None and meter.other_cpus() is None


def test_validate_warns_only_past_the_threshold():
    quiet = describe_steal({"cpus": 2, "steal_cpus": 0.02})
    busy = describe_steal({"cpus": 2, "steal_cpus": 2 * STEAL_WARN_FRACTION + 0.01})
    assert quiet.startswith("host: the hypervisor took 0.02 of 2 CPUs") and "neighbours" not in quiet
    assert "neighbours were busy" in busy
    assert describe_steal({"cpus": 2, "steal_cpus": None}) is None
