"""flightrec.OpConverter on recorded Flight Recorder dumps (an H100 NCCL job, a gloo job: tests/fixtures, with their
origin in the READMEs there): each op's fields against the entry itself, what one converter makes for a whole dump
against a converter per entry (what it works out once per group must not leak from one entry into another), and
the ranges it checks so that the detail store can take its ops unchecked (CommLog.add(checked=True))."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest

from conftest import REPO
from steplens.agent.commlog import CommLog, RealtimeClock, normalize_op
from steplens.agent.sources.flightrec import OpConverter, parse_dump
from steplens.agent.transport.codec import decode_records, record_problem, records_payload

FIX = os.path.join(REPO, "tests", "fixtures")
DUMPS = [os.path.join(FIX, "gpu-recorded", "fr-nccl.json"),
         os.path.join(FIX, "flightrec-gloo", "fr_pending_gloo_rank0.json"),
         os.path.join(FIX, "flightrec-gloo", "fr_pending_gloo_rank1.json")]
SIZES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4, "Byte": 1, "Char": 1, "Bool": 1}


def _clock() -> RealtimeClock:
    return RealtimeClock(monotonic_ns=lambda: 1_000, realtime_ns=lambda: 5_000)   # realtime - monotonic = 4,000


def _with_p2p(doc: dict) -> dict:
    """The dump plus a send made from its first entry the way NCCL names it (no recording here has one)."""
    doc = copy.deepcopy(doc)
    e = dict(doc["entries"][0], is_p2p=True, profiling_name="nccl:send 0->1", p2p_seq_id=3,
             record_id=max(x["record_id"] for x in doc["entries"]) + 1)
    doc["entries"].append(e)
    return doc


@pytest.mark.parametrize("path", DUMPS, ids=os.path.basename)
def test_each_op_is_its_entry(path):
    doc = _with_p2p(json.load(open(path)))
    dump = parse_dump(json.dumps(doc).encode())
    conv = OpConverter(dump, _clock(), 77, 9, 0, 1, "job")
    ops = [conv(e) for e in dump.entries]
    assert len({(o.op, o.bytes) for o in ops}) >= 2      # more than one kind of op: the cache is exercised
    for e, o in zip(dump.entries, ops):
        p2p = e["is_p2p"]
        assert o.comm_id == "pg:" + e["process_group"][0] and o.comm_desc == e["process_group"][1]
        assert o.op == normalize_op(e["profiling_name"])
        assert o.count == sum(math.prod(s) for s in e["input_sizes"])
        assert o.dtype == e["input_dtypes"][0] and o.bytes == o.count * SIZES[o.dtype]
        assert (o.seq, o.p2p_seq, o.seq_source) == ((-1, e["p2p_seq_id"], "") if p2p else
                                                    (e["collective_seq_id"], -1, "trace"))
        assert o.issue_mono_ns == e["time_created_ns"] - 4_000
        if "duration_ms" in e:
            assert (o.timing, o.start_mono_ns) == ("cuda_event", o.issue_mono_ns)
            assert o.end_mono_ns - o.start_mono_ns == int(e["duration_ms"] * 1e6) and o.mono_ns == o.end_mono_ns
        else:
            assert (o.timing, o.start_mono_ns, o.end_mono_ns, o.mono_ns) == ("cpu_enqueue", 0, 0, o.issue_mono_ns)
        assert (o.pid, o.start_ticks, o.rank, o.job_key) == (77, 9, 0, "job")
        assert record_problem(o) is None
    # what one converter makes for the dump is what a converter per entry makes
    assert ops == [OpConverter(dump, _clock(), 77, 9, 0, 1, "job")(e) for e in dump.entries]


def test_members_and_group_rank_from_pg_config_and_world():
    doc = json.load(open(DUMPS[0]))                    # pg_config "0": ranks "[0]"
    dump = parse_dump(json.dumps(doc).encode())
    o = OpConverter(dump, _clock(), 1, rank=0)(dump.entries[0])
    assert (o.members, o.group_rank, o.nranks) == ([0], 0, 1)
    doc = json.load(open(DUMPS[1]))                    # gloo lists no ranks: the default group is the world
    dump = parse_dump(json.dumps(doc).encode())
    o = OpConverter(dump, _clock(), 1, rank=1, world_size=2)(dump.entries[0])
    assert (o.members, o.group_rank, o.nranks) == ([0, 1], 1, 2)


def test_values_the_encoder_would_refuse_are_refused_by_the_converter(tmp_path):
    """An entry whose sizes or sequence number leave the encoder's ranges, and every entry of a group whose
    member list does (a crafted pg_config), raise ValueError (the source counts them as malformed entries); what
    the converter returns is taken unchecked by the detail store and still encodes on a fetch."""
    doc = json.load(open(DUMPS[0]))
    good = doc["entries"][:3]
    huge = dict(good[0], record_id=100, input_sizes=[[1 << 40, 1 << 40]])
    seq = dict(good[0], record_id=101, collective_seq_id=1 << 63)
    neg = dict(good[0], record_id=102, input_sizes=[[-4]])
    other = dict(good[0], record_id=103, process_group=["7", "crafted"])
    odd = dict(good[0], record_id=104, process_group={"name": "0"})
    doc["entries"] = good + [huge, seq, neg, other, odd]
    doc["pg_config"]["7"] = {"desc": "crafted", "name": "7", "ranks": f"[0, {1 << 40}]"}
    dump = parse_dump(json.dumps(doc).encode())
    conv = OpConverter(dump, _clock(), 5, rank=0)
    ops, refused = [], []
    for e in dump.entries:
        try:
            ops.append(conv(e))
        except (ValueError, TypeError) as exc:
            refused.append((e["record_id"], str(exc)))
    assert [r for r, _ in refused] == [100, 101, 102, 103, 104]
    assert "members" in refused[-2][1] and "not a list" in refused[-1][1]
    log = CommLog(str(tmp_path), "flightrec", monotonic_ns=lambda: 1 << 62)
    try:
        log.add(ops, checked=True)
        assert log.store.records_rejected == 0
        back = [r for _, r in decode_records(records_payload(log.store.records(["commop"])))]
        assert sorted(o.seq for o in back) == sorted(o.seq for o in ops) and len(back) == 3
    finally:
        log.close()
