"""`servelab generate` and `servelab chat` on the tiny model, and the bundled model's answer."""

from __future__ import annotations

import io
import json
import re

import pytest

from servelab.cli import main


def test_generate_prints_text_and_a_timing_line(tiny_llama, capsys):
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_llama),
            "--dtype",
            "float32",
            "--prompt",
            "hello world",
            "--max-tokens",
            "6",
            "--temperature",
            "0",
            "--ignore-eos",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    text, timing = out.rstrip("\n").rsplit("\n", 1)
    assert text.strip()
    assert re.search(
        r"\d+ prompt \+ 6 output tokens \(length\) \| TTFT [\d.]+ ms \| TPOT [\d.]+ ms \| [\d.]+ tok/s", timing
    )


def test_generate_with_a_16_bit_kv_cache_says_so(tiny_llama, capsys):
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_llama),
            "--dtype",
            "float32",
            "--kv-cache-dtype",
            "float16",
            "--prompt",
            "hello world",
            "--max-tokens",
            "3",
            "--temperature",
            "0",
            "--ignore-eos",
        ]
    )
    assert rc == 0
    assert "float32, KV cache float16]" in capsys.readouterr().out


def test_generate_deterministic_says_so(tiny_llama, capsys):
    rc = main(["generate", "--model", str(tiny_llama), "--deterministic", "--prompt", "hello world",
               "--max-tokens", "3", "--temperature", "0", "--ignore-eos"])  # fmt: skip
    assert rc == 0
    assert "float32, deterministic]" in capsys.readouterr().out


def test_generate_json_and_chat_template(tiny_llama, capsys):
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_llama),
            "--dtype",
            "float32",
            "--prompt",
            "hi",
            "--chat",
            "--json",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "--ignore-eos",
        ]
    )
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and len(data["token_ids"]) == 4 and data["finish_reason"] == "length"
    assert data["ttft_s"] > 0 and data["e2e_s"] >= data["ttft_s"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-tokens", "0"], "max_tokens must be >= 1"),
        (["--temperature", "-1"], "temperature must be a number in [0, 100]"),
        (["--temperature", "nan"], "temperature must be a number in [0, 100], got nan"),
        (["--top-p", "inf"], "top_p must be in (0, 1], got inf"),
        (["--model", "/nonexistent/model.gguf"], "does not exist"),
        (["--system", "be brief"], "--system needs --chat"),
        (["--quantization", "int8", "--dtype", "bfloat16"], "quantization 'int8' computes in float32"),
        (["--deterministic", "--dtype", "bfloat16"], "deterministic mode computes in float32"),
    ],
)
def test_generate_user_errors_exit_2_with_a_message(tiny_llama, capsys, argv, message):
    base = ["generate", "--model", str(tiny_llama), "--prompt", "hi"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_chat_keeps_history_and_resets(tiny_llama, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello world\nwhat is the model\n/reset\nfast\n/exit\n"))
    rc = main(
        [
            "chat",
            "--model",
            str(tiny_llama),
            "--dtype",
            "float32",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--ignore-eos",
            "--stats",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0
    assert len([line for line in captured.out.splitlines() if line.strip()]) == 3  # three replies
    assert captured.err.count("TTFT") == 3 and "(conversation reset)" in captured.err
    # The second turn carries the first: its prompt is longer than a fresh single-message chat.
    prompt_lens = [int(m) for m in re.findall(r"\[(\d+) prompt", captured.err)]
    assert prompt_lens[1] > prompt_lens[0] and prompt_lens[2] < prompt_lens[1]


def test_generate_replaces_bytes_that_are_not_utf8_and_says_so(tiny_llama, capsys):
    # Python hands argv's undecodable bytes over as lone surrogates (surrogateescape)
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_llama),
            "--dtype",
            "float32",
            "--prompt",
            "a\udcffb",
            "--max-tokens",
            "2",
            "--temperature",
            "0",
            "--ignore-eos",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    assert err.count("U+FFFD") == 1 and "--prompt holds bytes that are not UTF-8" in err and "Traceback" not in err


def test_chat_replaces_bytes_that_are_not_utf8_once(tiny_llama, capsys, monkeypatch):
    # a strict stdin (a UTF-8 locale) would raise UnicodeDecodeError; UTF-8 mode gives lone surrogates
    stdin = io.TextIOWrapper(io.BytesIO(b"a\xffb\n\xfe\xfe\n/exit\n"), encoding="utf-8", errors="strict")
    monkeypatch.setattr("sys.stdin", stdin)
    rc = main(
        [
            "chat",
            "--model",
            str(tiny_llama),
            "--dtype",
            "float32",
            "--max-tokens",
            "2",
            "--temperature",
            "0",
            "--ignore-eos",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert len([line for line in captured.out.splitlines() if line.strip()]) == 2  # both turns answered
    assert captured.err.count("U+FFFD") == 1 and "your message holds bytes that are not UTF-8" in captured.err


def test_chat_survives_a_message_too_long_and_a_conversation_that_outgrew_the_context(tiny_llama, capsys, monkeypatch):
    # the tiny model's context is 2048 tokens; "word " is about 3 of its tokens
    lines = ["word " * 700, "word " * 400, "word " * 400, "hi", "/exit"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    rc = main(
        [
            "chat",
            "--model",
            str(tiny_llama),
            "--dtype",
            "float32",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--ignore-eos",
            "--stats",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert len([line for line in captured.out.splitlines() if line.strip()]) == 2  # the 2nd and 4th got replies
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and all("maximum context length" in e and "message not sent" in e for e in errors)
    assert "/reset" not in errors[0] and "/reset starts over" in errors[1]  # only the second had a conversation
    # the dropped message is not in the history: the last turn's prompt is the first reply's turn plus "hi"
    prompt_lens = [int(m) for m in re.findall(r"\[(\d+) prompt", captured.err)]
    assert prompt_lens[1] < prompt_lens[0] + 100


@pytest.mark.slow
def test_bundled_model_knows_the_capital_of_france(capsys):
    rc = main(["generate", "--chat", "--prompt", "What is the capital of France?", "--temperature", "0"])
    assert rc == 0
    assert "Paris" in capsys.readouterr().out
