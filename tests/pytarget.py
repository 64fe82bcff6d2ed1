"""Target processes for the pyframes tests: started, waited for ("ready <json>" on stdout), and
always killed and reaped; plus the source markers (`# @name`) the tests locate lines with."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import threading
import time

import pytest


def markers(path: str) -> dict[str, int]:
    out = {}
    with open(path, encoding="utf-8") as fh:
        for no, line in enumerate(fh, 1):
            m = re.search(r"#\s*@(\w+)\s*$", line)
            if m:
                assert m.group(1) not in out, f"marker {m.group(1)} twice in {path}"
                out[m.group(1)] = no
    return out


class Target:
    """A child process that prints 'ready <json>' once in place; `close` kills and reaps it."""

    def __init__(self, argv: list[str], reap: bool = False, **kwargs) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
        self.pid = self.proc.pid
        self.info: dict = {}
        self.extra_pids: list[int] = []
        self._reaper = None
        if reap:  # reap the moment it exits, as a supervisor would: no zombie window
            self._reaper = threading.Thread(target=self.proc.wait, daemon=True)
            self._reaper.start()

    def wait_ready(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        buf = b""
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if r:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                buf += chunk
                for line in buf.decode(errors="replace").splitlines():
                    if line.startswith("ready"):
                        self.info = json.loads(line[len("ready"):].strip() or "{}")
                        return self.info
            elif self.proc.poll() is not None:
                break
        self.close()
        err = self.proc.stderr.read().decode(errors="replace")
        raise AssertionError(f"target {self.pid} never got ready (rc={self.proc.returncode}): {buf!r} {err[-2000:]}")

    def close(self) -> None:
        for pid in self.extra_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.returncode is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._reaper is not None:
            self._reaper.join(10)
        self.proc.wait(10)
        for fh in (self.proc.stdout, self.proc.stderr):
            fh.close()


@pytest.fixture
def spawn():
    started: list[Target] = []

    def start(argv: list[str], ready: bool = True, **kwargs) -> Target:
        t = Target(argv, **kwargs)
        started.append(t)
        if ready:
            t.wait_ready()
        return t
    yield start
    for t in started:
        t.close()


def task_states(pid: int) -> dict[int, str]:
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as fh:
                for line in fh:
                    if line.startswith("State:"):
                        out[int(tid)] = line.split()[1]
                        break
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out
