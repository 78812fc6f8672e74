"""The speculative-decoding flags of `roofline`, `sim` and `plan`, defined once: vLLM's
`--speculative-config` (read by SpeculativeConfig.parse) and the acceptance the prediction
assumes, a rate or a profile measured by `bench`."""

from __future__ import annotations

import argparse
from typing import Any

from servelab.errors import InvalidArgument

SPECULATIVE_CONFIG_HELP = (
    "speculative decoding as vLLM's flag spells it: "
    '\'{"method": "ngram", "num_speculative_tokens": 4}\' (prompt lookup) or '
    '\'{"model": DRAFT, "num_speculative_tokens": 4}\' (a draft model: a catalog name, an HF config.json or a .gguf)'
)


def add_speculative_arguments(group: Any) -> None:
    group.add_argument("--speculative-config", default=None, metavar="JSON", help=SPECULATIVE_CONFIG_HELP)
    group.add_argument(
        "--spec-acceptance",
        type=float,
        default=None,
        metavar="RATE",
        help="probability that a draft token is accepted once every draft before it was, 0..1, the same at "
        "each position (vLLM's accepted / proposed ratio is lower: give its counters as a profile)",
    )
    group.add_argument(
        "--spec-acceptance-profile",
        default=None,
        metavar="FILE.json",
        help='acceptance by draft position, as bench measures it: {"acceptance_per_position": [...]} or '
        'vLLM\'s counters {"num_drafts": N, "accepted_per_position": [...]}',
    )


def speculation_from_args(args: argparse.Namespace) -> tuple[Any, Any] | None:
    """(SpeculativeConfig, Acceptance) the flags describe, or None without --speculative-config."""
    from servelab.core.speculative import SpeculativeConfig
    from servelab.cost.speculative import Acceptance

    rate, profile = args.spec_acceptance, args.spec_acceptance_profile
    try:
        config = SpeculativeConfig.parse(args.speculative_config)
    except InvalidArgument as e:
        raise InvalidArgument(f"--speculative-config: {e.message}", param="speculative_config") from None
    if config is None:
        if rate is not None or profile is not None:
            flag = "--spec-acceptance" if rate is not None else "--spec-acceptance-profile"
            raise InvalidArgument(f"{flag} needs --speculative-config (what is proposed and how many tokens)")
        return None
    if (rate is None) == (profile is None):
        raise InvalidArgument(
            "--speculative-config needs exactly one of --spec-acceptance RATE (0..1) or "
            "--spec-acceptance-profile FILE.json (acceptance by draft position, measured by bench)"
        )
    k = config.num_speculative_tokens
    if rate is not None:
        if not 0.0 <= rate <= 1.0:
            raise InvalidArgument(f"--spec-acceptance must be in [0, 1], got {rate:g}", param="spec_acceptance")
        return config, Acceptance.rate(rate, k)
    from servelab.workload.acceptance import load_profile

    try:
        measured = load_profile(profile)  # the format `bench --spec-profile-out` writes
        return config, Acceptance.from_profile(measured, f"profile {profile}").for_k(k)
    except InvalidArgument as e:
        message = e.message if e.message.startswith("--") else f"--spec-acceptance-profile: {e.message}"
        raise InvalidArgument(message, param="spec_acceptance_profile") from None


def describe_speculation(config: Any, acceptance: Any, draft: Any = None) -> str:
    """One line: what is proposed, how it is priced (given the DraftCost), and what it yields per verification."""
    priced = "" if draft is None else f"{draft.describe()}; "
    return (
        f"speculative decoding: {config.to_json()}; {priced}acceptance {acceptance.source} "
        f"-> {acceptance.expected_tokens():.2f} tokens per verification step in expectation "
        f"(draft acceptance {acceptance.draft_acceptance_rate:.3f}: accepted / proposed, as vLLM reports it)"
        + (f"; {acceptance.coverage:.1%} of decode steps draft" if acceptance.coverage < 1.0 else "")
        + (
            f"; each request draws one of {len(acceptance.per_request):,} measured requests' acceptance"
            if acceptance.per_request
            else ""
        )  # fmt: skip
    )
