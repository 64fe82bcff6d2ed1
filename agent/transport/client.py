"""The agent's side of the Ingest stream: sends spooled batches in order, answers clock probes,
applies acks and hands commands to the agent's control handler.

One long-lived bidirectional gRPC stream. On connect: Hello -> HelloAck(last committed seq), then
batches from last_seq + 1 with at most `window_batches` unacknowledged. A clock reply's t3 is
stamped in the request generator just before gRPC takes the message, so time spent queued behind
batches does not count as network delay. Reconnects back off exponentially with jitter.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Callable

import grpc

from steplens import SCHEMA_VERSION, __version__, conn
from steplens.agent.governor import name_native_thread
from steplens.v1 import ingest_pb2 as ipb
from steplens.v1 import ingest_pb2_grpc as igrpc

log = logging.getLogger("steplens.agent.transport")

GRPC_WAIT_SLICE_SECONDS = 1.0


def quiet_grpc_waits(seconds: float = GRPC_WAIT_SLICE_SECONDS) -> bool:
    """grpc's synchronous API waits for a stream's next message in slices of 0.1 s (grpc._common.
    MAXIMUM_WAIT_TIMEOUT), so that a signal handler of a thread blocked in it runs within 0.1 s: ten wake-ups a
    second of the transport thread on an idle agent (part of its idle CPU, bench/agent_footprint.py). The agent
    waits on its stream only in its transport thread, never in the main thread, where Python runs signal handlers,
    so longer slices delay nothing. Best effort: False where this grpc has no such setting."""
    try:
        from grpc import _common
    except ImportError:
        return False
    if not isinstance(getattr(_common, "MAXIMUM_WAIT_TIMEOUT", None), float):
        return False
    _common.MAXIMUM_WAIT_TIMEOUT = max(_common.MAXIMUM_WAIT_TIMEOUT, seconds)
    return True

_STOP = object()


@dataclass
class TransportConfig:
    collector: str                  # HOST:PORT, or several collectors of one cluster: HOST:PORT,HOST:PORT,...
    agent_id: str
    insecure: bool = False
    tls: conn.TlsFiles | None = None
    window_batches: int = 8
    status_interval_seconds: float = 5.0
    reconnect_min_seconds: float = 0.5
    reconnect_max_seconds: float = 30.0
    hello_timeout_seconds: float = 15.0


class _PendingClockReply:
    __slots__ = ("probe_id", "t1", "t2")

    def __init__(self, probe_id: int, t1: int, t2: int) -> None:
        self.probe_id, self.t1, self.t2 = probe_id, t1, t2


class StreamClient:
    def __init__(self, cfg: TransportConfig, spool, status_fn: Callable[[bool], ipb.AgentStatus],
                 command_fn: Callable[[ipb.Command], ipb.CommandResult | None],
                 mono_ns: Callable[[], int] = time.monotonic_ns, hostname: str = "", boot_id: str = "") -> None:
        self.cfg = cfg
        self.spool = spool
        self._status_fn = status_fn
        self._command_fn = command_fn
        self._mono_ns = mono_ns
        self._hostname = hostname
        self._boot_id = boot_id
        self._stop = threading.Event()
        self._drain = threading.Event()
        self._thread: threading.Thread | None = None
        self.connected = False
        self.last_error = ""
        self.connects = 0
        self._wake = threading.Condition()
        self._outbox: queue.Queue | None = None
        self._call = None
        self._last_acked = 0
        self._appends = 0  # bumped by every spool append, so the sender never sleeps through one
        self._status_due = False  # a status to send now, not at the next interval (status_soon)
        # several collectors: agents spread over them by their id, each staying with its own while it answers
        self.targets = conn.split_addresses(cfg.collector)
        self._tried = 0  # collectors tried in a row without a lasting stream
        self._target = zlib.crc32(cfg.agent_id.encode()) % len(self.targets)
        self.target = self.targets[self._target]
        spool.add_listener(self._notify)

    def status_soon(self) -> None:
        """Send the agent's status at once (a source came up or went down) instead of at the next interval."""
        with self._wake:
            self._status_due = True
            self._wake.notify_all()

    def _notify(self) -> None:
        with self._wake:
            self._appends += 1
            self._wake.notify_all()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="transport", daemon=True)
        self._thread.start()

    def drain_and_stop(self, timeout: float) -> bool:
        """Send everything spooled (until acked or timeout), a final status, then close. True if drained."""
        self._drain.set()
        deadline = time.monotonic() + timeout
        drained = False
        while time.monotonic() < deadline:
            if self.connected and self.spool.stats().backlog_batches == 0:
                drained = True
                break
            time.sleep(0.02)
        outbox = self._outbox
        if self.connected and outbox is not None:
            try:
                outbox.put(ipb.AgentMessage(status=self._status_fn(True)))
            except Exception:
                pass
        self._stop.set()
        if outbox is not None:
            outbox.put(_STOP)
        with self._wake:
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(max(0.5, deadline - time.monotonic() + 1.0))
        call = self._call
        if call is not None:
            call.cancel()
        return drained

    # -- connection loop -------------------------------------------------------------------
    def _main(self) -> None:
        name_native_thread("sl-transport")
        quiet_grpc_waits()
        delay = self.cfg.reconnect_min_seconds
        while not self._stop.is_set():
            started = time.monotonic()
            got_hello = False
            try:
                got_hello = self._run_stream()
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                self.last_error = f"{code.name if code else 'ERROR'}: {exc.details() if hasattr(exc, 'details') else exc}"
                if not self._stop.is_set():
                    log.warning("stream to %s ended: %s", self.target, self.last_error)
            except Exception as exc:  # never let the transport thread die
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("transport error")
            finally:
                self.connected = False
                self.spool.reset_in_flight()
            if self._stop.is_set():
                break
            if len(self.targets) > 1:
                # the next collector of the cluster: at once after a stream that had lasted (its collector
                # went away, another takes over), with the back-off once every one of them was tried
                self._target = (self._target + 1) % len(self.targets)
                self.target = self.targets[self._target]
                self._tried += 1
                if got_hello and time.monotonic() - started > 10:
                    self._tried = 1
                if self._tried < len(self.targets):
                    log.info("trying collector %s", self.target)
                    continue
                self._tried = 0
            if got_hello and time.monotonic() - started > 10:
                delay = self.cfg.reconnect_min_seconds
            sleep = delay * random.uniform(0.8, 1.2)
            self._stop.wait(sleep)
            delay = min(self.cfg.reconnect_max_seconds, delay * 2)

    def _requests(self, outbox: queue.Queue):
        while True:
            item = outbox.get()
            if item is _STOP:
                return
            if isinstance(item, _PendingClockReply):
                item = ipb.AgentMessage(clock=ipb.ClockReply(
                    probe_id=item.probe_id, t1_ns=item.t1, t2_mono_ns=item.t2, t3_mono_ns=self._mono_ns()))
            yield item

    def _run_stream(self) -> bool:
        cfg = self.cfg
        channel = conn.client_channel(self.target, cfg.insecure, cfg.tls)
        outbox: queue.Queue = queue.Queue()
        self._outbox = outbox
        stats = self.spool.stats()
        outbox.put(ipb.AgentMessage(hello=ipb.Hello(
            schema_version=SCHEMA_VERSION, agent_id=cfg.agent_id, spool_id=stats.spool_id,
            hostname=self._hostname, agent_version=__version__, boot_id=self._boot_id, mono_ns=self._mono_ns())))
        try:
            stub = igrpc.IngestStub(channel)
            call = stub.Stream(self._requests(outbox))
            self._call = call
            self.connects += 1
            return self._receive(call, outbox)
        finally:
            outbox.put(_STOP)
            self._call = None
            channel.close()

    def _receive(self, call, outbox: queue.Queue) -> bool:
        hello_deadline = time.monotonic() + self.cfg.hello_timeout_seconds
        sender: threading.Thread | None = None
        state = {"last_sent": 0, "in_flight": []}
        got_hello = False
        watchdog = threading.Timer(self.cfg.hello_timeout_seconds, lambda: (not got_hello) and call.cancel())
        watchdog.daemon = True
        watchdog.start()
        try:
            for msg in call:
                kind = msg.WhichOneof("msg")
                if kind == "probe":
                    outbox.put(_PendingClockReply(msg.probe.probe_id, msg.probe.t1_ns, self._mono_ns()))
                elif kind == "ack":
                    self._on_ack(msg.ack.seq, state)
                elif kind == "hello_ack":
                    got_hello = True
                    watchdog.cancel()
                    last = msg.hello_ack.last_seq
                    self.spool.reset_in_flight()
                    if last:
                        self.spool.ack(last)
                        self._last_acked = max(self._last_acked, last)
                    state["last_sent"] = last
                    self.connected = True
                    self.last_error = ""
                    sender = threading.Thread(target=self._sender, args=(outbox, state, call), name="sender",
                                              daemon=True)
                    sender.start()
                elif kind == "command":
                    threading.Thread(target=self._run_command, args=(msg.command, outbox), daemon=True).start()
                if not got_hello and time.monotonic() > hello_deadline:
                    raise TimeoutError("no HelloAck from the collector")
        finally:
            watchdog.cancel()
            self.connected = False
            with self._wake:
                self._wake.notify_all()
            if sender is not None:
                sender.join(2.0)
        return got_hello

    def _on_ack(self, seq: int, state: dict) -> None:
        self.spool.ack(seq)
        self._last_acked = max(self._last_acked, seq)
        with self._wake:
            state["in_flight"] = [s for s in state["in_flight"] if s > seq]
            self._wake.notify_all()

    def _run_command(self, command: ipb.Command, outbox: queue.Queue) -> None:
        try:
            result = self._command_fn(command)
        except Exception as exc:
            result = ipb.CommandResult(command_id=command.command_id, ok=False, message=f"{type(exc).__name__}: {exc}")
        if result is not None:
            outbox.put(ipb.AgentMessage(result=result))
            outbox.put(ipb.AgentMessage(status=self._status_fn(False)))

    def _sender(self, outbox: queue.Queue, state: dict, call) -> None:
        name_native_thread("sl-sender")
        cfg = self.cfg
        next_status = 0.0
        while self.connected and not self._stop.is_set():
            now = time.monotonic()
            if now >= next_status or self._status_due:
                self._status_due = False
                outbox.put(ipb.AgentMessage(status=self._status_fn(False)))
                next_status = now + cfg.status_interval_seconds
            seen = self._appends
            room = cfg.window_batches - len(state["in_flight"])
            batches = self.spool.take_for_send(state["last_sent"], room) if room > 0 else []
            if batches:
                with self._wake:
                    for seq, n, payload in batches:
                        state["in_flight"].append(seq)
                for seq, n, payload in batches:
                    outbox.put(ipb.AgentMessage(batch=ipb.Batch(
                        agent_id=cfg.agent_id, spool_id=self.spool.spool_id, seq=seq, n_records=n,
                        sent_mono_ns=self._mono_ns(), payload=payload)))
                    state["last_sent"] = seq
                continue
            # woken by a spool append, an ack or shutdown; otherwise only for the next status
            with self._wake:
                if self._appends == seen and not self._status_due:
                    self._wake.wait(0.01 if self._drain.is_set()
                                    else max(0.01, min(1.0, next_status - time.monotonic())))
