"""GPU-side parsers on artifacts recorded by steplens itself on a real H100 (tests/fixtures/gpu-recorded/README.md:
torch 2.11.0+cu130, NCCL 2.28.9, driver 580.159.04; recorded by record.py there). The job logged what it
issued (job.json), so the figures are checked against the job's own account, and against counts made here
with plain json/regex, not with the parsers' code. Times are the files' own clocks (identity).
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections import Counter

from steplens.agent import nccltopo, parse
from steplens.agent.kineto import trace

REC = os.path.join(os.path.dirname(__file__), "fixtures", "gpu-recorded")
KINETO = os.path.join(REC, "kineto-nccl.json.gz")
FR_JSON = os.path.join(REC, "fr-nccl.json")
FR_PKL = os.path.join(REC, "fr-nccl.pkl")
NCCL_LOG = os.path.join(REC, "nccl-h100-1rank.log")
SMI = os.path.join(REC, "nvidia-smi-q.txt")


def job() -> dict:
    with open(os.path.join(REC, "job.json")) as fh:
        return json.load(fh)


def issued(steps=None) -> Counter:
    return Counter(i["op"] for i in job()["issued"] if steps is None or i["step"] in steps)


def issued_bytes(op: str) -> set:
    return {i["bytes"] for i in job()["issued"] if i["op"] == op}


def test_kineto_h100_trace_ops_match_what_the_job_issued():
    res = parse.parse_file(KINETO)
    assert res.kind == "kineto"
    profiled = set(job()["profiled_steps"])
    assert Counter(o.op for o in res.ops) == issued(profiled)            # 6 all_reduce, 3 of each other kind
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        assert {o.bytes for o in res.ops if o.op == op} == issued_bytes(op), op
    assert res.notes["waits"] == 3                                       # the async all_reduce's work.wait()
    # torch 2.11 writes no "Seq": collectives numbered in issue order on the one group
    assert [o.seq for o in res.ops] == list(range(len(res.ops)))
    assert {o.seq_source for o in res.ops} == {"order"} and {o.comm_id for o in res.ops} == {"pg:0"}
    # one rank, so NCCL launches no kernel for a collective: every op is timed on the CPU
    assert {o.timing for o in res.ops} == {"cpu_enqueue"}
    # the op order inside each profiled step is the job's
    per_step = [o.op for o in res.ops][:7]
    assert per_step == [i["op"] for i in job()["issued"] if i["step"] == 2]


def test_kineto_h100_trace_kernels_names_launches_and_steps():
    with gzip.open(KINETO) as fh:
        doc = json.load(fh)
    evs = doc["traceEvents"]
    kernels = [e for e in evs if e.get("cat") == "kernel"]
    launches = {e["args"]["correlation"]: e for e in evs if e.get("cat") == "cuda_runtime"}
    parsed = trace.parse(doc, lambda t: t, pid=583)
    assert len(parsed.kernels) == len(kernels) == 63
    assert Counter(k.name for k in parsed.kernels) == Counter(e["name"] for e in kernels)
    assert len({k.name for k in parsed.kernels}) > 5                    # not one name for all
    by_corr = {k.correlation_id: k for k in parsed.kernels}
    base = doc["baseTimeNanoseconds"]
    for e in kernels:
        k, a = by_corr[e["args"]["correlation"]], e["args"]
        assert (k.device, k.stream, k.grid, k.block) == (a["device"], a["stream"], a["grid"], a["block"])
        launch = launches[a["correlation"]]
        assert k.launch_api == launch["name"]
        # issue latency (kernel start - launch start), computed here from the µs timestamps
        expect = round((e["ts"] - launch["ts"]) * 1000)
        assert abs((k.start_mono_ns - k.launch_start_mono_ns) - expect) <= 1
        assert k.start_mono_ns - base == round(e["ts"] * 1000) or abs(k.start_mono_ns - base - e["ts"] * 1000) <= 1
    lat = sorted(k.start_mono_ns - k.launch_start_mono_ns for k in parsed.kernels)
    assert 1_000 < lat[len(lat) // 2] < 100_000                          # H100, idle stream: microseconds
    # ProfilerStep#2..4 once each: the CPU span, not its mirror on the GPU timeline
    assert [s for s, _, _ in parsed.steps] == job()["profiled_steps"]


def test_flight_recorder_nccl_dump_json_and_pickle():
    res = parse.parse_file(FR_JSON)
    assert res.kind == "flightrec" and res.notes.get("version") == "2.10"
    assert Counter(o.op for o in res.ops) == issued()                    # all 6 steps, barrier included
    assert [o.seq for o in res.ops] == list(range(1, 43)) and {o.seq_source for o in res.ops} == {"trace"}
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        assert {o.bytes for o in res.ops if o.op == op} == issued_bytes(op), op
    with open(FR_JSON) as fh:
        entries = json.load(fh)["entries"]
    timed = [(o, e) for o, e in zip(res.ops, entries) if e.get("duration_ms") is not None]
    # ProcessGroupNCCL timed the ops of the first step (CUDA events); under the profiler it timed none
    assert len(timed) == 7 and all(o.timing == "cuda_event" for o, _ in timed)
    for o, e in timed:
        assert o.issue_mono_ns == e["time_created_ns"] == o.start_mono_ns
        assert o.end_mono_ns - o.start_mono_ns == int(e["duration_ms"] * 1e6)
        # the watchdog's discovery times bound the op from above: placing it there would be ~95 ms late
        assert o.end_mono_ns <= e["time_discovered_completed_ns"]
        assert e["time_discovered_started_ns"] - e["time_created_ns"] > 50e6
    assert all(o.timing == "cpu_enqueue" for o in res.ops[7:])
    # the pickle torch writes on a timeout carries the same entries
    pk = parse.parse_file(FR_PKL)
    assert pk.kind == "flightrec"
    assert [(o.op, o.seq, o.bytes, o.issue_mono_ns) for o in pk.ops] == \
           [(o.op, o.seq, o.bytes, o.issue_mono_ns) for o in res.ops]


def test_nccl_2_28_log_collective_lines_and_communicator():
    res = parse.parse_file(NCCL_LOG)
    assert res.kind == "nccl-log"
    with open(NCCL_LOG) as fh:
        lines = fh.read().splitlines()
    coll = [m for m in (re.search(r"NCCL INFO (\w+): opCount (\w+) .* count (\d+) datatype (\d+) .*"
                                  r"\[nranks=(\d+)\]", ln) for ln in lines) if m]
    assert len(res.ops) == len(coll) == 36
    names = {"AllReduce": "all_reduce", "AllGather": "all_gather", "Broadcast": "broadcast", "AlltoAll": "all_to_all"}
    assert Counter(o.op for o in res.ops) == Counter(names[m.group(1)] for m in coll)
    size = {"7": 4, "9": 2, "4": 8}                                      # float32, bfloat16, int64 (nccl.h)
    assert [o.bytes for o in res.ops] == [int(m.group(3)) * size[m.group(4)] for m in coll]
    # What NCCL 2.28 does on a 1-rank communicator, as logged: opCount stays 0, and ReduceScatter is not
    # logged at all (the job issued 6): the log's seq cannot order ops here, and its op count is short
    assert {o.seq for o in res.ops} == {0}
    assert "reduce_scatter" not in {o.op for o in res.ops} and issued()["reduce_scatter"] == 6
    # barrier(): a 1-element all-reduce in NCCL's log
    assert sum(1 for o in res.ops if o.op == "all_reduce" and o.bytes == 4) == issued()["barrier"]
    assert {o.comm_id for o in res.ops} == {"73209f01231a30c4"}


def test_nccl_bus_id_matches_nvidia_smi_on_the_same_host():
    comm = nccltopo.parse_log_files([NCCL_LOG])["73209f01231a30c4"]
    assert comm.complete and comm.nranks == 1
    place = comm.ranks[0]
    assert (place.host, place.pid, place.cuda_dev, place.bus_id) == ("vm", 583, 0, "60")
    smi_bus = re.search(r"Bus Id\s+:\s+(\S+)", open(SMI).read()).group(1)
    assert nccltopo.norm_bus_id(place.bus_id) == smi_bus == "00000000:00:06.0"
