"""CommProgress end to end: agent record -> codec -> collector decode (bad records rejected with a reason, the
good ones of the batch kept) -> the real writer -> Reader.comm_progress / comm_progress_latest with cluster times;
and the flightrec parsing of a real recorded dump pair (tests/fixtures/flightrec-gloo: torch 2.13 CPU, gloo, rank 1
waiting before the 4th all_reduce that rank 0 has entered)."""

from __future__ import annotations

import json
import os
import time

from conftest import REPO
from steplens.agent import records as r
from steplens.agent.commlog import RealtimeClock
from steplens.agent.sources.flightrec import parse_dump, progress_records
from steplens.agent.transport.codec import decode_records, encode_records
from steplens.collector.ingest.clock import ClockEstimate
from steplens.collector.ingest.decode import decode_batch
from steplens.collector.store.queries import Reader
from steplens.collector.store.writer import BatchJob, StoreWriter

T = 10**12
JOB = "torchelastic:j"
FIXTURES = os.path.join(REPO, "tests", "fixtures", "flightrec-gloo")
KEYS = ["node_id", "pid", "start_ticks", "job_key", "rank", "comm_id", "end_ns", "last_enqueued", "last_started",
        "last_completed", "pending_op", "pending_seq", "pending_p2p", "pending_peer", "pending_since_ns", "nranks"]


def prog(mono, rank, enq, done, op="", seq=-1, since=0, comm="pg:0", pid=None, job_key=JOB, p2p=False,
         peer=-1) -> r.CommProgress:
    return r.CommProgress(mono, 100 + rank if pid is None else pid, comm, 7, job_key, rank, enq, -1, done, op, seq,
                          p2p, peer, since, 2)


def test_codec_round_trip():
    recs = [("flightrec", prog(T, 0, 4, 3, "all_reduce", 4, T - 5)),
            ("flightrec", prog(T + 1, 1, 3, 3)),
            ("flightrec", prog(T + 2, 1, 9, 9, "recv", 2, T, p2p=True, peer=0))]
    assert decode_records(encode_records(recs)) == recs
    d = decode_batch(encode_records(recs), len(recs), T + 10)
    assert not d.rejected and [(m, c.rank, c.pending_seq, c.pending_p2p, c.pending_peer) for m, c in d.comm_progress] \
        == [(T, 0, 4, False, -1), (T + 1, 1, -1, False, -1), (T + 2, 1, 2, True, 0)]


def test_decode_rejects_bad_records_with_reasons_and_keeps_the_good_ones():
    good = [prog(T, 0, 4, 3, "all_reduce", 4, T - 5), prog(T, 1, 3, 3),
            prog(T, 0, 4, 3, "all_reduce", 4, 0)]  # an issue time the agent could not convert: kept, since 0
    bad = {
        "an empty or too long comm_id or job_key": [prog(T, 0, 1, 1, comm=""), prog(T, 0, 1, 1, job_key=""),
                                                    prog(T, 0, 1, 1, comm="pg:" + "x" * 300)],
        "a sequence number, rank or peer below -1": [prog(T, 0, -2, 1), prog(T, 0, 1, 1, "send", -5, T - 1),
                                                     prog(T, -3, 1, 1)],
        "a pending op issued after the record's time": [prog(T, 0, 4, 3, "all_reduce", 4, T + 1)],
        "a pending op without its sequence number": [prog(T, 0, 4, 3, "all_reduce", -1, T - 1)],
        "pending fields without a pending op": [prog(T, 0, 4, 3, "", 4, 0), prog(T, 0, 4, 3, "", -1, T - 1)],
    }
    recs = good[:1] + [x for v in bad.values() for x in v] + good[1:]
    d = decode_batch(encode_records([("flightrec", x) for x in recs]), len(recs), T + 10)
    assert dict(d.rejected) == {f"comm progress with {k}": len(v) for k, v in bad.items()}
    assert [(c.rank, c.pending_op, c.pending_since_mono_ns) for _, c in d.comm_progress] == \
        [(0, "all_reduce", T - 5), (1, "", 0), (0, "all_reduce", 0)]


def _store(tmp_path, recs, node="n1", seq=1, path=None):
    clock = ClockEstimate(offset_ns=5 * 10**12, drift_ppm=0.0, ref_mono_ns=0, uncertainty_ns=1, best_rtt_ns=1,
                          samples=5)
    path = path or str(tmp_path / "s.db")
    w = StoreWriter(path)
    w.start()
    done = []
    try:
        w.submit(BatchJob(node, "ab" * 8, seq, len(recs), encode_records([("flightrec", x) for x in recs]),
                          max(x.mono_ns for x in recs) + 1, clock, time.time_ns(), lambda *a: done.append(a)))
        deadline = time.monotonic() + 10
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        w.stop()
    assert done and done[0][0] == "stored", done
    return Reader(path), clock.offset_ns


def test_writer_and_reader(tmp_path):
    s = 10**9
    recs = [prog(T, 0, 3, 3), prog(T, 1, 3, 3),
            prog(T + s, 0, 4, 3, "all_reduce", 4, T + s // 2), prog(T + s, 1, 3, 3),
            prog(T + 2 * s, 0, 4, 3, "all_reduce", 4, T + s // 2),
            prog(T + 2 * s, 0, 7, 7, "send", 1, T + s, comm="pg:1", p2p=True, peer=1),
            prog(T + 3 * s, 0, 4, 3, "all_reduce", 4, T + s // 2, job_key="other")]
    reader, off = _store(tmp_path, recs)
    rows = reader.comm_progress(JOB)
    assert len(rows) == 6 and all(list(x) == KEYS for x in rows)
    assert [x["end_ns"] for x in rows] == sorted(x["end_ns"] for x in rows)  # oldest first
    pend = rows[2]
    assert pend == {"node_id": "n1", "pid": 100, "start_ticks": 7, "job_key": JOB, "rank": 0, "comm_id": "pg:0",
                    "end_ns": T + s + off, "last_enqueued": 4, "last_started": -1, "last_completed": 3,
                    "pending_op": "all_reduce", "pending_seq": 4, "pending_p2p": False, "pending_peer": -1,
                    "pending_since_ns": T + s // 2 + off, "nranks": 2}
    assert rows[0]["pending_since_ns"] == 0 and rows[0]["pending_op"] == ""  # none stays 0, not converted
    assert rows[-1]["pending_p2p"] is True and rows[-1]["pending_peer"] == 1
    assert [x["end_ns"] for x in reader.comm_progress(JOB, since_ns=T + s + off, until_ns=T + s + off)] == \
        [T + s + off] * 2
    assert {x["rank"] for x in reader.comm_progress(JOB, ranks=[1])} == {1}
    assert [x["end_ns"] for x in reader.comm_progress(JOB, limit=2)] == [T + 2 * s + off] * 2  # the newest
    assert reader.comm_progress("nope") == []

    latest = reader.comm_progress_latest(JOB)
    assert [(x["rank"], x["comm_id"], x["end_ns"], x["pending_seq"]) for x in latest] == \
        [(0, "pg:0", T + 2 * s + off, 4), (0, "pg:1", T + 2 * s + off, 1), (1, "pg:0", T + s + off, -1)]
    assert all(list(x) == KEYS for x in latest)
    early = reader.comm_progress_latest(JOB, until_ns=T + s + off - 1)
    assert [(x["rank"], x["end_ns"], x["pending_op"]) for x in early] == [(0, T + off, ""), (1, T + off, "")]
    assert reader.comm_progress_latest(JOB, until_ns=1) == []

    # a second node with the same pid is a process of its own; the job's data feeds the analysis loop
    reader, _ = _store(tmp_path, [prog(T + 5 * s, 1, 5, 5, pid=100)], node="n2", path=reader.path)
    assert [(x["node_id"], x["pid"], x["rank"]) for x in reader.comm_progress_latest(JOB)] == \
        [("n1", 100, 0), ("n1", 100, 0), ("n1", 101, 1), ("n2", 100, 1)]
    marks = reader.new_data_since(0)[1]
    assert marks[JOB] == T + 5 * s + off and reader.data_watermarks([JOB])[JOB] == T + 5 * s + off


def test_retention_drops_old_progress(tmp_path):
    reader, off = _store(tmp_path, [prog(T, 0, 3, 3), prog(T + 10**9, 0, 4, 4)])
    w = StoreWriter(reader.path)
    try:
        w.apply_retention(T + off + 1)
    finally:
        w.stop()
    assert [x["last_enqueued"] for x in reader.comm_progress(JOB)] == [4]


def _fixture(rank: int):
    with open(os.path.join(FIXTURES, f"fr_pending_gloo_rank{rank}.json"), "rb") as fh:
        return parse_dump(fh.read())


def test_recorded_gloo_dumps_give_the_waiting_and_the_blocked_rank():
    d0, d1 = _fixture(0), _fixture(1)
    assert d0.status == {"0": (4, -1, 3)} and d1.status == {"0": (3, -1, 3)}  # recorded as strings
    created = next(e["time_created_ns"] for e in d0.entries if e["collective_seq_id"] == 4)
    now_mono = 5 * 10**12
    # the host's clocks as they were when the dump was taken, 2 s after the op was issued
    clock = RealtimeClock(monotonic_ns=lambda: now_mono, realtime_ns=lambda: created + 2 * 10**9)
    (p0,), problems = progress_records(d0, clock, now_mono, 11, 7, 0, 2, "frtest")
    assert problems == []
    assert p0 == r.CommProgress(now_mono, 11, "pg:0", 7, "frtest", 0, 4, -1, 3, "all_reduce", 4, False, -1,
                                now_mono - 2 * 10**9, 2)
    (p1,), problems = progress_records(d1, clock, now_mono, 12, 8, 1, 2, "frtest")
    assert problems == []
    assert (p1.comm_id, p1.rank, p1.last_enqueued, p1.last_completed, p1.pending_op, p1.pending_seq,
            p1.pending_since_mono_ns, p1.nranks) == ("pg:0", 1, 3, 3, "", -1, 0, 2)
    # the culprit: the member that never entered the seq the other waits in
    assert p1.last_enqueued == p0.pending_seq - 1


def test_issue_time_of_another_boot_leaves_since_zero_and_is_counted():
    d0 = _fixture(0)
    clock = RealtimeClock(monotonic_ns=lambda: 10**9, realtime_ns=lambda: 10**9)  # the dump predates this boot
    (p0,), problems = progress_records(d0, clock, 10**9, 11, 7, 0, 2, "frtest")
    assert p0.pending_op == "all_reduce" and p0.pending_seq == 4 and p0.pending_since_mono_ns == 0
    assert [p[0] for p in problems] == ["future"]


def test_p2p_peer_and_malformed_status():
    doc = {"version": "2.10", "pg_config": {"1": {"ranks": "[2, 5]"}},
           "pg_status": {"1": {"last_enqueued_collective": "0", "last_started_collective": "-1",
                               "last_completed_collective": "0"},
                         "2": {"last_enqueued_collective": "x"}},
           "entries": [{"record_id": 8, "process_group": ["1", "pp"], "profiling_name": "nccl:recv 1<-0",
                        "is_p2p": True, "p2p_seq_id": 3, "collective_seq_id": 0, "retired": False,
                        "state": "started", "time_created_ns": 0},
                       {"record_id": 9, "process_group": ["1", "pp"], "profiling_name": "nccl:send 1->0",
                        "is_p2p": True, "p2p_seq_id": 4, "retired": False, "state": "scheduled"}]}
    d = parse_dump(doc)
    assert d.status == {"1": (0, -1, 0)} and d.status_malformed == 1
    (p,), problems = progress_records(d, RealtimeClock(), 10**12, 1, rank=5)
    assert problems == []
    assert (p.comm_id, p.pending_op, p.pending_seq, p.pending_p2p, p.pending_peer, p.pending_since_mono_ns,
            p.nranks) == ("pg:1", "recv", 3, True, 2, 0, 2)


def test_a_completion_torch_left_one_behind_is_read_from_the_entries():
    # rank 1's recorded dump as this machine produced it under CPU load: its entry 3 retired, pg_status still
    # saying last_completed 2 (torch's gloo worker thread for seq 2 stored after the one for seq 3)
    with open(os.path.join(FIXTURES, "fr_pending_gloo_rank1.json")) as fh:
        doc = json.load(fh)
    doc["pg_status"]["0"]["last_completed_collective"] = "2"
    d = parse_dump(doc)
    assert d.status == {"0": (3, -1, 2)}
    (p,), problems = progress_records(d, RealtimeClock(), 10**12, 12, 8, 1, 2, "frtest")
    assert problems == [] and (p.last_enqueued, p.last_completed, p.pending_seq) == (3, 3, -1)
    # never past what was enqueued, and a p2p entry's collective_seq_id does not count
    doc["pg_status"]["0"]["last_enqueued_collective"] = "2"
    (p,), _ = progress_records(parse_dump(doc), RealtimeClock(), 10**12, 12, 8, 1, 2, "frtest")
    assert (p.last_enqueued, p.last_completed) == (2, 2)
    doc["pg_status"]["0"]["last_enqueued_collective"] = "3"
    for e in doc["entries"]:
        e["is_p2p"] = e["collective_seq_id"] == 3
    (p,), _ = progress_records(parse_dump(doc), RealtimeClock(), 10**12, 12, 8, 1, 2, "frtest")
    assert p.last_completed == 2
