"""flightrec on a real 2-rank gloo job (torch CPU, child processes) launched with the steplens bootstrap:
ops of both ranks with matching collective seq per group and counts equal to the calls; dedup across
polls; ring wrap counted; unknown dump version, a stale socket and a killed rank reported and skipped.

The source runs directly (not inside an agent); its workload registry is filled with the real job pids,
as the procs source would. torch runs only in the child processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, free_port, wait_for
from procutil import child_memory_readable, reap, start_ticks
from steplens.agent.bootstrap import site_dir
from steplens.agent.records import CommOp, CommProgress, Event, Metric, ProcessInfo
from steplens.agent.sources.base import HostContext
from steplens.agent.sources.flightrec import (FlightrecConfig, FlightrecError, FlightrecSource, http_post_unix,
                                              parse_dump)

VENV_PY = os.path.join(REPO, ".venv", "bin", "python")

N_ALLREDUCE = 5      # default group ("0"), phase 1
N_BCAST = 7          # second group ("1", desc "second"), phase 1
N_ALLREDUCE_2 = 3    # default group, phase 2
N_WRAP = 100         # second group, phase 3: more than the ring holds
FR_BUFFER = 64

JOB = r'''
import os, sys, time
import torch, torch.distributed as dist
sync = sys.argv[1]
rank = int(os.environ["RANK"])
def wait(name):
    while not os.path.exists(os.path.join(sync, name)):
        time.sleep(0.02)
def mark(name):
    open(os.path.join(sync, f"{name}.{rank}"), "w").close()
dist.init_process_group("gloo")
g2 = dist.new_group([0, 1], group_desc="second")
t = torch.ones(16)
for _ in range(N_ALLREDUCE): dist.all_reduce(t)
for _ in range(N_BCAST): dist.broadcast(t, 0, group=g2)
mark("phase1"); wait("go2")
for _ in range(N_ALLREDUCE_2): dist.all_reduce(t)
mark("phase2"); wait("go3")
for _ in range(N_WRAP): dist.broadcast(t, 0, group=g2)
mark("phase3"); wait("exit")
'''


def _torch_available() -> bool:
    return os.path.exists(VENV_PY) and subprocess.run(
        [VENV_PY, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"]
    ).returncode == 0


pytestmark = pytest.mark.skipif(not _torch_available(), reason="torch is not installed in .venv")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    base = tmp_path_factory.mktemp("frjob")
    run, sync = base / "run", base / "sync"
    run.mkdir()
    sync.mkdir()
    script = base / "job.py"
    src = JOB
    for k, v in (("N_ALLREDUCE_2", N_ALLREDUCE_2), ("N_ALLREDUCE", N_ALLREDUCE), ("N_BCAST", N_BCAST),
                 ("N_WRAP", N_WRAP)):
        src = src.replace(k, str(v))
    script.write_text(src)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, PYTHONPATH=site_dir(), STEPLENS_BOOTSTRAP="1", STEPLENS_RUNTIME_DIR=str(run),
                   TORCH_FR_BUFFER_SIZE=str(FR_BUFFER), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   RANK=str(rank), WORLD_SIZE="2", STEPLENS_BOOTSTRAP_POLL_S="0.05", STEPLENS_JOB="frtest")
        procs.append(subprocess.Popen([VENV_PY, str(script), str(sync)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=open(base / f"rank{rank}.err", "wb")))
    try:
        wait_for(lambda: all((sync / f"phase1.{r}").exists() for r in range(2)) or
                 any(p.poll() is not None for p in procs), 120, what="phase 1 of the gloo job")
        assert all(p.poll() is None for p in procs), (base / "rank0.err").read_text()[-2000:]
        wait_for(lambda: all((run / f"{p.pid}.sock").exists() for p in procs), 30, what="worker-server sockets")
        yield {"procs": procs, "run": run, "sync": sync, "base": base}
    finally:
        (sync / "go2").touch()
        (sync / "go3").touch()
        (sync / "exit").touch()
        reap(procs)


def _source(tmp_path, job, procs=None, **cfg) -> FlightrecSource:
    ctx = HostContext(node_id="t", state_dir=str(tmp_path))
    infos = {}
    for rank, p in enumerate(procs or job["procs"]):
        infos[(p.pid, start_ticks(p.pid))] = ProcessInfo(0, p.pid, start_ticks(p.pid), rank=rank, world_size=2,
                                                         job_key="frtest")
    ctx.workloads.replace(infos)
    cfg.setdefault("socket_dirs", [str(job["run"])])
    cfg.setdefault("max_interval_seconds", 0)  # every step reads every ring: these tests are about what a read gives
    src = FlightrecSource(ctx, FlightrecConfig(**cfg))
    src.start()
    return src


def _collect(src, steps=1) -> tuple[list[CommOp], list]:
    """Run steps; capture the CommOps handed to the CommLog (the full stream) and what step() returned."""
    captured: list[CommOp] = []
    real_add = src.log.add

    def add(ops, kernels=(), steps=(), final=False, checked=False):
        captured.extend(ops)
        return real_add(ops, kernels, steps, final, checked)
    src.log.add = add
    out = []
    for _ in range(steps):
        out += src.step()
    src.log.add = real_add
    return captured, out


def _records(out) -> list:
    """What a step returned, less the python_gc_* Metrics every step carries for each bootstrapped process and the
    source's own flightrec_ring_reads_total and flightrec_ring_reads_by_way_total."""
    return [r for r in out if not (isinstance(r, Metric) and (r.name.startswith("python_gc_")
                                                              or r.name.startswith("flightrec_ring_reads_")))]


def _by(ops, pid=None):
    groups: dict = {}
    for o in ops:
        if pid is None or o.pid == pid:
            groups.setdefault((o.pid, o.comm_id, o.op), []).append(o)
    return groups


def _same_ops(a: list[CommOp], b: list[CommOp]) -> None:
    """The ops read from the processes' memory are the ops of their socket's JSON: every field, the issue time
    within the two sources' clock offsets (each RealtimeClock measured its own)."""
    key = lambda o: (o.pid, o.comm_id, o.seq, o.p2p_seq, o.op)
    a, b = sorted(a, key=key), sorted(b, key=key)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x.issue_mono_ns - y.issue_mono_ns) < 5_000_000
        assert dataclasses.replace(x, issue_mono_ns=0, mono_ns=0) == dataclasses.replace(y, issue_mono_ns=0,
                                                                                         mono_ns=0)


def test_gloo_job_ops_seq_counts_dedup_wrap_and_exit(tmp_path, job):
    """Read from the ranks' memory (the default) and, side by side, through their sockets: the same ops."""
    procs = job["procs"]
    src = _source(tmp_path, job)
    sock = _source(tmp_path / "sock", job, read="socket")
    try:
        ops, out = _collect(src)
        _same_ops(ops, _collect(sock)[0])
        way = "memory" if child_memory_readable() else "socket"   # else read through the socket, said once
        assert src.reads_by_way == {way: 2} and sock.reads_by_way == {"socket": 2}
        assert not [e for e in out if isinstance(e, Event) and e.kind != "flightrec_read_from_socket"], out
        assert {o.pid for o in ops} == {p.pid for p in procs}
        for p in procs:
            g = _by(ops, p.pid)
            ar, bc = g[(p.pid, "pg:0", "all_reduce")], g[(p.pid, "pg:1", "broadcast")]
            assert len(ar) == N_ALLREDUCE and len(bc) == N_BCAST
            assert set(g) == {(p.pid, "pg:0", "all_reduce"), (p.pid, "pg:1", "broadcast")}
            assert all(o.count == 16 and o.dtype == "Float" and o.bytes == 64 and o.timing == "cpu_enqueue"
                       for o in ar + bc)
            assert all(o.comm_desc == "default_pg" and o.members == [0, 1] and o.nranks == 2 for o in ar)
            assert all(o.comm_desc == "second" for o in bc)
            assert all(o.job_key == "frtest" and o.issue_mono_ns > 0 for o in ar + bc)
            # issue times are this host's monotonic clock: within the last minutes
            now = time.monotonic_ns()
            assert all(now - 300e9 < o.issue_mono_ns <= now for o in ar + bc)
        # collective sequence numbers agree across the two ranks of each group
        for comm, op in (("pg:0", "all_reduce"), ("pg:1", "broadcast")):
            seqs = [sorted(o.seq for o in ops if o.pid == p.pid and o.comm_id == comm and o.op == op) for p in procs]
            assert seqs[0] == seqs[1] and len(set(seqs[0])) == len(seqs[0]), seqs
        assert {o.rank for o in ops} == {0, 1}

        # the summaries go upstream
        summaries = [r for r in out if type(r).__name__ == "CommSummary"]
        assert sum(s.calls for s in summaries) == 2 * (N_ALLREDUCE + N_BCAST)
        # and each rank's Python GC time, from the bootstrap's <pid>.gc beside its socket
        gc_time = {m.entity for m in out if isinstance(m, Metric) and m.name == "python_gc_collections_total"}
        assert gc_time == {f"pid:{p.pid}:{start_ticks(p.pid)}" for p in procs}

        # a second poll with nothing new adds nothing (dedup by record id across polls)
        # (a CommProgress may come: torch's gloo threads store a group's last completed seq after the caller went
        # on, and a read from memory can come first)
        again, out = _collect(src)
        assert again == [] and not [r for r in _records(out) if not isinstance(r, CommProgress)]
        assert _collect(sock)[0] == []

        # phase 2: only the new all_reduces, seq continuing
        (job["sync"] / "go2").touch()
        wait_for(lambda: all((job["sync"] / f"phase2.{r}").exists() for r in range(2)), 60, what="phase 2")
        new, out = _collect(src)
        _same_ops(new, _collect(sock)[0])
        assert not [e for e in out if isinstance(e, Event)]
        for p in procs:
            g = _by(new, p.pid)
            assert set(g) == {(p.pid, "pg:0", "all_reduce")} and len(g[(p.pid, "pg:0", "all_reduce")]) == N_ALLREDUCE_2
        # the entries of phase 1 were not read again (memory), not parsed again (torch's own answer is laid out
        # as parse_dump expects)
        assert src.entries_left_out >= 2 * (N_ALLREDUCE + N_BCAST) - 2, src.entries_left_out
        assert sock.entries_left_out >= 2 * (N_ALLREDUCE + N_BCAST) - 2, sock.entries_left_out
        first = {p.pid: max(o.seq for o in ops if o.pid == p.pid and o.comm_id == "pg:0") for p in procs}
        assert all(min(o.seq for o in new if o.pid == pid) == first[pid] + 1 for pid in first)

        # phase 3: more broadcasts than the ring holds between two polls: the loss is counted and reported
        (job["sync"] / "go3").touch()
        wait_for(lambda: all((job["sync"] / f"phase3.{r}").exists() for r in range(2)), 60, what="phase 3")
        # (from memory the ring's oldest entry is counted lost too: at the time of the read a record in progress
        # may be writing over its slot, frmemory's docstring)
        for reader, held in ((src, FR_BUFFER - (way == "memory")), (sock, FR_BUFFER)):
            wrapped, out = _collect(reader)
            events = [e for e in out if isinstance(e, Event)]
            assert {e.kind for e in events} == {"flightrec_ring_wrapped"} and len(events) == 2
            for p in procs:
                got = len([o for o in wrapped if o.pid == p.pid])
                lost = [e.value for e in events if e.entity.startswith(f"pid:{p.pid}:")][0]
                assert got == held and got + lost == N_WRAP
            assert reader.lost_entries == 2 * (N_WRAP - held)

        # a rank killed (no atexit: its socket file stays): reported once as exited, the other rank goes on
        victim = procs[1]
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        assert (job["run"] / f"{victim.pid}.sock").exists()
        _, out = _collect(src)
        events = [e for e in out if isinstance(e, Event)]
        assert [e.kind for e in events] == ["flightrec_process_exited"], events
        assert events[0].entity.startswith(f"pid:{victim.pid}:")
        _, out = _collect(src, steps=2)
        assert not [e for e in out if isinstance(e, Event)]
        assert list(src.targets) == [k for k in src.targets if k[0] == procs[0].pid] and src.targets
    finally:
        sock.stop()
        src.stop()
        src.stop()  # idempotent


def test_unknown_version_is_reported_once_and_skipped(tmp_path, job):
    p0 = job["procs"][0]
    status, body = http_post_unix(str(job["run"] / f"{p0.pid}.sock"), "fr_trace_json")
    assert status == 200
    doc = json.loads(body)
    assert doc["version"] == "2.10"
    assert parse_dump(body).entries
    doc["version"] = "99.1"
    with pytest.raises(FlightrecError) as err:
        parse_dump(json.dumps(doc).encode())
    assert err.value.kind == "unknown_version" and "99.1" in str(err.value)
    with pytest.raises(FlightrecError) as err:
        parse_dump(body[: len(body) // 2])
    assert err.value.kind == "bad_json"

    # the source, told that only another version is verified: one Event per process, no ops, runs on
    src = _source(tmp_path, job, procs=[p0], accepted_versions=["1.0"])
    try:
        ops, out = _collect(src)
        out = _records(out)
        assert ops == []
        assert [e.kind for e in out] == ["flightrec_unknown_version"] and "'2.10'" in out[0].message
        ops, out = _collect(src)
        assert ops == [] and _records(out) == []
    finally:
        src.stop()


def test_stale_socket_is_reported_once_and_skipped(tmp_path, job):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = tmp_path / "stale"
        stale.mkdir()
        path = str(stale / f"{sleeper.pid}.sock")
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.close()  # the file stays; nothing listens: connect is refused
        src = _source(tmp_path, job, procs=[sleeper], socket_dirs=[str(stale)], retry_seconds=0.0)
        try:
            _, out = _collect(src)
            out = _records(out)
            assert [e.kind for e in out] == ["flightrec_refused"], out
            _, out = _collect(src, steps=3)  # retried each step, reported once
            assert out == []
            assert sleeper.poll() is None
        finally:
            src.stop()
    finally:
        sleeper.kill()
        sleeper.wait()


def _serve_dump(path: str, body: bytes):
    """A Unix socket at `path` answering fr_trace_json with `body` and anything else with 404, as a CPU build
    does; close() the returned socket."""
    import threading
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(4)

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            if b"/handler/fr_trace_json " in c.recv(4096):
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            else:
                c.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            c.close()
    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_entries_whose_times_do_not_convert_are_dropped_with_the_reason(tmp_path, job):
    """A real dump of the running job, with copies of its entries whose time_created_ns is before this boot,
    negative, days ahead or past the 64-bit range, and one with a size that is not a number, served as one
    process's answer: the crafted entries are dropped and reported per reason, the real ones are kept."""
    p0 = job["procs"][0]
    status, body = http_post_unix(str(job["run"] / f"{p0.pid}.sock"), "fr_trace_json")
    assert status == 200
    doc = json.loads(body)
    real = [e for e in doc["entries"] if e.get("retired") or e.get("state") == "completed"]
    assert real
    boot_real_ns = time.time_ns() - time.monotonic_ns()
    crafted = {"before_boot": [boot_real_ns - 3600 * 10**9, -10**15], "future": [time.time_ns() + 3 * 86400 * 10**9],
               "out_of_range": [1 << 64]}
    rid = max(e["record_id"] for e in doc["entries"]) + 1
    for times in crafted.values():
        for t in times:
            doc["entries"].append(dict(real[0], record_id=rid, time_created_ns=t))
            rid += 1
    doc["entries"].append(dict(real[0], record_id=rid, input_sizes=[["many"]]))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    d = tmp_path / "crafted"
    d.mkdir()
    srv = _serve_dump(str(d / f"{sleeper.pid}.sock"), json.dumps(doc).encode())
    try:
        src = _source(tmp_path, job, procs=[sleeper], socket_dirs=[str(d)])
        try:
            _, out = _collect(src)
            dropped = [e for e in out if isinstance(e, Event) and e.kind == "flightrec_records_dropped"]
            assert {e.message.split(":")[0]: e.value for e in dropped} == {r: len(t) for r, t in crafted.items()}
            malformed = [e for e in out if isinstance(e, Event) and e.kind == "flightrec_entries_malformed"]
            assert len(malformed) == 1 and malformed[0].value == 1 and "many" in malformed[0].message
            from steplens.agent.transport.codec import decode_records, records_payload
            stored = [rec for _, rec in decode_records(records_payload(src.log.store.records(["commop"])))]
            assert len(stored) == len(real) and {o.pid for o in stored} == {sleeper.pid}
            assert all(0 < o.issue_mono_ns <= time.monotonic_ns() for o in stored)
        finally:
            src.stop()
    finally:
        srv.close()
        sleeper.kill()
        sleeper.wait()


def test_answer_cut_mid_dump_is_reported(tmp_path, job):
    """A process that dies while answering: the server closes after part of the body."""
    import threading
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    d = tmp_path / "cut"
    d.mkdir()
    path = str(d / f"{sleeper.pid}.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(4)

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.recv(4096)
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\nContent-Type: application/json\r\n\r\n{\"vers")
            c.close()
    threading.Thread(target=serve, daemon=True).start()
    try:
        src = _source(tmp_path, job, procs=[sleeper], socket_dirs=[str(d)])
        try:
            _, out = _collect(src)
            out = _records(out)
            assert [e.kind for e in out] == ["flightrec_truncated"], out
        finally:
            src.stop()
    finally:
        srv.close()
        sleeper.kill()
        sleeper.wait()
