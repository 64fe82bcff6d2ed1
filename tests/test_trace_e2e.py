"""`steplens trace` end to end: a real 4-rank gloo job under the bootstrap (Flight Recorder comm ops), one real
agent (procs, host, pystacks, flightrec) and a real collector; a deep window on the agent; then one merged trace,
read back by Perfetto's own trace processor: every rank's group with its Python stacks and comm ops, one flow per
member of each collective towards the member that entered it last, the deep window, counters."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import time
from collections import Counter, defaultdict

import pytest

from conftest import FAST_AGENT_TOML, AgentProc, CollectorProc, free_port, wait_for
from perfettotp import TraceProcessorWasm, unavailable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_PY = os.path.join(REPO, ".venv", "bin", "python")

JOB = r'''
import os, sys, time
import torch, torch.distributed as dist
sync = sys.argv[1]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
t = torch.ones(4096)
def compute(ms):
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass
while not os.path.exists(os.path.join(sync, "stop")):
    compute(30 + (25 if rank == 3 else 0))   # rank 3 computes longer: the others wait for it in all_reduce
    dist.all_reduce(t)
'''


def _torch_available() -> bool:
    return os.path.exists(VENV_PY) and subprocess.run(
        [VENV_PY, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"]
    ).returncode == 0


pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _torch_available(), reason="torch is not installed in .venv"),
              pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "-")]


def test_trace_of_a_four_rank_job_loads_in_perfettos_trace_processor(tmp_path):
    from steplens.agent.bootstrap import site_dir
    short = pathlib.Path(tempfile.mkdtemp(prefix="slt", dir="/tmp"))  # AF_UNIX paths are short
    runtime, sync = short / "fr", tmp_path / "sync"
    runtime.mkdir()
    sync.mkdir()
    script = tmp_path / "job.py"
    script.write_text(JOB)
    toml = FAST_AGENT_TOML.replace("[sources.flightrec]\nenabled = false",
                                   f'[sources.flightrec]\ninterval_seconds = 0.5\nsocket_dirs = ["{runtime}"]')
    collector = CollectorProc(tmp_path).start()
    agent = AgentProc(tmp_path, "node-a", collector.address, toml=toml).start()
    procs = []
    out = tmp_path / "job.pftrace"
    try:
        wait_for(lambda: (collector.node("node-a") or {}).get("connected"), 60, what="agent connected")
        port = free_port()
        for rank in range(4):
            env = dict(os.environ, PYTHONPATH=site_dir(), STEPLENS_BOOTSTRAP="1", STEPLENS_RUNTIME_DIR=str(runtime),
                       STEPLENS_BOOTSTRAP_POLL_S="0.05", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4", STEPLENS_JOB="e2e-trace",
                       OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([VENV_PY, str(script), str(sync)], env=env, stdout=subprocess.DEVNULL,
                                          stderr=open(tmp_path / f"rank{rank}.err", "wb")))
        wait_for(lambda: len([p for p in collector.cli("procs") if p["job_key"] == "e2e-trace"]) == 4, 60,
                 what="4 ranks in procs")
        time.sleep(14)   # the dive's reference window (10 s, 1 s before it) in the job's steady state
        assert all(p.poll() is None for p in procs), (tmp_path / "rank0.err").read_text()[-3000:]
        # an operator's deep dive of the job (analysis/deepdive.py): its node, a reference window, ranked causes
        deep = collector.cli("deep", "start", "--job", "e2e-trace", "--duration", "3s", "--lead-ms", "200")
        assert deep["delivered"] == ["node-a"] and deep["deep_dive"]["ranks"] == [0, 1, 2, 3], deep

        def dive_done():
            rows = collector.cli("deep", "list", "--job", "e2e-trace")
            return rows[0] if rows and rows[0]["status"] in ("done", "failed") else None
        dive = wait_for(dive_done, 60, interval=1.0, what="the deep dive analysed")
        (sync / "stop").touch()
        steplens = os.path.join(REPO, ".venv", "bin", "steplens")
        r = subprocess.run([steplens, "--collector", collector.address, "--insecure", "trace", "e2e-trace",
                            "-o", str(out), "--since", "40s", "--json"], capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr

        summary = json.loads(r.stdout)
        # the CLI's errors: an unknown job, an empty window
        bad = subprocess.run([steplens, "--collector", collector.address, "--insecure", "trace", "no-such-job",
                              "-o", str(tmp_path / "x.pftrace")], capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and "no process of job 'no-such-job'" in bad.stderr
        assert not (tmp_path / "x.pftrace").exists() and not (tmp_path / "x.pftrace.part").exists()
    finally:
        (sync / "stop").touch()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        agent.stop()
        collector.stop()
        shutil.rmtree(short, ignore_errors=True)

    # the dive: switched on its one node (ModeChange), dense stacks of every rank, rank 3 (the slow one) ranked first
    assert dive["status"] == "done" and dive["command_id"] == deep["command_id"], dive
    assert list(dive["started"]) == ["node-a"] and dive["start_spread_ns"] == 0
    # denser than sentinel sampling (10 Hz): 1 kHz unless the agent's overhead governor held it back (its deep
    # budget, 3 % of the host's CPUs, is spent well before 1 kHz on 4 ranks sharing 2 cores)
    assert dive["data"]["ranks"] == 4 and dive["data"]["deep_samples"] > 3 * 4 * 3 * 10, dive["data"]
    assert dive["causes"] and dive["causes"][0]["rank"] == 3, dive["causes"][:3]
    assert summary["ranks"] == [0, 1, 2, 3] and summary["nodes"] == ["node-a"] and not summary["offline"]
    with TraceProcessorWasm.load(str(out)) as tp:
        tracks = tp.query("select id, name, parent_id from track")
        rank_tracks = {t["name"].split(" ·")[0]: t["id"] for t in tracks if t["name"].startswith("rank ")}
        assert sorted(rank_tracks) == ["rank 0", "rank 1", "rank 2", "rank 3"]
        parent = {t["id"]: t["parent_id"] for t in tracks}

        def rank_of(track_id):
            while track_id is not None:
                for name, tid in rank_tracks.items():
                    if tid == track_id:
                        return int(name.split()[1])
                track_id = parent.get(track_id)
            return None
        ops = tp.query("select s.id, s.track_id, s.ts, s.dur, s.name from slice s join track t on s.track_id = t.id"
                       " where t.name like 'comm %'")
        per_rank = Counter(rank_of(o["track_id"]) for o in ops)
        assert set(per_rank) == {0, 1, 2, 3} and min(per_rank.values()) >= 20, (per_rank, json.dumps(summary))
        assert {o["name"] for o in ops} == {"all_reduce"}
        # one flow per member of each collective (n-1), each into the op of the member that entered last
        flows = tp.query("select slice_out, slice_in from flow")
        by_id = {o["id"]: o for o in ops}
        into = defaultdict(list)
        for f in flows:
            into[f["slice_in"]].append(f["slice_out"])
        assert len(flows) == summary["counts"]["flows"] > 0
        # a collective that straddles the window's start or end can have a member outside it (seen once in CI: 304
        # collectives with 3 flows, 1 with 2): at most the two edge collectives may have fewer, never more
        short = [i for i, v in into.items() if len(v) != 3]
        assert all(len(v) <= 3 for v in into.values()) and len(short) <= 2, Counter(len(v) for v in into.values())
        if short:
            edge = sorted(into, key=lambda i: by_id[i]["ts"])
            assert set(short) <= {edge[0], edge[-1]}, [by_id[i]["ts"] for i in short]
        assert all(by_id[i]["ts"] >= max(by_id[o]["ts"] for o in outs) for i, outs in into.items())
        late = Counter(rank_of(by_id[i]["track_id"]) for i in into)
        assert late.most_common(1)[0][0] == 3, late     # rank 3 computes longest: the others wait for it
        # Python stacks as nested slices on every rank
        st = tp.query("select s.track_id, s.depth, s.name from slice s join track t on s.track_id = t.id"
                      " where t.name like 'python %'")
        seen = (Counter((rank_of(s["track_id"]), s["depth"], s["name"][:30]) for s in st).most_common(40),
                summary["messages"], summary["counts"])
        assert {rank_of(s["track_id"]) for s in st} == {0, 1, 2, 3}, seen
        assert max(s["depth"] for s in st) >= 1 and any("compute" in s["name"] for s in st), seen
        deep = tp.query("select s.ts, s.dur from slice s join track t on s.track_id = t.id"
                        " where t.name = 'deep dives'")
        # the operator's 3 s window (the collector may have started one of its own on a finding before it), drawn
        # from the node's own switch (its ModeChange): late where the command reached the agent after the 200 ms
        # lead (seen under load), yet ending at the dive's planned end
        sw, end = dive["started"]["node-a"], dive["start_ns"] + dive["duration_ns"]
        assert any(abs(d["ts"] - sw) < 50_000_000 and abs(d["ts"] + d["dur"] - end) < 500_000_000
                   for d in deep), (deep, dive)
        counters = {r["name"] for r in tp.query("select distinct t.name from counter c join track t"
                                                " on c.track_id = t.id")}
        assert any(n.startswith("cpu_utilization_percent") for n in counters), counters
        assert "process_cpu_percent" in counters, counters
