"""`servelab bench` reports the server's speculative-decoding acceptance over its run, from the
counters on /metrics (vLLM's or servelab's names), and writes it as an acceptance profile."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from servelab.bench.spec_decode import SpecCounters, SpecDecodeReport, parse_counters, per_request_acceptance
from servelab.cli import main as cli_main
from servelab.workload.acceptance import AcceptanceProfile, RequestAcceptance, load_profile

MOCK = Path(__file__).with_name("mock_openai_server.py")

VLLM = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="q"} 100.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="q"} 50.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="q"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="q"} 300.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="q"} 150.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="q"} 120.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="q"} 60.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="q",position="0"} 70.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="q",position="1"} 35.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="q",position="2"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="q",position="0"} 35.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="q",position="1"} 18.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="q",position="2"} 7.0
vllm:prefix_cache_hits_total{engine="0",model_name="q"} 10.0
"""
SERVELAB = """servelab:spec_decode_num_drafts_total 10
servelab:spec_decode_num_draft_tokens_total 40
servelab:spec_decode_num_accepted_tokens_total 7
servelab:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 2
servelab:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 5
"""


def test_counters_are_summed_over_label_sets_except_the_position():
    assert parse_counters(VLLM) == SpecCounters(150.0, 450.0, 180.0, (105.0, 53.0, 22.0))
    assert parse_counters(SERVELAB) == SpecCounters(10.0, 40.0, 7.0, (5.0, 2.0))
    # servelab's namespace first when a server exports both
    assert parse_counters(VLLM + SERVELAB) == parse_counters(SERVELAB)


def test_missing_or_partial_counters():
    assert parse_counters("") is None
    assert parse_counters("vllm:prefix_cache_hits_total 3\n") is None
    no_drafts = "\n".join(line for line in VLLM.splitlines() if "num_drafts_total" not in line)
    assert parse_counters(no_drafts) is None  # a total missing: not a spec-decode export
    no_positions = "\n".join(line for line in VLLM.splitlines() if "per_pos" not in line)
    assert parse_counters(no_positions) == SpecCounters(150.0, 450.0, 180.0, ())
    # a position never exported counts 0; a malformed value is skipped
    gap = SERVELAB.replace('position="1"} 2', 'position="3"} 2') + 'servelab:spec_decode_num_drafts_total{x="1"} oops\n'
    assert parse_counters(gap) == SpecCounters(10.0, 40.0, 7.0, (5.0, 0.0, 0.0, 2.0))
    # a servelab export without its totals falls back to vLLM's
    assert parse_counters(VLLM + 'servelab:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 5\n') == (
        parse_counters(VLLM)
    )


def test_the_report_is_the_difference_over_the_run():
    before = SpecCounters(150.0, 450.0, 180.0, (105.0, 53.0, 22.0))
    after = SpecCounters(350.0, 1050.0, 420.0, (265.0, 113.0, 42.0))
    report = SpecDecodeReport.between(before, after, source="http://h/v1 m edit")
    p = report.profile
    assert (p.num_drafts, p.num_draft_tokens, p.num_accepted_tokens) == (200, 600, 240)
    assert p.accepted_per_position == (160, 60, 20) and p.num_speculative_tokens == 3
    assert p.acceptance_rate == pytest.approx(0.4)
    assert p.mean_accepted_per_draft == pytest.approx(1.2) and p.tokens_per_step == pytest.approx(2.2)
    assert p.acceptance_per_position == pytest.approx((0.8, 0.375, 1 / 3))
    d = report.to_dict()
    assert d["acceptance_rate"] == pytest.approx(0.4) and d["tokens_per_step"] == pytest.approx(2.2)
    assert d["accepted_per_position"] == [160, 60, 20] and "source" not in d
    lines = report.lines()
    assert lines[0] == "Speculative decoding (server)"
    assert "240 (40.0% of draft tokens)" in lines[2] and lines[-1].endswith("0: 80%  1: 38%  2: 33%")
    # positions that appear only after the run started count from 0
    grown = SpecDecodeReport.between(SpecCounters(0, 0, 0, ()), SpecCounters(4, 8, 3, (2, 1)))
    assert grown.profile.accepted_per_position == (2, 1)
    assert SpecDecodeReport.between(None, after) is None and SpecDecodeReport.between(before, None) is None
    idle = SpecDecodeReport.between(before, before)
    assert not idle.drafted and idle.lines() == [] and idle.to_dict()["num_drafts"] == 0


@pytest.fixture(scope="module")
def spec_server():
    proc = subprocess.Popen(
        [sys.executable, str(MOCK), "--ttft-ms", "5", "--tpot-ms", "2", "--spec-tokens", "3"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield f"http://127.0.0.1:{int(proc.stdout.readline().split()[1])}"
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def plain_server():
    proc = subprocess.Popen([sys.executable, str(MOCK), "--ttft-ms", "5", "--tpot-ms", "2"], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        yield f"http://127.0.0.1:{int(proc.stdout.readline().split()[1])}"
    finally:
        proc.kill()
        proc.wait()


def _argv(url: str, *more: str) -> list[str]:
    return ["bench", "--base-url", url, "--concurrency", "2", "--num-requests", "4", "--output-len", "5",
            "--input-len", "16", "--no-progress", *more]  # fmt: skip


# The mock's steps accept 0, 1, 2, 3, 0 of 3 drafts over a 5-token output: per request 5 drafts,
# 15 draft tokens, 6 accepted, positions (3, 2, 1); the run has 4 requests.
WANT = {"num_drafts": 20, "num_draft_tokens": 60, "num_accepted_tokens": 24, "accepted_per_position": [12, 8, 4]}


def test_bench_prints_the_block_and_writes_the_profile(spec_server, tmp_path, capsys):
    out_file = tmp_path / "edit.json"
    for _ in range(2):  # the second run against the same server reports its own drafts only
        assert cli_main(_argv(spec_server, "--spec-profile-out", str(out_file))) == 0
        printed = capsys.readouterr().out
        block = printed[printed.index("Speculative decoding (server)") :].splitlines()
        assert block[1].split()[-2:] == ["20", "(60)"]
        assert "24 (40.0% of draft tokens)" in block[2] and block[3].endswith("1.20") and block[4].endswith("2.20")
        assert block[5].endswith("0: 60%  1: 67%  2: 50%")
        # each request's own counts (its usage.spec_decode): 5 tokens in 3 decode steps, one kept draft
        assert block[6] == "  Per request, tokens a step      p10 1.33  p50 1.33  p90 1.33 (4 requests)"
        assert f"wrote {out_file}" in printed
        profile = load_profile(out_file)
        assert profile.to_dict() | WANT == profile.to_dict() and profile.num_speculative_tokens == 3
        assert profile.source.startswith(f"{spec_server}/v1 mock-model 4 requests")
        assert profile.per_request == (RequestAcceptance(3, 2, 5, (1, 0, 0)),) * 4
    data = json.loads(out_file.read_text())
    assert data["acceptance_per_position"] == pytest.approx([0.6, 2 / 3, 0.5]) and data["acceptance_rate"] == 0.4


def test_bench_json_and_saved_result_carry_the_spec_decode_key(spec_server, tmp_path, capsys):
    saved = tmp_path / "res.json"
    assert cli_main(_argv(spec_server, "--json", "--warmup", "1", "--save-result", str(saved))) == 0
    data = json.loads(capsys.readouterr().out)
    # the warm-up request's 5 drafts are in the counters' growth, as for the prefix cache
    assert data["spec_decode"]["num_drafts"] == 25 and data["spec_decode"]["tokens_per_step"] == pytest.approx(2.2)
    assert json.loads(saved.read_text())["spec_decode"] == data["spec_decode"]


def test_a_server_without_the_counters_gets_no_block_and_no_profile(plain_server, tmp_path, capsys):
    assert cli_main(_argv(plain_server, "--json")) == 0
    assert "spec_decode" not in json.loads(capsys.readouterr().out)
    assert cli_main(_argv(plain_server)) == 0
    assert "Speculative decoding" not in capsys.readouterr().out
    out_file = tmp_path / "p.json"
    assert cli_main(_argv(plain_server, "--spec-profile-out", str(out_file))) == 1
    captured = capsys.readouterr()
    assert "Requests (completed / failed)" in captured.out  # the run's report all the same
    assert "exports no speculative-decoding counters" in captured.err and not out_file.exists()


def test_a_profile_is_refused_for_a_capacity_search(capsys):
    argv = ["bench", "--base-url", "http://127.0.0.1:9", "--find-capacity", "--slo-tpot", "1s"]
    assert cli_main([*argv, "--spec-profile-out", "p.json"]) == 2
    assert "--spec-profile-out" in capsys.readouterr().err


def test_the_generated_tokens_give_the_decode_steps_and_the_draft_coverage():
    served = SERVELAB + (
        'servelab:generation_tokens_total{model_name="m"} 400\n'
        'servelab:request_success_total{finished_reason="length",model_name="m"} 3\n'
        'servelab:request_success_total{finished_reason="stop",model_name="m"} 1\n'
    )
    before = parse_counters(served)
    assert before == SpecCounters(10.0, 40.0, 7.0, (5.0, 2.0), 400.0, 4.0)
    # 8 requests, 1,008 tokens: 1,000 from decode steps, 240 of them accepted drafts, so 760 steps
    after = SpecCounters(210.0, 840.0, 247.0, (165.0, 82.0), 1408.0, 12.0)
    p = SpecDecodeReport.between(before, after).profile
    assert p.num_decode_steps == 760 and p.draft_coverage == pytest.approx(200 / 760)
    assert "Decode steps with drafts        200 of 760 (26.3%)" in "\n".join(SpecDecodeReport(p).lines())
    # without the totals, or with counts that do not close (a request in flight), no step count
    assert SpecDecodeReport.between(parse_counters(SERVELAB), after).profile.num_decode_steps is None
    short = SpecCounters(210.0, 840.0, 247.0, (165.0, 82.0), 600.0, 12.0)
    assert SpecDecodeReport.between(before, short).profile.num_decode_steps is None


def test_per_request_counts_come_from_usage_and_a_malformed_entry_is_left_out():
    good = {"num_decode_steps": 14, "num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 5,
            "accepted_per_position": [3, 2, 0]}  # fmt: skip
    records = per_request_acceptance([
        good,
        {"num_decode_steps": 0, "num_drafts": 0, "num_draft_tokens": 0, "accepted_per_position": []},
        {**good, "num_decode_steps": 3},  # more drafts than decode steps: counts that do not close
        {"num_drafts": 4},  # fields missing
        {**good, "accepted_per_position": [2, 3, 0]},  # rises with the position
        {**good, "num_drafts": "4"},
        {**good, "num_draft_tokens": 2.5},
        "not an object",
    ])  # fmt: skip
    assert records == (RequestAcceptance(14, 4, 12, (3, 2, 0)), RequestAcceptance(0, 0, 0, ()))
    p10, p50, p90 = SpecDecodeReport(AcceptanceProfile(4, 12, 5, (3, 2, 0), per_request=records)).per_request_spread()
    assert p10 == p50 == p90 == pytest.approx(1 + 5 / 14)  # the request with no decode step has no ratio
