"""A light emulated agent for load tests: the agent's side of the Ingest wire protocol on asyncio
(grpc.aio), so thousands of streams fit in a few processes. The collector it talks to is the real
thing under test; this is only the load.

It speaks proto/steplens/v1/ingest.proto the way agent/transport/client.py does:
  Hello (schema version, agent_id, spool_id, hostname, agent_version, boot_id, mono_ns), every ClockProbe
  answered at once with a ClockReply (t2 stamped on receipt, t3 just before gRPC takes the message, as the
  real client does), HelloAck awaited (reconnecting if none comes within `hello_timeout_s`), batches resent
  from HelloAck.last_seq + 1 with contiguous seq, at most `window_batches` unacknowledged, payloads a
  RecordList from agent/transport/codec.py encode_records (built by the caller), cumulative Acks applied,
  AgentStatus at connect, every `status_interval_s` and a final one after the last ack, and every Command
  answered with a CommandResult plus a status: by `on_command` where one is given (stream.py answers
  FetchDetail for commops from bench/sim/agentview.py `commops()`, as a real agent answers from its node-local
  detail store), else ok=False, "simulated agent runs no commands".

What it leaves out (the real agent has these; the collector cannot tell the difference on the wire):
  - no spool, no durability: unacknowledged batches live in memory only (the caller bounds them; see
    `backlog`), and records are never dropped or turned into Gap records;
  - reconnects resend only what is still in memory from HelloAck.last_seq + 1; if the collector's last_seq
    is behind what it already acknowledged (a collector that lost its store), those batches are gone;
  - no sources, no deep mode, no node-local store: commands are refused unless `on_command` answers them;
  - plaintext channels only (loopback), no mutual TLS.

Threading: every method runs on the event loop except `produced` / `acked_seq` reads, which a producer
thread may use to apply backpressure (plain ints, written by one side each).
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
import uuid
from typing import Awaitable, Callable

import grpc

from steplens import SCHEMA_VERSION, __version__
from steplens.v1 import ingest_pb2 as ipb
from steplens.v1 import records_pb2 as rpb

METHOD = "/steplens.v1.Ingest/Stream"
_STOP = object()


class _ClockReply:
    __slots__ = ("probe_id", "t1", "t2")

    def __init__(self, probe_id: int, t1: int, t2: int) -> None:
        self.probe_id, self.t1, self.t2 = probe_id, t1, t2


def channel(address: str, extra_options: list | None = None) -> grpc.aio.Channel:
    """A plaintext aio channel with the real agent's options; many LightAgents share one."""
    from steplens import conn
    conn.require_insecure_allowed(address)
    # each channel its own TCP connection (gRPC would otherwise share one subchannel across channels)
    opts = conn.CHANNEL_OPTIONS + [("grpc.use_local_subchannel_pool", 1)] + (extra_options or [])
    return grpc.aio.insecure_channel(address, options=opts)


class LightAgent:
    def __init__(self, agent_id: str, *, window_batches: int = 8, status_interval_s: float = 5.0,
                 hello_timeout_s: float = 15.0, reconnect_min_s: float = 0.5, reconnect_max_s: float = 5.0,
                 spool_id: str | None = None, boot_id: str | None = None, hostname: str | None = None,
                 on_ack: Callable[["LightAgent"], None] | None = None,
                 on_command: Callable[[ipb.Command], Awaitable[ipb.CommandResult]] | None = None) -> None:
        self.agent_id = agent_id
        self.on_command = on_command
        self.spool_id = spool_id or uuid.uuid4().hex
        self.boot_id = boot_id or uuid.uuid4().hex
        self.hostname = hostname or agent_id
        self.window = window_batches
        self.status_interval_s = status_interval_s
        self.hello_timeout_s = hello_timeout_s
        self.reconnect_min_s, self.reconnect_max_s = reconnect_min_s, reconnect_max_s
        self.on_ack = on_ack
        self.pending: collections.deque = collections.deque()  # (seq, n_records, payload), oldest first
        self.produced = 0          # batches handed to append() (a producer thread may count ahead; see backlog)
        self.appended = 0          # highest seq appended
        self.acked_seq = 0
        self.last_sent = 0
        self.records_produced = 0
        self.records_acked = 0
        self.connected = False
        self.connects = 0
        self.hello_acks = 0
        self.first_ack_s: float | None = None  # seconds from run() to the first HelloAck
        self.probes_answered = 0
        self.commands = 0
        self.last_error = ""
        self.first_error = ""  # the error that ended the first stream, if any (kept across reconnects)
        self._outbox: asyncio.Queue | None = None
        self._stopping = False
        self._drained = asyncio.Event()
        self._closed = asyncio.Event()
        self._call = None
        self._next_status = 0.0

    # -- producer side -----------------------------------------------------------------------
    @property
    def backlog(self) -> int:
        """Batches produced and not yet acknowledged."""
        return self.produced - self.acked_seq

    def append(self, payload: bytes, n_records: int) -> int:
        """Queue one encoded RecordList as the next seq (event loop thread); returns the seq."""
        self.appended += 1
        self.produced = max(self.produced, self.appended)
        self.pending.append((self.appended, n_records, payload))
        self.records_produced += n_records
        self._drained.clear()
        self._pump()
        return self.appended

    # -- lifecycle ---------------------------------------------------------------------------
    async def run(self, ch: grpc.aio.Channel) -> None:
        """Connect and stream until close(); reconnects with backoff like the real client."""
        t0 = time.monotonic()
        delay = self.reconnect_min_s
        while not self._stopping:
            try:
                await self._stream_once(ch, t0)
                if self._stopping:
                    break
                self.last_error = self.last_error or "stream ended"
            except grpc.aio.AioRpcError as exc:
                self.last_error = f"{exc.code().name}: {exc.details()}"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the emulated agent alive, like the real transport thread
                self.last_error = f"{type(exc).__name__}: {exc}"
            finally:
                self.connected = False
            if self._stopping:
                break
            if not self.first_error:
                self.first_error = f"{self.last_error} ({time.monotonic() - t0:.1f} s after start)"
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(self.reconnect_max_s, delay * 2)
        self._closed.set()

    async def drain_and_close(self, timeout: float) -> bool:
        """Wait until every appended batch is acknowledged, send the final status, end the stream."""
        drained = True
        if self.acked_seq < self.appended:
            try:
                await asyncio.wait_for(self._drained.wait(), timeout)
            except asyncio.TimeoutError:
                drained = False
        self._stopping = True
        out = self._outbox
        if self.connected and out is not None:
            out.put_nowait(ipb.AgentMessage(status=self._status(final=True)))
            out.put_nowait(_STOP)
            try:  # the collector ends the stream once it has read our half-close
                await asyncio.wait_for(self._closed.wait(), 5.0)
            except asyncio.TimeoutError:
                pass
        if self._call is not None and not self._closed.is_set():
            self._call.cancel()
        return drained

    def debug_state(self) -> dict:
        return {"agent": self.agent_id, "appended": self.appended, "last_sent": self.last_sent,
                "acked": self.acked_seq, "connected": self.connected, "connects": self.connects,
                "outbox": self._outbox.qsize() if self._outbox is not None else None, "error": self.last_error}

    # -- one stream --------------------------------------------------------------------------
    async def _stream_once(self, ch: grpc.aio.Channel, t0: float) -> None:
        call = ch.stream_stream(METHOD, request_serializer=ipb.AgentMessage.SerializeToString,
                                response_deserializer=ipb.CollectorMessage.FromString)()
        self._call = call
        self.connects += 1
        self.last_error = ""
        out: asyncio.Queue = asyncio.Queue()
        self._outbox = out
        out.put_nowait(ipb.AgentMessage(hello=ipb.Hello(
            schema_version=SCHEMA_VERSION, agent_id=self.agent_id, spool_id=self.spool_id, hostname=self.hostname,
            agent_version=__version__, boot_id=self.boot_id, mono_ns=time.monotonic_ns())))
        writer = asyncio.create_task(self._write_loop(call, out))
        loop = asyncio.get_running_loop()
        got_hello = False

        def watchdog() -> None:
            if not got_hello:
                self.last_error = "no HelloAck from the collector"
                call.cancel()
        timer = loop.call_later(self.hello_timeout_s, watchdog)
        status_timer = None
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    break
                kind = msg.WhichOneof("msg")
                if kind == "probe":
                    self.probes_answered += 1
                    out.put_nowait(_ClockReply(msg.probe.probe_id, msg.probe.t1_ns, time.monotonic_ns()))
                elif kind == "ack":
                    self._on_ack(msg.ack.seq)
                elif kind == "hello_ack":
                    got_hello = True
                    timer.cancel()
                    self.hello_acks += 1
                    if self.first_ack_s is None:
                        self.first_ack_s = time.monotonic() - t0
                    last = msg.hello_ack.last_seq
                    if last:
                        self._on_ack(last)
                    self.last_sent = last  # resend whatever is still in memory after last
                    self.connected = True
                    out.put_nowait(ipb.AgentMessage(status=self._status()))
                    status_timer = asyncio.create_task(self._status_loop(out))
                    self._pump()
                elif kind == "command":
                    self.commands += 1
                    if self.on_command is not None:  # answered when ready; reads and acks go on meanwhile
                        asyncio.create_task(self._answer(msg.command, out))
                    else:
                        out.put_nowait(ipb.AgentMessage(result=ipb.CommandResult(
                            command_id=msg.command.command_id, ok=False, message="simulated agent runs no commands")))
                        out.put_nowait(ipb.AgentMessage(status=self._status()))
        finally:
            timer.cancel()
            self.connected = False
            if status_timer is not None:
                status_timer.cancel()
            out.put_nowait(_STOP)
            writer.cancel()
            self._outbox = None
            self._call = None
            if self._stopping:
                self._closed.set()

    async def _answer(self, cmd: ipb.Command, out: asyncio.Queue) -> None:
        try:
            result = await self.on_command(cmd)
        except Exception as exc:  # the handler's failure is the command's, never the stream's
            result = ipb.CommandResult(command_id=cmd.command_id, ok=False, message=f"{type(exc).__name__}: {exc}")
        out.put_nowait(ipb.AgentMessage(result=result))
        out.put_nowait(ipb.AgentMessage(status=self._status()))

    async def _write_loop(self, call, out: asyncio.Queue) -> None:
        try:
            while True:
                item = await out.get()
                if item is _STOP:
                    await call.done_writing()
                    return
                if type(item) is _ClockReply:
                    item = ipb.AgentMessage(clock=ipb.ClockReply(probe_id=item.probe_id, t1_ns=item.t1,
                                                                 t2_mono_ns=item.t2, t3_mono_ns=time.monotonic_ns()))
                await call.write(item)
        except (asyncio.CancelledError, grpc.aio.AioRpcError, grpc.aio.UsageError):
            pass

    async def _status_loop(self, out: asyncio.Queue) -> None:
        while True:
            await asyncio.sleep(self.status_interval_s * random.uniform(0.9, 1.1))
            out.put_nowait(ipb.AgentMessage(status=self._status()))

    def _status(self, final: bool = False) -> ipb.AgentStatus:
        backlog = [p for p in self.pending]
        return ipb.AgentStatus(mono_ns=time.monotonic_ns(), spool_backlog_batches=len(backlog),
                               spool_backlog_records=sum(n for _, n, _ in backlog),
                               spool_backlog_bytes=sum(len(p) for _, _, p in backlog),
                               records_produced=self.records_produced, records_acked=self.records_acked,
                               records_dropped=0, mode=rpb.MODE_SENTINEL, final=final)

    def _on_ack(self, seq: int) -> None:
        if seq <= self.acked_seq:
            return
        self.acked_seq = seq
        pending = self.pending
        while pending and pending[0][0] <= seq:
            self.records_acked += pending.popleft()[1]
        if self.acked_seq >= self.appended:
            self._drained.set()
        self._pump()
        if self.on_ack is not None:
            self.on_ack(self)

    def _pump(self) -> None:
        """Send pending batches after last_sent while the window has room."""
        out = self._outbox
        if not self.connected or out is None:
            return
        room = self.window - (self.last_sent - self.acked_seq)
        if room <= 0:
            return
        for seq, n, payload in self.pending:
            if seq <= self.last_sent:
                continue
            out.put_nowait(ipb.AgentMessage(batch=ipb.Batch(
                agent_id=self.agent_id, spool_id=self.spool_id, seq=seq, n_records=n,
                sent_mono_ns=time.monotonic_ns(), payload=payload)))
            self.last_sent = seq
            room -= 1
            if room <= 0:
                break
