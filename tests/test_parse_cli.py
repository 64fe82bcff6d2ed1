"""`steplens-agent parse FILE`: one recorded file in, what steplens extracts out (real fixtures, see
tests/fixtures/gpu-real/README.md)."""

from __future__ import annotations

import gzip
import json
import os
import pickle
from collections import OrderedDict

from steplens.agent import cli

HERE = os.path.dirname(__file__)
REAL = os.path.join(HERE, "fixtures", "gpu-real")
FR_DUMP = os.path.join(REAL, "flightrec", "pytorch-tutorial-nccl-2rank-rank0.json")


def run(capsys, *argv):
    rc = cli.main(["parse", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_kineto_json_object(capsys):
    rc, out, _ = run(capsys, os.path.join(REAL, "hta-128rank-sampled-rank0.json.gz"), "--json")
    assert rc == 0
    doc = json.loads(out)
    assert set(doc) >= {"kind", "ops", "kernels", "steps", "skipped"} and doc["kind"] == "kineto"
    assert (len(doc["ops"]), len(doc["kernels"]), len(doc["steps"]), doc["skipped"]) == (10, 1154, 2, 0)
    op = doc["ops"][0]
    for k in ("op", "comm_id", "seq", "bytes", "start_ns", "end_ns", "issue_ns", "timing", "seq_source"):
        assert k in op
    k = doc["kernels"][0]
    for f in ("name", "device", "stream", "start_ns", "end_ns", "launch_start_ns", "grid", "block"):
        assert f in k
    # the file's own clock (CLOCK_REALTIME µs x 1000), no conversion
    raw = json.load(gzip.open(os.path.join(REAL, "hta-128rank-sampled-rank0.json.gz")))
    first = min(e["ts"] for e in raw["traceEvents"] if e.get("cat") == "kernel")
    assert min(k["start_ns"] for k in doc["kernels"]) == first * 1000


def test_human_summary(capsys):
    rc, out, _ = run(capsys, os.path.join(REAL, "hta-16rank-rank0.json.gz"))
    assert rc == 0
    assert "all_to_all 55" in out and "reduce_scatter 10 (587,202,560 B)" in out
    assert "kernels: 6080" in out and "seq from: order 85" in out and "skipped: 0" in out


def test_flight_recorder_json_and_pickle(capsys, tmp_path):
    rc, out, _ = run(capsys, FR_DUMP, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["kind"] == "flightrec" and doc["version"] == "2.5"
    (op,) = doc["ops"]
    assert (op["op"], op["seq"], op["bytes"], op["comm_id"], op["issue_ns"]) == ("all_reduce", 1, 48, "pg:0",
                                                                                1724779239936775119)
    # torch writes the dump as a pickle on timeout (process_group a tuple)
    with open(FR_DUMP) as fh:
        d = json.load(fh)
    d["entries"][0]["process_group"] = tuple(d["entries"][0]["process_group"])
    p = tmp_path / "nccl_trace_rank_0"
    p.write_bytes(pickle.dumps(d))
    rc, out, _ = run(capsys, str(p), "--json")
    assert rc == 0 and json.loads(out)["ops"][0]["seq"] == 1


def test_pickle_with_a_class_is_refused(capsys, tmp_path):
    p = tmp_path / "evil"
    p.write_bytes(pickle.dumps({"entries": [], "version": "2.5", "x": OrderedDict()}))   # names a class
    rc, _, err = run(capsys, str(p), "--kind", "flightrec")
    assert rc == 1 and "not a Flight Recorder dump" in err


def test_nccl_log(capsys):
    rc, out, _ = run(capsys, os.path.join(REAL, "nccl-logs", "nvidia-nccl-1814-64rank-init.log"), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["kind"] == "nccl-log" and doc["ops"] == []
    (comm,) = doc["communicators"]
    assert (comm["comm_id"], comm["nranks"], [r["rank"] for r in comm["ranks"]]) == ("5ae77eb5ea4ec1ee", 64,
                                                                                     [32, 34, 35, 36])
    rc, out, _ = run(capsys, os.path.join(REAL, "nccl-logs", "pytorch-torchtitan-1369-2rank-coll.log"))
    assert rc == 0 and "all_gather 3 (25,165,824 B)" in out


def test_unreadable_files_exit_1_with_the_reason(capsys, tmp_path):
    rc, _, err = run(capsys, str(tmp_path / "missing.json"))
    assert rc == 1 and "No such file" in err
    bad = tmp_path / "cut.json.gz"
    bad.write_bytes(gzip.compress(b'{"traceEvents": [{"ph": "X"')[:-3])
    rc, _, err = run(capsys, str(bad))
    assert rc == 1 and err.startswith("steplens-agent: ")
    junk = tmp_path / "junk.txt"
    junk.write_text("hello\n")
    rc, _, err = run(capsys, str(junk))
    assert rc == 1 and "give --kind" in err
    rc, _, err = run(capsys, FR_DUMP, "--kind", "kineto")
    assert rc == 1 and "no traceEvents" in err
