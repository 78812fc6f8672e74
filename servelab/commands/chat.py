"""`servelab chat`: an interactive terminal chat that streams tokens as they come.

Type a message and press Enter. `/reset` forgets the conversation, `/exit` (or Ctrl-D) quits,
Ctrl-C stops the reply being generated.
"""

from __future__ import annotations

import argparse
import sys

from servelab.commands._engine_cli import (
    UNDECODABLE_NOTE,
    add_engine_arguments,
    add_sampling_arguments,
    build_engine,
    replace_undecodable,
    sampling_params_from,
    stdin_keeps_undecodable_bytes,
    timing_line,
)

HELP = "interactive chat in the terminal, streaming tokens"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default=None, help="system message")
    parser.add_argument("--stats", action="store_true", help="print a timing line after each reply")
    add_sampling_arguments(parser, max_tokens=512)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from servelab.errors import RequestTooLong, ServelabError

    params = sampling_params_from(args)
    engine = build_engine(args)
    params = sampling_params_from(args, engine.sampling_defaults)
    noted = False  # the note on bytes that are not UTF-8 is said once

    def clean(text: str, what: str) -> str:
        nonlocal noted
        text, replaced = replace_undecodable(text)
        if replaced and not noted:
            print(f"note: {what} {UNDECODABLE_NOTE}", file=sys.stderr)
            noted = True
        return text

    system = [{"role": "system", "content": clean(args.system, "--system")}] if args.system else []
    messages: list[dict] = list(system)
    stdin_keeps_undecodable_bytes()
    interactive = sys.stdin.isatty()
    print(f"servelab chat with {engine.model_name} — /reset to start over, /exit or Ctrl-D to quit", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            print(file=sys.stderr)
            return 0
        line = clean(line, "your message").strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages = list(system)
            print("(conversation reset)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        rid = f"chat-{turn}"
        turn += 1
        try:
            prompt = engine.tokenizer.encode_chat(messages, add_generation_prompt=True)
            seq = engine.add_request(rid, prompt, params)
        except ServelabError as exc:  # this message is dropped; the conversation before it goes on
            messages.pop()
            hint = ""
            if isinstance(exc, RequestTooLong) and len(messages) > len(system):
                hint = "; the prompt holds the whole conversation: /reset starts over"
            print(f"error: {exc.message}{hint} (message not sent)", file=sys.stderr)
            continue
        reply: list[str] = []
        sys.stdout.write("assistant> " if interactive else "")
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    reply.append(out.text_delta)
                    sys.stdout.write(out.text_delta)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
            sys.stdout.write(" [stopped]")
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
        if args.stats:
            print(timing_line(seq, engine), file=sys.stderr)
