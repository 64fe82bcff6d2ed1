"""The operators' Control API (grpc.aio): listings from the store, and deep-mode triggers.

Auth: on a TLS collector every call needs a bearer token (`authorization: Bearer ...`) equal to
the collector's token, or a client certificate whose CN is one of the operator names. On an
insecure (loopback-only) collector there is nothing to check.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import uuid

import grpc

from steplens.collector.control.trigger import start_deep_mode
from steplens.collector.store.queries import Reader
from steplens.v1 import control_pb2 as cpb
from steplens.v1 import control_pb2_grpc as cgrpc


class ControlService(cgrpc.ControlServicer):
    def __init__(self, reader: Reader, ingest, clock, tls: bool, token: str = "",
                 operator_cns: tuple[str, ...] = ("steplens-operator",)) -> None:
        self.reader = reader
        self.ingest = ingest
        self.clock = clock
        self.tls = tls
        self.token = token
        self.operator_cns = operator_cns

    async def _auth(self, context) -> None:
        if not self.tls:
            return
        md = dict(context.invocation_metadata() or ())
        given = md.get("authorization", "")
        if self.token and given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip(), self.token):
            return
        auth = context.auth_context() or {}
        cns = [n.decode() for n in auth.get("x509_common_name", [])]
        if any(cn in self.operator_cns for cn in cns):
            return
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "Control needs a bearer token or an operator client certificate")

    async def ListNodes(self, request, context):
        await self._auth(context)
        rows = await asyncio.to_thread(self.reader.nodes, request.node_id)
        out = cpb.NodeList()
        for r in rows:
            n = out.nodes.add()
            for k, v in r.items():
                if k == "sources":
                    for name, s in v.items():
                        n.sources.add(name=name, up=s["up"], reason=s["reason"],
                                      last_duration_seconds=s["last_duration_seconds"], errors=s["errors"])
                else:
                    setattr(n, k, v)
            # a live stream knows better than the store whether it is connected right now
            n.connected = r["node_id"] in self.ingest.sessions
        return out

    async def ListGpus(self, request, context):
        await self._auth(context)
        rows = await asyncio.to_thread(self.reader.gpus, request.node_id)
        out = cpb.GpuList()
        for r in rows:
            g = out.gpus.add(node_id=r["node_id"], index=r["index"] or 0, uuid=r["uuid"], name=r["name"] or "",
                             pci_bus_id=r["pci_bus_id"] or "", memory_total_bytes=r["memory_total_bytes"] or 0,
                             driver_version=r["driver_version"] or "", last_seen_ns=r["last_seen_ns"] or 0)
            for name, m in r["latest"].items():
                g.latest.add(name=name, value=m["value"], ts_ns=m["ts_ns"])
        return out

    async def ListProcs(self, request, context):
        await self._auth(context)
        rows = await asyncio.to_thread(self.reader.procs, request.node_id, request.alive_only)
        out = cpb.ProcList()
        for r in rows:
            p = out.procs.add()
            for k, v in r.items():
                if v is not None:
                    setattr(p, k, v)
        return out

    async def ListGaps(self, request, context):
        await self._auth(context)
        rows = await asyncio.to_thread(self.reader.gaps, request.node_id)
        return cpb.GapList(gaps=[cpb.GapRow(**r) for r in rows])

    async def ListStacks(self, request, context):
        await self._auth(context)
        rows = await asyncio.to_thread(self.reader.stacks, request.node_id, request.pid, request.since_ns,
                                       request.limit or 200)
        out = cpb.StackList()
        for r in rows:
            out.stacks.add(node_id=r["node_id"], pid=r["pid"], start_ticks=r["start_ticks"], tid=r["tid"],
                           thread_name=r["thread_name"] or "", python=r["python"] or "", start_ns=r["start_ns"],
                           end_ns=r["end_ns"], samples=r["samples"], errors=r["errors"],
                           last_state=r["last_state"] or "", stacks_json=json.dumps(r["stacks"], ensure_ascii=False))
        return out

    async def SetDeepMode(self, request, context):
        await self._auth(context)
        if request.enable and not (0 < request.duration_ns <= 3600 * 10**9):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "duration must be within 0..3600 s")
        return await start_deep_mode(self.ingest, self.clock, request, command_id=uuid.uuid4().hex[:12])
