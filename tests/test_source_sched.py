"""sched: rendering (pure), then real raw tracepoints against real processes with known on/off-CPU patterns.

Ground truth for the eBPF figures comes from the kernel's own accounting of the same threads:
CLOCK_THREAD_CPUTIME_ID (sum_exec_runtime) for on-CPU time, wall clock minus that for off-CPU time, and
/proc/PID/schedstat (run_delay) for run-queue time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from procutil import bpftool_progs, needs_ebpf, own_prog_ids, prog_ids_of, progs_alive, started
from procutil import start_ticks as _start_ticks

from steplens.agent.records import Event, Metric, Mode, ProcessInfo
from steplens.agent.sources.base import ConfigError, HostContext, build_config
from steplens.agent.sources.sched import (BPF_FILE, PROGRAMS, SchedConfig, SchedSource, prev_state_is_arg,
                                          render_program)

CPU = max(os.sched_getaffinity(0))

SPIN_SLEEP = textwrap.dedent(r"""
    import os, sys, time
    os.sched_setaffinity(0, {int(sys.argv[1])})
    spin, sleep, cycles = float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    print("ready", flush=True)
    sys.stdin.readline()
    t0, c0 = time.monotonic_ns(), time.thread_time_ns()
    for _ in range(cycles):
        t = time.thread_time()  # spin for CPU time, so a busy machine stretches wall time, not the pattern
        while time.thread_time() - t < spin:
            pass
        time.sleep(sleep)
    print(t0, c0, flush=True)
    sys.stdin.readline()
""")

BUSY = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass\n"


def _values(records, entity: str) -> dict[str, float]:
    return {m.name: m.value for m in records if isinstance(m, Metric) and m.entity == entity}


_prog_ids_of = prog_ids_of
_bpftool_progs = bpftool_progs
_alive = progs_alive


def _wait_gone(ids: set[int], timeout: float = 10.0) -> set[int]:
    """Programs left after `timeout`: the kernel frees a program after an RCU grace period, not at close()."""
    deadline = time.monotonic() + timeout
    while _alive(ids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _alive(ids)


# -- pure ---------------------------------------------------------------------------------------------


def test_render_program():
    with open(BPF_FILE) as fh:
        template = fh.read()
    text = render_program(template, pid_off=1264, tgid_off=1268, state_off=24, prev_state_arg=True,
                          config=SchedConfig(max_threads=777, stack_entries=128))
    assert "{{" not in text
    assert "#define TASK_PID_OFF 1264" in text and "#define TASK_TGID_OFF 1268" in text
    assert "#define PREV_STATE_IS_ARG 1" in text
    assert "BPF_HASH(stats, u32, struct tstat, 777)" in text and "BPF_STACK_TRACE(stacks, 128)" in text
    fns = re.findall(r"^int (\w+)\(struct bpf_raw_tracepoint_args", text, re.M)
    assert sorted(fns) == sorted(fn for _, fn in PROGRAMS)
    assert all(fn.startswith("steplens_") and len(fn) <= 15 for fn in fns)
    old = render_program(template, pid_off=1, tgid_off=2, state_off=3, prev_state_arg=False, config=SchedConfig())
    assert "#define PREV_STATE_IS_ARG 0" in old


def test_prev_state_is_arg():
    assert prev_state_is_arg("6.18.44-fc-v657")
    assert prev_state_is_arg("5.18.0")
    assert not prev_state_is_arg("5.17.15-generic")
    assert not prev_state_is_arg("4.19.0")


def test_config_defaults_and_validation():
    assert build_config(SchedConfig, {}, "sources.sched") == SchedConfig()
    with pytest.raises(ConfigError):
        build_config(SchedConfig, {"max_threads": 1}, "sources.sched")
    with pytest.raises(ConfigError):
        build_config(SchedConfig, {"deep_stack_top": -1}, "sources.sched")


# -- real tracepoints -----------------------------------------------------------------------------------


@pytest.fixture
def source(started):
    return started(SchedSource(HostContext(node_id="t"), SchedConfig()))


def _wait_sleeping(pid: int, timeout: float = 10.0) -> None:
    """Until the process is in interruptible sleep (state S in /proc/PID/stat) twice 20 ms apart."""
    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        seen = seen + 1 if state == "S" else 0
        if seen >= 2:
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} never blocked")


def _register(src: SchedSource, *procs: subprocess.Popen) -> dict[int, str]:
    keys = {(p.pid, _start_ticks(p.pid)): ProcessInfo(0, p.pid, _start_ticks(p.pid)) for p in procs}
    src.ctx.workloads.replace(keys)
    return {pid: f"pid:{pid}:{start}:tid:{pid}" for pid, start in keys}


def _sum_exec_ns(pid: int) -> int:
    """The kernel's on-CPU ns of a thread (sum_exec_runtime, the base of CLOCK_THREAD_CPUTIME_ID)."""
    with open(f"/proc/{pid}/schedstat") as fh:
        return int(fh.read().split()[0])


@needs_ebpf
def test_on_and_off_cpu_match_known_proportions(source):
    """Read while the child sleeps, however long after its loop: its truth runs from its loop's start to the
    read (the metric's timestamp), on-CPU from the kernel's sum_exec_runtime; the source's off-CPU includes the
    sleep still open at the read."""
    # 40 ms spin / 60 ms sleep, 30 cycles (3 s), pinned to one CPU
    child = subprocess.Popen([sys.executable, "-c", SPIN_SLEEP, str(CPU), "0.04", "0.06", "30"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        # Register only once the child is blocked on stdin: a switch-out after registration would open an
        # off-CPU interval that the wake-up at "go" closes, adding the time until "go" (tens of ms on a
        # loaded machine) to `off` but not to the child's own window.
        _wait_sleeping(child.pid)
        entity = _register(source, child)[child.pid]
        before = _values(source.step(), entity)
        child.stdin.write("go\n")
        child.stdin.flush()
        t0, c0 = (int(x) for x in child.stdout.readline().split())
        _wait_sleeping(child.pid)  # blocked on stdin again, for some tens of ms already
        records = source.step()
        cpu_ns = _sum_exec_ns(child.pid) - c0
    finally:
        child.kill()
        child.wait()
    after = _values(records, entity)
    read_ns = next(m.mono_ns for m in records if isinstance(m, Metric) and m.entity == entity)
    on = after["sched_on_cpu_seconds_total"] - before.get("sched_on_cpu_seconds_total", 0.0)
    off = after["sched_off_cpu_seconds_total"] - before.get("sched_off_cpu_seconds_total", 0.0)
    true_on, true_off = cpu_ns / 1e9, (read_ns - t0 - cpu_ns) / 1e9
    print(f"on {on:.4f}s (truth {true_on:.4f}s), off {off:.4f}s (truth {true_off:.4f}s)")
    assert true_on == pytest.approx(1.2, rel=0.25)  # the pattern really ran
    assert on == pytest.approx(true_on, rel=0.05)
    assert off == pytest.approx(true_off, rel=0.05)
    switches = after["sched_switches_total"] - before.get("sched_switches_total", 0.0)
    assert switches >= 30  # at least one voluntary switch per sleep


@needs_ebpf
def test_open_intervals_count_as_they_happen(source):
    """A thread spinning alone on a CPU may not switch out for seconds, and a blocked one (a hung collective)
    for minutes: between two reads of either, the counters move by the time that passed, not at the switch."""
    spinner = subprocess.Popen([sys.executable, "-c", BUSY, str(CPU)])
    sleeper = subprocess.Popen([sys.executable, "-c", SPIN_SLEEP, str(CPU), "0.001", "0.001", "1"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline().strip() == "ready"
        entities = _register(source, spinner, sleeper)
        source.step()
        sleeper.stdin.write("go\n")  # one short cycle while watched, so its switch-out is seen
        sleeper.stdin.flush()
        sleeper.stdout.readline()
        time.sleep(0.2)
        _wait_sleeping(sleeper.pid)
        first = source.step()
        cpu0 = _sum_exec_ns(spinner.pid)
        time.sleep(1.0)
        second = source.step()
        cpu1 = _sum_exec_ns(spinner.pid)
    finally:
        for p in (spinner, sleeper):
            p.kill()
            p.wait()
    elapsed = (max(m.mono_ns for m in second) - max(m.mono_ns for m in first)) / 1e9
    a, b = _values(first, entities[spinner.pid]), _values(second, entities[spinner.pid])
    on = b["sched_on_cpu_seconds_total"] - a["sched_on_cpu_seconds_total"]
    print(f"spinner: on {on:.3f}s over {elapsed:.3f}s (kernel {(cpu1 - cpu0) / 1e9:.3f}s)")
    assert on == pytest.approx((cpu1 - cpu0) / 1e9, rel=0.05, abs=0.02)
    a, b = _values(first, entities[sleeper.pid]), _values(second, entities[sleeper.pid])
    off = b["sched_off_cpu_seconds_total"] - a["sched_off_cpu_seconds_total"]
    print(f"sleeper: off {off:.3f}s over {elapsed:.3f}s")
    assert off == pytest.approx(elapsed, rel=0.02)
    assert b["sched_on_cpu_seconds_total"] == a["sched_on_cpu_seconds_total"]


@needs_ebpf
def test_runqueue_time_of_two_threads_sharing_a_core(source):
    a = subprocess.Popen([sys.executable, "-c", BUSY, str(CPU)])
    b = subprocess.Popen([sys.executable, "-c", BUSY, str(CPU)])
    try:
        entities = _register(source, a, b)
        time.sleep(0.3)
        before = source.step()
        sched0 = {p.pid: open(f"/proc/{p.pid}/schedstat").read().split() for p in (a, b)}
        invol0 = {p.pid: _nonvoluntary(p.pid) for p in (a, b)}
        time.sleep(1.5)
        after = source.step()
        sched1 = {p.pid: open(f"/proc/{p.pid}/schedstat").read().split() for p in (a, b)}
        invol1 = {p.pid: _nonvoluntary(p.pid) for p in (a, b)}
    finally:
        for p in (a, b):
            p.kill()
            p.wait()
    for p in (a, b):
        v0, v1 = _values(before, entities[p.pid]), _values(after, entities[p.pid])
        runq = v1["sched_runqueue_seconds_total"] - v0.get("sched_runqueue_seconds_total", 0.0)
        true_runq = (int(sched1[p.pid][1]) - int(sched0[p.pid][1])) / 1e9
        invol = v1["sched_involuntary_switches_total"] - v0.get("sched_involuntary_switches_total", 0.0)
        true_invol = invol1[p.pid] - invol0[p.pid]
        print(f"pid {p.pid}: runq {runq:.3f}s (schedstat {true_runq:.3f}s), involuntary {invol} (/proc {true_invol})")
        assert runq > 0.3  # about half of 1.5 s waiting for the shared core
        assert runq == pytest.approx(true_runq, rel=0.2)
        assert invol == pytest.approx(true_invol, rel=0.2, abs=5)


def _nonvoluntary(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(re.search(r"nonvoluntary_ctxt_switches:\s+(\d+)", fh.read()).group(1))


@needs_ebpf
def test_deep_mode_reports_offcpu_stacks(source):
    child = subprocess.Popen([sys.executable, "-c", SPIN_SLEEP, str(CPU), "0.005", "0.05", "20"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        entity = _register(source, child)[child.pid]
        source.set_mode(Mode.DEEP)
        source.step()
        child.stdin.write("go\n")
        child.stdin.flush()
        child.stdout.readline()
        records = source.step()
        source.set_mode(Mode.SENTINEL)
        later = source.step()
    finally:
        child.kill()
        child.wait()
    stacks = [r for r in records if isinstance(r, Event) and r.kind == "offcpu_stack" and r.entity == entity]
    assert 0 < len(stacks) <= SchedConfig().deep_stack_top
    top = max(stacks, key=lambda e: e.value)
    print(top)
    assert "nanosleep" in top.message  # time.sleep blocks in clock_nanosleep
    assert 0.5 < top.value < 1.5       # ~20 x 50 ms
    assert not [r for r in later if isinstance(r, Event) and r.kind == "offcpu_stack"]


@needs_ebpf
def test_exited_process_is_forgotten(source):
    child = subprocess.Popen([sys.executable, "-c", "import time\nfor _ in range(20): time.sleep(0.01)"])
    entity = _register(source, child)[child.pid]
    source.step()  # now watched
    child.wait()
    assert _values(source.step(), entity)
    source.ctx.workloads.replace({})
    assert _values(source.step(), entity)  # emitted a last time after leaving the workloads
    assert source.step() == []
    assert len(source._bpf[b"stats"]) == 0 and len(source._bpf[b"watched"]) == 0


@needs_ebpf
def test_stop_detaches_and_is_idempotent(started):
    """Counts only the programs this test loaded (held by this process since a baseline, named as sched's), so
    programs another test left behind cannot fail it."""
    baseline = _prog_ids_of(os.getpid(), prefix="")
    src = started(SchedSource(HostContext(node_id="t"), SchedConfig()))
    ids = own_prog_ids(baseline, (fn for _, fn in PROGRAMS))
    assert len(ids) == len(PROGRAMS), ids
    src.stop()
    src.stop()
    assert _wait_gone(ids) == set()
    assert src.step() == []


@needs_ebpf
def test_sigkill_of_agent_leaves_no_programs():
    script = textwrap.dedent("""
        import time
        from steplens.agent.sources.base import HostContext
        from steplens.agent.sources.sched import SchedConfig, SchedSource
        src = SchedSource(HostContext(node_id="t"), SchedConfig())
        src.start()
        print("started", flush=True)
        time.sleep(600)
    """)
    agent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout.readline().strip() == "started"
        ids = _prog_ids_of(agent.pid)
        assert len(ids) == len(PROGRAMS)
    finally:
        agent.kill()
        agent.wait()
    assert _wait_gone(ids) == set()


@needs_ebpf
def test_cost_of_programs(source):
    """Per-event BPF run time from the kernel's bpf_stats (enabled for the test, then restored)."""
    path = "/proc/sys/kernel/bpf_stats_enabled"
    with open(path) as fh:
        previous = fh.read().strip()
    busy = subprocess.Popen([sys.executable, "-c", SPIN_SLEEP, str(CPU), "0.001", "0.001", "2000"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout.readline().strip() == "ready"
        _register(source, busy)
        source.step()
        with open(path, "w") as fh:
            fh.write("1")
        ids = own_prog_ids(set(), (fn for _, fn in PROGRAMS))  # sched's only, whatever else is loaded
        start = {p["id"]: (p.get("run_time_ns", 0), p.get("run_cnt", 0)) for p in _bpftool_progs() if p["id"] in ids}
        t0 = time.monotonic()
        busy.stdin.write("go\n")
        busy.stdin.flush()
        busy.stdout.readline()
        elapsed = time.monotonic() - t0
        end = {p["id"]: (p.get("run_time_ns", 0), p.get("run_cnt", 0), p["name"]) for p in _bpftool_progs()
               if p["id"] in ids}
    finally:
        with open(path, "w") as fh:
            fh.write(previous)
        busy.kill()
        busy.wait()
    total_ns = 0
    for pid_, (ns, cnt, name) in end.items():
        dns, dcnt = ns - start[pid_][0], cnt - start[pid_][1]
        total_ns += dns
        print(f"{name}: {dcnt} runs, {dns / max(dcnt, 1):.0f} ns/run")
    print(f"total {total_ns / 1e6:.2f} ms of CPU over {elapsed:.2f} s = {100 * total_ns / 1e9 / elapsed:.3f}% of one core")
    sw = next(v for v in end.values() if v[2] == "steplens_sw")
    runs = sw[1] - start[next(k for k, v in end.items() if v[2] == "steplens_sw")][1]
    assert runs > 1000
    assert total_ns / max(runs, 1) < 5000  # well under 5 µs per context switch
