"""`--speculative-config` with `--spec-acceptance` or `--spec-acceptance-profile` on `roofline`
(sim's and plan's are in tests/sim/test_speculative_sim.py): the table, the crossover, the JSON and
a one-line error naming the flag for every bad value."""

import json

import pytest

from servelab.cli import main
from servelab.workload.acceptance import AcceptanceProfile

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'
ROOFLINE = ["roofline", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--context", "512"]


def test_roofline_prints_speculation_against_plain_decoding(capsys):
    assert main([*ROOFLINE, "--batch", "1,64,800", "--speculative-config", NGRAM, "--spec-acceptance", "0.7"]) == 0
    out = capsys.readouterr().out
    assert "2.77 tokens per verification step" in out
    rows = {line.split()[0]: line.split() for line in out.split("speculative decoding:")[1].splitlines()[3:6]}
    assert float(rows["1"][-1].rstrip("x")) == pytest.approx(2.76, abs=0.02)
    assert float(rows["800"][-1].rstrip("x")) < 1.0
    assert "speculation stops paying from batch 501 at context 512 (within the memory limit" in out


def test_roofline_json_carries_the_speculative_row(capsys):
    args = [*ROOFLINE, "--json", "--batch", "1,8", "--speculative-config", NGRAM, "--spec-acceptance", "0"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    spec = rows[0]["speculative"]
    assert spec["tokens_per_step"] == 1.0 and spec["crossover_batch"] == 1
    assert spec["plain_tpot_s"] == pytest.approx(rows[0]["step_time_s"])
    assert spec["speedup"] < 1.0
    assert main([*ROOFLINE, "--json", "--batch", "1"]) == 0
    assert "speculative" not in json.loads(capsys.readouterr().out)[0]


def test_roofline_reads_an_acceptance_profile(tmp_path, capsys):
    path = tmp_path / "acceptance.json"
    counts = [80, 60, 30, 10]
    profile = AcceptanceProfile(num_drafts=100, num_draft_tokens=400, num_accepted_tokens=180,
                                accepted_per_position=tuple(counts), source="test")  # fmt: skip
    profile.write(path)
    args = [*ROOFLINE, "--json", "--batch", "1", "--speculative-config", NGRAM, "--spec-acceptance-profile", str(path)]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)[0]["speculative"]["tokens_per_step"] == pytest.approx(2.8)


def test_roofline_with_a_draft_model(capsys):
    config = '{"model": "llama-3.2-1b", "num_speculative_tokens": 3}'
    assert main([*ROOFLINE, "--batch", "1", "--speculative-config", config, "--spec-acceptance", "0.8"]) == 0
    assert "3 forward passes of the draft model llama-3.2-1b per step" in capsys.readouterr().out
    assert main([*ROOFLINE, "--json", "--batch", "1", "--speculative-config", config, "--spec-acceptance", "0.8"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    # the draft's weights and KV share the memory: fewer sequences fit than the target alone allows
    assert 0 < row["speculative"]["memory_limit_batch"] < 833
    assert main([*ROOFLINE, "--json", "--batch", "1", "--speculative-config", NGRAM, "--spec-acceptance", "0.8"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["speculative"]["memory_limit_batch"] == 833


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--speculative-config", "{bad"], "--speculative-config: speculative_config must be a JSON object"),
        (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens is required"),
        (["--speculative-config", NGRAM], "needs exactly one of --spec-acceptance"),
        (["--spec-acceptance", "0.5"], "--spec-acceptance needs --speculative-config"),
        (["--speculative-config", NGRAM, "--spec-acceptance", "1.5"], "--spec-acceptance must be in [0, 1]"),
        (["--speculative-config", NGRAM, "--spec-acceptance", "nan"], "--spec-acceptance must be in [0, 1]"),
        (
            ["--speculative-config", NGRAM, "--spec-acceptance", "0.5", "--spec-acceptance-profile", "x.json"],
            "exactly one of",
        ),
        (
            ["--speculative-config", NGRAM, "--spec-acceptance-profile", "/no/such.json"],
            "'/no/such.json': no such file",
        ),
        (
            ["--speculative-config", '{"model": "nope-7b", "num_speculative_tokens": 2}', "--spec-acceptance", ".5"],
            "speculative_config.model 'nope-7b'",
        ),
    ],
)
def test_bad_speculation_flags_are_one_line_errors(capsys, args, needle):
    assert main([*ROOFLINE, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert needle in captured.err and len(captured.err.strip().splitlines()) == 1


def test_a_short_profile_names_the_flag(tmp_path, capsys):
    path = tmp_path / "acceptance.json"
    AcceptanceProfile(num_drafts=10, num_draft_tokens=20, num_accepted_tokens=15, accepted_per_position=(9, 6)).write(
        path
    )
    assert main([*ROOFLINE, "--speculative-config", NGRAM, "--spec-acceptance-profile", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"error: --spec-acceptance-profile: profile {path} covers 2 draft position(s), fewer than " in err
