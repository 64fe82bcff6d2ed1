"""Optional consistent snapshots: briefly stop only the Python threads with PTRACE_SEIZE +
PTRACE_INTERRUPT, sample, and detach.

Only threads that own a Python thread state are stopped (stopping every native thread stalls
processes with many of them; py-spy issue #872). A target is never left stopped: every thread is
detached in a `finally`, and if the agent dies mid-sample the kernel detaches its tracees, which
then resume (a PTRACE_INTERRUPT stop is a ptrace-stop, not a group-stop). Needs CAP_SYS_PTRACE
and a Yama ptrace_scope that allows it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import time

from steplens.agent.pyframes.memory import NoPermission, PyFramesError

PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_DETACH = 17
_WALL = 0x40000000

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


def _ptrace(req: int, tid: int) -> None:
    if _libc.ptrace(req, tid, None, None) == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class StoppedThreads:
    """Context manager: `with StoppedThreads(tids): sample()`; returns how long they were stopped."""

    def __init__(self, tids: list[int], timeout_s: float = 0.05) -> None:
        self.tids = [t for t in tids if t]
        self.timeout_s = timeout_s
        self.seized: list[int] = []
        self.stopped_ns = 0
        self._t0 = 0

    def __enter__(self) -> "StoppedThreads":
        try:
            for tid in self.tids:
                try:
                    _ptrace(PTRACE_SEIZE, tid)
                except OSError as exc:
                    if exc.errno == errno.ESRCH:
                        continue  # the thread exited meanwhile
                    if exc.errno == errno.EPERM:
                        raise NoPermission(f"cannot ptrace thread {tid}: needs CAP_SYS_PTRACE "
                                           "(and kernel.yama.ptrace_scope <= 1 for root)") from None
                    raise PyFramesError(f"PTRACE_SEIZE {tid}: {exc.strerror}") from None
                self.seized.append(tid)
            self._t0 = time.monotonic_ns()
            for tid in self.seized:
                try:
                    _ptrace(PTRACE_INTERRUPT, tid)
                except OSError:
                    pass
            deadline = time.monotonic() + self.timeout_s
            pending = set(self.seized)
            while pending and time.monotonic() < deadline:
                for tid in list(pending):
                    try:
                        pid, _ = os.waitpid(tid, os.WNOHANG | _WALL)
                    except ChildProcessError:
                        pending.discard(tid)
                        continue
                    if pid == tid:
                        pending.discard(tid)
            return self
        except BaseException:
            self._detach()
            raise

    def _detach(self) -> None:
        for tid in self.seized:
            try:
                _ptrace(PTRACE_DETACH, tid)
            except OSError:
                pass
        self.seized = []

    def __exit__(self, *exc) -> bool:
        self._detach()
        if self._t0:
            self.stopped_ns = time.monotonic_ns() - self._t0
        return False
