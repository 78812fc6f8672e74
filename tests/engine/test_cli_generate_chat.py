"""`servelab generate` and `servelab chat` on the tiny model, and the bundled model's answer."""

from __future__ import annotations

import io
import json
import re

import pytest

from servelab.cli import main


def test_generate_prints_text_and_a_timing_line(tiny_llama, capsys):
    rc = main(["generate", "--model", str(tiny_llama), "--dtype", "float32", "--prompt", "hello world",
               "--max-tokens", "6", "--temperature", "0", "--ignore-eos"])
    out = capsys.readouterr().out
    assert rc == 0
    text, timing = out.rstrip("\n").rsplit("\n", 1)
    assert text.strip()
    assert re.search(r"\d+ prompt \+ 6 output tokens \(length\) \| TTFT [\d.]+ ms \| TPOT [\d.]+ ms \| [\d.]+ tok/s", timing)


def test_generate_with_a_16_bit_kv_cache_says_so(tiny_llama, capsys):
    rc = main(["generate", "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-dtype", "float16",
               "--prompt", "hello world", "--max-tokens", "3", "--temperature", "0", "--ignore-eos"])
    assert rc == 0
    assert "float32, KV cache float16]" in capsys.readouterr().out


def test_generate_deterministic_says_so(tiny_llama, capsys):
    rc = main(["generate", "--model", str(tiny_llama), "--deterministic", "--prompt", "hello world",
               "--max-tokens", "3", "--temperature", "0", "--ignore-eos"])  # fmt: skip
    assert rc == 0
    assert "float32, deterministic]" in capsys.readouterr().out


def test_generate_json_and_chat_template(tiny_llama, capsys):
    rc = main(["generate", "--model", str(tiny_llama), "--dtype", "float32", "--prompt", "hi", "--chat", "--json",
               "--max-tokens", "4", "--temperature", "0", "--ignore-eos"])
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
    rc = main(["chat", "--model", str(tiny_llama), "--dtype", "float32", "--max-tokens", "5", "--temperature", "0",
               "--ignore-eos", "--stats"])
    captured = capsys.readouterr()
    assert rc == 0
    assert len([line for line in captured.out.splitlines() if line.strip()]) == 3  # three replies
    assert captured.err.count("TTFT") == 3 and "(conversation reset)" in captured.err
    # The second turn carries the first: its prompt is longer than a fresh single-message chat.
    prompt_lens = [int(m) for m in re.findall(r"\[(\d+) prompt", captured.err)]
    assert prompt_lens[1] > prompt_lens[0] and prompt_lens[2] < prompt_lens[1]


@pytest.mark.slow
def test_bundled_model_knows_the_capital_of_france(capsys):
    rc = main(["generate", "--chat", "--prompt", "What is the capital of France?", "--temperature", "0"])
    assert rc == 0
    assert "Paris" in capsys.readouterr().out
