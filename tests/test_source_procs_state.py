"""procs source: workload state changes (stopped, blocked, running again, zombie) as Event records.

Real processes where the kernel lets a test make the state: SIGSTOP ('T'), the agent's own ptrace stopper
('t'), a vfork parent waiting for its child ('D', a small C program built here), an unreaped child ('Z').
A fixture /proc tree (a stat file whose state letter and a schedstat file the test rewrites) checks the
threshold arithmetic exactly, with a fake clock.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from procutil import start_ticks as _start_ticks

from steplens.agent.records import Event, ProcessExit, ProcessInfo
from steplens.agent.sources.base import ConfigError, HostContext, build_config
from steplens.agent.sources.procs import ProcsConfig, ProcsSource


class Clock:
    """CLOCK_MONOTONIC plus an offset the test advances, so thresholds pass without sleeping."""

    def __init__(self) -> None:
        self.offset_ns = 0

    def __call__(self) -> int:
        return time.monotonic_ns() + self.offset_ns

    def advance(self, seconds: float) -> None:
        self.offset_ns += int(seconds * 1e9)


class FakeClock:
    def __init__(self) -> None:
        self.now_ns = 1_000_000_000_000

    def __call__(self) -> int:
        return self.now_ns

    def at(self, seconds: float) -> None:
        self.now_ns = 1_000_000_000_000 + int(seconds * 1e9)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                                                             "STEPLENS_JOB", "SLURM_PROCID")}
    env.update(extra)
    return env


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return data[data.rindex(b")") + 2:].split()[0].decode()


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _events(records, pid: int) -> list[Event]:
    """The events about `pid` (other tests on this host may start workloads of their own meanwhile)."""
    return [r for r in records if isinstance(r, Event) and r.entity.split(":")[0] == str(pid)]


@pytest.fixture
def children():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.kill()
            p.wait()


def _sleeper(tmp_path, marker: str, comm: str = "", **env: str) -> subprocess.Popen:
    """A Python workload (matched by `marker`) that optionally renames its comm, then sleeps."""
    ready = tmp_path / f"ready-{uuid.uuid4().hex[:6]}"
    code = textwrap.dedent(f"""
        import time
        if {comm!r}:
            with open("/proc/self/comm", "w") as f:
                f.write({comm!r})
        open({str(ready)!r}, "w").close()
        while True:
            time.sleep(0.05)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code, marker], env=_env(**env))
    _wait(ready.exists, "the child to start")
    return proc


def test_sigstop_reported_once_then_running_again(tmp_path, children):
    marker = f"steplens-state-{uuid.uuid4().hex[:8]}"
    # a comm with ") R " in it: the state letter must come after the last ')'
    child = _sleeper(tmp_path, marker, comm="x) R 1 (y", RANK="3", STEPLENS_JOB="job-x")
    plain = _sleeper(tmp_path, "not-a-workload")
    children += [child, plain]
    clock = Clock()
    src = ProcsSource(HostContext(node_id="t", mono_ns=clock), ProcsConfig(patterns=[marker]))
    src.start()
    out = src.step()
    assert any(isinstance(r, ProcessInfo) and r.pid == child.pid for r in out)
    assert _events(out, child.pid) == []
    entity = f"{child.pid}:{_start_ticks(child.pid)}"

    os.kill(child.pid, signal.SIGSTOP)
    os.kill(plain.pid, signal.SIGSTOP)  # not a workload: never reported
    _wait(lambda: _state(child.pid) == "T" and _state(plain.pid) == "T", "state T")
    out = src.step()
    assert _events(out, plain.pid) == []
    events = _events(out, child.pid)
    assert [(e.kind, e.entity) for e in events] == [("process_stopped", entity)]  # at once, no threshold for T
    assert events[0].value >= 0
    assert events[0].message == "rank 3 of job job-x stopped (state T)"

    clock.advance(3.0)
    assert _events(src.step(), child.pid) == []  # still stopped: not repeated
    clock.advance(1.5)
    os.kill(child.pid, signal.SIGCONT)
    _wait(lambda: _state(child.pid) != "T", "SIGCONT to take effect")
    events = _events(src.step(), child.pid)
    assert [(e.kind, e.entity) for e in events] == [("process_running", entity)]
    assert 4.5 <= events[0].value < 4.5 + 60  # the clock moved 4.5 s, the rest is real time on a loaded host
    assert events[0].message.startswith("rank 3 of job job-x running again (state ")
    assert _events(src.step(), child.pid) == []
    os.kill(plain.pid, signal.SIGCONT)


def test_ptrace_stop_reported_only_when_it_lasts(tmp_path, children):
    """The agent's own stopper (PTRACE_SEIZE + PTRACE_INTERRUPT): two scans that each catch a different stop
    are not one long stop; the same stop seen stopped_after_seconds apart is."""
    from steplens.agent.pyframes.memory import NoPermission
    from steplens.agent.pyframes.seize import StoppedThreads

    marker = f"steplens-trace-{uuid.uuid4().hex[:8]}"
    child = _sleeper(tmp_path, marker, RANK="1", STEPLENS_JOB="job-t")
    children.append(child)
    entity = f"{child.pid}:{_start_ticks(child.pid)}"
    clock = Clock()
    src = ProcsSource(HostContext(node_id="t", mono_ns=clock), ProcsConfig(patterns=[marker]))
    src.start()
    src.step()

    @contextlib.contextmanager
    def stopped():
        stopper = StoppedThreads([child.pid], timeout_s=10.0)
        try:
            stopper.__enter__()
        except NoPermission as exc:
            pytest.skip(str(exc))
        try:
            yield
        finally:
            stopper.__exit__(None, None, None)

    with stopped():
        _wait(lambda: _state(child.pid) == "t", "ptrace stop")
        assert _events(src.step(), child.pid) == []
    _wait(lambda: _state(child.pid) != "t", "the child to run again")
    with stopped():
        _wait(lambda: _state(child.pid) == "t", "ptrace stop")
        clock.advance(3.0)
        assert _events(src.step(), child.pid) == []  # 't' at both scans 3 s apart, but it ran in between: another stop
        clock.advance(2.5)
        events = _events(src.step(), child.pid)  # the same stop, 2.5 s (plus real time) later
        assert [(e.kind, e.entity) for e in events] == [("process_stopped", entity)]
        assert 2.5 <= events[0].value < 2.5 + 60
        assert events[0].message.startswith("rank 1 of job job-t stopped (state t, ptrace stop) for ")
        clock.advance(1.0)
        assert _events(src.step(), child.pid) == []
    _wait(lambda: _state(child.pid) != "t", "the child to run again")
    events = _events(src.step(), child.pid)
    assert [(e.kind, e.entity) for e in events] == [("process_running", entity)]
    assert 3.5 <= events[0].value < 3.5 + 60


VFORK_C = r"""
#include <sys/wait.h>
#include <unistd.h>
/* The parent waits for its vfork child in TASK_KILLABLE, which /proc shows as 'D', until the child exits. */
int main(int argc, char **argv) {
    pid_t c = vfork();
    if (c == 0) {
        while (access(argv[1], F_OK) != 0) usleep(10000);
        _exit(0);
    }
    waitpid(c, 0, 0);
    for (;;) sleep(1);
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the vfork program")
def test_uninterruptible_sleep_reported_after_threshold(tmp_path, children):
    marker = f"steplens-blocked-{uuid.uuid4().hex[:8]}"
    (tmp_path / "vfork.c").write_text(VFORK_C)
    exe = tmp_path / "vfork_wait"
    subprocess.run(["cc", "-O", "-o", str(exe), str(tmp_path / "vfork.c")], check=True)
    go = tmp_path / "go"
    # RANK on both: the vfork child (same cmdline and environ) is a same-rank helper, left out
    proc = subprocess.Popen([str(exe), str(go), marker], env=_env(RANK="0", STEPLENS_JOB="job-d"),
                            start_new_session=True)
    children.append(proc)
    try:
        _wait(lambda: _state(proc.pid) == "D", "the vfork wait")
        entity = f"{proc.pid}:{_start_ticks(proc.pid)}"
        clock = Clock()
        src = ProcsSource(HostContext(node_id="t", mono_ns=clock), ProcsConfig(patterns=[marker]))
        src.start()
        out = src.step()
        assert proc.pid in [r.pid for r in out if isinstance(r, ProcessInfo)]
        assert _events(out, proc.pid) == []
        clock.advance(4.0)
        assert _events(src.step(), proc.pid) == []  # below blocked_after_seconds (5)
        clock.advance(1.5)
        events = _events(src.step(), proc.pid)
        assert [(e.kind, e.entity) for e in events] == [("process_blocked", entity)]
        assert 5.5 <= events[0].value < 5.5 + 60
        assert events[0].message.startswith("rank 0 of job job-d blocked in uninterruptible sleep (state D) for ")
        clock.advance(10.0)
        assert _events(src.step(), proc.pid) == []
        go.touch()
        _wait(lambda: _state(proc.pid) != "D", "the vfork child to exit")
        events = _events(src.step(), proc.pid)
        assert [(e.kind, e.entity) for e in events] == [("process_running", entity)]
        assert 15.5 <= events[0].value < 15.5 + 60
    finally:
        os.killpg(proc.pid, signal.SIGKILL)


def test_zombie_reported_before_its_exit(tmp_path, children):
    marker = f"steplens-zombie-{uuid.uuid4().hex[:8]}"
    child = _sleeper(tmp_path, marker, RANK="2", STEPLENS_JOB="job-z")
    children.append(child)
    key = (child.pid, _start_ticks(child.pid))
    src = ProcsSource(HostContext(node_id="t"), ProcsConfig(patterns=[marker]))
    src.start()
    src.step()
    os.kill(child.pid, signal.SIGKILL)
    _wait(lambda: _state(child.pid) == "Z", "the zombie state (not reaped)")
    out = [r for r in src.step() if isinstance(r, (Event, ProcessExit)) and _about(r, child.pid)]
    kinds = [(type(r).__name__, getattr(r, "kind", ""), getattr(r, "entity", "") or (r.pid, r.start_ticks))
             for r in out]
    assert kinds == [("Event", "process_zombie", f"{key[0]}:{key[1]}"), ("ProcessExit", "", key)]
    assert out[0].message == "rank 2 of job job-z exited, not reaped yet (state Z)"
    assert [r for r in src.step() if _about(r, child.pid)] == []  # still a zombie: once, exit not repeated
    child.wait()


def _about(record, pid: int) -> bool:
    if isinstance(record, Event):
        return record.entity.split(":")[0] == str(pid)
    return getattr(record, "pid", None) == pid


# -- fixture /proc tree: exact thresholds with a fake clock --------------------------------------------------

class FakeProc:
    """/proc/PID of a Python workload whose stat state letter and schedstat the test sets."""

    def __init__(self, root, pid: int, marker: str, schedstat: bool = True) -> None:
        self.dir = root / str(pid)
        self.dir.mkdir(parents=True)
        self.pid = pid
        self.schedstat = schedstat
        (self.dir / "cmdline").write_bytes(b"/usr/bin/python3\0train.py\0" + marker.encode() + b"\0")
        (self.dir / "environ").write_bytes(b"RANK=2\0STEPLENS_JOB=fake-job\0PATH=/bin\0")
        self.set("S", runs=1)

    def set(self, state: str, runs: int) -> None:
        """State letter; `runs` stands for the times it was scheduled in (schedstat field 3)."""
        # comm with spaces and ')'; fields after it: state ppid pgrp session tty tpgid flags ... starttime (22)
        rest = [state, "1", str(self.pid), str(self.pid), "0", "-1", "4194304"] + ["0"] * 12 + ["4242"] + ["0"] * 30
        (self.dir / "stat").write_text(f"{self.pid} (py) (t) D) " + " ".join(rest) + "\n")
        if self.schedstat:
            (self.dir / "schedstat").write_text(f"{runs * 1000} 0 {runs}\n")


def _fake_source(tmp_path, **cfg):
    marker = "fake-marker"
    clock = FakeClock()
    src = ProcsSource(HostContext(node_id="t", proc_root=str(tmp_path / "proc"), mono_ns=clock),
                      build_config(ProcsConfig, {"patterns": [marker], **cfg}, "sources.procs"))
    return src, clock, marker


def _kinds(src) -> list[tuple[str, float]]:
    return [(e.kind, e.value) for e in src.step() if isinstance(e, Event)]


def test_fixture_tree_thresholds(tmp_path):
    src, clock, marker = _fake_source(tmp_path)
    p = FakeProc(tmp_path / "proc", 4242, marker)
    src.start()
    assert [r.pid for r in src.step() if isinstance(r, ProcessInfo)] == [4242]

    # D: reported once it lasted 5 s, once; then back to S
    clock.at(10)
    p.set("D", runs=2)
    assert _kinds(src) == []
    clock.at(14.9)
    assert _kinds(src) == []
    clock.at(15)
    events = _events(src.step(), 4242)
    assert [(e.kind, e.value, e.entity) for e in events] == [("process_blocked", 5.0, "4242:4242")]
    assert events[0].message == "rank 2 of job fake-job blocked in uninterruptible sleep (state D) for 5.0 s"
    clock.at(16)
    assert _kinds(src) == []
    clock.at(18)
    p.set("S", runs=3)
    events = _events(src.step(), 4242)
    assert [(e.kind, e.value) for e in events] == [("process_running", 8.0)]
    assert events[0].message == "rank 2 of job fake-job running again (state S) after 8.0 s blocked"

    # D at every scan, but it ran in between (schedstat moved): each wait counts from where it was seen
    clock.at(20)
    p.set("D", runs=4)
    assert _kinds(src) == []
    clock.at(23)
    p.set("D", runs=5)
    assert _kinds(src) == []  # restarted at 23
    clock.at(27.9)
    assert _kinds(src) == []
    clock.at(28)
    assert _kinds(src) == [("process_blocked", 5.0)]

    # a short 't' (the sampler) between scans of S is never reported; a lasting one after 2 s
    clock.at(30)
    p.set("S", runs=6)
    assert _kinds(src) == [("process_running", 7.0)]
    clock.at(31)
    p.set("t", runs=7)
    assert _kinds(src) == []
    clock.at(34)
    p.set("S", runs=8)
    assert _kinds(src) == []
    clock.at(35)
    p.set("t", runs=9)
    assert _kinds(src) == []
    clock.at(36.5)
    assert _kinds(src) == []
    clock.at(37)
    assert _kinds(src) == [("process_stopped", 2.0)]
    # a stop that turns into a block: one episode, running again counts from the stop's onset
    clock.at(38)
    p.set("D", runs=9)
    assert _kinds(src) == []
    clock.at(43)
    assert _kinds(src) == [("process_blocked", 5.0)]
    clock.at(44)
    p.set("R", runs=10)
    assert _kinds(src) == [("process_running", 9.0)]


def test_fixture_tree_without_schedstat_uses_the_scans(tmp_path):
    src, clock, marker = _fake_source(tmp_path, stopped_after_seconds=1.0)
    p = FakeProc(tmp_path / "proc", 5151, marker, schedstat=False)
    src.start()
    src.step()
    clock.at(1)
    p.set("t", runs=0)
    assert _kinds(src) == []
    clock.at(2)
    assert _kinds(src) == [("process_stopped", 1.0)]
    clock.at(3)
    p.set("T", runs=0)
    assert _kinds(src) == []  # still stopped: the same episode
    clock.at(4)
    p.set("Z", runs=0)
    out = src.step()
    assert [(type(r).__name__, getattr(r, "kind", "")) for r in out] == [("Event", "process_zombie"),
                                                                          ("ProcessExit", "")]


def test_state_config_validation():
    cfg = build_config(ProcsConfig, {}, "sources.procs")
    assert (cfg.stopped_after_seconds, cfg.blocked_after_seconds) == (2.0, 5.0)
    with pytest.raises(ConfigError, match="stopped_after_seconds"):
        build_config(ProcsConfig, {"stopped_after_seconds": 0}, "sources.procs")
    with pytest.raises(ConfigError, match="blocked_after_seconds"):
        build_config(ProcsConfig, {"blocked_after_seconds": -1.0}, "sources.procs")
