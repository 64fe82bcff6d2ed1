"""The iters source end to end on a real child Python process under the steplens bootstrap, with a fake engine
module configured as anchor (STEPLENS_ITER_ANCHORS): its iterations arrive once each, within the child's own
logged times, while it runs and after it exited (the ring kept at exit, read, then deleted); a ring that lapped
is counted as lost; rings of another version, truncated, or of a recycled pid are reported once and never crash
a step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from conftest import REPO, wait_for
from procutil import start_ticks
from steplens.agent.bootstrap import site_dir
from steplens.agent.records import Event, Iteration, Metric, ProcessInfo
from steplens.agent.sources.base import HostContext
from steplens.agent.sources.iters import ItersConfig, ItersSource

SITE = site_dir()
VENV_PY = os.path.join(REPO, ".venv", "bin", "python")
sys.path.insert(0, SITE)
import steplens_iters  # noqa: E402

ENGINE = '''
import time
class Engine:
    def step(self, n):
        time.sleep(0.003)
        return n
'''

JOB = r'''
import json, os, sys, time
import eng
sync = sys.argv[1]
e, log = eng.Engine(), []
def run(k):
    for i in range(k):
        t0 = time.monotonic_ns(); e.step(i); log.append((t0, time.monotonic_ns()))
run(5)
open(os.path.join(sync, "first"), "w").close()
while not os.path.exists(os.path.join(sync, "go")):
    time.sleep(0.01)
run(5)
json.dump(log, open(os.path.join(sync, "log.json"), "w"))
'''


def _source(tmp_path, workloads=None, **cfg) -> ItersSource:
    ctx = HostContext(node_id="t", state_dir=str(tmp_path))
    ctx.workloads.replace(workloads or {})
    cfg.setdefault("ring_dirs", [str(tmp_path / "run")])
    src = ItersSource(ctx, ItersConfig(**cfg))
    src.start()
    return src


def _split(out):
    its = [r for r in out if isinstance(r, Iteration)]
    events = [r for r in out if isinstance(r, Event)]
    metrics = {r.name: r.value for r in out if isinstance(r, Metric)}
    return its, events, metrics


def test_iterations_of_a_real_process_while_it_runs_and_after_it_exits(tmp_path):
    run, sync = tmp_path / "run", tmp_path / "sync"
    run.mkdir()
    sync.mkdir()
    (tmp_path / "eng.py").write_text(ENGINE)
    (tmp_path / "job.py").write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPLENS_", "TORCH_"))}
    env.update(PYTHONPATH=os.pathsep.join([SITE, str(tmp_path)]), STEPLENS_BOOTSTRAP="1",
               STEPLENS_RUNTIME_DIR=str(run), STEPLENS_ITER_ANCHORS="eng:Engine.step", STEPLENS_JOB="itjob",
               RANK="3")
    proc = subprocess.Popen([VENV_PY, str(tmp_path / "job.py"), str(sync)], env=env)
    try:
        wait_for(lambda: (sync / "first").exists(), timeout=30)
        key = (proc.pid, start_ticks(proc.pid))
        src = _source(tmp_path, {key: ProcessInfo(0, proc.pid, key[1], rank=3, job_key="itjob")})
        first, events, metrics = _split(src.step())
        assert [i.seq for i in first] == list(range(5)) and not events
        assert metrics["iters_read_total"] == 5 and metrics["iters_lost_total"] == 0
        again, _, _ = _split(src.step())
        assert again == []  # nothing read twice
        (sync / "go").touch()
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    ring = run / f"{proc.pid}.iters"
    assert ring.exists()  # kept at exit for the last read
    src.ctx.workloads.replace({})  # procs saw the exit
    rest, events, metrics = _split(src.step())
    assert [i.seq for i in rest] == list(range(5, 10)) and not events and not ring.exists()
    assert metrics["iters_read_total"] == 10 and metrics["iters_torn_total"] == 0
    log = json.loads((sync / "log.json").read_text())
    for it, (t0, t1) in zip(first + rest, log):
        assert it.pid == proc.pid and it.start_ticks == key[1] and it.job_key == "itjob" and it.rank == 3
        assert it.anchor == "eng:Engine.step" and it.phase == "" and it.mono_ns == it.end_mono_ns
        # within the child's own times, up to the realtime -> monotonic mapping's error
        assert t0 - 50_000 <= it.start_mono_ns < it.end_mono_ns <= t1 + 50_000, (it, t0, t1)
        assert it.end_mono_ns - it.start_mono_ns >= 3_000_000
    assert _split(src.step())[0] == []


def _ring(path, ticks, n, slots=8):
    ring = steplens_iters.Ring(str(path), ticks, ["m:E.step"], slots=slots)
    now = time.time_ns()
    for k in range(n):
        ring.add(now - 10_000_000 + k * 1000, now - 10_000_000 + k * 1000 + 500, 0, 2, (1,) * 9)
    return ring


def test_lap_bad_rings_and_recycled_pids_are_reported_once(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    me = (os.getpid(), start_ticks(os.getpid()))
    live = _ring(run / f"{me[0]}.iters", me[1], 5)
    src = _source(tmp_path)
    its, events, metrics = _split(src.step())
    assert [i.seq for i in its] == list(range(5)) and its[0].anchor == "m:E.step" and its[0].phase == "decode"
    now = time.time_ns()
    for k in range(20):  # laps the 8 slots before the next read: 12 overwritten, and the oldest one left is one
        live.add(now + k, now + k + 1, 0, 1, (0,) * 9)  # the writer could reach during the copy: 13 lost
    its, events, metrics = _split(src.step())
    assert [i.seq for i in its] == list(range(18, 25))
    assert [e.kind for e in events] == ["iters_ring_wrapped"] and events[0].value == 13.0
    assert metrics["iters_lost_total"] == 13
    # another version, a truncated file, a bad magic: reported once each, the live ring still read
    data = (run / f"{me[0]}.iters").read_bytes()
    (run / "1.iters").write_bytes(data[:8] + (2).to_bytes(4, "little") + data[12:])
    (run / "2.iters").write_bytes(data[:5000])
    (run / "3.iters").write_bytes(b"x" * 5000)
    for step in range(2):
        live.add(time.time_ns(), time.time_ns() + 1, 0, 1, (0,) * 9)
        its, events, _ = _split(src.step())
        assert [i.seq for i in its] == [25 + step]
        msgs = sorted(e.message for e in events)
        if step == 0:
            assert [e.kind for e in events] == ["iters_bad_ring"] * 3
            assert "version 2" in msgs[0] and "truncated" in msgs[1] and "magic" in msgs[2], msgs
        else:
            assert events == []
    # a ring left by an earlier process with a pid that now names another: read once, reported, removed
    _ring(run / f"{os.getppid()}.iters", start_ticks(os.getppid()) + 7, 3).close()
    its, events, _ = _split(src.step())
    assert [(i.pid, i.seq) for i in its] == [(os.getppid(), 0), (os.getppid(), 1), (os.getppid(), 2)]
    assert [e.kind for e in events] == ["iters_stale_ring"] and not (run / f"{os.getppid()}.iters").exists()
    live.close()
