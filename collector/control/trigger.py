"""Deep-mode triggers: one cluster-time start instant, converted per agent through its clock
model, so agents of a job switch together (within their clock uncertainty)."""

from __future__ import annotations

import asyncio

from steplens.v1 import control_pb2 as cpb
from steplens.v1 import ingest_pb2 as ipb


async def start_deep_mode(ingest, clock, request: cpb.DeepRequest, command_id: str,
                          reply_timeout_s: float = 5.0) -> cpb.DeepReply:
    lead_ns = (request.lead_ms or 500) * 1_000_000
    start_ns = request.start_ns or clock.now_ns() + lead_ns
    targets = list(request.node_ids) or await ingest.connected_nodes()
    reply = cpb.DeepReply(command_id=command_id, start_ns=start_ns if request.enable else 0)
    futures = {}
    sessions = await asyncio.gather(*(ingest.session(node) for node in targets))
    for node, session in zip(targets, sessions):
        if session is None or session.clock is None:
            reply.offline.append(node)
            reply.messages[node] = "not connected"
            continue
        deep = ipb.DeepMode(enable=request.enable, duration_ns=request.duration_ns, sources=list(request.sources))
        if request.enable:
            deep.start_ns = start_ns
            deep.start_mono_ns = max(1, session.clock.to_agent(start_ns))
        futures[node] = session.send_command(ipb.Command(command_id=command_id, deep=deep))
    for node, fut in futures.items():
        try:
            result = await asyncio.wait_for(fut, reply_timeout_s)
        except asyncio.TimeoutError:
            reply.offline.append(node)
            reply.messages[node] = f"no answer within {reply_timeout_s:.0f}s"
            continue
        (reply.delivered if result.ok else reply.offline).append(node)
        reply.messages[node] = result.message
    return reply
