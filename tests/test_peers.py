"""Collector to collector (collector/control/peers.py): several collectors on one ClickHouse store, each agent's
stream on one of them; Control calls on any collector reach every agent through the one that holds its stream.

Two real collectors (one process: chDB runs one engine per process) on one chDB database, two real agents, one
on each; and the Peer service's mutual TLS on a real TLS server with certificates of a test CA."""

import asyncio
import itertools
import os
import threading

import grpc
import pytest

from conftest import AgentProc, wait_for
from steplens import conn
from steplens.v1 import control_pb2 as cpb
from steplens.v1 import control_pb2_grpc as cgrpc

chdb = pytest.importorskip("chdb")

from steplens.collector.analysis.base import AnalysisSettings  # noqa: E402
from steplens.collector.server import Collector, CollectorSettings  # noqa: E402

_N = itertools.count()


class _Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.th = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.th.start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.th.join(10)


def _collector(tmp_path, name: str, store: str) -> Collector:
    return Collector(CollectorSettings(
        db=str(tmp_path / f"{name}.db"), store=store, listen="127.0.0.1:0", insecure=True,
        analysis=AnalysisSettings(collector_id=name, heartbeat_seconds=0.3, collector_ttl_seconds=3.0,
                                  interval_seconds=1.0)))


def _nodes(stub) -> dict:
    return {n.node_id: (n.connected, n.collector) for n in stub.ListNodes(cpb.ListRequest(), timeout=10).nodes}


def test_control_calls_on_either_collector_reach_both_agents(tmp_path, engine_dir):
    store = f"chdb://{engine_dir}?database=peers{os.getpid()}_{next(_N)}"
    lp = _Loop()
    a, b = _collector(tmp_path, "ca", store), _collector(tmp_path, "cb", store)
    pa, pb = lp.run(a.start()), lp.run(b.start())
    agents = [AgentProc(tmp_path, "na", f"127.0.0.1:{pa}").start(), AgentProc(tmp_path, "nb", f"127.0.0.1:{pb}").start()]
    chans = [grpc.insecure_channel(f"127.0.0.1:{p}") for p in (pa, pb)]
    stubs = [cgrpc.ControlStub(ch) for ch in chans]
    try:
        # each collector lists both agents, connected, the other's with the collector that holds it
        want = [{"na": (True, ""), "nb": (True, "cb")}, {"na": (True, "ca"), "nb": (True, "")}]
        for stub, w in zip(stubs, want):
            wait_for(lambda: _nodes(stub) == w, 60, interval=0.5, what=f"both agents listed: {w}")
        # FetchDetail of the agent on the other collector, from each side
        for stub, node in ((stubs[0], "nb"), (stubs[1], "na")):
            reply = stub.FetchDetail(cpb.FetchRequest(node_id=node, kinds=["stacks"]), timeout=60)
            assert reply.node_id == node
        # deep mode on both agents from one collector: both take it, at one cluster-time start
        reply = stubs[1].SetDeepMode(cpb.DeepRequest(node_ids=["na", "nb"], enable=True, duration_ns=2 * 10**9),
                                     timeout=60)
        assert sorted(reply.delivered) == ["na", "nb"] and not reply.offline, reply
        assert (a.peer_service.relays, b.peer_service.relays) == (2, 1)   # na: FetchDetail and deep; nb: FetchDetail
        # without a target, "every connected node" is every node of the cluster
        reply = stubs[0].SetDeepMode(cpb.DeepRequest(enable=False), timeout=60)
        assert sorted(reply.delivered) == ["na", "nb"], reply
        # an agent whose collector is gone is offline with a reason, not an error of the call
        agents[1].stop()
        wait_for(lambda: _nodes(stubs[0]).get("nb", (True,))[0] is False, 60, interval=0.5,
                 what="nb disconnected, as its collector's replicated row says")
        with pytest.raises(grpc.RpcError) as exc:
            stubs[0].FetchDetail(cpb.FetchRequest(node_id="nb", kinds=["stacks"]), timeout=30)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and "not connected" in exc.value.details()
    finally:
        for ag in agents:
            ag.stop() if ag.proc.poll() is None else None
        for ch in chans:
            ch.close()
        lp.run(a.stop(0.5))
        lp.run(b.stop(0.5))
        lp.close()


class _Clock:
    offset_ns, drift_ppm, ref_mono_ns, uncertainty_ns, best_rtt_ns, samples = 5_000_000, 1.5, 7, 40_000, 90_000, 9


class _Session:
    clock = _Clock()

    def send_command(self, cmd):
        from steplens.v1 import ingest_pb2 as ipb
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(ipb.CommandResult(command_id=cmd.command_id, ok=True, message="took it"))
        return fut


class _Ingest:
    sessions = {"n1": _Session()}


class _Reader:
    def __init__(self, address: str) -> None:
        self.address = address

    def live_collectors(self, since_ns: int) -> list[dict]:
        return [{"id": "holder", "address": self.address}]

    def nodes(self) -> list[dict]:
        return [{"node_id": "n1", "connected": True, "collector": "holder"}]


def test_peer_relay_needs_a_collector_certificate(tmp_path):
    """The Peer service on a mutual-TLS port: a collector's certificate (CN in peer_cns) relays and gets the
    agent's clock; an operator's certificate is refused (PERMISSION_DENIED); a client with no certificate does
    not get through the handshake."""
    from certs import Pki
    from steplens.collector.control.peers import Peers, PeerService
    from steplens.v1 import ingest_pb2 as ipb
    from steplens.v1 import peer_pb2_grpc
    ca = Pki(str(tmp_path), "ca")
    srv_cert, srv_key = ca.issue("localhost", server=True)
    col_cert, col_key = ca.issue("steplens-collector")
    op_cert, op_key = ca.issue("steplens-operator")
    lp = _Loop()

    async def serve():
        server = grpc.aio.server()
        peer_pb2_grpc.add_PeerServicer_to_server(PeerService(_Ingest(), "holder", True, ("steplens-collector",)),
                                                 server)
        port = server.add_secure_port("127.0.0.1:0", conn.server_credentials(
            conn.TlsFiles(ca.ca_path, srv_cert, srv_key), require_client_cert=True))
        await server.start()
        return server, port

    async def ask(cert: str, key: str):
        peers = Peers(_Reader(f"localhost:{port}"), "asker", False, conn.TlsFiles(ca.ca_path, cert, key))
        try:
            s = await peers.session("n1")
            if s is None:
                return None, peers.errors
            return (s.clock, await s.send_command(ipb.Command(command_id="c1"))), peers.errors
        finally:
            await peers.close()
    server, port = lp.run(serve())
    try:
        (clock, result), errors = lp.run(ask(col_cert, col_key))
        assert (clock.offset_ns, clock.drift_ppm, clock.samples) == (5_000_000, 1.5, 9)
        assert result.ok and result.message == "took it" and errors == 0
        got, errors = lp.run(ask(op_cert, op_key))
        assert got is None and errors == 1   # PERMISSION_DENIED, logged
        got, errors = lp.run(ask("", ""))
        assert got is None and errors == 1   # no client certificate: the handshake fails
    finally:
        lp.run(server.stop(0))
        lp.close()


def test_the_scaleout_run_loses_nothing_when_a_collector_dies(tmp_path):
    """bench/scaleout.py small: 12 agents over two collectors on one chDB database, the job's owner killed; the
    run's own checks (every agent listed and reached from both, the survivor takes the agents and the job, every
    record stored once) come back in its JSON line."""
    import json
    import subprocess
    import sys
    bench = os.path.join(os.path.dirname(__file__), "..", "bench", "scaleout.py")
    out = subprocess.run([sys.executable, bench, "--agents", "12", "--before", "2", "--after", "2", "--rate", "6000"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    head = json.loads(out.stdout.strip().splitlines()[-1])
    assert head["fetch_ok_before"] == 24 and head["fetch_ok_after"] == 12, head
    assert head["job_ranks_seen_per_collector"] == [12, 12]
    assert head["records_produced"] > 0 and head["records_lost"] == 0 and head["batches_duplicated"] == 0
    assert head["metric_rows_lost"] == 0 and head["metric_rows_duplicated"] == 0
    assert head["analysis_takeover_seconds"] is not None


def test_a_peer_certificate_without_its_key_is_a_clear_error(tmp_path):
    with pytest.raises(conn.SecurityError, match="peer_tls_cert needs peer_tls_key"):
        CollectorSettings(db=str(tmp_path / "c.db"), listen="127.0.0.1:0", insecure=True,
                          peer_tls=conn.TlsFiles("", str(tmp_path / "c.crt"), "")).validate()
