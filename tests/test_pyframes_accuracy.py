"""`steplens-agent stack --json` against real target programs under every pyenv CPython (3.9-3.13).

The target (pytargets/ziel_ü.py, a non-ASCII file name) parks a main thread and four workers at known
lines inside known call chains (a generator being iterated, an asyncio coroutine chain, a non-ASCII
function, a static method, 500 frames of recursion) and prints its native thread ids. Expected lines come
from `# @marker` comments in the target, so editing it does not break these tests. A second test stops the
target with SIGSTOP and compares our stacks with `py-spy dump` of the very same state.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

import pytarget

BIN = os.path.dirname(sys.executable)
AGENT = os.path.join(BIN, "steplens-agent")
PYSPY = shutil.which("py-spy", path=BIN) or shutil.which("py-spy")
HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(HERE, "pytargets", "ziel_ü.py")
PYENV = "/root/.pyenv/versions"
VERSIONS = ["3.9.18", "3.10.13", "3.11.7", "3.12.1", "3.13.0"]
DEPTH = 500
THREADING_TAIL = [("run", "Thread.run", "self._target("), ("_bootstrap_inner", "Thread._bootstrap_inner", "self.run()"),
                  ("_bootstrap", "Thread._bootstrap", "self._bootstrap_inner()")]

privileged = pytest.mark.privileged
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (ptrace and /proc/PID/mem of any process)")


def interpreter(version: str) -> str:
    path = os.path.join(PYENV, version, "bin", "python3")
    if not os.access(path, os.X_OK):
        pytest.skip(f"no CPython {version} at {path}")
    return path


def markers(path: str = TARGET) -> dict[str, int]:
    return pytarget.markers(path)


def source_line(path: str, line: int) -> str:
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    assert 1 <= line <= len(lines), f"{path}:{line} is past the end of the file ({len(lines)} lines)"
    return lines[line - 1]


from pytarget import spawn  # noqa: E402,F401 (a fixture)

thread_states = pytarget.task_states


def stack_json(pid: int, *extra: str) -> dict:
    out = subprocess.run([AGENT, "stack", str(pid), "--json", *extra], capture_output=True, timeout=30)
    assert out.returncode == 0, f"stack {pid} failed: {out.stderr.decode(errors='replace')}"
    return json.loads(out.stdout.decode("utf-8"))


def expected_chains(version: tuple[int, int]) -> dict[str, list[tuple[str, str, int]]]:
    """Per thread: the (function, qualname, line) frames in the target file, innermost first."""
    m = markers()
    q = (lambda name, qual: qual) if version >= (3, 11) else (lambda name, qual: name)

    def f(name, qual, marker):
        return (name, q(name, qual), m[marker])
    return {
        "main": [f("method", "Klass.method", "main_busy"), f("main", "main", "main_call"),
                 f("<module>", "<module>", "module")],
        "gen": [f("erzeuge", "erzeuge", "gen_leaf"), f("worker_gen", "worker_gen", "gen_for")],
        "async": [f("blocking", "blocking", "async_leaf"), f("inner", "inner", "async_inner"),
                  f("outer", "outer", "async_outer"), f("worker_async", "worker_async", "async_run")],
        "utf": [f("statisch", "Klass.statisch", "utf_leaf"), f("größe_ü", "größe_ü", "utf_call")],
        "rek": [f("rekursion", "rekursion", "rek_leaf")] + [f("rekursion", "rekursion", "rek_call")] * (DEPTH - 1)
               + [f("worker_rek", "worker_rek", "rek_start")],
    }


def check_thread(role: str, frames: list[dict], version: tuple[int, int]) -> None:
    want = expected_chains(version)[role]
    got = [(f["function"], f["qualname"], f["line"]) for f in frames]
    ours = [(fn, q, line) for (fn, q, line), f in zip(got, frames) if f["file"] == TARGET]
    assert got[0] == want[0], f"{role}: innermost frame {got[0]} != {want[0]}"
    assert ours == want, f"{role}: frames in the target file differ:\n got  {ours[:8]}...\n want {want[:8]}..."
    if role == "main":
        assert got == want, f"main thread has frames outside the target: {got}"
        return
    # below the target's outermost frame: threading's bootstrap, at the lines that call the next frame
    tail = frames[len(frames) - 3:]
    assert len(frames) >= len(want) + 3
    for f, (name, qual, text) in zip(tail, THREADING_TAIL):
        assert os.path.basename(f["file"]) == "threading.py", f"{role}: tail frame {f}"
        assert f["function"] == name and f["qualname"] == (qual if version >= (3, 11) else name), f
        assert text in source_line(f["file"], f["line"]), f"{role}: {f} does not point at `{text}`"
    if role == "async":
        # between outer() and worker_async: the event loop's frames, all in asyncio
        i_outer = next(i for i, f in enumerate(frames) if f["function"] == "outer")
        i_worker = next(i for i, f in enumerate(frames) if f["function"] == "worker_async")
        between = frames[i_outer + 1:i_worker]
        assert between, "no event-loop frames between outer() and asyncio.run()"
        for f in between:
            assert f"{os.sep}asyncio{os.sep}" in f["file"], f"async: unexpected frame {f}"
            assert source_line(f["file"], f["line"]).strip(), f"async: {f} points at a blank line"
        assert between[-1]["function"] == "run" and between[0]["function"] == "_run", between
    else:
        assert len(frames) == len(want) + 3, f"{role}: extra frames {got[len(want):]}"


@privileged
@needs_root
@pytest.mark.parametrize("stop", [False, True], ids=["running", "stop"])
@pytest.mark.parametrize("version", VERSIONS)
def test_stack_json_matches_known_chains(spawn, version, stop):
    python = interpreter(version)
    t = spawn([python, TARGET, "--busy"])
    info = t.info
    major_minor = tuple(int(x) for x in version.split(".")[:2])
    doc = stack_json(t.pid, *(["--stop"] if stop else []))
    assert doc["pid"] == t.pid
    assert doc["python"] == "%d.%d" % major_minor
    by_tid = {th["tid"]: th for th in doc["threads"]}
    roles = {info[r]: r for r in ("main", "gen", "async", "utf", "rek")}
    assert sorted(by_tid) == sorted(roles), f"tids {sorted(by_tid)} != the target's {sorted(roles)}"
    for tid, role in roles.items():
        check_thread(role, by_tid[tid]["frames"], major_minor)
        assert by_tid[tid]["name"], f"{role}: no thread name"
    holders = [by_tid[tid] for tid in by_tid if by_tid[tid]["gil"]]
    assert len(holders) <= 1, f"{len(holders)} threads hold the GIL"
    if holders:
        assert holders[0]["tid"] == info["main"], "the GIL holder is a sleeping thread, not the busy main thread"
    # never left stopped (--stop detached every thread)
    time.sleep(0.05)
    states = thread_states(t.pid)
    assert not [s for s in states.values() if s in "Tt"], f"target left stopped: {states}"
    # the scheduler state is the target's own, also with --stop: a state read while the sampler itself
    # holds the thread in a ptrace stop says "stopped" for every thread, and `active` (what `record`
    # keeps without --idle) then drops busy threads that do not hold the GIL
    got_states = {roles[tid]: by_tid[tid]["state"] for tid in roles}
    want_states = {role: "running" if role == "main" else "sleeping" for role in roles.values()}
    assert got_states == want_states
    assert [roles[tid] for tid in by_tid if by_tid[tid]["active"]] == ["main"]


def pyspy_dump(pid: int) -> list[dict]:
    out = subprocess.run([PYSPY, "dump", "--pid", str(pid), "--json", "--nonblocking"], capture_output=True,
                         timeout=60)
    if out.returncode != 0:
        pytest.skip(f"py-spy dump failed here: {out.stderr.decode(errors='replace').strip()[:300]}")
    return json.loads(out.stdout)


@privileged
@needs_root
@pytest.mark.skipif(PYSPY is None, reason="py-spy is not installed")
@pytest.mark.parametrize("version", VERSIONS)
def test_same_stacks_as_py_spy_on_a_stopped_target(spawn, version):
    python = interpreter(version)
    t = spawn([python, TARGET, "--busy"])
    os.kill(t.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5
        while set(thread_states(t.pid).values()) - {"T"} and time.monotonic() < deadline:
            time.sleep(0.01)
        ours = stack_json(t.pid)
        theirs = pyspy_dump(t.pid)
    finally:
        os.kill(t.pid, signal.SIGCONT)
    ours_by = {th["thread_id"]: th for th in ours["threads"]}
    theirs_by = {th["thread_id"]: th for th in theirs}
    assert sorted(ours_by) == sorted(theirs_by), "different thread sets (by pthread id)"
    for thread_id, th in ours_by.items():
        other = theirs_by[thread_id]
        if other.get("os_thread_id"):
            assert other["os_thread_id"] == th["tid"], f"thread {thread_id}: tid {th['tid']} vs py-spy's"
        a = [(f["qualname"], f["file"], f["line"]) for f in th["frames"]]
        b = [(f["name"], f["filename"], f["line"]) for f in other["frames"]]
        assert len(a) == len(b), f"thread {th['tid']}: {len(a)} frames, py-spy {len(b)}: {a[:5]} vs {b[:5]}"
        diff = [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y]
        assert not diff, f"thread {th['tid']} differs from py-spy at {diff[:5]}"
    states = thread_states(t.pid)
    assert not [s for s in states.values() if s in "Tt"] or time.sleep(0.2) or \
        not [s for s in thread_states(t.pid).values() if s in "Tt"], "target still stopped after SIGCONT"
