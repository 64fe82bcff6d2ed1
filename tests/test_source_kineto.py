"""kineto source: the dynolog-compatible endpoint, the trace parser, and real torch (gloo, CPU) jobs
traced on demand. torch runs only in child processes (never imported here)."""

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import REPO
from steplens.agent.commlog import CommLog, RealtimeClock
from steplens.agent.kineto import trace
from steplens.agent.records import CommSummary, Event, Metric, Mode, ProcessInfo
from steplens.agent.sources.base import ConfigError, HostContext, WorkloadRegistry
from steplens.agent.sources.kineto import KinetoConfig, KinetoSource
from steplens.agent.transport.codec import decode_records, records_payload
from wallclock import rebase_kineto, rebased_kineto_bytes

FIX = os.path.join(REPO, "tests", "fixtures", "kineto")
GLOO_TRACE = os.path.join(FIX, "gloo_cpu_2rank_rank0.json")
GPU_TRACE = os.path.join(FIX, "gpu_nccl_handbuilt.json")
JOB = os.path.join(FIX, "gloo_job.py")
ITEMSIZE = {"torch.float32": 4, "torch.int64": 8}


def _has_torch() -> bool:
    return subprocess.run([sys.executable, "-c", "import importlib.util as u; raise SystemExit(u.find_spec('torch') is None)"]
                          ).returncode == 0


needs_torch = pytest.mark.skipif(not _has_torch(), reason="torch is not installed in this environment")


@pytest.fixture
def sockdir():
    d = tempfile.mkdtemp(prefix="kt", dir="/tmp")  # short: AF_UNIX paths are limited to 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        stat = fh.read()
    return int(stat[stat.rfind(b")") + 2:].split()[19])


def make_source(tmp_path, sockdir, mode=Mode.DEEP, registry=None, **cfg) -> KinetoSource:
    ctx = HostContext("n1", state_dir=str(tmp_path / "state"), workloads=registry or WorkloadRegistry(),
                      mode=lambda: mode)
    os.makedirs(ctx.state_dir, exist_ok=True)
    config = KinetoConfig(socket_dir=sockdir, **cfg)
    config.validate()
    src = KinetoSource(ctx, config)
    src.start()
    return src


class Client:
    """A libkineto stand-in speaking the fabric protocol, for protocol-level tests."""

    def __init__(self, sockdir: str, name: str = "dynoconfigclient-test"):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(os.path.join(sockdir, name))
        self.sock.settimeout(2.0)
        self.dest = os.path.join(sockdir, "dynolog")

    def send_raw(self, data: bytes) -> None:
        self.sock.sendto(data, self.dest)

    def send(self, msg_type: str, payload: bytes) -> tuple[str, bytes]:
        self.send_raw(struct.pack("=Q32s", len(payload), msg_type.encode()) + payload)
        data = self.sock.recv(65536)
        size, raw = struct.unpack_from("=Q32s", data)
        assert size == len(data) - 40
        return raw.rstrip(b"\0").decode(), data[40:]

    def req(self, pids, config_type=3) -> str:
        kind, body = self.send("req", struct.pack(f"=iiq{len(pids)}i", config_type, len(pids), 0, *pids))
        assert kind == "req"
        return body.decode()

    def close(self):
        self.sock.close()


def config_of(text: str) -> dict:
    return dict(line.split("=", 1) for line in text.splitlines() if line)


def match_calls(ops, calls, to_mono, tol_ns=200_000):
    """Each traced op to the job's logged call that contains it (same op and bytes). Returns the matched
    calls; asserts every op matched once and every call inside the traced span was traced."""
    matched = []
    used = set()
    for op in ops:
        hits = [i for i, c in enumerate(calls) if i not in used and c["op"] == op.op
                and c["numel"] * ITEMSIZE[c["dtype"]] == op.bytes
                and to_mono(c["t0"]) - tol_ns <= op.start_mono_ns and op.end_mono_ns <= to_mono(c["t1"]) + tol_ns]
        assert len(hits) >= 1, f"traced op {op} is not one of the job's calls"
        used.add(hits[0])
        matched.append(calls[hits[0]])
    first, last = min(o.start_mono_ns for o in ops), max(o.end_mono_ns for o in ops)
    inside = [i for i, c in enumerate(calls) if to_mono(c["t0"]) >= first and to_mono(c["t1"]) <= last]
    assert set(inside) <= used, "a call made inside the traced span has no traced op"
    return matched


def assert_consecutive_per_group(matched):
    for pg in {c["pg"] for c in matched}:
        seqs = sorted(c["seq"] for c in matched if c["pg"] == pg)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"group {pg}: ops missing from the trace"


# ---- parser on recorded and hand-built traces ----

def test_parse_recorded_gloo_cpu_trace():
    doc = trace.load(GLOO_TRACE, 1 << 24)
    parsed = trace.parse(doc, lambda rt: rt, pid=29192, start_ticks=5, rank=0, job_key="j")
    assert parsed.skipped == 0 and parsed.steps == []
    a, b = parsed.span_mono_ns
    assert b - a == pytest.approx(150e6, rel=0.05)            # ACTIVITIES_DURATION_MSECS=150
    assert len(parsed.ops) == 24 and parsed.kernels == []
    for op in parsed.ops:
        # gloo on torch 2.13 records no record_param_comms: no group name, no sequence number
        assert (op.timing, op.comm_id, op.seq, op.pid, op.start_ticks, op.rank, op.job_key) == \
            ("backend_thread", "pg:?", -1, 29192, 5, 0, "j")
        assert a <= op.start_mono_ns <= op.end_mono_ns <= b and op.mono_ns == op.end_mono_ns
        assert op.bytes == op.count * {"float32": 4, "int64": 8}[op.dtype]
    assert {(o.op, o.dtype, o.count) for o in parsed.ops} == {("all_reduce", "float32", 256),
                                                               ("all_reduce", "float32", 512),
                                                               ("broadcast", "int64", 256)}
    with open(os.path.join(FIX, "gloo_cpu_2rank_rank0.calls.jsonl")) as fh:
        calls = [json.loads(line) for line in fh]
    matched = match_calls(parsed.ops, calls, lambda rt: rt)
    assert {c["pg"] for c in matched} == {"default", "pair"}
    assert_consecutive_per_group(matched)


def test_parse_handbuilt_gpu_trace_links_kernels_to_launches(tmp_path):
    # HAND-BUILT fixture (see tests/fixtures/kineto/README.md): format only, not real GPU output
    doc = trace.load(GPU_TRACE, 1 << 24)
    base = doc["baseTimeNanoseconds"]
    parsed = trace.parse(doc, lambda rt: rt - base, pid=4242, rank=0)
    us = 1000
    assert parsed.steps == [(7, 1000 * us, 6000 * us)]
    nccl, gemm = parsed.kernels
    assert (nccl.correlation_id, nccl.launch_api, nccl.device, nccl.stream, nccl.grid, nccl.block) == \
        (501, "cudaLaunchKernel", 0, 7, [2, 1, 1], [640, 1, 1])
    assert (nccl.start_mono_ns, nccl.end_mono_ns, nccl.launch_start_mono_ns, nccl.launch_end_mono_ns) == \
        (1125 * us, 1525 * us, 1110 * us, 1118 * us)
    assert (gemm.launch_api, gemm.tid, gemm.pid) == ("cuLaunchKernel", 4242, 4242)
    ar, send = parsed.ops  # the NCCL kernel wins over its record_param_comms; the send has no kernel
    assert (ar.timing, ar.comm_id, ar.comm_desc, ar.op, ar.seq, ar.members, ar.nranks, ar.group_rank) == \
        ("gpu_kernel", "pg:0", "default_pg", "all_reduce", 42, [0, 1], 2, 0)
    assert (ar.bytes, ar.dtype, ar.issue_mono_ns, ar.start_mono_ns, ar.stream) == \
        (4 * 1048576, "float32", 1110 * us, 1125 * us, 7)
    assert (send.timing, send.op, send.peer, send.bytes, send.dtype, send.seq, send.members, send.group_rank) == \
        ("cpu_enqueue", "send", 4, 2 * 4096, "bfloat16", 5, [0, 4], 0)
    log = CommLog(str(tmp_path), "kineto")
    sums = log.add(parsed.ops, parsed.kernels, parsed.steps)
    k = next(s for s in sums if s.op == "kernels")
    assert (k.step, k.kernels, k.issue_latency_ns_sum) == (7, 2, (1125 - 1110 + 2010 - 2000) * us)
    log.close()


def test_bad_trace_files_raise_trace_error(tmp_path):
    good = open(GLOO_TRACE, "rb").read()
    cases = {"truncated": good[: len(good) // 2], "empty": b"", "garbage": b"\x00\xffnot json",
             "list": b"[]", "no_events": b'{"baseTimeNanoseconds": 1}', "bad_base": b'{"traceEvents": [], "baseTimeNanoseconds": "x"}'}
    for name, data in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_bytes(data)
        with pytest.raises(trace.TraceError):
            trace.load(str(path), 1 << 24)
    with pytest.raises(trace.TraceError, match="max_trace_bytes"):
        trace.load(GLOO_TRACE, 1000)
    # malformed events inside a valid file are counted, not fatal
    doc = json.loads(good)
    doc["traceEvents"] += [{"ph": "X", "name": "gloo:all_reduce", "ts": "x"}, {"ph": "X", "name": 5}, "junk"]
    parsed = trace.parse(doc, lambda rt: rt, pid=1)
    assert parsed.skipped == 2 and len(parsed.ops) == 24


# ---- the endpoint and window scheduling, spoken to like libkineto does ----

def test_endpoint_protocol_windows_and_unexpected_messages(tmp_path, sockdir):
    me = os.getpid()
    reg = WorkloadRegistry()
    reg.replace({(me, start_ticks(me)): ProcessInfo(0, me, start_ticks(me), job_key="jobA", rank=3)})
    src = make_source(tmp_path, sockdir, mode=Mode.SENTINEL, registry=reg, sentinel_window_ms=100,
                      sentinel_period_seconds=1.0)
    cl = Client(sockdir)
    try:
        kind, body = cl.send("ctxt", struct.pack("=iiq", 0, me, 0))
        assert kind == "ctxt" and struct.unpack("=i", body) == (1,)
        assert cl.req([me, 1]) == ""                      # sentinel: not due before the first period
        assert cl.req([4_000_000, me], config_type=2) == ""  # another process: known now, job_key via ancestor
        time.sleep(1.05)
        assert cl.req([me], config_type=1) == ""         # events only: Kineto activities are what we hand out
        cfg = config_of(cl.req([me]))
        assert cfg["ACTIVITIES_DURATION_MSECS"] == "100" and cfg["PROFILE_START_TIME"] == "0"
        assert cfg["ACTIVITIES_LOG_FILE"].startswith(os.path.join(str(tmp_path), "state", "kineto", "w"))
        assert cl.req([me]) == ""                         # one window at a time per process
        src.set_mode(Mode.DEEP)
        assert config_of(cl.req([4_000_000, me]))["ACTIVITIES_DURATION_MSECS"] == "2000"
        assert (src.procs[me].rank, src.procs[me].job_key) == (3, "jobA")
        assert (src.procs[4_000_000].rank, src.procs[4_000_000].job_key) == (-1, "jobA")
        # unexpected datagrams are counted and ignored; the endpoint keeps answering
        for junk in (b"", b"abc", struct.pack("=Q32s", 99, b"req"), struct.pack("=Q32s", 0, b"hello"),
                     struct.pack("=Q32s", 16, b"req") + struct.pack("=iiq", 2, 5, 0)):
            cl.send_raw(junk)
        cl.sock.settimeout(0.3)
        with pytest.raises(socket.timeout):
            cl.sock.recv(100)
        cl.sock.settimeout(2.0)
        assert cl.req([5_000_000]) != ""
        out = src.step()
        assert [m.value for m in out if isinstance(m, Metric) and m.name == "kineto_ipc_unexpected_total"] == [5]
    finally:
        cl.close()
        src.stop()
        src.stop()  # idempotent
    assert not os.path.exists(os.path.join(sockdir, "dynolog"))


def test_corrupt_truncated_and_missing_traces_are_reported_and_skipped(tmp_path, sockdir):
    me = os.getpid()
    src = make_source(tmp_path, sockdir, deep_window_ms=10, trace_timeout_seconds=0.5, max_trace_bytes=1 << 20)
    cl = Client(sockdir)
    good = rebased_kineto_bytes(GLOO_TRACE)  # recorded wall-clock times, moved to "just now"

    def window() -> str:
        return config_of(cl.req([me]))["ACTIVITIES_LOG_FILE"][: -len(".json")] + f"_{me}.json"

    def events(out, kind):
        return [e for e in out if isinstance(e, Event) and e.kind == kind]

    try:
        # a truncated file that is still fresh may be in the middle of being written: wait
        path = window()
        open(path, "wb").write(good[:5000])
        assert src.step() == [] and os.path.exists(path)
        old = time.time() - 10
        os.utime(path, (old, old))
        out = src.step()
        assert len(events(out, "kineto_trace_corrupt")) == 1 and not os.path.exists(path)
        for data in (b"\x00garbage", b"x" * ((1 << 20) + 10)):   # corrupt; over max_trace_bytes
            path = window()
            open(path, "wb").write(data)
            os.utime(path, (old, old))
            assert len(events(src.step(), "kineto_trace_corrupt")) == 1 and not os.path.exists(path)
        # a window whose trace never comes
        window()
        time.sleep(0.6)
        missing = events(src.step(), "kineto_trace_missing")
        assert len(missing) == 1 and "no trace" in missing[0].message
        # and the source still parses a good trace afterwards
        path = window()
        open(path, "wb").write(good)
        out = src.step()
        sums = [s for s in out if isinstance(s, CommSummary)]
        assert sum(s.calls for s in sums) == 24 and all(s.pid == me for s in sums)
        assert not os.path.exists(path) and src.traces_total == 1 and src.traces_failed == 4
    finally:
        cl.close()
        src.stop()


def test_times_that_do_not_convert_are_dropped_with_the_reason_and_the_rest_kept(tmp_path, sockdir):
    """A real trace (rebased to just now) plus copies of its gloo events whose CLOCK_REALTIME times are before
    this boot, negative, days in the future, or past the 64-bit range: through the real window path, those
    are dropped and reported per reason (Event kineto_records_dropped), the 24 real ops are kept, and nothing
    raises out of step()."""
    me = os.getpid()
    src = make_source(tmp_path, sockdir, deep_window_ms=10)
    cl = Client(sockdir)
    doc = rebase_kineto(json.load(open(GLOO_TRACE)))
    base = doc["baseTimeNanoseconds"]
    real_gloo = [e for e in doc["traceEvents"] if isinstance(e, dict) and str(e.get("name")).startswith("gloo:")]
    boot_real_ns = time.time_ns() - time.monotonic_ns()
    crafted = {  # reason -> realtime ns of the crafted event's start
        "before_boot": [boot_real_ns - 3600 * 10**9, -10**15],                        # an hour before boot; < 0
        "future": [time.time_ns() + 3 * 86400 * 10**9],                               # three days ahead
        "out_of_range": [1 << 64, -(1 << 64)],                                        # past int64 either way
    }
    for starts in crafted.values():
        for start in starts:
            ev = json.loads(json.dumps(real_gloo[0]))
            ev["ts"], ev["dur"] = (start - base) / 1000, 1.0
            doc["traceEvents"].append(ev)
    try:
        path = config_of(cl.req([me]))["ACTIVITIES_LOG_FILE"][: -len(".json")] + f"_{me}.json"
        with open(path, "w") as fh:
            json.dump(doc, fh)
        out = src.step()
        dropped = [e for e in out if isinstance(e, Event) and e.kind == "kineto_records_dropped"]
        by_reason = {e.message.split(":")[0]: e.value for e in dropped}
        assert by_reason == {reason: len(starts) for reason, starts in crafted.items()}, dropped
        assert all(e.entity == f"pid:{me}:0" for e in dropped)
        sums = [s for s in out if isinstance(s, CommSummary)]
        assert sum(s.calls for s in sums) == len(real_gloo) == 24
        stored = [rec for _, rec in decode_records(records_payload(src.log.store.records(["commop"])))]
        assert len(stored) == 24 and all(0 < o.start_mono_ns <= o.end_mono_ns <= time.monotonic_ns() for o in stored)
        assert src.traces_total == 1 and src.log.rejected == {r: len(s) for r, s in crafted.items()}
    finally:
        cl.close()
        src.stop()


def test_config_validation():
    KinetoConfig().validate()
    for bad in ({"deep_window_ms": 0}, {"sentinel_window_ms": 5}, {"sentinel_period_seconds": 0.1},
                {"max_trace_bytes": 10}, {"socket_dir": "/" + "x" * 60}, {"trace_timeout_seconds": 0}):
        with pytest.raises(ConfigError):
            KinetoConfig(**bad).validate()
    KinetoConfig(sentinel_window_ms=0, sentinel_period_seconds=0).validate()  # sentinel windows off


# ---- real torch (gloo, CPU) jobs launched with KINETO_USE_DAEMON=1 ----

def start_job(sockdir, tmp_path, rank, world, seconds, extra=()):
    env = dict(os.environ, KINETO_USE_DAEMON="1", KINETO_IPC_SOCKET_DIR=sockdir)
    log = str(tmp_path / f"calls{rank}.jsonl")
    proc = subprocess.Popen([sys.executable, JOB, "--init", f"file://{tmp_path}/rdv", "--rank", str(rank),
                             "--world", str(world), "--seconds", str(seconds), "--log", log, "--sleep-ms", "10",
                             *extra], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, log


@needs_torch
def test_deep_mode_traces_a_real_two_rank_gloo_job(tmp_path, sockdir):
    reg = WorkloadRegistry()
    # 1 s: >= 6 ops of both groups per rank even when the host is busy (a 500 ms window caught 4 with the
    # 2-core machine running three other CPU-bound jobs beside the tests)
    src = make_source(tmp_path, sockdir, registry=reg, deep_window_ms=1000)
    jobs = [start_job(sockdir, tmp_path, r, 2, 14, ["--pair"]) for r in range(2)]
    infos = {}
    for r, (p, _) in enumerate(jobs):
        ticks = start_ticks(p.pid)
        infos[(p.pid, ticks)] = ProcessInfo(0, p.pid, ticks, job_key="jobK", rank=r, world_size=2)
    reg.replace(infos)
    t_begin = time.monotonic_ns()
    out = []
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and src.traces_total < 2:
            out += src.step()
            time.sleep(0.2)
        assert src.traces_total >= 2, f"no traces: {out}"
        assert not [e for e in out if isinstance(e, Event)], out
    finally:
        for p, _ in jobs:
            p.kill()
            p.wait()
        store_ops = [rec for _, rec in decode_records(records_payload(src.log.store.records(["commop"])))]
        src.stop()
    t_end = time.monotonic_ns()
    clock = RealtimeClock()
    sums = [s for s in out if isinstance(s, CommSummary)]
    for r, (p, log) in enumerate(jobs):
        ops = [o for o in store_ops if o.pid == p.pid]
        assert len(ops) >= 6, f"rank {r}: {len(ops)} ops"
        assert {(o.rank, o.job_key, o.timing, o.seq) for o in ops} == {(r, "jobK", "backend_thread", -1)}
        assert all(t_begin < o.start_mono_ns <= o.end_mono_ns < t_end for o in ops)
        with open(log) as fh:
            calls = [json.loads(line) for line in fh]
        matched = match_calls(ops, calls, clock.to_mono)
        assert {c["pg"] for c in matched} == {"default", "pair"}
        assert_consecutive_per_group(matched)
        mine = [s for s in sums if s.pid == p.pid]
        assert sum(s.calls for s in mine) == len(ops) and {(s.rank, s.job_key) for s in mine} == {(r, "jobK")}
        assert sum(s.bytes for s in mine) == sum(o.bytes for o in ops)


@needs_torch
def test_process_exiting_mid_window_is_reported_and_the_source_goes_on(tmp_path, sockdir):
    src = make_source(tmp_path, sockdir, deep_window_ms=30_000, trace_timeout_seconds=120)
    proc, _ = start_job(sockdir, tmp_path, 0, 1, 2)
    out = []
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not any(isinstance(e, Event) for e in out):
            out += src.step()
            time.sleep(0.2)
        proc.wait(10)
        events = [e for e in out if isinstance(e, Event)]
        assert [e.kind for e in events] == ["kineto_trace_missing"] and "exited" in events[0].message
        assert events[0].entity == f"pid:{proc.pid}:0"
        cl = Client(sockdir)
        try:
            assert config_of(cl.req([os.getpid()]))["ACTIVITIES_DURATION_MSECS"] == "30000"
        finally:
            cl.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        src.stop()
