"""nccltopo source: NCCL init log lines (real published lines, tests/fixtures/nccl) -> CommMember records,
tailed by offset, sent once per place, joined with local workloads; RAS unreachable reported once."""

import os
import shutil
import socket

from steplens.agent.records import CommMember, Event, ProcessInfo
from steplens.agent.sources.base import HostContext, build_config
from steplens.agent.sources.nccltopo import NccltopoConfig, NccltopoSource

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "nccl")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _source(tmp_path, **cfg) -> NccltopoSource:
    cfg.setdefault("ras_port", _free_port())  # nothing listens there
    config = build_config(NccltopoConfig, {"log_dirs": [str(tmp_path)], "ras_host": "127.0.0.1", **cfg},
                          "[sources.nccltopo]")
    return NccltopoSource(HostContext(node_id="t", state_dir=str(tmp_path)), config)


def test_members_from_logs_once_then_only_changes(tmp_path):
    shutil.copy(os.path.join(FIX, "init_2x_commid.log"), tmp_path / "nccl.hostname-test.984.log")
    shutil.copy(os.path.join(FIX, "init_old_nohash.log"), tmp_path / "nccl.a03.193027.log")
    src = _source(tmp_path)
    first = src.step()
    members = [m for m in first if isinstance(m, CommMember)]
    events = [e for e in first if isinstance(e, Event)]
    assert [e.kind for e in events] == ["nccl_ras_unavailable"]  # reported once...
    m36 = [m for m in members if m.comm_id == "5ae77eb5ea4ec1ee" and m.rank == 36]
    assert len(m36) == 1 and (m36[0].nranks, m36[0].host, m36[0].pid, m36[0].cuda_dev, m36[0].bus_id) == \
        (64, "hostname-test", 984, 4, "9b000")
    old = [m for m in members if m.host.startswith("A03-R28-I49-3")]
    assert old and all(m.comm_id.startswith("ptr:") for m in old)  # no commId in old logs: the comm pointer
    assert all(m.via == "nccl_log" and m.global_rank == -1 for m in members)
    assert src.step() == []  # ...and nothing twice (RAS retried only after its interval)
    # a line appended in two writes (the first without its newline) is read once, when complete
    line = ("hostname-test:990:1300 [5] NCCL INFO comm 0x55aa rank 37 nranks 64 cudaDev 5 nvmlDev 5 busId 9c000 "
            "commId 0x5ae77eb5ea4ec1ee - Init COMPLETE\n")
    with open(tmp_path / "nccl.hostname-test.984.log", "a") as fh:
        fh.write(line[:40])
    assert src.step() == []
    with open(tmp_path / "nccl.hostname-test.984.log", "a") as fh:
        fh.write(line[40:])
    new = src.step()
    assert [(m.rank, m.pid, m.bus_id) for m in new] == [(37, 990, "9c000")]
    # a restarted rank (new pid) is sent again
    with open(tmp_path / "nccl.hostname-test.984.log", "a") as fh:
        fh.write(line.replace(":990:", ":991:"))
    assert [(m.rank, m.pid) for m in src.step()] == [(37, 991)]


def test_local_workload_gets_global_rank_and_job(tmp_path):
    host = os.uname().nodename
    (tmp_path / f"nccl.{host}.4242.log").write_text(
        f"{host}:4242:4250 [0] NCCL INFO comm 0x1 rank 1 nranks 2 cudaDev 0 busId 1b000 commId 0xABC - Init COMPLETE\n")
    src = _source(tmp_path, ras=False)
    src.ctx.workloads.replace({(4242, 1): ProcessInfo(1, 4242, 1, rank=9, job_key="jobx")})
    (m,) = src.step()
    assert (m.comm_id, m.rank, m.global_rank, m.job_key) == ("abc", 1, 9, "jobx")


def test_unreadable_or_missing_dirs_and_replaced_files(tmp_path):
    src = _source(tmp_path / "missing", ras=False)
    assert src.step() == []
    src = _source(tmp_path, ras=False)
    p = tmp_path / "nccl.h.1.log"
    p.write_text("h:1:1 [0] NCCL INFO comm 0x1 rank 0 nranks 1 cudaDev 0 busId 1000 commId 0x1 - Init COMPLETE\n")
    assert len(src.step()) == 1
    p.write_text("h:2:2 [0] NCCL INFO comm 0x2 rank 0 nranks 1 cudaDev 0 busId 1000 commId 0x2 - Init COMPLETE\n"[:20])
    p.write_text("h:2:2 [0] NCCL INFO comm 0x2 rank 0 nranks 1 cudaDev 0 busId 1 commId 0x2 - Init START\n")
    got = src.step()  # the file shrank (replaced): read again from its start
    assert [(m.comm_id, m.pid) for m in got] == [("2", 2)]


def test_ras_answer_is_used_when_reachable(tmp_path):
    """A RAS server stand-in on loopback answering NCCL's client protocol with the fixture document."""
    import threading
    doc = open(os.path.join(FIX, "ras_status.json"), "rb").read()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve():
        c, _ = srv.accept()
        buf = b""
        c.settimeout(5)
        while b"STATUS" not in buf:
            chunk = c.recv(4096)
            if not chunk:
                break
            buf += chunk
            for ln in buf.split(b"\n"):
                if ln.startswith(b"CLIENT PROTOCOL"):
                    c.sendall(b"SERVER PROTOCOL 2\n")
                    buf = buf.replace(ln + b"\n", b"")
                elif ln.startswith((b"TIMEOUT", b"SET FORMAT")):
                    c.sendall(b"OK\n")
                    buf = buf.replace(ln + b"\n", b"")
        c.sendall(doc)
        c.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    src = _source(tmp_path, ras_port=srv.getsockname()[1])
    out = src.step()
    th.join(5)
    srv.close()
    ras = [m for m in out if isinstance(m, CommMember)]
    assert ras and all(m.via == "nccl_ras" for m in ras), out


def test_members_reach_the_collector_and_comms_lists_them(tmp_path):
    """Real agent -> real collector -> `steplens comms --json`."""
    from conftest import FAST_AGENT_TOML, AgentProc, CollectorProc, wait_for
    logs = tmp_path / "nccl"
    logs.mkdir()
    shutil.copy(os.path.join(FIX, "init_2x_commid.log"), logs / "nccl.hostname-test.984.log")
    toml = FAST_AGENT_TOML + f'\n[sources.nccltopo]\ninterval_seconds = 0.5\nlog_dirs = ["{logs}"]\nras = false\n'
    c = CollectorProc(tmp_path).start()
    a = AgentProc(tmp_path, "gpu-a", c.address, toml=toml).start()
    try:
        rows = wait_for(lambda: [r for r in c.cli("comms") if r["comm_id"] == "5ae77eb5ea4ec1ee"], 60,
                        what="comm members in the collector")
        by_rank = {r["rank"]: r for r in rows}
        assert by_rank[36]["host"] == "hostname-test" and by_rank[36]["bus_id"] == "9b000"
        assert all(r["node_id"] == "gpu-a" and r["nranks"] == 64 and r["seen_ns"] > 0 for r in rows)
        assert c.cli("comms", "--comm", "nope") == []
    finally:
        assert a.stop() == 0
        c.stop()
