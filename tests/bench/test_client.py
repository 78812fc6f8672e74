"""The load generator against a mock OpenAI streaming server with a known schedule."""

from __future__ import annotations

import asyncio
import json
import time
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from servelab.bench.client import BenchRequest, OpenAIStreamClient, ServerUnreachable, normalize_base_url
from servelab.bench.records import to_records
from servelab.bench.runner import run_load
from servelab.cli import main as cli_main
from servelab.errors import InvalidArgument
from servelab.metrics import summarize

MOCK = Path(__file__).with_name("mock_openai_server.py")
TTFT_S, TPOT_S = 0.050, 0.080


@pytest.fixture(scope="module")
def mock_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("mock") / "server.jsonl"
    proc = subprocess.Popen(
        [sys.executable, str(MOCK), "--ttft-ms", str(TTFT_S * 1e3), "--tpot-ms", str(TPOT_S * 1e3), "--log", str(log)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(proc.stdout.readline().split()[1])
        yield f"http://127.0.0.1:{port}", log
    finally:
        proc.kill()
        proc.wait()


def _server_log(log: Path, want: set[str] = frozenset(), timeout_s: float = 10.0) -> dict[str, dict]:
    """The mock server's rows by prompt; it writes a row after the stream's [DONE], so a client can
    end before its last rows land: wait (up to `timeout_s`) until every prompt in `want` has one."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = {}
        for line in log.read_text().splitlines():
            row = json.loads(line)
            rows[row["prompt"].split()[0]] = row
        if want <= rows.keys() or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


async def _run(url: str, requests, concurrency: int, endpoint: str = "chat", **kw):
    async with OpenAIStreamClient(url, model="mock-model", endpoint=endpoint, max_connections=concurrency, **kw) as c:
        # Warm-up opens the pool's connections, as `servelab bench --warmup` does.
        await run_load(
            c, [BenchRequest(10**6 + i, f"warm-{i}", 1, 2) for i in range(concurrency)], concurrency=concurrency
        )
        return await run_load(c, requests, concurrency=concurrency)


def test_ttft_and_tpot_within_2ms_of_truth_at_64_streams(mock_server):
    url, log = mock_server
    # Output lengths vary so the 64 streams do not all end (and resend) in the same instant.
    requests = [BenchRequest(i, f"acc-{i} hello", 4, 6 + i % 7) for i in range(192)]
    outcome = asyncio.run(_run(url, requests, concurrency=64))
    assert all(r.success for r in outcome.results), [r.error for r in outcome.results if not r.success]
    truth = _server_log(log, {f"acc-{r.index}" for r in outcome.results})
    ttft_err, tpot_err, sched_err = [], [], []
    for r in outcome.results:
        row = truth[f"acc-{r.index}"]
        writes = row["token_s"]
        assert len(r.token_times_s) == len(writes) == r.output_tokens_planned
        # True TTFT: from the client's send to the server writing the first content token;
        # true TPOT: the server's own spacing of its writes (same monotonic clock, other process).
        ttft_err.append((r.first_token_s - r.send_s) - (writes[0] - r.send_s))
        measured_tpot = (r.token_times_s[-1] - r.first_token_s) / (len(r.token_times_s) - 1)
        tpot_err.append(measured_tpot - (writes[-1] - writes[0]) / (len(writes) - 1))
        sched_err.append(writes[0] - row["received_s"] - TTFT_S)
    # The role-only chunk, sent at once, must not have been taken as the first token.
    assert min(r.first_token_s - r.send_s for r in outcome.results) >= TTFT_S
    assert abs(statistics.median(ttft_err)) <= 0.002, statistics.median(ttft_err)
    assert abs(statistics.mean(tpot_err)) <= 0.002, statistics.mean(tpot_err)
    assert abs(statistics.median(tpot_err)) <= 0.002
    records, report = to_records(outcome.results, outcome.start_s, None)
    summary = summarize(records, outcome.duration_s)
    assert summary.completed == 192 and summary.failed == 0
    assert report.output_tokens_from_usage == 192
    # The mock kept to its schedule, so the configured delays are the truth too.
    assert statistics.median(sched_err) < 0.002
    assert abs(summary.tpot_s.p50 - TPOT_S) <= 0.002


def max_in_flight(results) -> int:
    events = sorted([(r.send_s, 1) for r in results] + [(r.end_s, -1) for r in results])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def test_role_only_first_chunk_is_not_ttft(mock_server):
    url, _ = mock_server
    out = asyncio.run(_run(url, [BenchRequest(0, "role-0 x", 1, 3)], concurrency=1))
    r = out.results[0]
    assert r.success and r.text == " tok0 tok1 tok2"
    assert r.first_token_s - r.send_s >= TTFT_S
    assert len(r.token_times_s) == 3


def test_failures_are_counted_with_reasons(mock_server):
    url, _ = mock_server
    requests = [
        BenchRequest(0, "ok-0", 1, 4),
        BenchRequest(1, "FAIL-1", 1, 4),
        BenchRequest(2, "DROP-2", 1, 6),
        BenchRequest(3, "HANG-3", 1, 4),
        BenchRequest(4, "ok-4", 1, 4),
    ]
    out = asyncio.run(_run(url, requests, concurrency=5, timeout_s=1.0))
    by_index = {r.index: r for r in out.results}
    assert len(out.results) == 5
    assert by_index[0].success and by_index[4].success
    assert by_index[1].error.startswith("HTTP 500: injected failure")
    assert by_index[2].error.startswith("stream dropped")
    assert by_index[3].error.startswith("timeout")
    records, report = to_records(out.results, out.start_s, None)
    summary = summarize(records, out.duration_s)
    assert (summary.completed, summary.failed) == (2, 3)
    assert sum(report.failures.values()) == 3
    assert any(k.startswith("HTTP 500") for k in report.failures)


def test_usage_disagreement_is_reported(mock_server):
    url, _ = mock_server
    out = asyncio.run(
        _run(url, [BenchRequest(0, "BADUSAGE-0", 1, 5), BenchRequest(1, "fine-1", 1, 5)], 2, endpoint="completions")
    )
    records, report = to_records(out.results, out.start_s, lambda text: len(text.split()))
    assert report.output_mismatch == 1 and report.output_mismatch_max == 1
    assert [r.output_tokens for r in records] == [6, 5]  # the server's usage is the authority


def test_open_loop_records_planned_and_actual_send_times(mock_server):
    url, _ = mock_server
    planned = [0.0, 0.05, 0.10, 0.30]
    requests = [BenchRequest(i, f"open-{i}", 1, 2, planned_send_s=t) for i, t in enumerate(planned)]

    async def go():
        async with OpenAIStreamClient(url, model="m", max_connections=None) as c:
            return await run_load(c, requests)

    out = asyncio.run(go())
    for r, t in zip(out.results, planned):
        assert r.planned_send_s == pytest.approx(out.start_s + t)
        assert 0 <= r.send_lag_s < 0.02


def test_unreachable_server_is_a_clear_error():
    async def go():
        async with OpenAIStreamClient("http://127.0.0.1:9", model="m") as c:
            await c.list_models()

    with pytest.raises(ServerUnreachable, match="cannot reach the server at http://127.0.0.1:9/v1"):
        asyncio.run(go())


def test_cli_unreachable_exits_2(capsys):
    rc = cli_main(
        [
            "bench",
            "--base-url",
            "http://127.0.0.1:9",
            "--concurrency",
            "2",
            "--num-requests",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "4",
        ]
    )
    assert rc == 2
    assert "cannot reach the server" in capsys.readouterr().err


def test_base_url_normalization():
    assert normalize_base_url("http://h:8000/") == "http://h:8000/v1"
    assert normalize_base_url("http://h:8000/v1") == "http://h:8000/v1"
    with pytest.raises(InvalidArgument):
        normalize_base_url("h:8000")


def test_cli_json_is_the_shared_summary_schema(mock_server, tmp_path, capsys):
    url, _ = mock_server
    out_file = tmp_path / "req.jsonl"
    rc = cli_main(
        [
            "bench",
            "--base-url",
            url,
            "--concurrency",
            "4",
            "--num-requests",
            "12",
            "--input-len",
            "16",
            "--output-len",
            "5",
            "--warmup",
            "2",
            "--json",
            "--slo-tpot",
            "100ms",
            "--requests-out",
            str(out_file),
            "--save-result",
            str(tmp_path / "res.json"),
        ]
    )
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    # Key for key what `servelab sim --json` prints, so the two compare field by field.
    assert set(data["summary"]) == set(summarize([], 1.0).to_dict())
    assert data["summary"]["completed"] == 12 and data["summary"]["goodput"] > 0
    assert len(out_file.read_text().splitlines()) == 12
    assert json.loads((tmp_path / "res.json").read_text())["summary"] == data["summary"]


def test_cli_fails_when_no_request_completes_and_keeps_the_report(mock_server, tmp_path, capsys):
    url, _ = mock_server
    saved = tmp_path / "res.json"
    rc = cli_main(
        [
            "bench",
            "--base-url",
            url,
            "--concurrency",
            "2",
            "--num-requests",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--request-timeout",
            "10ms",
            "--no-progress",
            "--save-result",
            str(saved),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 1
    assert "0 / 2" in captured.out and "2 x timeout" in captured.out  # the report is printed all the same
    assert captured.err.splitlines()[-1] == (
        "servelab bench: no request completed: 2 of 2 failed (2 x timeout: no complete response within 0.01s)"
    )
    assert json.loads(saved.read_text())["summary"]["failed"] == 2


def test_cli_capacity_search_fails_when_no_level_completes_a_request(mock_server, capsys):
    url, _ = mock_server
    rc = cli_main(
        [
            "bench",
            "--base-url",
            url,
            "--find-capacity",
            "--slo-tpot",
            "200ms",
            "--max-load",
            "2",
            "--num-requests",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--request-timeout",
            "10ms",
            "--no-progress",
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 1 and json.loads(captured.out)["capacity"]
    assert "servelab bench: no request completed" in captured.err.splitlines()[-1]


def test_cli_rejects_bad_arguments(capsys):
    rc = cli_main(["bench", "--base-url", "http://127.0.0.1:9", "--concurrency", "2", "--warmup", "-1"])
    assert rc == 2 and "--warmup" in capsys.readouterr().err
    rc = cli_main(["bench", "--base-url", "http://127.0.0.1:9", "--find-capacity", "--concurrency", "1"])
    assert rc == 2 and "--slo-tpot" in capsys.readouterr().err


def test_no_arrival_within_the_duration_is_a_clear_error(mock_server, capsys):
    url, _ = mock_server
    # at 0.01 req/s the first arrival (drawn too) lands far past one second
    rc = cli_main(["bench", "--base-url", url, "--model", "mock-model", "--rate", "0.01", "--duration", "1s",
                   "--input-len", "8", "--output-len", "4", "--seed", "1"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "no request arrives within --duration 1 s" in err and "Traceback" not in err


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_a_reasoning_models_thinking_counts_as_tokens(field):
    from servelab.bench.client import StreamResult, _chunk_text

    result = StreamResult(index=0, planned_send_s=None, send_s=0.0, end_s=0.0, prompt_tokens_planned=1,
                          output_tokens_planned=1)  # fmt: skip
    assert _chunk_text({"choices": [{"delta": {field: "Let me think"}}]}, result) == "Let me think"
    assert _chunk_text({"choices": [{"delta": {"content": "4"}}]}, result) == "4"


def test_capacity_and_duration_arguments_that_cannot_run_are_named(capsys):
    base = ["bench", "--base-url", "http://127.0.0.1:9"]
    rc = cli_main([*base, "--find-capacity", "--slo-tpot", "50ms", "--max-load", "0.5"])
    assert (
        rc == 2 and "--max-load is a number of clients with --search concurrency: at least 1" in capsys.readouterr().err
    )
    rc = cli_main([*base, "--rate", "1000", "--duration", "1000s"])
    err = capsys.readouterr().err
    assert rc == 2 and "--rate 1000 for --duration 1000 s plans 1,500,016 requests" in err, err
