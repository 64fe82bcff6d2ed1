"""The collector's Ingest service: one bidirectional stream per agent (grpc.aio).

Per stream: the first message must be a Hello with our schema version and, under mutual TLS, an
agent_id equal to the client certificate's common name. The collector then probes the agent's
clock (a burst, then one probe a second), answers HelloAck with the last committed seq, and from
then on hands each Batch to the store writer with the agent's current clock estimate, sending the
Ack only after the writer's commit. Requests arrive as raw bytes and are parsed here, so a
malformed frame gets INVALID_ARGUMENT with a reason instead of an opaque deserialization error.

Refusals (all leave other agents' streams untouched, and nothing of a refused batch is written):
  INVALID_ARGUMENT    malformed AgentMessage, batch for another agent/spool, first message not Hello
  FAILED_PRECONDITION schema version mismatch
  PERMISSION_DENIED   agent_id does not match the client certificate
  RESOURCE_EXHAUSTED  message over the size limit (enforced by gRPC itself)
  UNAVAILABLE         the store failed to commit (the agent keeps the batch and resends)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError

from steplens import SCHEMA_VERSION
from steplens.collector.ingest.clock import ClockEstimate, ClockModel, ClusterClock
from steplens.collector.store.writer import AgentUpdate, BatchJob, StoreWriter
from steplens.v1 import ingest_pb2 as ipb

log = logging.getLogger("steplens.collector.ingest")

AGENT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
_PROBE = object()
CLOCK_SAVE_INTERVAL_NS = 2 * 10**9
_CLOSE = object()


@dataclass
class IngestSettings:
    require_client_cert: bool = False  # mutual TLS: agent_id must equal the certificate CN
    probe_burst: int = 8
    probe_burst_spacing_seconds: float = 0.01
    probe_interval_seconds: float = 1.0          # for the first steady_after_seconds of a stream
    # then this: every probe is a round trip that wakes the agent's transport threads, and once the model has a
    # minute of 1 Hz exchanges (drift needs a 60 s span) the clock moves by ppm: 4 s keeps the 256-sample window
    # ~17 minutes long and cuts the agent's idle CPU for clock probes by 4 (bench/agent_footprint.py)
    steady_probe_interval_seconds: float = 4.0
    steady_after_seconds: float = 60.0
    min_probes_before_ack: int = 3
    hello_timeout_seconds: float = 10.0
    # batches handed to the store writer and not yet committed, over all streams; a stream with a batch
    # beyond this waits its turn (FIFO) instead of polling the writer's queue
    max_batches_in_writer: int = 256


@dataclass
class Session:
    agent_id: str
    spool_id: str
    boot_id: str
    peer: str
    outbox: asyncio.Queue
    model: ClockModel
    connected_ns: int
    pending: dict = field(default_factory=dict)  # command_id -> Future[CommandResult]
    closed: bool = False

    @property
    def clock(self) -> ClockEstimate | None:
        return self.model.estimate

    def send_command(self, cmd: ipb.Command) -> "asyncio.Future":
        fut = asyncio.get_running_loop().create_future()
        self.pending[cmd.command_id] = fut
        self.outbox.put_nowait(ipb.CollectorMessage(command=cmd))
        return fut


class IngestService:
    def __init__(self, writer: StoreWriter, clock: ClusterClock, settings: IngestSettings | None = None) -> None:
        self.writer = writer
        self.clock = clock
        self.settings = settings or IngestSettings()
        self.sessions: dict[str, Session] = {}
        self._models: dict[tuple[str, str], ClockModel] = {}
        self._probe_ids = itertools.count(1)
        self.streams_refused = 0
        self._writer_slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self.peers = None   # control/peers.py Peers: agents whose streams other collectors of the store hold

    async def session(self, node_id: str):
        """The agent's stream: here (a Session), on another collector of the store (a RemoteSession relaying
        through it), or None."""
        local = self.sessions.get(node_id)
        if local is not None or self.peers is None:
            return local
        return await self.peers.session(node_id)

    async def connected_nodes(self) -> list[str]:
        """Every agent connected here or to another live collector of the store."""
        nodes = set(self.sessions)
        if self.peers is not None:
            try:
                nodes |= set(await asyncio.to_thread(self.peers.holders))
            except Exception as exc:   # the store went away: what is here still answers
                log.warning("which collectors hold the other agents: %s", exc)
        return sorted(nodes)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler("steplens.v1.Ingest", {
            "Stream": grpc.stream_stream_rpc_method_handler(
                self.stream, request_deserializer=None, response_serializer=ipb.CollectorMessage.SerializeToString)})

    # -- helpers ---------------------------------------------------------------------------
    async def _refuse(self, context, code: grpc.StatusCode, details: str):
        self.streams_refused += 1
        log.warning("refused stream from %s: %s %s", context.peer(), code.name, details)
        await context.abort(code, details)

    async def _parse(self, raw: bytes, context) -> ipb.AgentMessage:
        try:
            return ipb.AgentMessage.FromString(raw)
        except (DecodeError, ValueError) as exc:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed AgentMessage: {exc}")
            raise  # unreachable: abort raises

    def _cert_cn(self, context) -> str | None:
        auth = context.auth_context() or {}
        names = auth.get("x509_common_name") or []
        return names[0].decode() if names else None

    # -- the stream ------------------------------------------------------------------------
    async def stream(self, request_iterator, context):
        s = self.settings
        it = request_iterator.__aiter__()
        try:
            raw = await asyncio.wait_for(it.__anext__(), s.hello_timeout_seconds)
        except (asyncio.TimeoutError, StopAsyncIteration):
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "no Hello received")
            return
        msg = await self._parse(raw, context)
        if msg.WhichOneof("msg") != "hello":
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a Hello")
            return
        hello = msg.hello
        if hello.schema_version != SCHEMA_VERSION:
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION,
                               f"schema version {hello.schema_version} is not supported; this collector speaks "
                               f"{SCHEMA_VERSION}: upgrade the older side")
            return
        if not AGENT_ID_RE.match(hello.agent_id) or not re.fullmatch(r"[0-9a-f]{8,64}", hello.spool_id or ""):
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"bad agent_id {hello.agent_id!r} or spool_id {hello.spool_id!r}")
            return
        if s.require_client_cert:
            cn = self._cert_cn(context)
            if cn != hello.agent_id:
                await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED,
                                   f"agent_id {hello.agent_id!r} does not match the client certificate CN {cn!r}")
                return
        await self._serve(hello, it, context)

    async def _serve(self, hello: ipb.Hello, it, context) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        agent = hello.agent_id
        model = self._models.setdefault((agent, hello.boot_id or hello.spool_id), ClockModel())
        session = Session(agent, hello.spool_id, hello.boot_id, context.peer(), asyncio.Queue(), model,
                          self.clock.now_ns())
        old = self.sessions.get(agent)
        if old is not None:  # a reconnecting agent replaces its stale stream
            old.closed = True
            old.outbox.put_nowait(_CLOSE)
        self.sessions[agent] = session
        probes: dict[int, int] = {}
        failed: dict = {}
        writer_task = asyncio.create_task(self._write_loop(session, context, probes))
        prober = asyncio.create_task(self._probe_loop(session))
        self._update(agent, hostname=hello.hostname, agent_version=hello.agent_version, boot_id=hello.boot_id,
                     spool_id=hello.spool_id, connected=1, peer=context.peer())
        acked_hello = False
        answered = 0
        clock_saved_ns = 0
        inbox: asyncio.Queue = asyncio.Queue(maxsize=64)
        reader = asyncio.create_task(self._read_loop(it, inbox))
        try:
            last_seq = await asyncio.to_thread(self.writer.last_seq, agent, hello.spool_id)
            ack_deadline = time.monotonic() + s.hello_timeout_seconds
            while not session.closed:
                # gate on exchanges answered on *this* stream: the model's count of good (near-minimum RTT)
                # samples can stay low for minutes after one lucky exchange
                if not acked_hello and answered >= s.min_probes_before_ack:
                    session.outbox.put_nowait(ipb.CollectorMessage(
                        hello_ack=ipb.HelloAck(schema_version=SCHEMA_VERSION, last_seq=last_seq)))
                    acked_hello = True
                try:
                    # never time out a read on the stream itself (cancelling it ends the stream); the
                    # reader task owns the stream and hands over (t4, bytes) pairs
                    item = await asyncio.wait_for(inbox.get(), 0.25 if not acked_hello else None)
                except asyncio.TimeoutError:
                    if time.monotonic() > ack_deadline:
                        await self._refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                                           "the agent did not answer clock probes")
                    continue
                if item is None:
                    break
                t4, raw = item
                msg = await self._parse(raw, context)
                kind = msg.WhichOneof("msg")
                if kind == "clock":
                    c = msg.clock
                    if probes.pop(c.probe_id, None) == c.t1_ns and model.add(c.t1_ns, c.t2_mono_ns, c.t3_mono_ns, t4):
                        answered += 1
                        # the clock model lives here; the store gets a copy for `nodes` at most every few
                        # seconds (one writer round trip per probe reply does not scale to thousands of agents)
                        if t4 - clock_saved_ns >= CLOCK_SAVE_INTERVAL_NS:
                            clock_saved_ns = t4
                            e = model.estimate
                            self._update(agent, clock_offset_ns=e.offset_ns, clock_drift_ppm=e.drift_ppm,
                                         clock_uncertainty_ns=e.uncertainty_ns, clock_rtt_ns=e.best_rtt_ns,
                                         clock_samples=e.samples)
                elif kind == "batch":
                    if not acked_hello:
                        await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, "batch before HelloAck")
                    b = msg.batch
                    if b.agent_id != agent or b.spool_id != hello.spool_id:
                        await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                                           f"batch for agent {b.agent_id!r} spool {b.spool_id!r} on the stream of "
                                           f"{agent!r} spool {hello.spool_id!r}")
                    await self._submit(session, b, loop, failed)
                    if failed:
                        break
                elif kind == "status":
                    self._on_status(session, msg.status)
                elif kind == "result":
                    fut = session.pending.pop(msg.result.command_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg.result)
                elif kind == "hello":
                    await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "a second Hello on one stream")
                else:
                    await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "empty AgentMessage")
            if failed:
                await context.abort(grpc.StatusCode.UNAVAILABLE, failed["note"])
        finally:
            prober.cancel()
            reader.cancel()
            session.closed = True
            session.outbox.put_nowait(_CLOSE)
            try:
                await asyncio.wait_for(writer_task, 2.0)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                writer_task.cancel()
            for fut in session.pending.values():
                if not fut.done():
                    fut.set_result(ipb.CommandResult(ok=False, message="agent disconnected"))
            if self.sessions.get(agent) is session:
                del self.sessions[agent]
                self._update(agent, connected=0)

    async def _read_loop(self, it, inbox: asyncio.Queue) -> None:
        try:
            async for raw in it:
                await inbox.put((self.clock.now_ns(), raw))
        except Exception:  # the stream broke or was cancelled: the handler sees the end
            pass
        finally:
            await inbox.put(None)

    def _slots(self, loop) -> asyncio.Semaphore:
        if self._writer_slots is None or self._writer_slots[0] is not loop:
            self._writer_slots = (loop, asyncio.Semaphore(self.settings.max_batches_in_writer))
        return self._writer_slots[1]

    async def _submit(self, session: Session, b: ipb.Batch, loop, failed: dict) -> None:
        # Admission: at most max_batches_in_writer batches queued at the writer, the rest of the streams
        # wait here in FIFO order (and stop reading meanwhile). Polling writer.submit every 10 ms from
        # every stream instead kept the event loop busy enough, with 1,000+ streams, to starve the writer
        # thread of the GIL (measured: 45% of the collector's samples in that poll, the writer at 20%).
        slots = self._slots(loop)
        await slots.acquire()

        def done(outcome: str, rejected: int, note: str, seq=b.seq) -> None:
            loop.call_soon_threadsafe(self._on_done, session, seq, outcome, rejected, note, failed, slots)
        job = BatchJob(session.agent_id, session.spool_id, b.seq, b.n_records, b.payload, b.sent_mono_ns,
                       session.clock, self.clock.now_ns(), done)
        try:
            while not self.writer.submit(job):  # queue full of agent updates: rare, poll briefly
                await asyncio.sleep(0.01)
        except BaseException:  # cancelled before the writer took it: done() will never run
            slots.release()
            raise

    def _on_done(self, session: Session, seq: int, outcome: str, rejected: int, note: str, failed: dict,
                 slots: asyncio.Semaphore | None = None) -> None:
        if slots is not None:
            slots.release()
        if outcome == "failed":
            failed.setdefault("note", note)
            session.closed = True
            session.outbox.put_nowait(_CLOSE)
            return
        if outcome == "rejected":
            log.warning("agent %s batch %d rejected: %s", session.agent_id, seq, note)
        session.outbox.put_nowait(ipb.CollectorMessage(ack=ipb.Ack(seq=seq, rejected_records=rejected, note=note)))

    def _on_status(self, session: Session, st: ipb.AgentStatus) -> None:
        sources = {x.name: {"up": x.up, "reason": x.reason, "last_duration_seconds": x.last_duration_seconds,
                            "steps": x.steps, "errors": x.errors, "records": x.records, "cpu_cores": x.cpu_cores,
                            "rate_scale": x.rate_scale or 1.0} for x in st.sources}
        mode = "deep" if st.mode == 2 else "sentinel"
        until = 0
        if st.mode_until_mono_ns and session.clock is not None:
            until = session.clock.to_cluster(st.mode_until_mono_ns)
        self._update(session.agent_id, sources=sources, spool_backlog=st.spool_backlog_batches,
                     records_produced=st.records_produced, records_acked=st.records_acked,
                     records_dropped=st.records_dropped, mode=mode, mode_until_ns=until,
                     agent_cpu_cores=st.agent_cpu_cores, cpu_budget_cores=st.cpu_budget_cores)

    def _update(self, agent_id: str, **fields) -> None:
        fields["last_seen_ns"] = self.clock.now_ns()
        if not self.writer.submit(AgentUpdate(agent_id, fields)):
            log.debug("writer backlogged; agent update for %s skipped", agent_id)

    async def _probe_loop(self, session: Session) -> None:
        s = self.settings
        try:
            for _ in range(s.probe_burst):
                session.outbox.put_nowait(_PROBE)
                await asyncio.sleep(s.probe_burst_spacing_seconds)
            started = time.monotonic()
            while not session.closed:
                steady = time.monotonic() - started >= s.steady_after_seconds
                await asyncio.sleep(s.steady_probe_interval_seconds if steady else s.probe_interval_seconds)
                session.outbox.put_nowait(_PROBE)
        except asyncio.CancelledError:
            pass

    async def _write_loop(self, session: Session, context, probes: dict) -> None:
        while True:
            item = await session.outbox.get()
            if item is _CLOSE:
                return
            if item is _PROBE:
                pid = next(self._probe_ids)
                if len(probes) > 64:  # unanswered probes: forget the oldest
                    probes.pop(next(iter(probes)))
                t1 = self.clock.now_ns()
                probes[pid] = t1
                item = ipb.CollectorMessage(probe=ipb.ClockProbe(probe_id=pid, t1_ns=t1))
            try:
                await context.write(item)
            except Exception:
                session.closed = True
                return
