"""flightrec's read schedule (agent/sources/flightrec.py, Schedule), without a job: when a process's Flight Recorder
ring is due to be read from its op rate, its ring size, its anchors and what the last read saw; the ring size
taken from the process's environment; the source thread's nice value."""

from __future__ import annotations

import os
import struct
import threading

from steplens.agent.bootstrap import DEFAULT_FR_BUFFER_SIZE
from steplens.agent.sources.base import HostContext
from steplens.agent.sources.flightrec import ENDPOINTS, FlightrecConfig, FlightrecSource, _Target


def _src(tmp_path, **cfg) -> FlightrecSource:
    cfg = {"max_interval_seconds": 20.0, "interval_seconds": 1.0, **cfg}  # the schedule (the defaults)
    src = FlightrecSource(HostContext(node_id="t", state_dir=str(tmp_path), proc_root=str(tmp_path / "proc")),
                          FlightrecConfig(socket_dirs=[str(tmp_path)], **cfg))
    src.start()
    return src


def _target(tmp_path, pid=4242, ring=2000) -> _Target:
    return _Target((pid, 1), str(tmp_path / f"{pid}.sock"), None, ring)


def _anchors(tmp_path, pid: int, count: int) -> None:
    """An anchor ring file as far as the schedule reads it: the count at byte 32."""
    path = tmp_path / f"{pid}.anchors"
    data = bytearray(path.read_bytes() if path.exists() else bytes(64))
    struct.pack_into("<Q", data, 32, count)
    path.write_bytes(bytes(data))


def _read(src, tgt, at: float, high: int, pending: bool = False) -> None:
    """What a successful read leaves: the cursor's highest record id, the groups' pending state."""
    tgt.cursors[ENDPOINTS[0]].high = high
    tgt.pending = pending
    src._read_done(tgt, at)


def test_rate_and_ring_decide_when_a_ring_is_read(tmp_path):
    src = _src(tmp_path)
    try:
        tgt = _target(tmp_path)
        assert src._due(tgt, 100.0) == "first"
        _read(src, tgt, 100.0, 49)
        assert src._due(tgt, 101.0) == "rate_unknown"  # one read gives no rate: the next check reads again
        _read(src, tgt, 101.0, 149)                     # 100 entries/s
        assert tgt.rate == 100.0
        # ring_fill 0.5 of 2000 entries: 1000 new entries, 10 s at 100/s
        assert src._due(tgt, 110.5) == ""
        assert src._due(tgt, 111.0) == "ring_fill"
        # a quiet process: read at max_interval_seconds at the latest
        _read(src, tgt, 111.0, 1149)
        _read(src, tgt, 131.0, 1149)
        assert tgt.rate == 0 and not tgt.stalled
        assert src._due(tgt, 150.0) == "" and src._due(tgt, 151.0) == "max_interval"
    finally:
        src.stop()


def test_a_stalled_process_is_read_every_stalled_interval(tmp_path):
    src = _src(tmp_path)
    try:
        tgt = _target(tmp_path)
        _read(src, tgt, 0.0, 10)
        _read(src, tgt, 1.0, 10, pending=True)   # nothing new, an op pending: hung, or a long collective
        assert tgt.stalled
        assert src._due(tgt, 5.9) == "" and src._due(tgt, 6.0) == "stalled"
        _read(src, tgt, 6.0, 11, pending=True)   # it moved
        assert not tgt.stalled and src._due(tgt, 11.0) == ""
    finally:
        src.stop()


def test_anchors_bring_a_read_forward(tmp_path):
    src = _src(tmp_path)
    pid = 4243
    try:
        tgt = _target(tmp_path, pid)
        _anchors(tmp_path, pid, 0)
        _read(src, tgt, 0.0, -1)
        _read(src, tgt, 1.0, -1)                 # nothing recorded yet (the job still starting): rate 0
        assert src._due(tgt, 2.0) == ""
        _anchors(tmp_path, pid, 3)               # iterations began: read to learn the ops per iteration
        assert src._due(tgt, 3.0) == "anchors_began"
        _read(src, tgt, 3.0, 11)                 # 12 entries in 3 anchors: 4 per anchor
        assert tgt.ops_per_anchor == 4.0
        _read(src, tgt, 4.0, 11)                 # rate 0 since (a pause), 4 per anchor kept
        # 250 anchors -> ~1000 entries predicted: ring_fill although the rate says 0
        _anchors(tmp_path, pid, 3 + 249)
        assert src._due(tgt, 5.0) == ""
        _anchors(tmp_path, pid, 3 + 250)
        assert src._due(tgt, 5.0) == "ring_fill"
    finally:
        src.stop()


def test_iterations_that_stop_bring_a_read_forward_once(tmp_path):
    src = _src(tmp_path)
    pid = 4244
    try:
        tgt = _target(tmp_path, pid)
        _anchors(tmp_path, pid, 100)
        _read(src, tgt, 0.0, 399)
        _anchors(tmp_path, pid, 200)
        _read(src, tgt, 10.0, 799)               # 10 anchors/s, 40 entries/s
        _anchors(tmp_path, pid, 210)
        assert src._due(tgt, 11.0) == ""         # the count moved at this check
        assert src._due(tgt, 12.5) == ""         # quiet 1.5 s: under max(2 s, 3 anchor intervals)
        assert src._due(tgt, 13.0) == "iterations_stopped"
        _read(src, tgt, 13.0, 840, pending=True)
        assert src._due(tgt, 14.0) == ""         # read since they stopped: not again for that
    finally:
        src.stop()


def test_every_check_and_deep_mode_read_every_ring(tmp_path):
    src = _src(tmp_path, max_interval_seconds=0)
    try:
        tgt = _target(tmp_path)
        _read(src, tgt, 0.0, 10)
        _read(src, tgt, 1.0, 10)
        assert src._due(tgt, 1.5) == "every_check"
    finally:
        src.stop()


def test_a_fetch_has_rings_read_only_where_its_window_is_not_covered(tmp_path):
    """refresh(until, pids) before a comm-op fetch: a window that ended before the last read of every ring it asks
    about is covered by what is stored (False, no read); one that ends later, an open one (0), or one about a
    process whose ring was read before its end has every ring read at the next step."""
    src = _src(tmp_path)
    try:
        a, b = _target(tmp_path, 10), _target(tmp_path, 11)
        src.targets = {a.key: a, b.key: b}
        a.read_mono_ns, b.read_mono_ns = 5_000, 9_000
        assert src.refresh(4_000, None) is False and not src._refresh
        assert src.refresh(5_000, {10, 11}) is False and not src._refresh
        assert src.refresh(8_000, {11}) is False and not src._refresh         # only b asked about
        assert src.refresh(8_000, {10}) is True and src._refresh               # a was read before 8,000
        src._refresh = False
        assert src.refresh(6_000, None) is True and src._refresh
        src._refresh = False
        assert src.refresh(0, {11}) is True and src._refresh                   # open: always read
        src._refresh = False
        assert src.refresh(4_000, {99}) is False                               # no ring of those processes
    finally:
        src.stop()


def test_ring_size_from_the_environment(tmp_path):
    src = _src(tmp_path)
    try:
        for pid, env, want in ((11, b"A=1\0TORCH_FR_BUFFER_SIZE=500\0B=2\0", 500),
                               (12, b"A=1\0", DEFAULT_FR_BUFFER_SIZE),
                               (13, b"TORCH_FR_BUFFER_SIZE=x\0", DEFAULT_FR_BUFFER_SIZE)):
            d = tmp_path / "proc" / str(pid)
            d.mkdir(parents=True)
            (d / "environ").write_bytes(env)
            assert src._ring_size(pid) == want
        assert src._ring_size(14) == DEFAULT_FR_BUFFER_SIZE  # unreadable
    finally:
        src.stop()


def test_the_source_thread_is_niced_and_the_main_thread_is_not(tmp_path):
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = {}

    def run():
        src = _src(tmp_path, nice=19)
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        src.stop()
    th = threading.Thread(target=run)
    th.start()
    th.join()
    assert seen["nice"] == 19
    _src(tmp_path, nice=19).stop()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_reads_by_reason_are_counted_as_metrics(tmp_path):
    """flightrec_ring_reads_total per reason (entity <node>:<reason>): what the reads cost is for, sent with the
    GC metrics when a count moved."""
    src = _src(tmp_path)
    try:
        src.reads.update(first=2, ring_fill=3)
        src.gc_at = -1e9
        got = {m.entity: m.value for m in src.step() if getattr(m, "name", "") == "flightrec_ring_reads_total"}
        assert got == {"t:first": 2.0, "t:ring_fill": 3.0}
        src.reads.update(ring_fill=1)
        src.gc_at = -1e9
        got = {m.entity: m.value for m in src.step() if getattr(m, "name", "") == "flightrec_ring_reads_total"}
        assert got == {"t:ring_fill": 4.0}
    finally:
        src.stop()
