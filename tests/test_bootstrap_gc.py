"""Python GC time from the bootstrap: real interpreters under the bootstrap collecting real cyclic garbage, the
<pid>.gc counters they write checked against what each measured itself with its own gc.callbacks entry, read by
the flightrec source as python_gc_* metrics (also for a process without a worker-server socket); STEPLENS_GC=0,
forked children, torn copies, and files of another layout or process."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import time

import pytest

from conftest import REPO, wait_for
from procutil import start_ticks
from steplens.agent.bootstrap import site_dir
from steplens.agent.records import Event, Metric, ProcessInfo
from steplens.agent.sources.base import HostContext
from steplens.agent.sources.flightrec import FlightrecConfig, FlightrecSource, read_gc_file

SITE = site_dir()
VENV_PY = os.path.join(REPO, ".venv", "bin", "python")
PYTHONS = [VENV_PY] + [p for v in ("3.8", "3.13")
                        for p in sorted(glob.glob(f"/root/.pyenv/versions/{v}.*/bin/python"))[:1]]


def _py_id(py: str) -> str:
    return "python" + py.split("/versions/")[-1].split("/")[0] if "/versions/" in py else "venv"


GC_NAMES = ("python_gc_seconds_total", "python_gc_collections_total", "python_gc_gen2_seconds_total")


def _site():
    sys.path.insert(0, SITE)
    try:
        import steplens_bootstrap
    finally:
        sys.path.remove(SITE)
    return steplens_bootstrap


def _env(run_dir, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPLENS_", "TORCH_"))}
    env.update(PYTHONPATH=SITE, STEPLENS_BOOTSTRAP="1", STEPLENS_RUNTIME_DIR=str(run_dir), **extra)
    return env


# The child times its own collections with a gc.callbacks entry appended after the bootstrap's, so both see every
# collection from then on (the bootstrap's counters at that moment are the base: start-up collected already);
# phase 1, then a pause for the test to read, then phase 2; with GC disabled (no collection can happen between its
# totals and the file's) it writes its totals and waits to be told to exit.
CHILD = r'''
import gc, json, os, sys, time
import steplens_bootstrap
sync = sys.argv[1]
def wait(name):
    while not os.path.exists(os.path.join(sync, name)):
        time.sleep(0.01)
mine = {"collections": [0, 0, 0], "ns": [0, 0, 0]}
began = [0]
def mine_cb(phase, info):
    if phase == "start":
        began[0] = time.monotonic_ns()
        return
    g = info["generation"]
    mine["collections"][g] += 1
    mine["ns"][g] += time.monotonic_ns() - began[0]
gc.disable()
base = steplens_bootstrap.read_gc(steplens_bootstrap.status()["gc"])[0]
gc.callbacks.append(mine_cb)
gc.enable()
keep = [[i] for i in range(100000)]  # tracked objects: a full collection takes milliseconds
def phase(rounds):
    for _ in range(rounds):
        for _ in range(3000):
            a = []
            b = [a]
            a.append(b)  # cyclic garbage: automatic collections of generations 0 and 1
        gc.collect()
phase(5)
open(os.path.join(sync, "half"), "w").close()
wait("go")
phase(10)
gc.disable()
with open(os.path.join(sync, "mine.json"), "w") as fh:
    json.dump(dict(mine, base=base, timers=[getattr(c, "__name__", "") for c in gc.callbacks]), fh)
open(os.path.join(sync, "done"), "w").close()
wait("exit")
'''


def _source(tmp_path, procs, run_dir) -> FlightrecSource:
    ctx = HostContext(node_id="t", state_dir=str(tmp_path))
    ctx.workloads.replace({(p.pid, start_ticks(p.pid)): ProcessInfo(0, p.pid, start_ticks(p.pid)) for p in procs})
    src = FlightrecSource(ctx, FlightrecConfig(socket_dirs=[str(run_dir)], gc_interval_seconds=0))  # every step
    src.start()
    return src


def _metrics(out) -> dict:
    return {(m.name, m.entity): m.value for m in out if isinstance(m, Metric)}


@pytest.mark.parametrize("py", PYTHONS, ids=_py_id)
def test_gc_counters_match_the_process_own_measure_and_flightrec_emits_them(tmp_path, py):
    b = _site()
    run, sync = tmp_path / "run", tmp_path / "sync"
    run.mkdir()
    sync.mkdir()
    (tmp_path / "child.py").write_text(CHILD)
    p = subprocess.Popen([py, str(tmp_path / "child.py"), str(sync)], env=_env(run), stderr=subprocess.PIPE)
    try:
        wait_for(lambda: (sync / "half").exists() or p.poll() is not None, 60, what="phase 1")
        assert p.poll() is None, p.stderr.read().decode()
        path = str(run / f"{p.pid}.gc")
        key = (p.pid, start_ticks(p.pid))
        entity = f"pid:{key[0]}:{key[1]}"
        assert not list(run.glob("*.sock"))  # no torch.distributed: no socket, the counters are read all the same
        src = _source(tmp_path, [p], run)
        try:
            first = _metrics(src.step())
            assert {n for n, _ in first} == set(GC_NAMES) and {e for _, e in first} == {entity}
            assert first[("python_gc_collections_total", entity)] >= 5

            (sync / "go").touch()
            wait_for(lambda: (sync / "done").exists() or p.poll() is not None, 120, what="phase 2")
            assert p.poll() is None, p.stderr.read().decode()
            out = src.step()
            assert not [e for e in out if isinstance(e, Event)], out
            second = _metrics(out)
        finally:
            src.stop()
        mine = json.loads((sync / "mine.json").read_text())
        assert mine["timers"] == ["steplens_gc_timer", "mine_cb"]
        got, why = b.read_gc(path, key[1])
        assert why == "" and got["start_ticks"] == key[1]
        assert read_gc_file(path, key[1]) == (got["collections"], got["ns"])  # the agent's reader, the same

        # every collection counted, per generation, and timed like the process timed it itself
        base = mine["base"]
        since = {k: [a - b for a, b in zip(got[k], base[k])] for k in ("collections", "ns")}
        print(f"{py}: collections {since['collections']}, gc ns bootstrap {since['ns']} / process {mine['ns']}")
        assert since["collections"] == mine["collections"], (got, mine)
        assert min(mine["collections"]) > 0 and mine["collections"][2] >= 15
        assert sum(since["ns"]) == pytest.approx(sum(mine["ns"]), rel=0.10)
        assert since["ns"][2] == pytest.approx(mine["ns"][2], rel=0.10)

        assert second[("python_gc_collections_total", entity)] == sum(got["collections"])
        assert second[("python_gc_seconds_total", entity)] == pytest.approx(sum(got["ns"]) / 1e9)
        assert second[("python_gc_gen2_seconds_total", entity)] == pytest.approx(got["ns"][2] / 1e9)
        for name in GC_NAMES:
            assert second[(name, entity)] > first[(name, entity)], name
        assert 0 < got["last_end_mono_ns"] <= time.monotonic_ns()

        (sync / "exit").touch()
        assert p.wait(timeout=30) == 0, p.stderr.read().decode()
        assert not os.path.exists(path)  # removed at exit
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_steplens_gc_0_writes_no_file(tmp_path):
    out = subprocess.run([VENV_PY, "-c", "import gc, os, steplens_bootstrap as b; gc.collect(); "
                          "print(os.getpid(), len(gc.callbacks), repr(b.status()['gc']))"],
                         env=_env(tmp_path, STEPLENS_GC="0"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out
    pid, callbacks, gc_path = out.stdout.split()
    assert callbacks == "0" and gc_path == "''"
    assert not list(tmp_path.glob("*.gc")) and not list(tmp_path.glob("*.tmp"))


FORK = r'''
import gc, os, sys, steplens_bootstrap as b
gc.collect()
path = b.status()["gc"]
before = b.read_gc(path)[0]["collections"]
pid = os.fork()
if pid == 0:
    for _ in range(20):
        gc.collect()
    sys.exit(0)  # atexit runs in the child: it must not remove its parent's file
os.waitpid(pid, 0)
after = b.read_gc(path)[0]["collections"]
print(before == after, os.path.exists(path), len(gc.callbacks))
'''


@pytest.mark.parametrize("py", PYTHONS, ids=_py_id)
def test_a_forked_child_stops_timing_and_leaves_its_parent_file(tmp_path, py):
    # 3.12+ warns that the process forks with a thread running (the bootstrap's watcher): not what is tested here
    out = subprocess.run([py, "-W", "ignore::DeprecationWarning", "-c", FORK], env=_env(tmp_path),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out
    assert out.stdout.split() == ["True", "True", "1"]
    assert not list(tmp_path.glob("*.gc"))  # the parent's own exit removed it


def _write_gc(path, magic=b"SLGCTIM1", version=1, ticks=0, seq=2, counts=(3, 2, 1), ns=(30, 20, 10)) -> None:
    b = _site()
    data = bytearray(b.GC_FILE_BYTES)
    b._GC_HEAD.pack_into(data, 0, magic, version, b.GC_FILE_BYTES, ticks)
    struct.pack_into("<Q", data, b.GC_SEQ_AT, seq)
    b._GC_BODY.pack_into(data, b.GC_BODY_AT, *counts, *ns, 12345)
    with open(path, "wb") as fh:
        fh.write(data)


def test_files_of_another_layout_or_process_are_reported_once_and_skipped(tmp_path):
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(5)]
    try:
        keys = [(p.pid, start_ticks(p.pid)) for p in sleepers]
        _write_gc(tmp_path / f"{keys[0][0]}.gc", magic=b"NOTMAGIC", ticks=keys[0][1])
        _write_gc(tmp_path / f"{keys[1][0]}.gc", version=2, ticks=keys[1][1])
        _write_gc(tmp_path / f"{keys[2][0]}.gc", ticks=keys[2][1] - 1)  # a reused pid's stale file
        (tmp_path / f"{keys[3][0]}.gc").write_bytes(b"SLGCTIM1\x01")
        _write_gc(tmp_path / f"{keys[4][0]}.gc", ticks=keys[4][1])
        src = _source(tmp_path, sleepers, tmp_path)
        try:
            out = src.step()
            events = {e.entity: e.message for e in out if isinstance(e, Event) and e.kind == "flightrec_bad_gc"}
            ent = [f"pid:{k[0]}:{k[1]}" for k in keys]
            assert set(events) == set(ent[:4]), out
            assert "magic" in events[ent[0]] and "version 2" in events[ent[1]]
            assert "another process" in events[ent[2]] and "short" in events[ent[3]]
            assert _metrics(out) == {("python_gc_seconds_total", ent[4]): 60e-9,
                                     ("python_gc_collections_total", ent[4]): 6.0,
                                     ("python_gc_gen2_seconds_total", ent[4]): 10e-9}
            assert not [e for e in src.step() if isinstance(e, Event)]  # once
            # a file replaced by a good one (a new inode) is read again
            tmp = tmp_path / "replacement"
            _write_gc(tmp, ticks=keys[2][1], counts=(1, 0, 0))
            os.replace(tmp, tmp_path / f"{keys[2][0]}.gc")
            out = src.step()
            assert _metrics(out)[("python_gc_collections_total", ent[2])] == 1.0
            assert ("python_gc_collections_total", ent[0]) not in _metrics(out)
        finally:
            src.stop()
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def test_a_copy_taken_while_the_counters_are_rewritten_is_not_used(tmp_path):
    """An odd sequence (the writer between its two stores): both readers retry and then give up for this poll."""
    b = _site()
    path = tmp_path / "1.gc"
    _write_gc(path, ticks=7, seq=5)
    assert b.read_gc(str(path), 7) == (None, "being written (torn three times)")
    assert read_gc_file(str(path), 7) is None
    _write_gc(path, ticks=7, seq=6)
    assert read_gc_file(str(path), 7) == ([3, 2, 1], [30, 20, 10])


COST = r'''
import gc, time, statistics, steplens_bootstrap as b
timer = gc.callbacks[0]
def per_collect(n=20000):
    t = time.perf_counter_ns()
    for _ in range(n):
        gc.collect(0)
    return (time.perf_counter_ns() - t) / n
deltas = []
for _ in range(5):
    gc.callbacks.remove(timer)
    off = per_collect()
    gc.callbacks.append(timer)
    deltas.append(per_collect() - off)
print(statistics.median(deltas))
'''


def test_gc_timer_cost(tmp_path):
    """Time the timer adds to each collection (a gc.collect(0) with and without it, median of 5 x 20,000); the figure
    is in steplens_bootstrap's docstring."""
    out = subprocess.run([VENV_PY, "-c", COST], env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out
    ns = float(out.stdout)
    print(f"gc timer: {ns:.0f} ns per collection")
    assert 0 < ns < 10_000
