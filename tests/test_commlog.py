"""Shared comm-op plumbing: op names, realtime->monotonic, summaries, and the node-local ring."""

import json
import os
import time

from steplens.agent import records as r
from steplens.agent.commlog import CommLog, RealtimeClock, dtype_bytes, normalize_op, summarize
from steplens.agent.transport.codec import decode_records, records_payload


def test_op_names_from_every_source_normalize():
    cases = {"gloo:all_reduce": "all_reduce", "nccl:_allgather_base": "all_gather", "ncclAllReduce": "all_reduce",
             "c10d::allreduce_": "all_reduce", "gloo:send": "send", "nccl:recv": "recv",
             "ncclBroadcast": "broadcast", "ncclReduceScatter": "reduce_scatter", "nccl:_reduce_scatter_base":
             "reduce_scatter", "alltoall_base": "all_to_all", "barrier": "barrier", "gloo:barrier": "barrier",
             "ncclAllGather": "all_gather", "something_else": "unknown"}
    assert {k: normalize_op(k) for k in cases} == cases


def test_dtype_sizes():
    assert [dtype_bytes(d) for d in ("Float", "torch.bfloat16", "ncclFloat32", "ncclBfloat16", "ncclInt8", "x")] \
        == [4, 2, 4, 2, 1, 0]


def test_realtime_clock_uses_the_tightest_read_and_refreshes():
    # each offset_ns call reads "now", then 5 (mono, real, mono) triples; the tightest is (4000, 4001)
    mono = iter([100, 0, 50, 1000, 1002, 2000, 2010, 3000, 3100, 4000, 4001, 200])
    clock = RealtimeClock(refresh_s=10, monotonic_ns=lambda: next(mono), realtime_ns=lambda: 5_000_000)
    assert clock.offset_ns == 5_000_000 - 4000
    assert clock.to_mono(6_000_000) == 6_000_000 - 5_000_000 + 4000  # second call: "now" 200, no re-measure
    real = RealtimeClock()
    import time
    a = time.monotonic_ns()
    assert abs(real.to_mono(time.time_ns()) - a) < 50_000_000
    assert real.to_mono(0) == 0


def test_summaries_group_by_step_and_count_issue_latency():
    ops = [r.CommOp(110, "backend_thread", 7, "pg:0", "all_reduce", start_mono_ns=100, end_mono_ns=110, bytes=8, seq=1),
           r.CommOp(130, "backend_thread", 7, "pg:0", "all_reduce", start_mono_ns=120, end_mono_ns=130, bytes=8, seq=2),
           r.CommOp(310, "backend_thread", 7, "pg:0", "all_reduce", start_mono_ns=300, end_mono_ns=310, bytes=8, seq=3),
           r.CommOp(140, "backend_thread", 7, "pg:1", "send", start_mono_ns=135, end_mono_ns=140, bytes=4, peer=1)]
    ks = [r.KernelRec(160, 7, "gemm", 150, 160, launch_start_mono_ns=140)]
    out = summarize(ops, ks, steps=[(5, 90, 200), (6, 290, 400)])
    by = {(s.comm_id, s.op, s.step): s for s in out}
    ar5 = by[("pg:0", "all_reduce", 5)]
    assert (ar5.calls, ar5.bytes, ar5.busy_ns, ar5.max_ns, ar5.seq_first, ar5.seq_last) == (2, 16, 20, 10, 1, 2)
    assert by[("pg:0", "all_reduce", 6)].calls == 1
    assert by[("pg:1", "send", 5)].bytes == 4
    k = by[("", "kernels", 5)]
    assert (k.kernels, k.issue_latency_ns_sum, k.busy_ns) == (1, 10, 10)


def test_commlog_keeps_the_stream_on_the_node_and_returns_summaries(tmp_path):
    log = CommLog(str(tmp_path), "kineto", max_records=1000)
    ops = [r.CommOp(10 + i, "backend_thread", 7, "pg:0", "all_reduce", rank=i % 2, seq=i, start_mono_ns=5 + i,
                    end_mono_ns=10 + i) for i in range(1200)]
    summaries = [s for s in log.add(ops) if isinstance(s, r.CommSummary)]  # Steps come too (test_steps.py)
    assert sum(s.calls for s in summaries) == 1200
    assert log.dropped > 0  # the ring bound: oldest rows deleted in chunks and counted
    kept = log.store.records(["commop"])
    assert len(kept) + log.dropped == 1200
    back = decode_records(records_payload(log.store.records(["commop"], ranks={1}, limit=5)))
    assert [rec.rank for _, rec in back] == [1] * 5 and all(src == "kineto" for src, _ in back)
    assert os.path.exists(tmp_path / "detail.db")
    log.close()


def test_sources_share_one_store_per_file(tmp_path):
    """kineto, flightrec and pystacks write through one DetailStore (one SQLite writer, one bound per kind)."""
    from steplens.agent.detail import open_shared, release_shared
    a = CommLog(str(tmp_path), "kineto", max_records=1000)
    b = CommLog(str(tmp_path), "flightrec", max_records=5000)
    assert a.store is b.store and a.store.max_records == 5000
    st = open_shared(str(tmp_path / "detail.db"))
    assert st is a.store
    a.add([r.CommOp(5, "backend_thread", 7, "pg:0", "all_reduce")])
    b.add([r.CommOp(6, "cpu_enqueue", 8, "pg:0", "all_reduce")])
    a.close()
    b.close()
    assert len(st.records(["commop"])) == 2  # still open: one user left
    release_shared(st)
    c = CommLog(str(tmp_path), "kineto")
    assert c.store is not st and len(c.store.records(["commop"])) == 2
    c.close()


def test_record_filter_by_pid_or_rank(tmp_path):
    log = CommLog(str(tmp_path), "flightrec", max_records=1000)
    log.add([r.CommOp(10 + i, "cpu_enqueue", 100 + i % 3, "pg:0", "all_reduce", rank=i % 3 if i % 2 else -1)
             for i in range(30)])

    def got(**kw):
        return [rec for _, rec in decode_records(records_payload(log.store.records(["commop"], **kw)))]

    assert {x.pid for x in got(pids={101})} == {101}
    assert {x.rank for x in got(ranks={2})} == {2}
    both = got(pids={100}, ranks={2})
    assert both and all(x.pid == 100 or x.rank == 2 for x in both)
    assert len(both) == len([x for x in got() if x.pid == 100 or x.rank == 2])
    assert got(pids=set()) == [] and len(got(limit=7)) == 7
    assert [x.mono_ns for x in got(since_mono_ns=20, until_mono_ns=22)] == [20, 21, 22]
    log.close()


def test_a_reader_opening_the_shared_store_first_sets_no_bound(tmp_path):
    from steplens.agent.detail import open_shared, release_shared
    reader = open_shared(str(tmp_path / "detail.db"))  # the fetch handler, before any source
    log = CommLog(str(tmp_path), "kineto", max_records=1000)
    assert log.store is reader and reader.max_records == 1000
    release_shared(reader)
    log.close()


def test_records_whose_times_do_not_convert_are_dropped_per_reason_and_the_rest_kept(tmp_path):
    """CLOCK_REALTIME converted to a CLOCK_MONOTONIC before boot (negative), days ahead, past int64, or not an
    integer: CommLog.add drops the record, counts it by reason and returns one Event per (process, reason);
    the good records of the same call reach the detail store and the summaries."""
    now = 10**12
    log = CommLog(str(tmp_path), "kineto", max_records=1000, monotonic_ns=lambda: now)
    good = [r.CommOp(now - 100 + i, "cpu_enqueue", 7, "pg:0", "all_reduce", start_ticks=5, start_mono_ns=now - 200,
                     end_mono_ns=now - 100 + i, bytes=8) for i in range(3)]
    bad = [r.CommOp(-163470956672636, "cpu_enqueue", 7, "pg:0", "all_reduce", start_ticks=5),      # before boot
           r.CommOp(now, "cpu_enqueue", 7, "pg:0", "all_reduce", start_ticks=5, issue_mono_ns=-1),
           r.CommOp(now + 3 * 86400 * 10**9, "cpu_enqueue", 7, "pg:0", "all_reduce", start_ticks=5),  # future
           r.CommOp(1 << 63, "cpu_enqueue", 7, "pg:0", "all_reduce", start_ticks=5),                # past int64
           r.CommOp(now, "cpu_enqueue", 7, "pg:0", "all_reduce", start_ticks=5, end_mono_ns=1.5e12),  # a float
           r.CommOp(now, "cpu_enqueue", 7, "pg:0", "all_reduce", start_ticks=5, bytes=-8)]           # not a time
    kbad = [r.KernelRec(now, 7, "gemm", now - 10, now, start_ticks=5, launch_start_mono_ns=-(1 << 70))]
    kgood = [r.KernelRec(now, 7, "gemm", now - 10, now, start_ticks=5, launch_start_mono_ns=now - 20)]
    out = log.add(bad[:3] + good + bad[3:], kbad + kgood)
    events = {(e.message.split(":")[0], e.message.split()[2]): e for e in out if isinstance(e, r.Event)}
    assert {k: e.value for k, e in events.items()} == {
        ("before_boot", "CommOp"): 2, ("future", "CommOp"): 1, ("out_of_range", "CommOp"): 1,
        ("not_a_time", "CommOp"): 1, ("unencodable", "record(s)"): 1, ("out_of_range", "KernelRec"): 1}
    assert all(e.kind == "kineto_records_dropped" and e.entity == "pid:7:5" and e.mono_ns == now
               for e in events.values())
    assert "-163470956672636" in events[("before_boot", "CommOp")].message
    assert log.rejected == {"before_boot": 2, "future": 1, "out_of_range": 2, "not_a_time": 1, "unencodable": 1}
    sums = [s for s in out if isinstance(s, r.CommSummary)]
    assert sum(s.calls for s in sums if s.op == "all_reduce") == 3 and sum(s.bytes for s in sums) == 24
    assert sum(s.kernels for s in sums if s.op == "kernels") == 1
    assert len(log.store.records(["commop"])) == 3 and len(log.store.records(["kernelrec"])) == 1
    assert (log.ops_total, log.kernels_total) == (3, 1)
    log.close()


def test_cupti_records_with_bad_times_or_shapes_are_counted_not_raised(tmp_path):
    """read_cupti on a crafted <pid>.cupti.jsonl: kernels whose CUPTI (CLOCK_REALTIME) times fall before boot or
    far ahead, entries of the wrong shape or type, and lines that are not objects are counted by reason; the
    good kernel of the same line is kept."""
    from collections import Counter

    from steplens.agent import bootstrap
    clock = RealtimeClock()
    off = clock.offset_ns
    now_real = off + time.monotonic_ns()

    def k(start, stop, corr=42):
        return ["gemm", 0, 7, start, stop, corr, 4, 1, 1, 128, 1, 1, 0]
    line = {"pid": 123, "k": [k(now_real - 5_000, now_real - 2_000),                  # good
                              k(off - 10**12, off - 10**12 + 5),                       # before boot
                              k(now_real + 3 * 86400 * 10**9, now_real + 3 * 86400 * 10**9 + 5),  # days ahead
                              k(1 << 70, (1 << 70) + 5),                               # past int64
                              k("soon", "later"), ["short"], {"not": "a list"}],
            "a": [["runtime", 211, now_real - 6_000, now_real - 5_500, 42, 99], [1, 2, 3, 4, [5], 6]]}
    path = tmp_path / "123.cupti.jsonl"
    path.write_text(json.dumps(line) + "\n[1, 2]\n" + json.dumps({"k": 5}) + "\n")
    rejects = Counter()
    kernels, pos, _ = bootstrap.read_cupti(str(path), 0, clock, rejects=rejects)
    assert len(kernels) == 1 and kernels[0].launch_api == "runtime:211" and pos == len(path.read_bytes())
    assert rejects == {"before_boot": 1, "future": 1, "out_of_range": 1, "malformed": 4}, rejects
