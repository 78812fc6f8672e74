"""The "your machine" panel's background calibration: `servelab calibrate --base-url` against the
server the lab runs in, as a subprocess, one at a time.

A calibration from outside (the black-box profile, docs/fidelity.md) measures the server as it
serves, HTTP included, which is what the panel replays; run in the server's own process it would
compete with the server for the interpreter. The lab's run is sized to a short, stated budget
(LAB_BUDGET_S and LAB_FLAGS: shorter prompts, smaller bursts and two passes, against the CLI's
10-minute default), reports progress from calibrate's one-line-per-point output, and is ended
with the server. When it succeeds, `on_profile` loads the profile into the panel.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from servelab.errors import ServelabError

# Two passes over 22 points (prompts up to 256 tokens, bursts up to 4): the second pass is what
# gives the profile its noise verdict, so the budget leaves room for both.
LAB_BUDGET_S = 120
LAB_FLAGS = ("--max-prompt-tokens", "256", "--max-concurrency", "4", "--repeats", "2")
# What the fit, the profile's write and the interpreter's start add to the budget before the run
# counts as hung and is ended.
GRACE_S = 60
_PROGRESS = re.compile(r"^progress (\d+)/(\d+) ?(.*)$")
_TAIL_LINES = 20


class CalibrationRunning(ServelabError):
    http_status = 409
    error_type = "invalid_request_error"
    code = "calibration_running"


class CalibrationStopped(ServelabError):
    http_status = 503
    error_type = "server_overloaded"
    code = "shutting_down"


def calibrate_argv(base_url: str, out: str, served_model: str | None) -> list[str]:
    """The lab's `servelab calibrate` command line (the API key travels in the environment)."""
    argv = [sys.executable, "-m", "servelab.cli", "calibrate", "--base-url", base_url, "--out", out,
            "--budget", f"{LAB_BUDGET_S}s", *LAB_FLAGS]  # fmt: skip
    if served_model:
        argv += ["--served-model", served_model]
    return argv


@dataclass(slots=True)
class _Run:
    argv: list[str]
    out: str
    started_s: float
    process: subprocess.Popen[str] | None = None
    state: str = "running"  # running, done, failed, cancelled
    done_points: int = 0
    total_points: int | None = None
    label: str = ""
    finished_s: float | None = None
    error: str | None = None
    tail: list[str] = field(default_factory=list)  # the last lines calibrate printed


class CalibrationRunner:
    """At most one background calibration; `status()` for the page, `stop()` for a stopping server.
    `argv_for(base_url, out, served_model)` builds the command (tests give a stand-in)."""

    def __init__(
        self,
        on_profile: Callable[[dict[str, Any], str], None],
        argv_for: Callable[[str, str, str | None], list[str]] = calibrate_argv,
        budget_s: float = LAB_BUDGET_S,
        out_dir: str | None = None,
    ):
        self._on_profile = on_profile
        self._argv_for = argv_for
        self.budget_s = budget_s
        self._out_dir = out_dir
        self._run: _Run | None = None
        self._stopping = False
        self._lock = threading.Lock()

    def start(self, base_url: str, api_key: str | None, served_model: str | None) -> dict[str, Any]:
        with self._lock:
            if self._stopping:
                raise CalibrationStopped("the server is shutting down; it starts no calibration")
            if self._run is not None and self._run.state == "running":
                raise CalibrationRunning(
                    f"a calibration is already running ({self._run.done_points} points measured, "
                    f"{time.monotonic() - self._run.started_s:.0f} s of its {self.budget_s:g} s budget); "
                    "wait for it to finish"
                )
            out_dir = self._out_dir or tempfile.mkdtemp(prefix="servelab-lab-calibrate-")
            out = os.path.join(out_dir, f"profile-{time.strftime('%Y%m%dT%H%M%S')}.json")
            run = _Run(self._argv_for(base_url, out, served_model), out, time.monotonic())
            env = dict(os.environ)
            env.pop("SERVELAB_API_KEY", None)
            if api_key:
                env["SERVELAB_API_KEY"] = api_key
            try:
                run.process = subprocess.Popen(run.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                               env=env, start_new_session=True)  # fmt: skip
            except OSError as exc:
                raise ServelabError(f"could not start `servelab calibrate`: {exc.strerror or exc}") from None
            self._run = run
        threading.Thread(target=self._follow, args=(run,), name="lab-calibrate", daemon=True).start()
        return self.status()

    def _follow(self, run: _Run) -> None:
        process = run.process
        assert process is not None and process.stdout is not None
        deadline = threading.Timer(self.budget_s + GRACE_S, self._end, args=(run, "ran past its budget"))
        deadline.daemon = True
        deadline.start()
        for raw in process.stdout:
            line = raw.rstrip("\n")
            match = _PROGRESS.match(line)
            with self._lock:
                if match:
                    run.done_points, run.total_points, run.label = int(match[1]), int(match[2]), match[3]
                elif line.strip():
                    run.tail = [*run.tail, line][-_TAIL_LINES:]
        rc = process.wait()
        deadline.cancel()
        profile, error = None, None
        if run.state == "running" and rc == 0:
            from servelab.cost.profile import load_profile

            try:
                profile = load_profile(run.out)
            except ServelabError as exc:
                error = exc.message
        elif run.state == "running":
            error = _failure(run.tail, rc)
        with self._lock:
            run.finished_s = time.monotonic()
            if run.state == "running":
                run.state, run.error = ("done", None) if profile is not None else ("failed", error)
        if profile is not None:
            self._on_profile(profile, run.out)

    def _end(self, run: _Run, why: str) -> None:
        with self._lock:
            if run.state != "running":
                return
            run.state, run.error = "cancelled", f"the calibration was stopped: {why}"
        if run.process is not None and run.process.poll() is None:
            run.process.terminate()

    def stop(self) -> None:
        """Ends a running calibration and refuses new ones (the server is stopping)."""
        with self._lock:
            self._stopping = True
            run = self._run
        if run is not None:
            self._end(run, "the server is shutting down")

    def status(self) -> dict[str, Any]:
        with self._lock:
            run = self._run
            if run is None:
                return {"state": "idle", "budget_s": self.budget_s, "flags": list(LAB_FLAGS)}
            end = run.finished_s if run.finished_s is not None else time.monotonic()
            return {
                "state": run.state,
                "budget_s": self.budget_s,
                "flags": list(LAB_FLAGS),
                "elapsed_s": end - run.started_s,
                "points_done": run.done_points,
                "points_total": run.total_points,
                "current": run.label or None,
                "profile_path": run.out if run.state == "done" else None,
                "error": run.error,
                "output": list(run.tail),
            }


def _failure(tail: list[str], rc: int) -> str:
    """calibrate's own error line where it printed one, else its last words and exit status."""
    errors = [line for line in tail if "error:" in line]
    if errors:
        return errors[-1].split("error:", 1)[1].strip()
    last = tail[-1] if tail else "no output"
    return f"`servelab calibrate` exited with status {rc}: {last}"
