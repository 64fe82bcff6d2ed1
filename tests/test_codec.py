"""Round trip: agent records -> agent/transport encoding -> collector/ingest decoding."""

import math
import time

from steplens.agent import records as r
from steplens.agent.transport.codec import decode_records, encode_records
from steplens.collector.ingest.decode import decode_batch, process_row

T = time.monotonic_ns()
SAMPLES = [
    ("host", r.Metric(T, "cpu_utilization_percent", "cpu0", 12.5)),
    ("gpu", r.GpuInfo(T + 1, 0, "GPU-1234", "NVIDIA H100", "00000000:1B:00.0", 80 * 2**30, "575.1", "12.9", 18, "S1")),
    ("procs", r.ProcessInfo(T + 2, 4242, 99812, 1, "/usr/bin/python3", ["python", "train.py", "--lr", "ü"], "torch",
                            "torchelastic:abc", 3, 1, 8, "10.0.0.1", 29500, {"RANK": "3"}, "c0ffee", 1000)),
    ("procs", r.ProcessExit(T + 3, 4242, 99812)),
    ("gpu", r.Event(T + 4, "xid", "gpu0", "XID 79: fallen off the bus", 79.0)),
    ("agent", r.Gap(T + 5, 100, 3, 7, 9, "spool full")),
    ("agent", r.ModeChange(T + 6, r.Mode.DEEP, "cmd1", T + 10**9, "command")),
]


COMM = [
    ("kineto", r.CommOp(T + 9, "backend_thread", 4242, "pg:1", "all_reduce", 99812, 4243, -1, "dp", 3, 1, 2, [1, 3],
                        -1, -1, 1024, "float32", 4096, 17, -1, 0, T + 7, T + 8, T + 9, "torchelastic:abc")),
    ("kineto", r.KernelRec(T + 12, 4242, "ampere_sgemm_128x64_nn", T + 11, T + 12, 99812, 4243, 0, 7, [120, 1, 1],
                           [256, 1, 1], 555, "cudaLaunchKernel", T + 10, T + 10 + 500, 0, 3)),
    ("kineto", r.CommSummary(T + 20, 4242, "pg:1", "all_reduce", T + 8, 4, 16384, 40_000, 12_000, 99812,
                             "torchelastic:abc", 3, 12, 17, 20, "backend_thread", 0, 0)),
    ("flightrec", r.CommProgress(T + 21, 4242, "pg:1", 99812, "torchelastic:abc", 3, 18, -1, 17, "send", 5, True, 2,
                                 T + 19, 4)),
]


def test_agent_side_round_trip():
    assert decode_records(encode_records(SAMPLES)) == SAMPLES
    assert decode_records(encode_records(COMM)) == COMM


def test_collector_decodes_what_the_agent_encodes():
    d = decode_batch(encode_records(SAMPLES), len(SAMPLES), T + 10**9)
    assert not d.rejected
    assert d.metrics == [(T, "cpu_utilization_percent", "cpu0", 12.5)]
    (mono, g), = d.gpus
    assert (mono, g.uuid, g.memory_total_bytes, g.nvlink_count) == (T + 1, "GPU-1234", 80 * 2**30, 18)
    (mono, p), = d.processes
    row = process_row(p)
    assert row["rank"] == 3 and row["job_key"] == "torchelastic:abc" and "ü" in row["cmdline"]
    assert d.exits == [(T + 3, 4242, 99812)]
    assert d.events == [(T + 4, "gpu", "xid", "gpu0", "XID 79: fallen off the bus", 79.0)]
    (mono, src, gap), = d.gaps
    assert (gap.dropped_records, gap.dropped_batches, gap.reason) == (100, 3, "spool full")
    (mono, mode), = d.modes
    assert mode.mode == 2 and mode.until_mono_ns == T + 10**9


def test_non_record_is_refused_by_the_encoder():
    import pytest
    with pytest.raises(TypeError, match="not a steplens record"):
        encode_records([("x", object())])


def test_nan_is_carried_so_the_collector_can_count_it():
    d = decode_batch(encode_records([("h", r.Metric(T, "m", "e", math.nan))]), 1, T + 1)
    assert d.metrics == [] and sum(d.rejected.values()) == 1


def test_records_split_and_rejoin_without_decoding():
    """The detail store keeps one serialized Record per op (encode_each: one pass, split at the framing); a fetch
    joins them back (records_payload). A record the encoder refuses is that entry's exception, the rest stay."""
    import pytest

    from steplens.agent.transport.codec import encode_each, encode_record, records_payload, split_payload
    ops = [rec for _, rec in COMM[:2]] * 70
    big = r.CommOp(T, "cpu_enqueue", 1, "pg:0", "x" * 300, members=list(range(200)))   # a 2-byte varint length
    blobs = encode_each("kineto", ops + [big])
    assert all(isinstance(b, bytes) for b in blobs) and blobs[-1] == encode_record("kineto", big)
    assert decode_records(records_payload(blobs)) == [("kineto", x) for x in ops + [big]]
    assert split_payload(records_payload(blobs)) == blobs and split_payload(b"") == []
    bad = r.CommOp(T, "cpu_enqueue", 1, "pg:0", "all_reduce", bytes=-5)   # uint64 field
    mixed = encode_each("kineto", [ops[0], bad, ops[1]])
    assert mixed[0] == blobs[0] and isinstance(mixed[1], ValueError) and mixed[2] == blobs[1]
    with pytest.raises(ValueError, match="not a RecordList"):
        split_payload(b"\x12\x00")


def test_record_problem_says_exactly_what_the_encoder_refuses():
    """codec.record_problem (what the detail store checks instead of encoding) agrees with encode_record on
    every field of a CommOp and a KernelRec set to values in, at and past each protobuf type's range, or of
    another type."""
    import dataclasses
    import random

    from steplens.agent.transport.codec import encode_record, record_problem
    rng = random.Random(5)
    values = [0, 1, -1, (1 << 31) - 1, 1 << 31, -(1 << 31), -(1 << 31) - 1, (1 << 32) - 1, 1 << 32, (1 << 63) - 1,
              1 << 63, -(1 << 63), -(1 << 63) - 1, (1 << 64) - 1, 1 << 64, 1.5, "x", None, True, [1], [-1], [1 << 32]]
    bases = [r.CommOp(5, "backend_thread", 7, "pg:0", "all_reduce", members=[0, 1]),
             r.KernelRec(5, 7, "gemm", 1, 5, grid=[1, 2, 3])]
    checked = refused = 0
    for base in bases:
        for name in base.__slots__:
            for v in values + [rng.randrange(-(1 << 65), 1 << 65) for _ in range(5)]:
                rec = dataclasses.replace(base, **{name: v})
                try:
                    encode_record("s", rec)
                    ok = True
                except (ValueError, TypeError, OverflowError):
                    ok = False
                problem = record_problem(rec)
                assert (problem is None) == ok, (type(rec).__name__, name, v, problem)
                assert problem is None or problem.startswith(name + ":")
                checked, refused = checked + 1, refused + (not ok)
    assert checked > 1000 and refused > checked // 2
