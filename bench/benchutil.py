"""Helpers shared by the bench/ scripts (run as `python bench/NAME.py`, so this directory is on sys.path)."""

from __future__ import annotations

import os
import signal
import subprocess


def cpu_ticks(pid: int, task: str = "") -> int:
    """utime + stime of a process (or one of its threads) in clock ticks, from /proc."""
    path = f"/proc/{pid}/task/{task}/stat" if task else f"/proc/{pid}/stat"
    with open(path) as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def threads(pid: int) -> dict[str, int]:
    """CPU ticks per thread name (summed over threads of one name)."""
    out: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                name = fh.read().strip()
            out[name] = out.get(name, 0) + cpu_ticks(pid, tid)
        except OSError:
            pass
    return out


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
