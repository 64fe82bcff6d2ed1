"""GPU-side parsers on real recorded GPU artifacts (tests/fixtures/gpu-real/README.md says where each came
from; ../shared/fixtures/gpu-traces/ holds the two HTA traces the issue was found on).

Figures are checked two ways: against numbers read off the files by hand (stated here), and against counts
made in this file with plain json, without the parser's code. Times are the file's own clock (identity).
"""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter

import pytest

from steplens.agent import nccltopo, parse
from steplens.agent.kineto import trace
from steplens.agent.sources import flightrec

HERE = os.path.dirname(__file__)
REAL = os.path.join(HERE, "fixtures", "gpu-real")
SHARED = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "fixtures", "gpu-traces"))
TRACE_2RANK = os.path.join(SHARED, "nccl-2rank-rank0.json.gz")        # NCCL 2.17.1, torch 2.x (2024)
TRACE_1RANK = os.path.join(SHARED, "nccl-1rank-ns.json.gz")
TRACE_16RANK = os.path.join(REAL, "hta-16rank-rank0.json.gz")            # 16 ranks, May 2023 build
TRACE_128RANK = os.path.join(REAL, "hta-128rank-sampled-rank0.json.gz")  # 128 ranks, Apr 2023 build
TRACE_2021 = os.path.join(REAL, "kineto-tbplugin-resnet50-2021.json.gz")  # torch 1.9 era, one GPU
FR_DUMP = os.path.join(REAL, "flightrec", "pytorch-tutorial-nccl-2rank-rank0.json")
LOGS = os.path.join(REAL, "nccl-logs")

need_shared = pytest.mark.skipif(not os.path.exists(TRACE_2RANK), reason="../shared/fixtures/gpu-traces not present")


def raw(path: str) -> dict:
    with gzip.open(path) as fh:
        return json.load(fh)


def parsed(path: str) -> trace.ParsedTrace:
    return trace.parse(raw(path), lambda ns: ns, pid=1)


def x_events(doc: dict) -> list[dict]:
    return [e for e in doc["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]


# ---- independent counts (plain json) ----

def kernel_events(doc):
    return [e for e in x_events(doc) if str(e.get("cat", "")).lower() == "kernel"]


def cpu_comm_spans(doc):
    """nccl:<op> annotations on the CPU timeline, by name."""
    return Counter(e["name"] for e in x_events(doc) if e["name"].startswith("nccl:") and e.get("cat") != "gpu_user_annotation")


def issue_latency_ns(doc, correlation: int) -> int:
    evs = x_events(doc)
    k = next(e for e in evs if str(e.get("cat", "")).lower() == "kernel" and e["args"].get("correlation") == correlation)
    launch = next(e for e in evs if str(e.get("cat", "")).lower() in ("cuda_runtime", "cuda_driver", "runtime")
                  and e["args"].get("correlation") == correlation)
    # the 2021 trace has integer µs near 1.6e15: x1000 in float would round to 256 ns
    return int(round(k["ts"] * 1000)) - int(round(launch["ts"] * 1000)) if isinstance(k["ts"], float) \
        else (k["ts"] - launch["ts"]) * 1000


NORMAL = {"nccl:all_reduce": "all_reduce", "nccl:broadcast": "broadcast", "nccl:all_to_all": "all_to_all",
          "nccl:_all_gather_base": "all_gather", "nccl:_reduce_scatter_base": "reduce_scatter"}


# ---- Kineto: kernels ----

@need_shared
def test_kernels_keep_their_own_names_grid_block_stream_and_issue_latency_2rank():
    doc = raw(TRACE_2RANK)
    p = trace.parse(doc, lambda ns: ns, pid=2910249)
    assert len(p.kernels) == len(kernel_events(doc)) == 2700
    assert Counter(k.name for k in p.kernels) == Counter(e["name"] for e in kernel_events(doc))
    assert not any(k.name.startswith("PyTorch Profiler") for k in p.kernels)
    nccl = [k for k in p.kernels if k.name.startswith("ncclKernel_")]
    assert len(nccl) == 21
    bc = next(k for k in p.kernels if k.correlation_id == 19832)
    assert bc.name.startswith("ncclKernel_Broadcast_RING_LL_Sum_int8_t")
    assert (bc.grid, bc.block, bc.stream, bc.device, bc.launch_api) == ([8, 1, 1], [512, 1, 1], 40, 0,
                                                                        "cudaLaunchKernelExC")
    assert bc.start_mono_ns - bc.launch_start_mono_ns == issue_latency_ns(doc, 19832) == 18561
    ar = next(k for k in p.kernels if k.correlation_id == 60047)
    assert (ar.grid, ar.block) == ([8, 1, 1], [544, 1, 1]) and "AllReduce_RING_LL_Sum_float" in ar.name


def test_torch_1_9_trace_with_capitalised_categories():
    # torch 1.9 wrote cat "Kernel" / "Runtime" / "Operator": every kernel must still be found and linked
    doc = raw(TRACE_2021)
    p = parsed(TRACE_2021)
    assert len(p.kernels) == len(kernel_events(doc)) == 8772
    assert Counter(k.name for k in p.kernels) == Counter(e["name"] for e in kernel_events(doc))
    assert all(k.launch_api for k in p.kernels)      # every kernel's cudaLaunchKernel is in the window
    k = next(k for k in p.kernels if k.correlation_id == 34441)
    assert (k.name, k.grid, k.block, k.stream) == (
        "cask_cudnn::computeOffsetsKernel(cask_cudnn::ComputeOffsetsParams)", [50, 1, 1], [256, 1, 1], 7)
    assert k.start_mono_ns - k.launch_start_mono_ns == issue_latency_ns(doc, 34441) == 27000
    assert [s for s, _, _ in p.steps] == [5, 6, 7, 8, 9, 10] and p.ops == []


# ---- Kineto: NCCL ops ----

@need_shared
def test_nccl_ops_2rank_wait_is_not_an_op_and_seq_comes_from_order():
    doc = raw(TRACE_2RANK)
    p = trace.parse(doc, lambda ns: ns, pid=2910249)
    rpc = [e for e in x_events(doc) if e["name"] == "record_param_comms"]
    names = Counter(e["args"]["Collective name"] for e in rpc)
    assert names == {"allreduce": 15, "broadcast": 6, "wait": 6}
    assert Counter(o.op for o in p.ops) == {"all_reduce": 15, "broadcast": 6} and p.waits == 6
    assert all(o.timing == "gpu_kernel" and o.comm_id == "pg:0" and o.members == [0, 1] for o in p.ops)
    # bytes = In msg nelems x dtype size (Float 4, Long 8: the DDP buffer broadcasts), summed independently
    want = Counter()
    for e in rpc:
        if e["args"]["Collective name"] != "wait":
            want[e["args"]["Collective name"]] += e["args"]["In msg nelems"] * {"Float": 4, "Long": 8}[e["args"]["dtype"]]
    assert sum(o.bytes for o in p.ops if o.op == "all_reduce") == want["allreduce"] == 306684384
    assert sum(o.bytes for o in p.ops if o.op == "broadcast") == want["broadcast"] == 638712
    # no Seq in this build: numbered by issue order per group, and said so
    assert sorted(o.seq for o in p.ops) == list(range(21)) and {o.seq_source for o in p.ops} == {"order"}
    by_seq = sorted(p.ops, key=lambda o: o.seq)
    assert [o.issue_mono_ns for o in by_seq] == sorted(o.issue_mono_ns for o in by_seq)
    first = by_seq[0]
    assert (first.op, first.bytes, first.stream, first.start_mono_ns - first.issue_mono_ns) == ("broadcast", 212480, 40, 18561)


@need_shared
def test_nccl_ops_1rank_without_kernels_are_cpu_enqueue():
    doc = raw(TRACE_1RANK)
    p = parsed(TRACE_1RANK)
    assert Counter(o.op for o in p.ops) == Counter(NORMAL[n] for n, c in cpu_comm_spans(doc).items() for _ in range(c)) \
        == {"all_reduce": 25, "broadcast": 10}
    assert p.waits == 10 and {o.timing for o in p.ops} == {"cpu_enqueue"} and {o.comm_id for o in p.ops} == {"pg:0"}
    assert all(o.bytes > 0 for o in p.ops)


@pytest.mark.parametrize("path,expect", [
    (TRACE_16RANK, {"all_to_all": 55, "reduce_scatter": 10, "all_reduce": 10, "all_gather": 10}),
    (TRACE_128RANK, {"all_to_all": 4, "all_reduce": 4, "all_gather": 2}),
])
def test_older_builds_name_ops_by_their_nccl_annotation(path, expect):
    # record_param_comms has only Input Dims/Input type, the kernels no collective args: the op is the
    # enclosing nccl:<op> span, its tensor that span's Input Dims x Input type
    doc = raw(path)
    p = parsed(path)
    spans = cpu_comm_spans(doc)
    assert Counter(o.op for o in p.ops) == Counter({NORMAL[n]: c for n, c in spans.items()}) == expect
    assert not any(o.op == "unknown" for o in p.ops)
    want_bytes = Counter()
    size = {"float": 4, "int": 4, "long": 8, "long int": 8, "signed char": 1, "unsigned char": 1}
    for e in x_events(doc):
        if e["name"] in NORMAL and e.get("cat") != "gpu_user_annotation":
            (dims,), (ty,) = e["args"]["Input Dims"], e["args"]["Input type"]
            n = 1
            for d in dims:
                n *= d
            want_bytes[NORMAL[e["name"]]] += n * size[ty]
    assert {op: sum(o.bytes for o in p.ops if o.op == op) for op in expect} == dict(want_bytes)
    assert {o.seq_source for o in p.ops} == {"order"}
    assert sorted(o.seq for o in p.ops) == list(range(len(p.ops)))


def test_128rank_figures():
    doc = raw(TRACE_128RANK)
    p = parsed(TRACE_128RANK)
    ops = sorted(p.ops, key=lambda o: o.seq)
    assert [o.op for o in ops] == ["all_to_all", "all_to_all", "all_reduce", "all_reduce", "all_gather",
                                   "all_to_all", "all_to_all", "all_reduce", "all_reduce", "all_gather"]
    ar = ops[2]
    assert (ar.bytes, ar.dtype, ar.count, ar.timing, ar.stream) == (78473228, "float32", 19618307, "gpu_kernel", 84)
    ag = ops[4]   # an FSDP-style _all_gather_base with no record_param_comms around it, on its own stream
    assert (ag.bytes, ag.dtype, ag.stream) == (16777216, "int8", 203)
    k = next(k for k in p.kernels if k.correlation_id == 6937369)
    assert (k.name.split("(")[0], k.grid, k.block, k.stream, k.start_mono_ns - k.launch_start_mono_ns) == \
        ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t", [16, 1, 1], [640, 1, 1], 84, issue_latency_ns(doc, 6937369))
    assert issue_latency_ns(doc, 6937369) == 13000


def test_16rank_zero_sized_all_to_all_launch_nothing_and_waits_are_left_out():
    doc = raw(TRACE_16RANK)
    p = parsed(TRACE_16RANK)
    rpc = [e for e in x_events(doc) if e["name"] == "record_param_comms"]
    assert len(rpc) == 150 and p.waits == 75      # 75 work.wait() records name nothing and enclose no nccl:<op>
    cpu = [o for o in p.ops if o.timing == "cpu_enqueue"]
    assert len(cpu) == 10 and {(o.op, o.bytes) for o in cpu} == {("all_to_all", 0)}
    assert sum(o.bytes for o in p.ops if o.op == "reduce_scatter") == 587202560


def test_handbuilt_trace_keeps_trace_seq():
    doc = trace.load(os.path.join(HERE, "fixtures", "kineto", "gpu_nccl_handbuilt.json"), 1 << 24)
    p = trace.parse(doc, lambda ns: ns, pid=4242, rank=0)
    assert [(o.op, o.seq, o.seq_source) for o in p.ops] == [("all_reduce", 42, "trace"), ("send", 5, "trace")]
    assert [k.name[:12] for k in p.kernels] == ["ncclDevKerne", "sm90_xmma_ge"]


# ---- Flight Recorder ----

def test_flight_recorder_entry_from_a_real_nccl_run():
    with open(FR_DUMP) as fh:
        doc = json.load(fh)
    dump = flightrec.parse_dump(doc, accepted_versions=("2.5",))
    assert dump.members == {"0": [0, 1]}
    op = flightrec.entry_to_op(dump.entries[0], dump, parse._Identity, pid=7, rank=0)
    assert (op.op, op.comm_id, op.comm_desc, op.seq, op.seq_source, op.count, op.dtype, op.bytes) == \
        ("all_reduce", "pg:0", "default_pg", 1, "trace", 12, "Float", 48)
    assert (op.members, op.nranks, op.group_rank, op.timing, op.issue_mono_ns) == \
        ([0, 1], 2, 0, "cpu_enqueue", 1724779239936775119)
    with pytest.raises(flightrec.FlightrecError):    # the agent source still refuses unverified layouts
        flightrec.parse_dump(doc)


# ---- NCCL logs ----

def log_lines(name):
    with open(os.path.join(LOGS, name)) as fh:
        return fh.read().splitlines()


def test_nccl_init_lines_64rank_with_commid():
    comms = nccltopo.parse_log(log_lines("nvidia-nccl-1814-64rank-init.log"))
    assert list(comms) == ["5ae77eb5ea4ec1ee"]
    c = comms["5ae77eb5ea4ec1ee"]
    assert (c.nranks, c.complete, sorted(c.ranks)) == (64, True, [32, 34, 35, 36])
    r = c.ranks[36]
    assert (r.host, r.pid, r.cuda_dev, r.nvml_dev, r.bus_id, r.comm_ptr) == \
        ("hostname-test", 984, 4, 4, "9b000", "0x557fe785f7a0")
    assert nccltopo.norm_bus_id(r.bus_id) == "00000000:9B:00.0"


def test_nccl_init_lines_without_commid_and_init_start():
    comms = nccltopo.parse_log(log_lines("nvidia-nccl-629-16rank-init.log"))
    # no commId before NCCL 2.1x: one key per process and comm pointer (ranks cannot be grouped)
    assert len(comms) == 8 and {c.nranks for c in comms.values()} == {16}
    assert "ptr:A03-R28-I49-3-9000018:193027:0x7fdf08000d00" in comms
    comms = nccltopo.parse_log(log_lines("nvidia-nccl-tests-252-8rank-initstart.log"))
    c = comms["996ee6f117cb8e1e"]
    assert (c.nranks, c.complete, sorted(c.ranks)) == (8, False, [0, 1, 4, 5, 6, 7])


def test_nccl_collective_lines_2rank():
    res = parse.parse_nccl_log(log_lines("pytorch-torchtitan-1369-2rank-coll.log"))
    assert res.skipped == 0 and len(res.ops) == 7
    by_proc = {}
    for o in res.ops:
        by_proc.setdefault(o.pid, []).append((o.op, o.seq))
    assert by_proc == {191370: [("all_gather", 13), ("reduce_scatter", 14), ("all_gather", 15)],
                       191369: [("reduce_scatter", 14), ("all_gather", 15), ("all_reduce", 16), ("all_reduce", 17)]}
    ag = res.ops[0]
    assert (ag.bytes, ag.dtype, ag.count, ag.nranks, ag.device, ag.comm_id) == \
        (2097152 * 4, "float32", 2097152, 2, 1, "ptr:hopper01:191370:0x55fca23fc0f0")
    rs = res.ops[1]
    assert (rs.bytes, rs.count) == (2097152 * 2 * 4, 2097152 * 2)   # input of a reduce-scatter: recvcount x nranks


def test_nccl_collective_lines_show_a_desync_and_ray_prefixes():
    res = parse.parse_nccl_log(log_lines("rocm-rccl-429-4rank-mismatch.log"))
    at = {}
    for o in res.ops:
        at.setdefault(o.seq, set()).add(o.op)
    assert at == {0x28c: {"all_reduce", "all_gather"}, 0x28d: {"all_reduce", "all_gather"}}   # ranks disagree
    ag = next(o for o in res.ops if o.op == "all_gather")
    assert (ag.dtype, ag.bytes) == ("int8", 59205120)
    res = parse.parse_nccl_log(log_lines("nvidia-nccl-1193-128rank-ray.log"))
    assert [(o.pid, o.seq, o.nranks, o.bytes) for o in res.ops] == [
        (615, 0x139d, 128, 7382228 * 4), (22754, 0x139d, 128, 7382228 * 4),
        (619, 0x139e, 128, 7066572 * 4), (22754, 0x139e, 128, 7066572 * 4)]


def test_torn_nccl_lines_are_counted_not_parsed():
    good = log_lines("pytorch-torchtitan-1369-2rank-coll.log")
    torn = good[0][:120] + good[1]           # two writers interleaved on one line
    res = parse.parse_nccl_log([torn] + good[2:])
    assert res.skipped == 1 and len(res.ops) == 5


@need_shared
def test_absolute_microsecond_times_keep_their_nanoseconds():
    """nccl-1rank-ns writes absolute µs with ns decimals (~1.7e15 µs, where a float steps by 0.25 µs): times and
    durations must come out exact to the ns (found against HolisticTraceAnalysis, bench/compare_hta.py)."""
    import re
    with gzip.open(TRACE_1RANK, "rt") as fh:
        text = fh.read()
    # the file's own digits, read as text: {correlation: (ts ns, dur ns)} of every kernel
    exact = {}
    for ev in re.finditer(r'\{[^{}]*"cat": "kernel"[^{}]*"ts": ([\d.]+), "dur": ([\d.]+),[^{}]*"args": \{[^{}]*?'
                          r'"correlation": (\d+)', text):
        ts, dur, corr = ev.groups()
        w, _, f = ts.partition(".")
        dw, _, df = dur.partition(".")
        exact[int(corr)] = (int(w) * 1000 + int((f + "000")[:3]), int(dw) * 1000 + int((df + "000")[:3]))
    assert len(exact) > 3500                              # most of the 4,350 (args in other orders are left out)
    kernels = {k.correlation_id: k for k in parse.parse_file(TRACE_1RANK).kernels}
    for corr, (ts, dur) in exact.items():
        k = kernels[corr]
        assert (k.start_mono_ns, k.end_mono_ns - k.start_mono_ns) == (ts, dur), corr
    k = kernels[135071]                                   # CatArrayBatchedCopy: "ts": ...505582.988, "dur": 4.928
    assert k.end_mono_ns - k.start_mono_ns == 4928 and k.start_mono_ns % 1000 == 988
