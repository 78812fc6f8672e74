"""`--engine-profile NAME` for `servelab sim` and `servelab plan`: simulate a deployment as vLLM,
SGLang, TensorRT-LLM or servelab runs it by default. `--engine-profile list` shows the profiles."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

# The scheduler knobs a profile sets: their flags default to "the profile's".
PROFILE_KNOBS = ("policy", "admission", "max_num_batched_tokens", "max_num_seqs")
PROFILE_UNSET = {name: "the engine profile's" for name in PROFILE_KNOBS}
LIST = "list"


def add_engine_profile_argument(group: Any) -> None:
    from servelab.sim.engine_profiles import DEFAULT_ENGINE_PROFILE, engine_profiles

    group.add_argument(
        "--engine-profile",
        default=DEFAULT_ENGINE_PROFILE,
        metavar="NAME",
        help=f"serving engine whose defaults to simulate (budgets for the accelerator, step policy, "
        f"admission, KV memory share, host cost): {', '.join(engine_profiles())} "
        f"(default {DEFAULT_ENGINE_PROFILE}); the scheduler flags given win; "
        f"'{LIST}' shows each profile's settings and sources",
    )


def profile_defaults() -> dict[str, None]:
    """add_scheduler_arguments(defaults=...): the profile's knobs stay unset unless given."""
    return dict.fromkeys(PROFILE_KNOBS)


def wants_list(args: argparse.Namespace) -> bool:
    return args.engine_profile.strip().lower() == LIST


def print_profiles(as_json: bool) -> None:
    from servelab.commands._table import render_table
    from servelab.sim.engine_profiles import engine_profiles

    profiles = engine_profiles().values()
    if as_json:
        print(json.dumps([p.to_dict() for p in profiles], indent=2))
        return
    headers = ["profile", "engine", "policy", "admission", "tokens/step", "seqs", "KV memory", "host"]
    rows = [
        [
            p.name,
            p.engine,
            _rule(p.entries["policy"]),
            _rule(p.entries["admission"]),
            _rule(p.entries["max_num_batched_tokens"]),
            _rule(p.entries["max_num_seqs"]),
            _kv_memory(p.entries["kv_memory"]),
            _host(p.entries["host"]),
        ]
        for p in profiles
    ]
    print(render_table(headers, rows, left=(0, 1, 2, 3, 4, 5, 6, 7)))
    print("tiers by the accelerator's memory (GiB); flags given win over a profile; servelab is the default")
    for p in profiles:
        print(f"\n{p.name} ({p.engine} {p.version}): {p.summary}")
        for key, entry in p.provenance().items():
            print(f"  {key}: {entry['source']} [{entry['ref']}]")


def _rule(entry: Mapping[str, Any]) -> str:
    if "value" in entry:
        return str(entry["value"])
    if "from_kv_pool" in entry:
        r = entry["from_kv_pool"]
        return f"min(KV pool/{r['divisor']}, {r['req_pool_min']}-{r['req_pool_max']})"
    return " | ".join(f"{t['value']}{_bounds(t)}" for t in entry["tiers"])


def _bounds(tier: Mapping[str, Any]) -> str:
    parts = []
    if "min_memory_gib" in tier:
        parts.append(f">={tier['min_memory_gib']}")
    if "below_memory_gib" in tier:
        parts.append(f"<{tier['below_memory_gib']}")
    if tier.get("not_named"):
        parts.append("not " + "/".join(tier["not_named"]))
    return f" ({' '.join(parts)})" if parts else ""


def _kv_memory(entry: Mapping[str, Any]) -> str:
    if "of_total" in entry:
        return f"{entry['of_total']:.0%} of memory"
    if "of_free" in entry:
        return f"{entry['of_free']:.0%} of free"
    return "memory less reserved"


def _host(entry: Mapping[str, Any]) -> str:
    if entry.get("none"):
        return "roofline overheads"
    if not (entry["step_s"] or entry["per_layer_s"] or entry["per_seq_s"]):
        return "hidden" if entry["overlapped"] else "none"
    how = "overlapped" if entry["overlapped"] else "serial"
    return f"{entry['step_s'] * 1e3:.3g} ms + {entry['per_seq_s'] * 1e6:.3g} us/seq, {how}"


def describe_config(config: Any) -> str:
    """One line: the profile and what it set for this deployment (a SimConfig)."""
    sched = config.scheduler
    host = "" if config.host_cost is None else f"; {config.host_cost.describe()}"
    return (
        f"engine profile {config.engine_profile}: {sched.policy}, admission {sched.admission}, "
        f"{sched.max_num_batched_tokens:,} tokens/step, {sched.max_num_seqs:,} seqs, "
        f"{config.memory_fraction:.1%} of memory for weights + KV{host}"
    )
