"""The sampler's walk in C (agent/pyframes/_walker.c) against the walk in Python (reader.py), on real
CPython processes of every pyenv version (3.9-3.13): the same threads, names, states and frames.

The accuracy tests (test_pyframes_accuracy.py, test_stacks_frames.py) check the default walk (the C one
where it is built) against the targets' known lines and py-spy; these check that the two walks agree, that
a thread whose stack moved is walked again (not served from the C walk's reuse of unchanged stacks), and
that the Python walk is used where asked or where the extension is not built.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time

import pytest

from pytarget import spawn, task_states  # noqa: F401 (a fixture)
from steplens.agent.pyframes import reader

PYENV = "/root/.pyenv/versions"
VERSIONS = ["3.9.18", "3.10.13", "3.11.7", "3.12.1", "3.13.0"]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (/proc/PID/mem of a child is fine, "
                                "but Yama may refuse it)")

# three threads parked in known functions, one spinning 20 frames deep, the main thread asleep; on a line
# "go" on stdin the mover thread returns from stage_one and calls stage_two (the same depth, so its thread
# state can read back as before)
TARGET = r'''
import json, sys, threading, time
go = threading.Event()
def parked(i):
    threading.Event().wait()
def stage_two():
    threading.Event().wait()
def stage_one():
    go.wait()
def mover():
    stage_one()
    stage_two()
def deep(n):
    if n == 0:
        x = 0
        while True:
            x += 1
    return deep(n - 1)
for i in range(2):
    threading.Thread(target=parked, args=(i,), name=f"parked{i}", daemon=True).start()
threading.Thread(target=mover, name="mover", daemon=True).start()
threading.Thread(target=deep, args=(20,), name="busy", daemon=True).start()
time.sleep(0.2)
print("ready {}", flush=True)
sys.stdin.readline()
go.set()
time.sleep(1000)
'''


def walker_built() -> bool:
    try:
        from steplens.agent.pyframes import _walker  # noqa: F401
    except ImportError:
        return False
    return True


needs_walker = pytest.mark.skipif(not walker_built(), reason="the C walk is not built (no compiler at install)")


def interpreter(version: str) -> str:
    path = os.path.join(PYENV, version, "bin", "python3")
    if not os.access(path, os.X_OK):
        pytest.skip(f"no CPython {version} at {path}")
    return path


def view(sample) -> dict:
    return {t.tid: (t.thread_id, t.name, t.state, [(f.function, f.qualname, f.file, f.line) for f in t.frames])
            for t in sample.threads}


def settled(pid: int) -> None:
    """Wait until the target's four waiting threads (main in readline among them) are asleep: it prints
    'ready' just before the main thread gets there."""
    deadline = time.monotonic() + 10
    while sum(s == "S" for s in task_states(pid).values()) < 4:
        assert time.monotonic() < deadline, f"target threads never settled: {task_states(pid)}"
        time.sleep(0.01)
    time.sleep(0.05)


def names(frames) -> list[str]:
    return [f[0] for f in frames]


def role(thread: tuple) -> str:
    """Which of the target's threads (CPython < 3.14 does not name OS threads): by its outer frames."""
    fns = names(thread[3])
    return next((r for r in ("deep", "mover", "parked") if r in fns), "main")


def test_the_c_walk_is_built_where_a_compiler_is():
    """`pip install -e .` builds the extension where there is a C compiler and Python's headers (CI has
    both); without them the install still works and the Python walk is used."""
    include = sysconfig.get_paths()["include"]
    if not (shutil.which("cc") or shutil.which("gcc")) or not os.path.exists(os.path.join(include, "Python.h")):
        pytest.skip("no C compiler or no Python.h here: the extension is optional")
    assert walker_built(), "a compiler and Python.h are here but steplens.agent.pyframes._walker is not built"


@needs_walker
@needs_root
@pytest.mark.parametrize("version", VERSIONS)
def test_the_c_walk_and_the_python_walk_agree(spawn, version):
    t = spawn([interpreter(version), "-c", TARGET], stdin=subprocess.PIPE)
    settled(t.pid)
    fast = reader.attach(t.pid, native=True)
    slow = reader.attach(t.pid, native=False)
    try:
        assert fast.native and not slow.native
        for _ in range(20):
            a, b = view(fast.sample()), view(slow.sample())
            assert a.keys() == b.keys() and len(a) == 5
            for tid in a:
                ta, tb = a[tid], b[tid]
                assert ta[:2] == tb[:2], (tid, ta, tb)
                if role(ta) == "deep":
                    # it runs between the two reads: the same frames below its innermost one
                    assert names(ta[3]) == names(tb[3]) and ta[3][1:] == tb[3][1:]
                    assert names(ta[3])[:2] == ["deep", "deep"] and len(ta[3]) == 21 + 3
                else:
                    assert ta[2] == tb[2] and ta[3] == tb[3], (tid, ta, tb)
            by_role = {role(v): v for v in a.values()}
            assert by_role.keys() == {"deep", "mover", "parked", "main"}
            assert names(by_role["mover"][3])[:3] == ["wait", "wait", "stage_one"]
            time.sleep(0.01)
    finally:
        fast.close()
        slow.close()


@needs_walker
@needs_root
@pytest.mark.parametrize("version", ["3.9.18", "3.12.1"])
def test_a_thread_whose_stack_moved_is_walked_again(spawn, version):
    """The C walk reuses a thread's last stack when the thread has not been on a CPU since (its schedstat
    and thread-state bytes unchanged) and returns only the records above the unchanged bottom ones: a
    thread that moved from stage_one to stage_two must come back with stage_two on top, the same frames
    below, and parked threads unchanged."""
    t = spawn([interpreter(version), "-c", TARGET], stdin=subprocess.PIPE)
    settled(t.pid)
    proc = reader.attach(t.pid, native=True, state_refresh_seconds=0.0)
    try:
        def mover():
            s = view(proc.sample())
            return next(v for v in s.values() if role(v) == "mover"), s
        before, s0 = mover()
        for _ in range(5):   # settled: the parked threads are reused from here on
            again, _ = mover()
            assert again == before
        assert "stage_one" in names(before[3]) and "stage_two" not in names(before[3])
        t.proc.stdin.write(b"go\n")
        t.proc.stdin.flush()
        deadline = time.monotonic() + 10
        after = before
        while time.monotonic() < deadline and "stage_two" not in names(after[3]):
            time.sleep(0.02)
            after, s1 = mover()
        assert names(after[3])[:3] == ["wait", "wait", "stage_two"], after
        assert names(after[3])[3] == "mover" and after[3][4:] == before[3][4:], "the frames below changed"
        parked = {k: v for k, v in s0.items() if role(v) == "parked"}
        assert parked and all(s1[k] == v for k, v in parked.items())
    finally:
        proc.close()


@needs_root
def test_the_python_walk_is_used_when_asked(spawn, monkeypatch):
    t = spawn([sys.executable, "-c", TARGET], stdin=subprocess.PIPE)
    proc = reader.attach(t.pid, native=False)
    try:
        assert not proc.native and len(proc.sample().threads) == 5
    finally:
        proc.close()
    monkeypatch.setenv("STEPLENS_PYFRAMES_NATIVE", "0")
    proc = reader.attach(t.pid)
    try:
        assert not proc.native
    finally:
        proc.close()
    # `steplens-agent check` says why (pystacks' probe)
    assert "turned off" in reader.native_unavailable()
    from steplens.agent.sources.base import HostContext
    from steplens.agent.sources.pystacks import PystacksSource
    assert "turned off" in PystacksSource.probe(HostContext(node_id="t", state_dir="/tmp")).reason
    if walker_built():
        monkeypatch.delenv("STEPLENS_PYFRAMES_NATIVE")
        assert reader.native_unavailable() == ""
        proc = reader.attach(t.pid)
        try:
            assert proc.native
        finally:
            proc.close()
    else:
        assert "not built" in reader.native_unavailable()
        with pytest.raises(reader.PyFramesError, match="not built"):
            reader.attach(t.pid, native=True)


@needs_walker
@needs_root
def test_a_layout_the_c_walk_cannot_take_is_refused_and_the_python_walk_is_used(spawn, monkeypatch):
    """The C walk reads fields at the layout's offsets out of the bytes it read (3.13+'s offsets come from the
    target's own memory): an offset outside them is refused at construction, never read past; attach then walks
    in Python."""
    from steplens.agent.pyframes import _walker
    t = spawn([sys.executable, "-c", TARGET], stdin=subprocess.PIPE)   # offsets by index: reader._make_walker
    proc = reader.attach(t.pid, native=False)
    try:
        lay = proc.layout
        good = dict(offsets=None)
        real = _walker.Walker

        def capture(*args):
            good["offsets"] = args[3]
            return real(*args)
        monkeypatch.setattr(_walker, "Walker", capture)
        assert proc._make_walker() is not None
        offsets = good["offsets"]
        for i, bad in [(7, lay.tstate_read_size), (16, lay.frame_read_size - 4), (11, 5000), (15, 7)]:
            broken = list(offsets)
            broken[i] = bad
            with pytest.raises(ValueError, match="layout"):
                real(proc.mem.fd, "/proc/", proc.runtime, tuple(broken), True, 0.005, 2.0, None,
                     lambda *a: None, tuple, {"?": "unknown"})
        monkeypatch.setattr(_walker, "Walker", lambda *a: real(*a[:3], tuple(list(a[3][:7]) + [lay.tstate_read_size]
                                                                             + list(a[3][8:])), *a[4:]))
        assert proc._make_walker() is None
    finally:
        proc.close()
