"""`servelab lab`: serves the page and its API; bad arguments exit 2 with one line."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest

from servelab.cli import main


def test_bad_port_is_a_one_line_error(capsys):
    assert main(["lab", "--port", "70000"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "servelab lab: error: --port: must be between 1 and 65535, got 70000"


def test_port_in_use_is_a_one_line_error(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["lab", "--port", str(port)]) == 2
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


@pytest.mark.slow
def test_servelab_lab_serves_the_page_and_api():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "servelab", "lab", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                page = httpx.get(url + "/", timeout=5)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "servelab lab did not start"
                time.sleep(0.2)
        assert page.status_code == 200 and "servelab lab" in page.text
        batching = httpx.post(url + "/api/lessons/batching", json={"batch": 64}, timeout=30).json()
        assert batching["selected"]["tokens_per_s_total"] == pytest.approx(4500, rel=0.1)
        assert (
            httpx.get(url + "/static/plotly.min.js", timeout=30).headers["content-type"].startswith("text/javascript")
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_bad_profile_is_a_one_line_error(capsys, tmp_path):
    bad = tmp_path / "profile.json"
    bad.write_text("{}")
    assert main(["lab", "--port", "1", "--profile", str(bad)]) == 2  # refused before any port is tried
    assert "not a servelab profile" in capsys.readouterr().err
