"""`servelab models`: the model catalog, with parameter counts computed from each spec, and
whether the engine runs each model beside the cost model, which prices them all."""

from __future__ import annotations

import argparse
import json

HELP = "list the model catalog"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def run(args: argparse.Namespace) -> int:
    from servelab.commands._table import render_table
    from servelab.spec.model import MODELS

    if args.json:
        print(json.dumps([{**m.to_dict(), "engine_loads": m.engine_refusal is None} for m in MODELS.values()],
                         indent=2))  # fmt: skip
        return 0
    headers = [
        "model",
        "params",
        "active",
        "layers",
        "hidden",
        "heads",
        "kv heads",
        "head dim",
        "ffn",
        "vocab",
        "experts",
        "tied",
        "max ctx",
        "KV/token bf16",
        "engine",
    ]
    body = [
        [
            m.name,
            _count(m.num_params),
            _count(m.num_active_params),
            m.num_layers,
            m.hidden_size,
            m.num_heads,
            m.num_kv_heads,
            m.head_dim,
            m.ffn_size,
            m.vocab_size,
            f"{m.num_active_experts}/{m.num_experts}" if m.is_moe else "-",
            "yes" if m.tie_embeddings else "no",
            m.max_context,
            f"{m.kv_bytes_per_token('bf16') / 1024:,.0f} KiB",
            "loads" if m.engine_refusal is None else f"no: {m.engine_refusal}",
        ]
        for m in MODELS.values()
    ]
    print(render_table(headers, body, left=(0, 11, 14)))
    print("The cost model (roofline, sim, plan) prices every model; `engine` says whether servelab's engine runs it.")
    return 0
