"""pystacks end to end: a real workload process, a real agent and collector; its Python stacks
arrive as per-thread summaries, raw samples stay in the node-local detail store, deep mode raises
the rate, and an exited process is dropped cleanly."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from procutil import start_ticks as _start_ticks

from conftest import FAST_AGENT_TOML, AgentProc, wait_for
from steplens.agent.detail import DetailStore
from steplens.agent.records import Mode
from steplens.agent.sources.base import HostContext
from steplens.agent.sources.pystacks import PystacksConfig, PystacksSource
from steplens.agent.records import ProcessInfo

TARGET = textwrap.dedent('''
    import sys, threading, time
    def inner_wait():
        time.sleep(3600)  # @wait
    def outer_wait():
        inner_wait()
    def burn():
        x = 0
        while True: x += 1  # @burn  (one line: a sample on the loop's back-edge is on this line too)
    threading.Thread(target=outer_wait, name="waiter", daemon=True).start()
    print("ready", flush=True)
    burn()
''')


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "pystacks_target.py"
    path.write_text(TARGET)
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    lines = {m: i for i, line in enumerate(TARGET.splitlines(), start=1) for m in ("@wait", "@burn") if m in line}
    yield proc, str(path), lines
    proc.kill()
    proc.wait()




def _watching(tmp_path, proc, config: PystacksConfig) -> PystacksSource:
    """A source (not started) whose only workload is proc, its detail store under tmp_path."""
    ctx = HostContext("t", state_dir=str(tmp_path))
    key = (proc.pid, _start_ticks(proc.pid))
    ctx.workloads.replace({key: ProcessInfo(0, proc.pid, key[1])})
    return PystacksSource(ctx, config)


def test_source_summarizes_and_keeps_raw_samples(tmp_path, target):
    proc, path, lines = target
    src = _watching(tmp_path, proc, PystacksConfig(interval_seconds=0.01, summary_seconds=0.5))
    src.start()
    try:
        out = []
        t_end = time.monotonic() + 1.2
        while time.monotonic() < t_end:
            out += src.step()
            time.sleep(0.01)
        summaries = [r for r in out if type(r).__name__ == "StackSummary"]
        assert summaries, out
        by_thread = {}
        for s in summaries:
            by_thread.setdefault(s.thread_name if s.tid != proc.pid else "main", []).append(s)
        main = by_thread["main"][0]
        (top_ids, count, gil, running) = max(main.stacks, key=lambda s: s[1])
        top = [main.frames[i] for i in top_ids]
        assert top[0][:3] == ("burn", "burn", path) and top[0][3] == lines["@burn"]
        assert gil > 0 and running > 0
        waiter = [s for s in summaries if s.tid != proc.pid][0]
        (ids, count, gil, running) = waiter.stacks[0]
        frames = [waiter.frames[i] for i in ids]
        assert [f[0] for f in frames[:2]] == ["inner_wait", "outer_wait"] and frames[0][3] == lines["@wait"]
        assert gil == 0 and running == 0 and waiter.last_state == "sleeping"
        # deep mode samples faster: the runner uses deep_interval; here we check the summary period shrinks
        src.set_mode(Mode.DEEP)
        assert src.deep
    finally:
        src.stop()
    store = DetailStore(str(tmp_path / "detail.db"))
    raw = store.stack_samples(pid=proc.pid)
    assert len(raw) >= 2 * sum(s.samples for s in summaries if s.tid == proc.pid) // 2
    assert any(r["frames"][0][0] == "burn" for r in raw)
    store.close()


def test_an_unchanged_stack_costs_no_key_and_is_counted_and_kept_as_before(tmp_path, target, monkeypatch):
    """The reader hands back the same frame list for a thread whose stack it found unchanged (the waiter, asleep):
    its later samples reuse the stack's key and detail-store id (no stack_id call), and each is counted in the
    summary and kept in the detail store exactly as a sample whose key was built."""
    proc, path, lines = target
    src = _watching(tmp_path, proc, PystacksConfig(interval_seconds=0.01, summary_seconds=3600))
    src.start()
    calls = []
    try:
        real = src.detail.stack_id
        monkeypatch.setattr(src.detail, "stack_id", lambda frames: calls.append(frames) or real(frames))
        for _ in range(20):
            src.step()
        src._aggregate()   # samples are counted once a second; now, for this check
        waiter = next(a for a in src.targets[next(iter(src.targets))].threads.values() if a.tid != proc.pid)
        assert waiter.samples == 20 and list(waiter.stacks.values()) == [[20, 0, 0]]
        (frames,) = waiter.stacks
        assert calls.count(frames) == 1        # once: the 19 later samples reused it
    finally:
        src.stop()
    store = DetailStore(str(tmp_path / "detail.db"))
    raw = [r for r in store.stack_samples(pid=proc.pid) if r["tid"] != proc.pid]
    assert len(raw) == 20 and all(tuple(map(tuple, r["frames"])) == frames for r in raw)
    assert [f[0] for f in frames[:2]] == ["inner_wait", "outer_wait"] and frames[0][3] == lines["@wait"]
    store.close()


def test_many_processes_share_the_sentinel_sample_budget(tmp_path, target):
    """max_samples_per_second spreads the sentinel budget over the processes: the steps (each samples every
    process) stretch by processes / (budget x interval) when that is over 1; deep mode is not capped."""
    proc, path, lines = target
    src = _watching(tmp_path, proc, PystacksConfig(interval_seconds=0.1, max_samples_per_second=20.0))
    src.start()
    try:
        assert src.pace() == 1.0                     # nothing attached yet
        src.step()
        assert len(src.targets) == 1 and src.pace() == 1.0   # 10 samples/s, under 20
        src.config.max_samples_per_second = 2.5
        assert src.pace() == 4.0                     # 1 process x 10 Hz over 2.5/s: every 0.4 s
        src.set_mode(Mode.DEEP)
        assert src.pace() == 1.0
        src.set_mode(Mode.SENTINEL)
        src.config.max_samples_per_second = 0
        assert src.pace() == 1.0
    finally:
        src.stop()


def test_exited_process_is_dropped_with_its_last_summary(tmp_path, target):
    proc, path, lines = target
    src = _watching(tmp_path, proc, PystacksConfig(interval_seconds=0.01, summary_seconds=60))
    src.start()
    try:
        for _ in range(5):
            assert src.step() == []
        proc.kill()
        proc.wait()
        out = src.step()
        assert {type(r).__name__ for r in out} == {"StackSummary"} and not src.targets
        assert src.step() == []
    finally:
        src.stop()


def test_unreadable_process_is_an_event_not_an_error(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        src = _watching(tmp_path, sleeper, PystacksConfig(interval_seconds=0.01, startup_grace_seconds=0))
        key = (sleeper.pid, _start_ticks(sleeper.pid))
        src.start()
        out = src.step()
        assert len(out) == 1 and out[0].kind == "pystacks_attach_failed" and "not a CPython process" in out[0].message
        assert src.step() == [] and src.failed[key][0] == 1  # not retried before its back-off (0.25 s)
        time.sleep(0.3)
        assert src.step() == [] and src.failed[key][0] == 2  # retried, and reported only once
        src.stop()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_process_attached_before_its_interpreter_is_read_soon_after(tmp_path):
    """procs sees a workload at its exec; a first attach before CPython is there fails. It is retried within a
    second (back-off from 0.25 s), not after retry_seconds, and a young process's failure is no Event."""
    proc = subprocess.Popen(["sh", "-c", f"sleep 0.5; exec {sys.executable} -c 'import time; time.sleep(30)'"])
    try:
        src = _watching(tmp_path, proc, PystacksConfig(interval_seconds=0.01, summary_seconds=60))
        key = (proc.pid, _start_ticks(proc.pid))
        src.start()
        events = src.step()
        assert key in src.failed and not src.targets
        deadline = time.monotonic() + 10
        while key not in src.targets and time.monotonic() < deadline:
            time.sleep(0.05)
            events += src.step()
        assert key in src.targets and key not in src.failed
        assert src.failed == {} and not [e for e in events if getattr(e, "kind", "") == "pystacks_attach_failed"]
        assert time.monotonic() - (deadline - 10) < 5    # well before retry_seconds (30 s)
        src.stop()
    finally:
        proc.kill()
        proc.wait()


def test_stacks_reach_the_collector(tmp_path, collector, agents, target):
    proc, path, lines = target
    toml = FAST_AGENT_TOML.replace("[sources.procs]\ninterval_seconds = 0.5\n", textwrap.dedent(r'''
        [sources.procs]
        interval_seconds = 0.3
        patterns = ['pystacks_target\.py']

        [sources.pystacks]
        interval_seconds = 0.05
        summary_seconds = 1.0
    '''))
    assert "pystacks_target" in toml
    a = AgentProc(tmp_path, "stk", collector.address, toml=toml).start()
    agents.append(a)

    def main_stacks():
        rows = collector.cli("stacks", "--pid", str(proc.pid))
        return [r for r in rows if r["tid"] == proc.pid] or None
    rows = wait_for(main_stacks, 30, what="stack summaries of the target")
    top = max(rows[0]["stacks"], key=lambda s: s["count"])
    assert top["frames"][0][:2] == ["burn", "burn"] and top["frames"][0][3] == lines["@burn"]
    n = collector.node("stk")
    assert n["sources"]["pystacks"]["up"], n["sources"]
    human = subprocess.run([os.path.join(os.path.dirname(sys.executable), "steplens"), "--collector",
                            collector.address, "--insecure", "stacks", "--pid", str(proc.pid)],
                           capture_output=True, text=True, timeout=30).stdout
    assert "burn" in human and f"pid {proc.pid}" in human
    assert a.stop() == 0


def test_raw_samples_are_fetched_on_demand(tmp_path, collector, agents, target):
    """The raw samples stay on the node; `steplens detail stacks` fetches them over the command
    channel for a cluster-time range, converted through the clock model both ways."""
    proc, path, lines = target
    toml = FAST_AGENT_TOML.replace("[sources.procs]\ninterval_seconds = 0.5\n", textwrap.dedent(r'''
        [sources.procs]
        interval_seconds = 0.3
        patterns = ['pystacks_target\.py']

        [sources.pystacks]
        interval_seconds = 0.05
        summary_seconds = 1.0
    '''))
    a = AgentProc(tmp_path, "det", collector.address, toml=toml).start()
    agents.append(a)
    wait_for(lambda: collector.cli("stacks", "--pid", str(proc.pid)), 30, what="pystacks running")
    time.sleep(1.5)  # the detail ring is flushed once a second
    rows = collector.cli("detail", "stacks", "--node", "det", "--since", "30s", "--pid", str(proc.pid))
    assert len(rows) >= 10
    now = time.time_ns()
    main = [r for r in rows if r["tid"] == proc.pid]
    assert main and all(abs(now - r["ts_ns"]) < 35 * 10**9 for r in rows)
    top = main[-1]["frames"][0]
    assert (top["function"], top["file"], top["line"]) == ("burn", path, lines["@burn"])
    waiter = [r for r in rows if r["tid"] != proc.pid]
    assert waiter and waiter[-1]["frames"][0]["function"] == "inner_wait" and waiter[-1]["state"] == "sleeping"
    # a narrow window holds fewer samples: the range is honoured on the agent. Its start is the median sample's
    # age, not a fixed 1 s (the ring is flushed once a second: on a loaded CI run the newest flush was older)
    mid = sorted(r["ts_ns"] for r in rows)[len(rows) // 2]
    age_ms = (time.time_ns() - mid) // 10**6
    narrow = collector.cli("detail", "stacks", "--node", "det", "--since", f"{age_ms}ms", "--pid", str(proc.pid))
    wide = collector.cli("detail", "stacks", "--node", "det", "--since", "30s", "--pid", str(proc.pid))
    assert 0 < len(narrow) < len(wide)
    # clear refusals: a node that is not connected, a kind the agent does not keep
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "steplens"), "--collector",
                          collector.address, "--insecure", "detail", "stacks", "--node", "ghost"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "not connected" in out.stderr
    import grpc
    from steplens.v1 import control_pb2 as cpb
    from steplens.v1 import control_pb2_grpc as cgrpc
    with grpc.insecure_channel(collector.address) as ch:
        with pytest.raises(grpc.RpcError) as exc:
            cgrpc.ControlStub(ch).FetchDetail(cpb.FetchRequest(node_id="det", kinds=["bogus"]), timeout=40)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "unknown detail kind" in exc.value.details()
    assert a.stop() == 0
