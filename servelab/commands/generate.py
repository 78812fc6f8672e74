"""`servelab generate`: one prompt through the real engine, streamed, then a timing line."""

from __future__ import annotations

import argparse
import json
import sys

from servelab.commands._engine_cli import (
    UNDECODABLE_NOTE,
    add_engine_arguments,
    add_sampling_arguments,
    build_engine,
    replace_undecodable,
    sampling_params_from,
    timing_line,
)

HELP = "generate text for one prompt and print timings"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template"
    )
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, timings) instead")
    add_sampling_arguments(parser, max_tokens=128)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from servelab.errors import InvalidArgument

    params = sampling_params_from(args)
    if args.system is not None and not args.chat:
        raise InvalidArgument("--system needs --chat", param="system")
    prompt, in_prompt = replace_undecodable(args.prompt)
    system, in_system = replace_undecodable(args.system or "")
    if in_prompt or in_system:
        which = " and ".join(flag for flag, n in (("--prompt", in_prompt), ("--system", in_system)) if n)
        print(f"servelab generate: note: {which} {UNDECODABLE_NOTE}", file=sys.stderr)
    engine = build_engine(args)
    params = sampling_params_from(args, engine.sampling_defaults)
    if args.chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        prompt = engine.tokenizer.encode_chat(messages, add_generation_prompt=True)
    seq = engine.add_request("generate-0", prompt, params)
    text = []
    while engine.has_unfinished():
        for out in engine.step():
            text.append(out.text_delta)
            if not args.json:
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
    if args.json:
        a = seq.arrival_s
        print(
            json.dumps(
                {
                    "model": engine.model_name,
                    "text": "".join(text),
                    "prompt_token_ids": seq.prompt_token_ids,
                    "token_ids": seq.output_token_ids,
                    "finish_reason": seq.finish_reason.value if seq.finish_reason else None,
                    "ttft_s": None if seq.first_token_s is None else seq.first_token_s - a,
                    "e2e_s": seq.token_times_s[-1] - a if seq.token_times_s else None,
                }
            )
        )
    else:
        print()
        print(timing_line(seq, engine))
    return 0
