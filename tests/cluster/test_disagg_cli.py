"""`serve --disagg P:D`'s flags: refused combinations exit 2 with one line naming the flag,
before any port is bound or model loaded."""

from __future__ import annotations

import pytest

from servelab.cli import main


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--disagg", "2"], "--disagg takes P:D, the prefill and decode worker counts (e.g. 1:1), got '2'"),
    (["serve", "--disagg", "one:one"], "--disagg takes P:D"),
    (["serve", "--disagg", "0:1"], "--disagg needs at least one prefill and one decode worker, got 0:1"),
    (["serve", "--disagg", "1:1", "--data-parallel", "2"], "--disagg P:D and --data-parallel N: give one"),
    (["serve", "--disagg", "1:1", "--kv-transfer-timeout", "0s"], "--kv-transfer-timeout: must be > 0, got '0s'"),
    (["serve", "--disagg", "1:1", "--kv-transfer-timeout=-1s"], "--kv-transfer-timeout: must be > 0, got '-1s'"),
    (["serve", "--disagg", "1:1", "--kv-transfer-timeout", "later"], "--kv-transfer-timeout"),
    (["serve", "--kv-transfer-timeout", "5s"], "--kv-transfer-timeout, --kv-transfer-granularity: only with --disagg"),
    (["serve", "--kv-transfer-granularity", "layer"], "only with --disagg P:D"),
])  # fmt: skip
def test_bad_disagg_flags_exit_2_naming_the_flag(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("servelab serve: error:"), err
