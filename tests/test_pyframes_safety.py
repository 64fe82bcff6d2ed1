"""The Python stack reader against hostile targets: each case gives a clear error or a correct result,
and the target is never left stopped or harmed.

Cases: a target that exits while we sample it (reaped at once, and left a zombie), one that execs into a
non-Python program, one that forks, one with thousands of native threads, a non-Python PID, a dead PID,
a sampler without permission (run as user nobody through setpriv), a target in its own PID + mount
namespace that sees other file paths than the host (unshare), and `record --stop` killed mid-run.
Targets live in pytargets/; every one is killed and reaped by a fixture, also when a test fails.
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
import threading
import time

import pytest

from steplens.agent.pyframes import reader
from steplens.agent.pyframes.memory import NoPermission, ProcessGone, PyFramesError

BIN = os.path.dirname(sys.executable)
AGENT = os.path.join(BIN, "steplens-agent")
HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = os.path.join(HERE, "pytargets")
PYENV = "/root/.pyenv/versions"
PY = os.path.join(PYENV, "3.12.1", "bin", "python3")
PYTHON = PY if os.access(PY, os.X_OK) else sys.executable

privileged = pytest.mark.privileged
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (ptrace and /proc/PID/mem of any process)")


def target(name: str) -> str:
    return os.path.join(TARGETS, name)


from pytarget import Target, markers, spawn, task_states  # noqa: E402,F401 (spawn is a fixture)


def assert_not_stopped(pid: int, within: float = 1.0) -> None:
    """Every thread leaves any stopped state within `within` seconds (a thread caught in the very
    instant of a sample may show 't' briefly while the sampler runs; here none runs)."""
    deadline = time.monotonic() + within
    while True:
        stopped = {tid: s for tid, s in task_states(pid).items() if s in ("T", "t")}
        if not stopped:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} left stopped: threads {sorted(stopped)[:10]} "
                                 f"({len(stopped)} in all) in state T/t")
        time.sleep(0.02)


def leaf_lines(sample, path: str) -> dict[int, list[int]]:
    return {t.tid: [f.line for f in t.frames if f.file == path] for t in sample.threads}


# -- the target goes away ---------------------------------------------------------------------------

def sample_until_gone(pid: int, timeout: float = 15.0, finalizing_ok: bool = False) -> tuple[int, BaseException]:
    """Sample until the first exception; with finalizing_ok, a TornRead that says the interpreter is
    finalizing (the process still exists, its interpreter list is already empty) is skipped."""
    proc = reader.attach(pid)
    n = 0
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                proc.sample()
            except reader.TornRead as exc:
                if not (finalizing_ok and "finalizing" in str(exc)):
                    return n, exc
            except BaseException as exc:  # noqa: BLE001 - the test checks which one
                return n, exc
            n += 1
        raise AssertionError(f"still sampling process {pid} {timeout}s later: it did not exit or we hang")
    finally:
        proc.close()


@privileged
@needs_root
@pytest.mark.parametrize("mode", ["normal", "hard"])
def test_target_exits_mid_read_gives_process_gone(spawn, mode):
    t = spawn([PYTHON, target("exits_soon.py"), "0.7", mode], reap=True)
    n, exc = sample_until_gone(t.pid, finalizing_ok=mode == "normal")
    assert n > 10, f"only {n} samples before the exit"
    assert isinstance(exc, ProcessGone), f"after {n} samples: {type(exc).__name__}: {exc}"
    assert str(t.pid) in str(exc)


@privileged
@needs_root
def test_zombie_target_gives_process_gone(spawn):
    """An exited process whose parent has not reaped it yet still has /proc/PID, but no memory."""
    t = spawn([PYTHON, target("exits_soon.py"), "0.5", "hard"])
    n, exc = sample_until_gone(t.pid)

    def state():
        with open(f"/proc/{t.pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    # the reader may see the exit (memory released) a moment before the kernel marks it a zombie
    deadline = time.monotonic() + 5
    while state() != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state() == "Z", "expected an unreaped (zombie) target"
    assert isinstance(exc, ProcessGone), f"after {n} samples of a zombie: {type(exc).__name__}: {exc}"
    with pytest.raises(ProcessGone):
        reader.attach(t.pid)


@privileged
@needs_root
def test_exec_into_non_python(spawn):
    t = spawn([PYTHON, target("execs.py")])
    proc = reader.attach(t.pid)
    try:
        before = proc.sample()
        assert len(before.threads) == 2
        os.kill(t.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while os.readlink(f"/proc/{t.pid}/exe") != "/usr/bin/sleep" and time.monotonic() < deadline:
            time.sleep(0.01)
        exe = os.readlink(f"/proc/{t.pid}/exe")
        assert os.path.basename(exe) == "sleep", exe
        for _ in range(3):
            with pytest.raises(PyFramesError) as err:
                got = proc.sample()
                pytest.fail(f"sampled a process that exec'd into {exe}: {got}")
            msg = str(err.value)
            assert str(t.pid) in msg, msg
    finally:
        proc.close()
    with pytest.raises(reader.NotPython, match=r"not a CPython process") as err:
        reader.attach(t.pid)
    assert "sleep" in str(err.value)
    out = subprocess.run([AGENT, "stack", str(t.pid)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "not a CPython process" in out.stderr, out.stderr
    assert t.proc.poll() is None, "the exec'd target should still be running"


@privileged
@needs_root
def test_exec_message_says_what_happened(spawn):
    """Sampling a PID that exec'd should say so, not report torn reads of the old image."""
    t = spawn([PYTHON, target("execs.py")])
    proc = reader.attach(t.pid)
    try:
        proc.sample()
        os.kill(t.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while os.path.basename(os.readlink(f"/proc/{t.pid}/exe")) != "sleep" and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(PyFramesError) as err:
            proc.sample()
        assert re.search(r"exec|no longer|replaced|not a CPython", str(err.value)), \
            f"{type(err.value).__name__}: {err.value}"
    finally:
        proc.close()


@privileged
@needs_root
def test_fork_parent_and_child(spawn):
    path = target("forks.py")
    m = markers(path)
    t = spawn([PYTHON, path])
    t.extra_pids.append(t.info["child"])
    parent, child = t.info["parent"], t.info["child"]
    assert parent == t.pid
    for pid in (parent, child):
        proc = reader.attach(pid)
        try:
            s = proc.sample()
        finally:
            proc.close()
        lines = leaf_lines(s, path)
        if pid == child:
            # only the forking thread survives a fork
            assert list(lines) == [child], f"child threads {list(lines)}"
            assert lines[child] == [m["fork_child"], m["fork_child_call"]]
        else:
            assert sorted(lines) == sorted([parent, t.info["worker"]])
            assert lines[parent] == [m["fork_parent"], m["fork_parent_call"]]
            assert lines[t.info["worker"]] == [m["fork_worker"]]
        for th in s.threads:
            assert th.state == "sleeping"
        assert_not_stopped(pid)


@privileged
@needs_root
def test_thousands_of_threads(spawn):
    n = 2000
    path = target("many_threads.py")
    park = markers(path)["park"]
    t = spawn([PYTHON, path, str(n)])
    tids = {int(x) for x in os.listdir(f"/proc/{t.pid}/task")}
    assert len(tids) == n + 1
    proc = reader.attach(t.pid)
    try:
        proc.sample()  # warm the code cache
        for stop in (False, True, True):
            t0 = time.monotonic()
            s = proc.sample(stop_threads=stop)
            took = time.monotonic() - t0
            assert len(s.threads) == n + 1, f"stop={stop}: {len(s.threads)} threads"
            assert {th.tid for th in s.threads} == tids
            parked = [th for th in s.threads if any(f.file == path and f.line == park for f in th.frames)]
            assert len(parked) == n
            assert took < 1.0, f"stop={stop}: one sample of {n + 1} threads took {took:.2f}s"
            assert_not_stopped(t.pid)
    finally:
        proc.close()
    assert t.proc.poll() is None


# -- PIDs that are not (or no longer, or not ours) Python ------------------------------------------

@privileged
@needs_root
def test_non_python_pid(spawn):
    t = spawn(["sleep", "30"], ready=False)
    time.sleep(0.1)
    with pytest.raises(reader.NotPython, match=rf"process {t.pid} .*sleep.* is not a CPython process"):
        reader.attach(t.pid)
    out = subprocess.run([AGENT, "stack", str(t.pid), "--json"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and out.stdout == ""
    assert f"stack {t.pid}:" in out.stderr and "not a CPython process" in out.stderr
    assert t.proc.poll() is None


def test_dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    assert not os.path.exists(f"/proc/{p.pid}")
    with pytest.raises(ProcessGone, match=rf"process {p.pid} does not exist"):
        reader.attach(p.pid)
    out = subprocess.run([AGENT, "stack", str(p.pid)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and f"process {p.pid} does not exist" in out.stderr, out.stderr
    out = subprocess.run([AGENT, "record", str(p.pid), "--duration", "1", "-o", os.devnull],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "does not exist" in out.stderr, out.stderr


AS_NOBODY = r"""
import sys
from steplens.agent.pyframes import reader
from steplens.agent.pyframes.seize import StoppedThreads
pid = int(sys.argv[1])
try:
    reader.attach(pid)
    print("attached")
except Exception as exc:
    print(type(exc).__name__, exc)
try:
    with StoppedThreads([pid]):
        print("seized")
except Exception as exc:
    print(type(exc).__name__, exc)
"""


@privileged
@needs_root
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")
def test_no_permission_as_nobody(spawn):
    t = spawn([PYTHON, target("execs.py")])
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    out = subprocess.run(nobody + [sys.executable, "-c", AS_NOBODY, str(t.pid)], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    attach_line, seize_line = out.stdout.splitlines()
    assert attach_line.startswith("NoPermission "), attach_line
    assert f"process {t.pid}" in attach_line and "CAP_SYS_PTRACE" in attach_line, attach_line
    assert seize_line.startswith("NoPermission ") and "CAP_SYS_PTRACE" in seize_line, seize_line
    out = subprocess.run(nobody + [AGENT, "stack", str(t.pid)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "permission denied" in out.stderr, out.stderr
    out = subprocess.run(nobody + [AGENT, "stack", "1"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "permission denied" in out.stderr, out.stderr
    assert t.proc.poll() is None
    assert_not_stopped(t.pid)


# -- containers: another PID and mount namespace ---------------------------------------------------

def ns_children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(x) for x in fh.read().split()]


def nspid(pid: int, tid: int) -> int:
    """A thread's id inside its innermost PID namespace (last NSpid field)."""
    with open(f"/proc/{pid}/task/{tid}/status") as fh:
        for line in fh:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    raise AssertionError("no NSpid line")


@pytest.fixture(params=["3.10.13", "3.12.1"])
def ns_target(spawn, tmp_path, request):
    """ziel_ü.py in its own PID + mount namespace, with the interpreter and the script bind-mounted at
    paths that are empty directories on the host (as in a container image)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    version = request.param
    prefix = os.path.join(PYENV, version)
    if not os.path.isdir(prefix):
        pytest.skip(f"no CPython {version}")
    mnt = tmp_path / "ctr"
    (mnt / "py").mkdir(parents=True)
    (mnt / "src").mkdir()
    py, src = str(mnt / "py"), str(mnt / "src")
    script = (f"mount --bind {prefix} {py} && mount --bind {TARGETS} {src} && "
              f"LD_LIBRARY_PATH={py}/lib exec {py}/bin/python3 {src}/ziel_ü.py")
    t = spawn(["unshare", "--pid", "--mount", "--fork", "--mount-proc", "sh", "-c", script])
    kids = ns_children(t.pid)
    assert len(kids) == 1, kids
    host_pid = kids[0]
    t.extra_pids.append(host_pid)
    assert t.info["pid"] == 1, "the target should see itself as PID 1"
    assert not os.listdir(py), "the bind mount leaked into the host's mount namespace"
    return t, host_pid, py, src, tuple(int(x) for x in version.split(".")[:2])


@privileged
@needs_root
def test_other_pid_and_mount_namespace_stacks(ns_target):
    t, host_pid, py, src, version = ns_target
    proc = reader.attach(host_pid)
    try:
        s = proc.sample()
        assert proc.version == version
        assert proc.binary.startswith(py + "/"), f"libpython as the target maps it: {proc.binary}"
    finally:
        proc.close()
    path = f"{src}/ziel_ü.py"
    m = markers(target("ziel_ü.py"))
    assert len(s.threads) == 5
    leaves = sorted((th.frames[0].qualname, th.frames[0].file, th.frames[0].line) for th in s.threads)
    q = (lambda qual: qual) if version >= (3, 11) else (lambda qual: qual.rpartition(".")[2])
    assert leaves == sorted([(q("Klass.method"), path, m["main_sleep"]), ("erzeuge", path, m["gen_leaf"]),
                             ("blocking", path, m["async_leaf"]), (q("Klass.statisch"), path, m["utf_leaf"]),
                             ("rekursion", path, m["rek_leaf"])])
    rek = next(th for th in s.threads if th.frames[0].function == "rekursion")
    assert sum(f.function == "rekursion" for f in rek.frames) == 500
    stdlib = [f.file for th in s.threads for f in th.frames if f.file.endswith("threading.py")]
    assert stdlib and all(f.startswith(py + "/lib/python%d.%d/" % version) for f in stdlib), stdlib[:3]
    assert_not_stopped(host_pid)


@privileged
@needs_root
def test_other_pid_namespace_thread_ids_are_host_ids(ns_target):
    """Thread ids a host tool reports must be host tids (the ones in /proc/PID/task), and each thread's
    scheduler state must come from its own task entry."""
    t, host_pid, py, src, version = ns_target
    host_tids = sorted(int(x) for x in os.listdir(f"/proc/{host_pid}/task"))
    ns_of = {tid: nspid(host_pid, tid) for tid in host_tids}
    assert sorted(ns_of.values()) == sorted(v for k, v in t.info.items() if k != "pid")
    doc = json.loads(subprocess.run([AGENT, "stack", str(host_pid), "--json"], capture_output=True,
                                    timeout=30, check=True).stdout)
    got = sorted(th["tid"] for th in doc["threads"])
    assert got == host_tids, f"tids {got}; host tids {host_tids}; namespace tids {sorted(ns_of.values())}"
    assert all(th["state"] == "sleeping" for th in doc["threads"]), [th["state"] for th in doc["threads"]]


NS_REUSE = r"""
import os, sys, threading, time
def first(stop):
    stop.wait()
def second(stop):
    stop.wait()
stop = threading.Event()
a = threading.Thread(target=first, args=(stop,), daemon=True)
a.start()
print(a.native_id, flush=True)
sys.stdin.readline()
stop.set()
a.join()
for _ in range(50):   # the tid is free a little after join returns: try until the new thread gets it
    time.sleep(0.02)
    try:   # the namespace's next tid is the one thread `first` had (this process is the namespace's init)
        with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
            fh.write(str(a.native_id - 1))
    except OSError as exc:
        print("no", exc, flush=True)
        break
    never = threading.Event()
    b = threading.Thread(target=second, args=(never,), daemon=True)
    b.start()
    if b.native_id == a.native_id:
        break
    never.set()
    b.join()
print(b.native_id, flush=True)
sys.stdin.readline()
"""


@privileged
@needs_root
@pytest.mark.parametrize("native", [True, False], ids=["c-walk", "python-walk"])
def test_a_namespace_tid_given_to_a_new_thread_is_looked_up_again(native):
    """In another PID namespace a thread's tid is the namespace's; the walks map it to ours and keep the answer.
    When that thread ends and the namespace hands its tid to a new thread, the kept answer names a task that is
    gone: the new thread must come back with its own host tid and its real state, not the old one's (unknown)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    py = os.path.join(PYENV, "3.12.1", "bin", "python3")
    if not os.path.exists(py):
        pytest.skip("no CPython 3.12.1")
    if native and reader.native_unavailable():
        pytest.skip(f"the C walk is not built here: {reader.native_unavailable()}")
    p = subprocess.Popen(["unshare", "--pid", "--mount", "--fork", "--mount-proc", py, "-c", NS_REUSE],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        first_ns = int(p.stdout.readline())
        (host_pid,) = ns_children(p.pid)
        proc = reader.attach(host_pid, native=native)
        try:
            assert proc.native == native

            def thread_in(function: str):
                for _ in range(40):   # the state of a thread just started may read as running first
                    th = [t for t in proc.sample().threads if t.frames and any(f.function == function
                                                                                 for f in t.frames)]
                    if th and th[0].state == "sleeping":
                        return th[0]
                    time.sleep(0.05)
                return th[0] if th else None

            a = thread_in("first")
            assert a is not None and a.state == "sleeping" and nspid(host_pid, a.tid) == first_ns
            p.stdin.write("\n")
            p.stdin.flush()
            line = p.stdout.readline()
            if line.startswith("no"):
                pytest.skip(f"ns_last_pid not writable here: {line.strip()}")
            if int(line) != first_ns:
                pytest.skip(f"the namespace did not give tid {first_ns} again (got {int(line)})")
            time.sleep(0.6)   # the namespace map is read again at most every 0.5 s
            b = thread_in("second")
            assert b is not None, "no thread in second()"
            assert b.tid != a.tid and nspid(host_pid, b.tid) == first_ns, (a.tid, b.tid)
            assert b.state == "sleeping", b.state
        finally:
            proc.close()
    finally:
        p.kill()
        p.wait(10)


# -- never left stopped ---------------------------------------------------------------------------

def read_counter(path) -> int:
    for _ in range(50):
        try:
            with open(path) as fh:
                return int(fh.read())
        except (FileNotFoundError, ValueError):
            time.sleep(0.01)
    raise AssertionError(f"cannot read the counter in {path}")


@privileged
@needs_root
def test_record_stop_killed_never_leaves_target_stopped(spawn, tmp_path):
    counter = str(tmp_path / "counter")
    t = spawn([PYTHON, target("counter.py"), counter])
    for i, after in enumerate((0.6, 1.0, 1.3, 0.8)):
        out = str(tmp_path / f"rec{i}.txt")
        rec = subprocess.Popen([AGENT, "record", str(t.pid), "--stop", "--rate", "500", "--duration", "10",
                                "--format", "collapsed", "-o", out], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
        try:
            time.sleep(after)
            assert rec.poll() is None, f"record ended early: {rec.stderr.read().decode(errors='replace')}"
            rec.kill()
        finally:
            rec.wait(10)
            rec.stderr.close()
        assert_not_stopped(t.pid, within=1.0)
        before = read_counter(counter)
        deadline = time.monotonic() + 2.0
        while (after_n := read_counter(counter)) < before + 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert after_n >= before + 3, f"round {i}: the target made no progress ({before} -> {after_n})"
        assert t.proc.poll() is None, "the target died"
