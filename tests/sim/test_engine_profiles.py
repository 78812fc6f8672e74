"""--engine-profile: each engine's defaults reach the simulator's scheduler, memory plan and step cost."""

from __future__ import annotations

from dataclasses import replace

import pytest

from servelab.core.config import SchedulerConfig
from servelab.cost import Efficiency, Roofline
from servelab.errors import InvalidArgument
from servelab.sim import SimConfig, simulate
from servelab.sim.engine_profiles import DEFAULT_ENGINE_PROFILE, engine_profile, engine_profiles
from servelab.sim.runner import build_cost_model, engine_sim_config, scheduler_config
from servelab.spec import get_hardware, get_model
from servelab.workload import WorkloadSpec

GB = 1e9
GIB = 1 << 30


def test_the_profiles_are_the_four_engines_and_every_setting_names_its_source():
    assert list(engine_profiles()) == ["servelab", "vllm", "sglang", "trtllm"]
    assert DEFAULT_ENGINE_PROFILE == "servelab"
    for profile in engine_profiles().values():
        assert set(profile.entries) == {
            "policy",
            "admission",
            "max_num_batched_tokens",
            "max_num_seqs",
            "kv_memory",
            "host",
            "gpu",
        }
        for key, entry in profile.provenance().items():
            assert entry["source"].strip() and entry["ref"].strip(), f"{profile.name}.{key} has no source"


def test_a_preset_with_its_own_roofline_terms_prices_the_simulated_steps_with_them():
    trtllm = engine_profile("trtllm").efficiency()
    assert trtllm is not None and trtllm != Efficiency()
    assert engine_profile("servelab").efficiency() is None  # the defaults, as the simulator always ran
    config = engine_sim_config("trtllm", model="llama-2-7b", hardware="h100-sxm", weight_dtype="fp8")
    assert config.efficiency == trtllm
    shape = [(1, 512)] * 32
    expected = Roofline(get_model("llama-2-7b"), get_hardware("h100-sxm"), "fp8", "bf16", efficiency=trtllm)
    assert build_cost_model(config).step_time_s(shape) == pytest.approx(expected.step_time_s(shape))
    # an Efficiency the caller gives wins over the preset's
    assert engine_sim_config("trtllm", efficiency=Efficiency()).efficiency == Efficiency()


def test_an_unknown_profile_is_a_clear_error_listing_the_names():
    with pytest.raises(
        InvalidArgument, match="unknown engine profile 'tgi'; choose one of servelab, vllm, sglang, trtllm"
    ):
        engine_profile("tgi")
    with pytest.raises(InvalidArgument, match="choose one of servelab, vllm"):
        SimConfig(engine_profile="tgi")


def test_the_default_profile_is_the_simulator_as_it_always_ran():
    # benchmarks/sim_fingerprint.py holds the runs themselves; here, the configuration.
    assert engine_sim_config("servelab") == replace(SimConfig(), engine_profile="servelab")
    overrides = {"max_num_seqs": 64, "policy": "prefill-first", "num_blocks": 900}
    assert engine_sim_config("servelab", scheduler=overrides, hardware="h200").scheduler == SchedulerConfig(**overrides)


# (profile, hardware) -> policy, admission, max_num_batched_tokens, max_num_seqs, memory fraction
EXPECTED = {
    ("vllm", "h100-sxm"): ("chunked", "recompute", 8192, 1024, 0.9),
    ("vllm", "h200"): ("chunked", "recompute", 8192, 1024, 0.9),
    ("vllm", "mi300x"): ("chunked", "recompute", 8192, 1024, 0.9),
    ("vllm", "a100-80gb"): ("chunked", "recompute", 2048, 256, 0.9),  # >= 70 GiB, but an A100
    ("vllm", "l4"): ("chunked", "recompute", 2048, 256, 0.9),
    ("sglang", "h100-sxm"): ("prefill-first-chunked", "reserve-ratio", 8192, None, round(1 - 10 * GIB / (80 * GB), 3)),
    ("sglang", "l4"): ("prefill-first-chunked", "reserve-ratio", 2048, None, round(1 - 2.9 * GIB / (24 * GB), 3)),
    ("sglang", "b200"): ("prefill-first-chunked", "reserve-ratio", 16384, None, round(1 - 32 * GIB / (180 * GB), 3)),
    ("trtllm", "h100-sxm"): ("decode-first-whole", "no-evict", 8192, 2048, None),
    ("servelab", "h100-sxm"): ("chunked", "recompute", 2048, 256, 0.9),
}


@pytest.mark.parametrize(("name", "hardware"), EXPECTED)
def test_each_profile_sets_its_engines_defaults_for_the_accelerator(name, hardware):
    policy, admission, budget, max_seqs, fraction = EXPECTED[name, hardware]
    config = engine_sim_config(name, hardware=hardware)
    sched = scheduler_config(config)  # what the replicas' Scheduler runs on
    assert (sched.policy, sched.admission, sched.max_num_batched_tokens) == (policy, admission, budget)
    assert config.engine_profile == name and config.to_dict()["engine_profile"] == name
    if max_seqs is not None:
        assert sched.max_num_seqs == max_seqs
    if fraction is not None:
        assert config.memory_fraction == pytest.approx(fraction)


def test_sglang_runs_as_many_requests_as_half_its_kv_pool_up_to_its_request_pool():
    config = engine_sim_config("sglang", hardware="h200")
    sched = scheduler_config(config)
    pool = sched.kv_capacity_tokens
    request_pool = min(max(pool * 512 // config.model_spec.max_context, 2048), 4096)
    assert sched.max_num_seqs == min(pool // 2, request_pool)
    small = scheduler_config(engine_sim_config("sglang", hardware="h100-sxm", scheduler={"num_blocks": 100}))
    assert small.max_num_seqs == 100 * 16 // 2


def test_trtllm_gives_the_kv_cache_its_share_of_what_the_weights_leave():
    from servelab.cost.memory import MemoryPlan

    config = engine_sim_config("trtllm", hardware="h100-sxm")
    weights = MemoryPlan(config.model_spec, config.hardware_spec).weight_bytes_per_device
    kv = MemoryPlan(config.model_spec, config.hardware_spec, memory_fraction=config.memory_fraction).kv_capacity_bytes
    assert kv == pytest.approx(0.9 * (80 * GB - weights))


def test_flags_a_user_gives_win_over_the_profile():
    config = engine_sim_config(
        "vllm", hardware="h100-sxm", scheduler={"max_num_seqs": 64, "admission": "no-evict"}, memory_fraction=0.8
    )
    assert (config.scheduler.max_num_seqs, config.scheduler.admission) == (64, "no-evict")
    assert config.scheduler.max_num_batched_tokens == 8192  # still vLLM's on an H100
    assert config.memory_fraction == 0.8


LOAD = WorkloadSpec(300, rate=None, concurrency=None, input_len="1024-6000", output_len="16-64", seed=11)


@pytest.mark.parametrize("name", ["servelab", "vllm", "sglang", "trtllm"])
def test_the_profiles_budgets_bound_every_simulated_step(name):
    config = engine_sim_config(name, hardware="h100-sxm")
    result = simulate(config, LOAD)
    sched = scheduler_config(config)
    assert result.summary.completed == 300
    assert max(result.trace.num_tokens) <= sched.max_num_batched_tokens
    assert max(result.trace.num_seqs) <= sched.max_num_seqs
    if name != "servelab":  # all requests at once: the larger budget is used, not just allowed
        assert max(result.trace.num_tokens) > SchedulerConfig().max_num_batched_tokens
    if sched.admission == "no-evict":
        assert all(r["preemptions"] == 0 for r in result.replica_stats)


def test_the_vllm_profiles_host_cost_bounds_each_step_from_below():
    config = engine_sim_config("vllm", hardware="h100-sxm", model="llama-3.2-1b")
    host = config.host_cost
    assert host is not None and host.overlapped
    result = simulate(config, WorkloadSpec(200, concurrency=64, input_len="64", output_len="128", seed=2))
    trace = result.trace
    host_s = [host.time_s(config.model_spec.num_layers, n) for n in trace.num_seqs]
    assert all(d >= h - 1e-15 for d, h in zip(trace.duration_s, host_s))
    # A small model's decode steps are host-bound: overlapping leaves exactly the host time.
    assert sum(d == pytest.approx(h) for d, h in zip(trace.duration_s, host_s)) > len(host_s) // 2
    assert result.config["host_cost"].endswith("hidden behind the GPU step (max)")


# ---- the CLI -------------------------------------------------------------------------------------


def test_sim_engine_profile_list_shows_every_profile_and_its_sources(capsys):
    import json

    from servelab.cli import main

    assert main(["sim", "--engine-profile", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("servelab", "vllm", "sglang", "trtllm"):
        assert f"\n{name} (" in out
    assert "8192 (>=70 not a100) | 2048" in out and "GUARANTEED_NO_EVICT" in out
    assert main(["plan", "--engine-profile", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in listed] == ["servelab", "vllm", "sglang", "trtllm"]


def test_sim_prints_and_reports_the_profile_it_used(capsys):
    import json

    from servelab.cli import main

    argv = ["sim", "--rate", "5", "--num-requests", "20", "--no-progress"]
    assert main([*argv, "--engine-profile", "trtllm", "--json"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["engine_profile"], config["scheduler"], config["admission"]) == (
        "trtllm",
        "decode-first-whole",
        "no-evict",
    )
    assert (config["max_num_batched_tokens"], config["max_num_seqs"]) == (8192, 2048)
    assert main(argv) == 0
    assert "engine profile servelab: chunked, admission recompute, 2,048 tokens/step" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(engine_profiles()))
def test_roofline_sim_plan_and_the_lab_read_the_same_terms(name):
    """One source of truth per preset: `sim` and `plan` (engine_sim_config), the lab's roofline
    lessons (Setup.roofline) and, for the default preset, the `roofline` command's Efficiency."""
    import argparse

    from servelab.commands import roofline as roofline_cmd
    from servelab.lab.common import Setup

    model, hw = get_model("llama-2-70b"), get_hardware("h100-sxm")
    sim_eff = build_cost_model(engine_sim_config(name, model="llama-2-70b", hardware="h100-sxm", tp=4))
    sim_eff = getattr(sim_eff, "gpu", sim_eff).efficiency
    lab = Setup(model, hw, "bf16", "bf16", 4, engine_profile=name).roofline()
    assert lab.efficiency == sim_eff == (engine_profile(name).efficiency() or Efficiency())
    if name == DEFAULT_ENGINE_PROFILE:
        parser = argparse.ArgumentParser()
        roofline_cmd.add_arguments(parser)
        args = parser.parse_args(["--model", "llama-2-70b", "--hardware", "h100-sxm"])
        assert roofline_cmd._efficiency(args, hw, "bf16") == sim_eff
