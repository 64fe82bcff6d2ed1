"""Comm ops end to end: a real 4-rank gloo job launched with the steplens bootstrap (Flight Recorder worker
server) and KINETO_USE_DAEMON=1, one real agent (flightrec + kineto sources) streaming to a real collector,
and `steplens commops JOB --json` fetching every rank's ops from the node-local detail store on demand.

Collectives (Flight Recorder): per rank, the all_reduce count on the default group and the broadcast count on
its pair group equal the calls made, collective seq numbers agree across each group's members, times are
cluster time (within the job's wall-clock span). P2P (gloo send/recv have no Flight Recorder entries): a deep
window is triggered and the Kineto trace must hold every send/recv the job logged inside the traced span.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict

import pytest

from conftest import FAST_AGENT_TOML, AgentProc, CollectorProc, free_port, wait_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_PY = os.path.join(REPO, ".venv", "bin", "python")
N_AR, N_BC = 6, 4

JOB = r'''
import json, os, sys, time
import torch, torch.distributed as dist
sync, log_path = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
def wait(name):
    while not os.path.exists(os.path.join(sync, name)):
        time.sleep(0.02)
dist.init_process_group("gloo")
ga = dist.new_group([0, 1], group_desc="pair_a")
gb = dist.new_group([2, 3], group_desc="pair_b")
mine, root = (ga, 0) if rank < 2 else (gb, 2)
t = torch.ones(256)
wait("go")
for _ in range(N_AR): dist.all_reduce(t)
for _ in range(N_BC): dist.broadcast(t, root, group=mine)
open(os.path.join(sync, f"collectives.{rank}"), "w").close()
peer = rank ^ 1
buf = torch.zeros(1024)
with open(log_path, "w", buffering=1) as log:
    while not os.path.exists(os.path.join(sync, "stop")):
        t0 = time.time_ns()
        if rank % 2 == 0:
            dist.send(buf, peer); op = "send"
        else:
            dist.recv(buf, peer); op = "recv"
        log.write(json.dumps({"op": op, "t0": t0, "t1": time.time_ns()}) + "\n")
        time.sleep(0.02)
wait("exit")
'''.replace("N_AR", str(N_AR)).replace("N_BC", str(N_BC))


def _torch_available() -> bool:
    return os.path.exists(VENV_PY) and subprocess.run(
        [VENV_PY, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"]
    ).returncode == 0


pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _torch_available(), reason="torch is not installed in .venv")]


def _agent_toml(runtime: str, ksock: str) -> str:
    toml = FAST_AGENT_TOML.replace("[sources.flightrec]\nenabled = false", f"""[sources.flightrec]
interval_seconds = 0.5
socket_dirs = ["{runtime}"]""")
    return toml.replace("[sources.kineto]\nenabled = false", f"""[sources.kineto]
interval_seconds = 0.5
socket_dir = "{ksock}"
deep_window_ms = 4000
sentinel_window_ms = 0
sentinel_period_seconds = 0""")


def test_four_rank_gloo_job_comm_ops_reach_the_fetch_path(tmp_path):
    from steplens.agent.bootstrap import site_dir

    import pathlib
    import shutil
    import tempfile

    short = pathlib.Path(tempfile.mkdtemp(prefix="slc", dir="/tmp"))  # AF_UNIX paths are short
    request_cleanup = lambda: shutil.rmtree(short, ignore_errors=True)  # noqa: E731
    runtime, ksock, sync = short / "fr", short / "k", tmp_path / "sync"
    for d in (runtime, ksock, sync):
        d.mkdir()
    script = tmp_path / "job.py"
    script.write_text(JOB)
    collector = CollectorProc(tmp_path).start()
    agent = AgentProc(tmp_path, "node-a", collector.address, toml=_agent_toml(str(runtime), str(ksock))).start()
    procs = []
    try:
        wait_for(lambda: (collector.node("node-a") or {}).get("connected"), 60, what="agent connected")
        port = free_port()
        wall0 = time.time_ns()
        for rank in range(4):
            env = dict(os.environ, PYTHONPATH=site_dir(), STEPLENS_BOOTSTRAP="1", STEPLENS_RUNTIME_DIR=str(runtime),
                       STEPLENS_BOOTSTRAP_POLL_S="0.05", KINETO_USE_DAEMON="1", KINETO_IPC_SOCKET_DIR=str(ksock),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                       WORLD_SIZE="4", STEPLENS_JOB="e2e-commops", OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([VENV_PY, str(script), str(sync), str(tmp_path / f"p2p.{rank}.jsonl")],
                                          env=env, stdout=subprocess.DEVNULL,
                                          stderr=open(tmp_path / f"rank{rank}.err", "wb")))
        # the agent must know the ranks (procs) and have the worker-server sockets before the calls happen
        wait_for(lambda: all((runtime / f"{p.pid}.sock").exists() for p in procs)
                 or any(p.poll() is not None for p in procs), 120, what="worker-server sockets")
        assert all(p.poll() is None for p in procs), (tmp_path / "rank0.err").read_text()[-3000:]
        wait_for(lambda: len([p for p in collector.cli("procs") if p["job_key"] == "e2e-commops"]) == 4, 30,
                 what="4 ranks in procs")
        (sync / "go").touch()
        wait_for(lambda: all((sync / f"collectives.{r}").exists() for r in range(4)), 60, what="collectives done")
        # P2P under a deep window: Kineto hands each polling process a 4 s trace window
        out = subprocess.run([os.path.join(REPO, ".venv", "bin", "steplens"), "--collector", collector.address,
                              "--insecure", "deep", "start", "--duration", "30s", "--json"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr

        def fetched():
            rows = collector.cli("commops", "e2e-commops", "--since", "10m")
            ops = [r for r in rows if r["kind"] == "commop"]
            ar = Counter(r["rank"] for r in ops if r["op"] == "all_reduce")
            p2p = {r["rank"] for r in ops if r["op"] in ("send", "recv")}
            return rows if all(ar[r] >= N_AR for r in range(4)) and p2p == {0, 1, 2, 3} else None

        rows = wait_for(fetched, 90, interval=2.0, what="collectives and P2P ops of all 4 ranks")

        def summarized():  # the per-step summaries streamed upstream and stored by the collector
            got = collector.cli("commops", "e2e-commops", "--summary", "--since", "10m")
            calls = Counter()
            for r in got:
                if r["source"] == "flightrec" and r["op"] == "all_reduce" and r["comm_id"] == "pg:0":
                    calls[r["rank"]] += r["calls"]
            return got if all(calls[r] == N_AR for r in range(4)) else None

        summaries = wait_for(summarized, 30, interval=1.0, what="stored comm summaries")
        (sync / "stop").touch()
        wall1 = time.time_ns()
    finally:
        (sync / "go").touch()
        (sync / "stop").touch()
        (sync / "exit").touch()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        agent.stop()
        collector.stop()
        request_cleanup()

    assert all(wall0 - 10**9 < r["end_ns"] < wall1 + 10**9 and r["node_id"] == "node-a" for r in summaries)
    ops = [r for r in rows if r["kind"] == "commop"]
    for r in ops:  # the documented JSON fields
        for key in ("rank", "comm_id", "op", "seq", "bytes", "start_ns", "end_ns", "source", "node_id"):
            assert key in r
    fr = [r for r in ops if r["source"] == "flightrec"]
    # counts equal the calls: all_reduce on the default group, broadcast on each rank's pair group
    for rank in range(4):
        mine = [r for r in fr if r["rank"] == rank]
        assert Counter(r["op"] for r in mine if r["comm_id"] == "pg:0")["all_reduce"] == N_AR, mine
        bc = [r for r in mine if r["op"] == "broadcast"]
        assert len(bc) == N_BC and len({r["comm_id"] for r in bc}) == 1, bc
        assert all(r["bytes"] == 256 * 4 for r in mine)
    # seq numbers agree across each group's members
    seqs = defaultdict(dict)
    for r in fr:
        seqs[r["comm_id"]].setdefault(r["rank"], []).append(r["seq"])
    assert set(seqs["pg:0"]) == {0, 1, 2, 3}
    assert len({tuple(sorted(v)) for v in seqs["pg:0"].values()}) == 1
    pair_groups = [g for g in seqs if g != "pg:0"]
    assert len(pair_groups) == 2 and {frozenset(seqs[g]) for g in pair_groups} == {frozenset({0, 1}),
                                                                                    frozenset({2, 3})}
    for g in pair_groups:
        assert len({tuple(sorted(v)) for v in seqs[g].values()}) == 1, seqs[g]
        assert sorted(next(iter(seqs[g].values()))) == sorted(set(next(iter(seqs[g].values()))))
    # cluster time: the collector's clock (this host's wall clock on loopback), inside the job's span
    for r in fr:
        t = r["issue_ns"] or r["start_ns"]
        assert wall0 - 10**9 < t < wall1 + 10**9, (r, wall0, wall1)
    # P2P from the Kineto window: every send/recv the job logged inside the traced span is there
    kin = [r for r in ops if r["source"] == "kineto" and r["op"] in ("send", "recv")]
    for rank in range(4):
        traced = sorted((r["start_ns"], r["end_ns"]) for r in kin if r["rank"] == rank)
        assert traced, rank
        with open(tmp_path / f"p2p.{rank}.jsonl") as fh:
            calls = [json.loads(line) for line in fh if line.strip()]
        slack = 2_000_000  # the clock mapping's uncertainty is well below this on loopback
        # each traced op is one logged call: inside its [t0, t1] (calls are >= 20 ms apart)
        matched = set()
        for a_, b_ in traced:
            hit = [i for i, c in enumerate(calls) if c["t0"] - slack <= a_ and b_ <= c["t1"] + slack]
            assert len(hit) == 1 and hit[0] not in matched, (rank, a_, b_, hit)
            matched.add(hit[0])
        # every call inside a traced window was captured (windows: runs of ops with no gap > 200 ms)
        windows, start, prev = [], traced[0][0], traced[0][1]
        for a_, b_ in traced[1:]:
            if a_ - prev > 200_000_000:
                windows.append((start, prev))
                start = a_
            prev = b_
        windows.append((start, prev))
        for lo, hi in windows:
            inside = [i for i, c in enumerate(calls) if c["t0"] >= lo and c["t1"] <= hi]
            assert set(inside) <= matched, (rank, lo, hi, sorted(set(inside) - matched))
        assert len(matched) >= 20, (rank, len(matched))  # a 4 s window at one call per ~20 ms
        assert all(c["op"] == ("send" if rank % 2 == 0 else "recv") for c in calls)
        assert all(wall0 - 10**9 < a and b < wall1 + 10**9 for a, b in traced)
