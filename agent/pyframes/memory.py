"""Reads another process's memory through /proc/PID/mem (pread), without stopping it.

pread on /proc/PID/mem was about 2x cheaper than process_vm_readv from Python here (FACTS.md).
Opening it needs ptrace access (root, CAP_SYS_PTRACE, or the same user where Yama allows it).
"""

from __future__ import annotations

import errno
import os
import struct

_U64 = struct.Struct("<Q")
_I32 = struct.Struct("<i")


class PyFramesError(RuntimeError):
    """Base of everything the sampler reports as a clear, non-crashing error."""


class ProcessGone(PyFramesError):
    pass


class NoPermission(PyFramesError):
    pass


class ReadError(PyFramesError):
    """An address could not be read (unmapped, or the process changed under us)."""


class ProcessChanged(PyFramesError):
    """The process exec'd another program since attach: attach again."""


def process_state(pid: int, proc_root: str = "/proc") -> str:
    """The one-letter scheduler state from /proc/PID/stat, or "" when the process is gone."""
    try:
        with open(os.path.join(proc_root, str(pid), "stat"), "rb") as fh:
            stat = fh.read()
        return chr(stat[stat.rindex(b")") + 2])
    except (OSError, ValueError, IndexError):
        return ""


class Memory:
    def __init__(self, pid: int, proc_root: str = "/proc") -> None:
        self.pid = pid
        self.proc_root = proc_root
        path = os.path.join(proc_root, str(pid), "mem")
        try:
            self.exe = os.readlink(os.path.join(proc_root, str(pid), "exe"))
        except OSError:
            self.exe = ""
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, ProcessLookupError):
            raise ProcessGone(f"process {pid} does not exist or has exited") from None
        except PermissionError as exc:
            who = "uid 0" if os.geteuid() == 0 else f"uid {os.geteuid()}"
            raise NoPermission(f"permission denied reading the memory of process {pid} (as {who}: {exc.strerror}); "
                               "needs CAP_SYS_PTRACE over it (root in the same user namespace, or the same user "
                               "with kernel.yama.ptrace_scope=0)") from None
        self.reads = 0

    def read(self, addr: int, size: int) -> bytes:
        self.reads += 1
        try:
            data = os.pread(self.fd, size, addr)
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                raise ProcessGone(f"process {self.pid} exited") from None
            self._check_alive()
            raise ReadError(f"cannot read {size} bytes at {addr:#x} in process {self.pid}: {exc.strerror}") from None
        except OverflowError:
            raise ReadError(f"address {addr:#x} out of range") from None
        if len(data) != size:
            if not data:
                # a process with no memory any more: exited (zombie), or exec'd another program
                self._check_alive()
            raise ReadError(f"short read at {addr:#x}: {len(data)} of {size} bytes")
        return data

    def _check_alive(self) -> None:
        state = process_state(self.pid, self.proc_root)
        if state in ("", "Z", "X"):
            raise ProcessGone(f"process {self.pid} exited")
        # an exiting process releases its memory before it turns zombie: its maps are empty by then
        try:
            with open(os.path.join(self.proc_root, str(self.pid), "maps"), "rb") as fh:
                if not fh.read(1):
                    raise ProcessGone(f"process {self.pid} is exiting")
        except (FileNotFoundError, ProcessLookupError):
            raise ProcessGone(f"process {self.pid} exited") from None
        except OSError:
            pass
        try:
            exe = os.readlink(os.path.join(self.proc_root, str(self.pid), "exe"))
        except OSError:
            return
        if exe != self.exe:
            raise ProcessChanged(f"process {self.pid} exec'd {exe} (was {self.exe}); attach again")
        probe = None
        try:
            fd = os.open(os.path.join(self.proc_root, str(self.pid), "mem"), os.O_RDONLY | os.O_CLOEXEC)
            os.close(fd)
            probe = True
        except OSError:
            probe = False
        if probe and self._mm_changed():
            raise ProcessChanged(f"process {self.pid} exec'd (same executable {exe}); attach again")

    def _mm_changed(self) -> bool:
        """The fd we hold belongs to the old address space when a read of the stack comes back empty."""
        try:
            with open(os.path.join(self.proc_root, str(self.pid), "maps")) as fh:
                for line in fh:
                    if line.rstrip().endswith("[stack]"):
                        lo = int(line.split("-", 1)[0], 16)
                        return not os.pread(self.fd, 1, lo)
        except (OSError, ValueError):
            return False
        return False

    def u64(self, addr: int) -> int:
        return _U64.unpack(self.read(addr, 8))[0]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
