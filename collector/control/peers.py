"""Collector to collector: commands reach an agent through the collector that holds its stream.

Several collectors share one ClickHouse store (collector/store/clickhouse.py); each agent streams to one of them
and its row in the replicated state (store/replication.py) names that collector, whose address is in the
store's `collectors` table (analysis/ownership.py's heartbeats). A Control call on any collector that must reach
an agent (FetchDetail, FetchCommOps, a trace's fetch, deep mode, a deep dive) asks `IngestService.session(node)`:
the local stream when it is here, else a `RemoteSession` that relays through the holder's `Peer.Relay`
(proto/steplens/v1/peer.proto) over mutual TLS (this collector's certificate as the client's; the holder accepts
the CNs in its `peer_cns`). The remote session carries the agent's clock as its holder estimates it, so the
caller converts cluster times for the agent as for one of its own. One hop only: a collector relays only to
agents whose streams it holds.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from steplens import conn
from steplens.collector.ingest.clock import ClockEstimate
from steplens.v1 import ingest_pb2 as ipb
from steplens.v1 import peer_pb2 as ppb
from steplens.v1 import peer_pb2_grpc as pgrpc

log = logging.getLogger("steplens.collector.peers")


class RemoteSession:
    """An agent's stream on another collector, as the control code uses a local Session: `clock`, and
    `send_command(cmd)` -> an awaitable of the agent's CommandResult."""

    def __init__(self, agent_id: str, collector_id: str, stub, clock: ClockEstimate, timeout_s: float,
                 self_id: str) -> None:
        self.agent_id, self.collector_id = agent_id, collector_id
        self._stub, self.clock, self._timeout_s, self._self_id = stub, clock, timeout_s, self_id

    def send_command(self, cmd: ipb.Command) -> "asyncio.Future":
        return asyncio.ensure_future(self._relay(cmd))

    async def _relay(self, cmd: ipb.Command) -> ipb.CommandResult:
        try:
            reply = await self._stub.Relay(ppb.RelayRequest(node_id=self.agent_id, command=cmd,
                                                            timeout_seconds=self._timeout_s,
                                                            from_collector=self._self_id),
                                           timeout=self._timeout_s + 5)
        except grpc.aio.AioRpcError as exc:
            return ipb.CommandResult(command_id=cmd.command_id, ok=False,
                                     message=f"via collector {self.collector_id}: {exc.code().name}: {exc.details()}")
        if not reply.connected:
            return ipb.CommandResult(command_id=cmd.command_id, ok=False,
                                     message=f"not connected to collector {self.collector_id} any more")
        if not reply.HasField("result"):
            raise asyncio.TimeoutError(f"via collector {self.collector_id}: {reply.message}")
        return reply.result


def _clock_of(c: ppb.AgentClock) -> ClockEstimate:
    return ClockEstimate(offset_ns=c.offset_ns, drift_ppm=c.drift_ppm, ref_mono_ns=c.ref_mono_ns,
                         uncertainty_ns=c.uncertainty_ns, best_rtt_ns=c.best_rtt_ns, samples=c.samples)


class Peers:
    """The client side: which collector holds an agent (from the store) and a channel to it."""

    def __init__(self, reader, self_id: str, insecure: bool, tls: conn.TlsFiles | None = None,
                 ttl_seconds: float = 10.0, max_message_bytes: int = 64 << 20, relay_timeout_s: float = 30.0) -> None:
        self.reader, self.self_id, self.insecure, self.tls = reader, self_id, insecure, tls
        self.ttl_ns = int(ttl_seconds * 1e9)
        self.max_message_bytes = max_message_bytes
        self.relay_timeout_s = relay_timeout_s
        self._stubs: dict[str, tuple] = {}
        self._holders: tuple[float, dict | None] = (0.0, None)
        self.relayed = 0
        self.errors = 0

    def _stub(self, address: str):
        got = self._stubs.get(address)
        if got is None:
            opts = [("grpc.max_receive_message_length", self.max_message_bytes),
                    ("grpc.max_send_message_length", self.max_message_bytes)]
            if self.insecure:
                ch = grpc.aio.insecure_channel(address, options=opts)
            else:
                ca, cert, key = (self.tls or conn.TlsFiles()).read()
                ch = grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(
                    root_certificates=ca, private_key=key, certificate_chain=cert), options=opts)
            got = self._stubs[address] = (ch, pgrpc.PeerStub(ch))
        return got[1]

    def live_ids(self) -> set[str]:
        """The collectors of the store heard from within the TTL."""
        return {c["id"] for c in self.reader.live_collectors(time.time_ns() - self.ttl_ns)}

    def holders(self, max_age_s: float = 1.0) -> dict[str, tuple[str, str]]:
        """Agents connected to another live collector: node -> (collector id, its address). Read from the store at
        most once per max_age_s (a fetch across a job asks for each of its nodes at once)."""
        t, got = self._holders
        if got is not None and time.monotonic() - t < max_age_s:
            return got
        got = self._read_holders()
        self._holders = (time.monotonic(), got)
        return got

    def _read_holders(self) -> dict[str, tuple[str, str]]:
        live = {c["id"]: c["address"] for c in self.reader.live_collectors(time.time_ns() - self.ttl_ns)}
        out = {}
        for n in self.reader.nodes():
            holder = n.get("collector") or ""
            if n["connected"] and holder and holder != self.self_id and live.get(holder):
                out[n["node_id"]] = (holder, live[holder])
        return out

    async def session(self, node_id: str) -> RemoteSession | None:
        """The agent's stream on another collector, with its clock; None when no live collector holds it."""
        holder = (await asyncio.to_thread(self.holders)).get(node_id)
        if holder is None:
            return None
        collector_id, address = holder
        stub = self._stub(address)
        try:
            reply = await stub.Relay(ppb.RelayRequest(node_id=node_id, from_collector=self.self_id), timeout=5)
        except grpc.aio.AioRpcError as exc:
            self.errors += 1
            log.warning("collector %s (%s), holder of %s: %s %s", collector_id, address, node_id, exc.code().name,
                        exc.details())
            return None
        if not reply.connected:
            return None
        self.relayed += 1
        return RemoteSession(node_id, collector_id, stub, _clock_of(reply.clock), self.relay_timeout_s, self.self_id)

    async def close(self) -> None:
        for ch, _ in self._stubs.values():
            await ch.close()
        self._stubs.clear()


class PeerService(pgrpc.PeerServicer):
    """The server side: relays to the agents whose streams this collector holds (never a second hop)."""

    def __init__(self, ingest, collector_id: str, tls: bool, peer_cns: tuple[str, ...]) -> None:
        self.ingest, self.collector_id, self.tls, self.peer_cns = ingest, collector_id, tls, peer_cns
        self.relays = 0

    async def Relay(self, request, context):
        if self.tls:
            auth = context.auth_context() or {}
            cns = [n.decode() for n in auth.get("x509_common_name", [])]
            if not any(cn in self.peer_cns for cn in cns):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"Peer needs a collector certificate (CN one of {', '.join(self.peer_cns)})")
        reply = ppb.RelayReply(collector_id=self.collector_id)
        session = self.ingest.sessions.get(request.node_id)
        if session is None or session.clock is None:
            reply.message = f"{request.node_id} is not connected to collector {self.collector_id}"
            return reply
        c = session.clock
        reply.connected = True
        reply.clock.CopyFrom(ppb.AgentClock(offset_ns=c.offset_ns, drift_ppm=c.drift_ppm, ref_mono_ns=c.ref_mono_ns,
                                            uncertainty_ns=c.uncertainty_ns, best_rtt_ns=c.best_rtt_ns,
                                            samples=c.samples))
        if not request.HasField("command"):
            return reply
        self.relays += 1
        timeout = request.timeout_seconds or 30.0
        try:
            result = await asyncio.wait_for(session.send_command(request.command), timeout)
        except asyncio.TimeoutError:
            reply.message = f"{request.node_id} did not answer in {timeout:.0f} s"
            return reply
        reply.result.CopyFrom(result)
        return reply


__all__ = ["Peers", "PeerService", "RemoteSession"]
