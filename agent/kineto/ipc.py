"""A dynolog-compatible IPC endpoint: answers libkineto's registration and config polls.

Processes started with KINETO_USE_DAEMON=1 poll "dynolog" over a connectionless AF_UNIX datagram socket:
the abstract name "\\0dynolog\\0" (trailing NUL included), or `$KINETO_IPC_SOCKET_DIR/dynolog` when that
variable is set. Each message is a header `{size_t size; char type[32]}` followed by `size` bytes:
  "ctxt": {int32 gpu; int32 pid; int64 jobid}            -> reply "ctxt" with an int32 (instances seen)
  "req":  {int32 type; int32 n; int64 jobid; int32 pids[n]} -> reply "req" with a config text ("" = nothing)
`pids` is the requesting process then its ancestors; `type` is a bit set (1 events, 2 activities).
libkineto waits only ~50 ms (5 x 10 ms) for a reply, so the endpoint answers on its own thread, never
from a source's step(). Layout read from pytorch/kineto ipcfabric/FabricManager.h and dynolog
IPCMonitor.cpp; the reply goes to the sender's address as recvfrom() reports it.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

NAME = "dynolog"
HEADER = struct.Struct("=Q32s")          # size_t size; char type[32]
CTXT = struct.Struct("=iiq")             # gpu, pid, jobid
REQ = struct.Struct("=iiq")              # type, n, jobid; then n int32 pids
MAX_DATAGRAM = 64 * 1024
CONFIG_EVENTS, CONFIG_ACTIVITIES = 1, 2


@dataclass(frozen=True)
class Request:
    """One config poll: pids[0] is the polling process, the rest its ancestors."""

    pids: tuple[int, ...]
    config_type: int
    jobid: int


def socket_address(socket_dir: str = "") -> str | bytes:
    """Where libkineto sends: '<dir>/dynolog' for filesystem sockets, else the abstract b'\\0dynolog\\0'."""
    if socket_dir:
        return os.path.join(socket_dir, NAME)
    return b"\0" + NAME.encode() + b"\0"


def encode(msg_type: str, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), msg_type.encode()) + payload


def decode(data: bytes) -> tuple[str, bytes]:
    """(type, payload) of one datagram; ValueError when it is not a well-formed fabric message."""
    if len(data) < HEADER.size:
        raise ValueError(f"short datagram ({len(data)} bytes)")
    size, raw_type = HEADER.unpack_from(data)
    if size != len(data) - HEADER.size:
        raise ValueError(f"header says {size} payload bytes, datagram has {len(data) - HEADER.size}")
    return raw_type.split(b"\0", 1)[0].decode("ascii", "replace"), data[HEADER.size:]


def parse_request(payload: bytes) -> Request:
    if len(payload) < REQ.size:
        raise ValueError("short req payload")
    config_type, n, jobid = REQ.unpack_from(payload)
    if n <= 0 or len(payload) != REQ.size + 4 * n:
        raise ValueError(f"req payload of {len(payload)} bytes does not hold {n} pids")
    return Request(struct.unpack_from(f"={n}i", payload, REQ.size), config_type, jobid)


class DynologEndpoint:
    """Binds the dynolog socket and serves it on a daemon thread.

    `on_request(Request) -> str` returns the config text for one poll (called on the endpoint thread;
    it must be quick and thread-safe). Counters: requests, registrations, unexpected (malformed or
    unknown messages, ignored), send_errors (a reply that could not be delivered).
    """

    def __init__(self, on_request: Callable[[Request], str], socket_dir: str = "") -> None:
        self.on_request = on_request
        self.address = socket_address(socket_dir)
        self.requests = self.registrations = self.unexpected = self.send_errors = 0
        self.registered: dict[int, int] = {}   # pid -> gpu from "ctxt"
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def open(self) -> None:
        """Bind now (raises OSError, e.g. EADDRINUSE when dynolog or another agent holds the name)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            if isinstance(self.address, str):
                if os.path.exists(self.address):
                    os.unlink(self.address)  # a stale socket file of an earlier run
                sock.bind(self.address)
                os.chmod(self.address, 0o666)  # workload processes may run as other users
            else:
                sock.bind(self.address)
            # blocking: close() wakes the loop with a datagram of its own (no periodic wake-up while idle)
        except OSError:
            sock.close()
            raise
        self._sock = sock

    def start(self) -> None:
        if self._sock is None:
            self.open()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="kineto-ipc", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                data, addr = self._sock.recvfrom(MAX_DATAGRAM)
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.01)  # a persistent error must not spin
                continue
            if self._stop.is_set():
                return
            self.handle(data, addr)

    def _wake(self) -> None:
        """Unblock recvfrom() in _loop: an empty datagram to our own address."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(b"", self.address)
        except OSError:
            pass

    def handle(self, data: bytes, addr) -> None:
        """Answer one datagram; anything unexpected is counted and dropped, never raised."""
        try:
            msg_type, payload = decode(data)
            if msg_type == "ctxt":
                if len(payload) != CTXT.size:
                    raise ValueError("ctxt payload size")
                gpu, pid, _jobid = CTXT.unpack(payload)
                self.registrations += 1
                self.registered[pid] = gpu
                reply = encode("ctxt", struct.pack("=i", len(self.registered)))
            elif msg_type == "req":
                req = parse_request(payload)
                self.requests += 1
                config = self.on_request(req) if req.config_type & CONFIG_ACTIVITIES else ""
                reply = encode("req", config.encode())
            else:
                raise ValueError(f"unknown message type {msg_type!r}")
        except Exception:
            self.unexpected += 1
            return
        if not addr:
            self.unexpected += 1  # an unbound sender cannot be answered
            return
        try:
            self._sock.sendto(reply, addr)
        except OSError:  # the client went away (ECONNREFUSED, ENOENT) or its queue is full (EAGAIN)
            self.send_errors += 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and release the name. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._wake()
            self._thread.join(timeout_s)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            if isinstance(self.address, str):
                try:
                    os.unlink(self.address)
                except OSError:
                    pass
