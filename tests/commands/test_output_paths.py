"""Output files and folders are checked before a run starts, so a run's results are never lost
to a typo in a path; and a negative workload seed is a one-line error, not numpy's traceback."""

from __future__ import annotations

import os

import pytest

from servelab.cli import main

SIM = ["sim", "--rate", "5", "--num-requests", "3", "--no-progress"]
BENCH = ["bench", "--base-url", "http://127.0.0.1:9", "--concurrency", "1", "--num-requests", "1", "--no-progress"]
PLAN = ["plan", "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--slo-tpot", "50ms"]
ROOFLINE = ["roofline", "--model", "llama-3.1-8b", "--hardware", "h100-sxm"]


@pytest.fixture
def bad(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return {
        "missing_dir": str(tmp_path / "nope" / "out.jsonl"),
        "a_dir": str(tmp_path),
        "a_file": str(a_file),
        "under_a_file": str(a_file / "plots"),
    }


@pytest.mark.parametrize(
    ("argv", "flag", "kind", "needle"),
    [
        (SIM, "--requests-out", "missing_dir", "does not exist"),
        (SIM, "--requests-out", "a_dir", "is a directory"),
        (SIM, "--plot-dir", "a_file", "is not a directory"),
        (SIM, "--plot-dir", "under_a_file", "is not a directory"),
        (BENCH, "--save-result", "missing_dir", "does not exist"),
        (BENCH, "--requests-out", "a_dir", "is a directory"),
        (BENCH, "--plot-dir", "a_file", "is not a directory"),
        (PLAN, "--plot", "missing_dir", "does not exist"),
        (ROOFLINE, "--plot", "missing_dir", "does not exist"),
    ],
)
def test_unwritable_outputs_fail_before_the_run(argv, flag, kind, needle, bad, capsys):
    assert main([*argv, flag, bad[kind]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and needle in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(("argv", "flag"), [(PLAN, "--plot"), (ROOFLINE, "--plot")])
def test_a_plot_format_matplotlib_cannot_write_fails_before_the_run(argv, flag, tmp_path, capsys):
    assert main([*argv, flag, str(tmp_path / "frontier.txt")]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "format 'txt' is not one of" in captured.err and "png" in captured.err
    assert captured.out == ""  # refused before any table is printed
    assert not (tmp_path / "frontier.txt").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a /proc file system")
@pytest.mark.parametrize(
    ("argv", "flag", "path"),
    [
        (SIM, "--requests-out", "/proc/servelab-x.jsonl"),
        (SIM, "--plot-dir", "/proc/servelab-x"),
        (BENCH, "--requests-out", "/proc/servelab-x.jsonl"),
        (BENCH, "--plot-dir", "/proc/servelab-x/plots"),
        (ROOFLINE, "--plot", "/proc/servelab-x.png"),
        (PLAN, "--plot", "/proc/servelab-x.png"),
    ],
)
def test_a_folder_that_refuses_new_files_fails_before_the_run(argv, flag, path, capsys):
    # /proc passes os.access(W_OK) for root, yet no file can be made in it
    assert main([*argv, flag, path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and "cannot" in err and "Traceback" not in err, err


def test_the_write_check_leaves_nothing_behind(tmp_path, capsys):
    assert main([*SIM, "--requests-out", str(tmp_path / "r.jsonl"), "--plot-dir", str(tmp_path / "plots")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots", "r.jsonl"]


def test_writable_outputs_are_written(tmp_path, capsys):
    out = tmp_path / "requests.jsonl"
    assert main([*SIM, "--requests-out", str(out), "--plot-dir", str(tmp_path / "new" / "plots")]) == 0
    assert len(out.read_text().splitlines()) == 3
    assert sorted(p.name for p in (tmp_path / "new" / "plots").iterdir())


@pytest.mark.parametrize("argv", [SIM, BENCH])
def test_negative_seed_is_a_one_line_error(argv, capsys):
    assert main([*argv, "--seed", "-1"]) == 2
    assert "seed must be >= 0, got -1" in capsys.readouterr().err
