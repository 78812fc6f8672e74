"""One name for the KV cache's dtype across the Python API, as EngineArgs and the CLI spell it
(`kv_cache_dtype`); the old `kv_dtype` of SimConfig, PlanJob and MemoryPlan still works, with a
DeprecationWarning."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from servelab.bench.planner import PlanJob
from servelab.cost.memory import MemoryPlan
from servelab.metrics import SLO
from servelab.sim.runner import SimConfig
from servelab.spec import get_hardware, get_model


def _makers():
    h100, llama = get_hardware("h100-sxm"), get_model("llama-3.1-8b")
    return {
        "SimConfig": lambda **kw: SimConfig(**kw),
        "PlanJob": lambda **kw: PlanJob("llama-3.1-8b", "h100-sxm", 1, SLO(), 90, {}, **kw),
        "MemoryPlan": lambda **kw: MemoryPlan(llama, h100, **kw),
    }


@pytest.mark.parametrize("name", ["SimConfig", "PlanJob", "MemoryPlan"])
def test_kv_cache_dtype_is_the_name_and_kv_dtype_a_deprecated_alias(name):
    make = _makers()[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name warns about nothing
        obj = make(kv_cache_dtype="fp8")
        assert obj.kv_cache_dtype == "fp8"
        assert "kv_cache_dtype" in {f.name for f in dataclasses.fields(obj)}
        assert "kv_dtype" not in {f.name for f in dataclasses.fields(obj)}
    with pytest.deprecated_call(match="kv_cache_dtype"):
        old = make(kv_dtype="fp8")
    assert old.kv_cache_dtype == "fp8"
    with pytest.deprecated_call(match="kv_cache_dtype"):
        assert old.kv_dtype == "fp8"
    with pytest.raises(TypeError, match="kv_cache_dtype"):
        make(kv_dtype="fp8", kv_cache_dtype="fp8")


def test_sim_reports_name_the_kv_cache_dtype():
    assert SimConfig(kv_cache_dtype="fp8").to_dict()["kv_cache_dtype"] == "fp8"
