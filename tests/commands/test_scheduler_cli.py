"""The scheduler's knobs are defined once (core/config.py SchedulerConfig): the engine's, the
simulator's and the planner's configs contain one, and every command's flags come from it."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.bench.planner import PlanJob
from servelab.cli import build_parser, main
from servelab.commands._engine_profile_cli import PROFILE_KNOBS
from servelab.commands._scheduler_cli import flag_name, scheduler_config_from_args, scheduler_overrides_from_args
from servelab.core.config import ORDERS, POLICIES, SchedulerConfig
from servelab.core.scheduler import Scheduler
from servelab.engine.llm_engine import EngineArgs
from servelab.errors import InvalidArgument
from servelab.metrics import SLO
from servelab.sim import SimConfig

KNOBS = {f.name for f in dataclasses.fields(SchedulerConfig)}
# The knobs each command takes a flag for.
COMMAND_KNOBS = {
    "serve": KNOBS,
    "sim": {
        "policy",
        "admission",
        "max_num_batched_tokens",
        "max_num_seqs",
        "max_model_len",
        "num_blocks",
        "enable_prefix_caching",
    },
    "plan": {"policy", "admission", "max_num_seqs", "max_num_batched_tokens"},
    "generate": {"max_model_len"},
    "chat": {"max_model_len"},
    "calibrate": {"max_model_len"},
}
REQUIRED = {"generate": ["--prompt", "x"], "calibrate": ["--out", "p.json"]}


def _parse(command: str, *argv: str):
    return build_parser(command).parse_args([command, *REQUIRED.get(command, []), *argv])


def _plan_job() -> PlanJob:
    return PlanJob(model="llama-3.1-8b", hardware="h100-sxm", tp=1, slo=SLO(tpot_s=0.05), percentile=90, workload={})


@pytest.mark.parametrize("owner", [EngineArgs(), SimConfig(), _plan_job()], ids=["EngineArgs", "SimConfig", "PlanJob"])
def test_engine_sim_and_planner_configs_contain_the_scheduler_config_and_repeat_none_of_its_fields(owner):
    assert owner.scheduler == SchedulerConfig()
    repeated = KNOBS & {f.name for f in dataclasses.fields(owner)}
    assert not repeated, f"{type(owner).__name__} repeats SchedulerConfig fields {repeated}"


@pytest.mark.parametrize("command", list(COMMAND_KNOBS))
def test_every_command_takes_its_scheduler_defaults_from_scheduler_config(command):
    parser = build_parser(command)
    flags = {o for a in parser._subparsers._group_actions[0].choices[command]._actions for o in a.option_strings}
    taken = {name for name in KNOBS if flag_name(name) in flags}
    assert taken == COMMAND_KNOBS[command]
    expected = SchedulerConfig(max_waiting=4096) if command == "serve" else SchedulerConfig()  # serve sheds load
    if command in ("sim", "plan"):
        # The engine profile's knobs are unset until given; the default profile is SchedulerConfig's.
        from servelab.sim.runner import engine_sim_config

        overrides = scheduler_overrides_from_args(_parse(command))
        assert not set(overrides) & set(PROFILE_KNOBS)
        assert engine_sim_config(_parse(command).engine_profile, scheduler=overrides).scheduler == expected
    else:
        assert scheduler_config_from_args(_parse(command)) == expected


def test_help_shows_the_dataclass_defaults_or_the_engine_profiles():
    text = build_parser("serve")._subparsers._group_actions[0].choices["serve"].format_help()
    assert f"(default {SchedulerConfig().max_num_batched_tokens})" in text
    assert f"(default {SchedulerConfig().max_num_seqs})" in text
    text = build_parser("sim")._subparsers._group_actions[0].choices["sim"].format_help()
    assert "(default: the engine profile's)" in text and "--engine-profile NAME" in text


def test_sim_flags_given_win_over_the_engine_profile():
    from servelab.commands.sim import config_from_args

    config = config_from_args(_parse("sim", "--engine-profile", "vllm", "--max-num-seqs", "64", "--rate", "1"))
    assert (config.engine_profile, config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (
        "vllm",
        64,
        8192,
    )


def _argv(config: SchedulerConfig) -> list[str]:
    """The flags that describe `config` (the inverse of scheduler_config_from_args, for serve)."""
    argv: list[str] = []
    for f in dataclasses.fields(SchedulerConfig):
        value = getattr(config, f.name)
        if isinstance(f.default, bool):
            argv += [] if value else [flag_name(f.name)]
        elif f.metadata.get("zero_is_none"):
            argv += [flag_name(f.name), str(value or 0)]
        elif value is not None:
            argv += [flag_name(f.name), str(value)]
    return argv


positive = st.integers(1, 1 << 20)


@settings(max_examples=60, deadline=None)
@given(st.builds(SchedulerConfig, num_blocks=st.none() | positive, block_size=positive,
                 max_num_batched_tokens=positive, max_num_seqs=positive, max_model_len=st.none() | positive,
                 max_waiting=st.none() | positive, policy=st.sampled_from(POLICIES), order=st.sampled_from(ORDERS),
                 enable_prefix_caching=st.booleans()))  # fmt: skip
def test_flags_built_from_scheduler_config_round_trip(config):
    assert scheduler_config_from_args(_parse("serve", *_argv(config))) == config


@pytest.mark.parametrize("command, argv, message", [
    ("serve", ["--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1, got 0"),
    ("sim", ["--max-num-batched-tokens", "0", "--rate", "1"], "--max-num-batched-tokens must be an integer >= 1"),
    ("plan", ["--max-num-seqs", "-2", "--slo-tpot", "50ms"], "--max-num-seqs must be an integer >= 1, got -2"),
    ("serve", ["--policy", "fastest"], "--policy must be one of chunked, prefill-first, prefill-first-chunked, "
                                       "decode-first-whole, got 'fastest'"),
    ("sim", ["--admission", "evict", "--rate", "1"], "--admission must be one of recompute, no-evict, reserve-ratio"),
    ("sim", ["--engine-profile", "tgi", "--rate", "1"], "unknown engine profile 'tgi'; choose one of servelab, vllm"),
    ("plan", ["--engine-profile", "tgi", "--slo-tpot", "50ms"], "choose one of servelab, vllm, sglang, trtllm"),
    ("serve", ["--order", "lifo"], "--order must be one of fcfs, priority, got 'lifo'"),
    ("serve", ["--max-waiting-requests", "-1"], "--max-waiting-requests must be >= 0 (0 = unbounded), got -1"),
    ("generate", ["--max-model-len", "0"], "--max-model-len must be an integer >= 1, got 0"),
])  # fmt: skip
def test_a_bad_knob_exits_2_naming_the_flag(capsys, command, argv, message):
    assert main([command, *REQUIRED.get(command, []), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_sim_scheduler_flag_is_a_deprecated_alias_of_policy(capsys):
    args = _parse("sim", "--scheduler", "prefill-first")
    assert "--scheduler is deprecated; use --policy" in capsys.readouterr().err
    assert scheduler_overrides_from_args(args)["policy"] == "prefill-first"
    assert _parse("sim", "--policy", "prefill-first").policy == "prefill-first"
    assert capsys.readouterr().err == ""


def test_engine_args_from_flat_keywords_route_the_knobs():
    args = EngineArgs.from_kwargs(model="m.gguf", max_num_seqs=3, num_blocks=9, seed=4)
    assert args.scheduler == SchedulerConfig(max_num_seqs=3, num_blocks=9) and args.seed == 4
    with pytest.raises(InvalidArgument, match="unknown engine argument"):
        EngineArgs.from_kwargs(max_num_seq=3)
    with pytest.raises(InvalidArgument, match="not both"):
        EngineArgs.from_kwargs(scheduler=SchedulerConfig(), max_num_seqs=3)


def test_a_scheduler_refuses_a_config_whose_pool_or_context_is_unsized():
    with pytest.raises(InvalidArgument, match="num_blocks is unset"):
        Scheduler(SchedulerConfig(max_model_len=64))
    with pytest.raises(InvalidArgument, match="max_model_len is unset"):
        Scheduler(SchedulerConfig(num_blocks=8))
    resolved = SchedulerConfig(max_num_seqs=3).resolve(num_blocks=8, max_model_len=64)
    assert (resolved.num_blocks, resolved.max_model_len, resolved.max_num_seqs) == (8, 64, 3)
    Scheduler(resolved)
