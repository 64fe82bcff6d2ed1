"""steplens anchors: the end time of each optimizer step of the job, in a shared-memory ring the agent reads.

Loaded by steplens_bootstrap inside the job (standard library only). Why: Flight Recorder gives a gloo
collective's enqueue time only and nothing marks what follows the last collective of an iteration (the
optimizer step), so a step cut from the comm ops alone ends an all-reduce plus an optimizer step early; the
optimizer step's end is where the iteration ends (what follows it, zero_grad and the loop's own bookkeeping,
is short). `install()` registers a global torch.optim optimizer-step post hook
(`torch.optim.optimizer.register_optimizer_step_post_hook`, public since torch 2.0) that writes CLOCK_REALTIME
ns of each optimizer step's end into the ring. The agent's flightrec source reads it next to the process's
worker-server socket and its segmenter ends each step there (agent/steps.py).

Why a file and not a worker-server handler: a Python handler runs on the server's thread and needs the GIL,
while `_WorkerServer.shutdown()` at exit joins that thread holding the GIL: a request arriving during the
job's exit deadlocked it (seen on the testbed job). Reading a file needs nothing from the job.

Layout of <runtime dir>/<pid>.anchors (little-endian; HEADER_BYTES + slots x 16 bytes, 64 KiB by default):
  0   8s   magic b"SLANCHR1"
  8   u32  version (1)          12  u32  slots
  16  u64  start time of the process (clock ticks since boot, /proc/self/stat field 22: a recycled pid's
           stale file is told apart)
  24  u32  clock (1: CLOCK_REALTIME)
  32  u64  count: optimizer steps written so far
  64  slots, slot k holds anchor number n with n % slots == k: u64 n + 1 (0 while being rewritten), u64 end ns
Writer order per anchor: the slot's number to 0, the time, the number, then count; a reader takes the numbers
it has not seen below count, keeps a slot only if its number is the one expected, and drops those the writer
may have reached again meanwhile (number <= count re-read after - slots), so a torn or overwritten slot is
never taken (x86 keeps stores in order; elsewhere a torn slot could give one wrong time).
Cost: one hook call per optimizer step, a lock, a clock read and three 8-byte stores into the mapping
(0.6 us measured on the 2-core VM, no system call); the hook returns None and swallows its errors, so it
never changes or breaks the step. Bounded: the ring (oldest overwritten); 4096 slots last 40 s at 100
steps/s, the agent reads every 1-5 s.
Caveat: a global optimizer hook is visible to torch.compile of an optimizer step; STEPLENS_ANCHORS=0 turns
this off.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time

MAGIC = b"SLANCHR1"
VERSION = 1
CLOCK_REALTIME = 1
HEADER_BYTES = 64
SLOT_BYTES = 16
DEFAULT_SLOTS = 4096
SUFFIX = ".anchors"
_HEAD = struct.Struct("<8sIIQI")   # magic, version, slots, start ticks, clock
_U64 = struct.Struct("<Q")
COUNT_AT = 32


def path_for(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{pid}{SUFFIX}")


class Ring:
    """The writer side: a fixed-size mapped file, one slot per optimizer step (see the module docstring)."""

    def __init__(self, path: str, start_ticks: int, slots: int = DEFAULT_SLOTS) -> None:
        self.path, self.slots, self.count = path, slots, 0
        self.lock = threading.Lock()
        size = HEADER_BYTES + slots * SLOT_BYTES
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _HEAD.pack_into(self.map, 0, MAGIC, VERSION, slots, start_ticks, CLOCK_REALTIME)
        os.replace(tmp, path)  # a reader never sees a file without its header

    def add(self, end_ns: int) -> None:
        with self.lock:
            n = self.count
            off = HEADER_BYTES + (n % self.slots) * SLOT_BYTES
            _U64.pack_into(self.map, off, 0)
            _U64.pack_into(self.map, off + 8, end_ns)
            _U64.pack_into(self.map, off, n + 1)
            self.count = n + 1
            _U64.pack_into(self.map, COUNT_AT, n + 1)

    def snapshot(self) -> list[list[int]]:
        """[[number, end ns], ...] of the anchors the ring still holds, oldest first (for the exit dump)."""
        with self.lock:
            n = self.count
            out = []
            for k in range(max(0, n - self.slots), n):
                off = HEADER_BYTES + (k % self.slots) * SLOT_BYTES
                out.append([k, _U64.unpack_from(self.map, off + 8)[0]])
            return out

    def close(self, unlink: bool = True) -> None:
        try:
            self.map.close()
        except (ValueError, BufferError):
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except OSError:
                pass


_ring: Ring | None = None


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    """Global optimizer-step post hook: the step's end into the ring (returns None, never raises)."""
    try:
        ring = _ring
        if ring is not None:
            ring.add(time.time_ns())
    except Exception:
        pass


def install(directory: str, start_ticks: int, slots: int = DEFAULT_SLOTS) -> Ring:
    """Create the ring and register the hook (torch must be imported); raises on failure, the caller catches."""
    global _ring
    from torch.optim.optimizer import register_optimizer_step_post_hook
    ring = Ring(path_for(directory, os.getpid()), start_ticks, slots)
    _ring = ring
    register_optimizer_step_post_hook(_on_optimizer_step)
    return ring


def close() -> None:
    """At exit, after the exit dump took the snapshot: the hook stops writing and the file goes."""
    global _ring
    ring, _ring = _ring, None
    if ring is not None:
        ring.close()


def read(path: str, start_ticks: int = -1, after: int = -1) -> tuple[list[tuple[int, int]], str]:
    """Reader side, for tests and tools (the agent's flightrec source has its own copy, tested against this):
    ([(number, end ns)] newer than `after`, oldest first; "" or why none could be read)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
            again = os.pread(fh.fileno(), 8, COUNT_AT)  # the count after the copy: slots it reached are unsafe
    except OSError as exc:
        return [], f"{exc.strerror or exc}"
    if len(data) < HEADER_BYTES or len(again) < 8:
        return [], "short file"
    magic, version, slots, ticks, clock = _HEAD.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION or clock != CLOCK_REALTIME or len(data) < HEADER_BYTES + slots * SLOT_BYTES:
        return [], "not an anchors ring of version 1"
    if start_ticks >= 0 and ticks != start_ticks:
        return [], "another process's ring (pid reused)"
    count = _U64.unpack_from(data, COUNT_AT)[0]
    out = []
    for n in range(max(after + 1, _U64.unpack(again)[0] - slots + 1, 0), count):
        off = HEADER_BYTES + (n % slots) * SLOT_BYTES
        num, ns = struct.unpack_from("<QQ", data, off)
        if num == n + 1:
            out.append((n, ns))
    return out, ""
