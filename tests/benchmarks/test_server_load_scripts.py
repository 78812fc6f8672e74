"""The benchmarks that start `servelab serve` and load it, in `--quick` mode on a tiny random
model: soak.py (RSS sampled under mixed load, a verdict) and big_requests.py (/health polled
while one big body is handled)."""

import json
import re
import sys
from pathlib import Path

import pytest

from tests.tiny_models import write_tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import big_requests  # noqa: E402
import soak  # noqa: E402

pytestmark = pytest.mark.slow  # each starts servers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny")))


def test_soak_quick_samples_the_server_and_gives_a_verdict(tiny, tmp_path, capsys):
    out = tmp_path / "soak.json"
    argv = ["--quick", "--server-args", f"--model {tiny}", "--server-log", str(tmp_path / "server.log")]
    rc = soak.main([*argv, "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == (0 if report["ok"] else 1) and report["argv"] == [*argv, "--out", str(out)]
    verdict = re.match(
        r"(PASS|FAIL): RSS after warm-up (\d+) MiB at \d+s, peak (\d+) MiB, last \d+ MiB: growth ([-+][\d.]+)% "
        r"\(limit 5%\); fitted slope [-+][\d.]+ MiB/min over \d+s$",
        report["verdict"],
    )
    assert verdict, report["verdict"]
    assert (verdict.group(1) == "PASS") == report["ok"] and int(verdict.group(3)) >= int(verdict.group(2)) > 0
    assert report["verdict"] in capsys.readouterr().out
    samples = report["samples"]
    assert len(samples) >= 15 and samples[-1]["elapsed_s"] >= 9.5 and all(s["rss_bytes"] > 0 for s in samples)
    counters = report["counters"]
    assert counters["requests"] > 20 and counters["output_tokens"] > 0
    # a random model may end a reply at once (no text); the server itself must not fail a request
    assert counters["errors"] < counters["requests"] / 10
    assert all(e.startswith("empty response") for e in counters["last_errors"]), counters["last_errors"]


def test_soak_quick_keeps_the_flags_given_beside_it(capsys):
    with pytest.raises(SystemExit):
        soak.main(["--quick", "--concurrency", "0"])
    assert "--concurrency must be >= 1, got 0" in capsys.readouterr().err


def test_big_requests_quick_answers_each_case_as_expected_while_health_answers(tiny, capsys):
    big_requests.main(["--quick", "--model", tiny])
    lines = capsys.readouterr().out.splitlines()
    pattern = (
        r"([\w-]+) \(([\d,]+) bytes\): (\d+) \(expected (\d+)\) in [\d.]+ s; /health idle p50 \d+ ms; "
        r"during: (\d+) polls, p50 (\d+) ms, p90 (\d+) ms, max (\d+) ms"
    )
    cases = [re.fullmatch(pattern, line) for line in lines]
    assert all(cases), lines
    assert [(m.group(1), m.group(2)) for m in cases] == [
        ("chat-10MB", "1,000,000"),
        ("chat-10MB-16MiB", "1,000,000"),
        ("tokenize-2MB", "200,000"),
    ]
    for m in cases:
        assert m.group(3) == m.group(4), m.group(0)  # 413 over the limit, 400 past the context, 200 tokenized
        assert int(m.group(5)) >= 1 and int(m.group(6)) <= int(m.group(7)) <= int(m.group(8))


def test_big_requests_names_an_unknown_case(capsys):
    with pytest.raises(SystemExit) as exc:
        big_requests.main(["chat-1GB"])
    assert exc.value.code == 2 and "unknown case(s) chat-1GB; choose from chat-10MB" in capsys.readouterr().err
