"""Helpers shared by the bench/ scripts (run as `python bench/NAME.py`, so this directory is on sys.path)."""

from __future__ import annotations

import signal
import subprocess


class Children:
    """Every child process we start; all are stopped (TERM, then KILL after a grace) on any exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(cmd, **kw)
        self.procs.append(p)
        return p

    @staticmethod
    def stop(p: subprocess.Popen, grace: float = 10.0) -> int | None:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
                p.wait(grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        return p.returncode

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            try:
                self.stop(p, 5.0)
            except Exception:
                pass
