"""Parse a Kineto Chrome-trace JSON file into CommOp, KernelRec and step windows.

What a trace holds depends on the build and the backend (checked on torch 2.13 CPU, see
tests/fixtures/kineto/README.md):
  * gloo (CPU): `gloo:<op>` user_annotation spans on the pt_gloo_runloop worker threads, with "Input Dims"
    and "Input type" when PROFILE_REPORT_INPUT_SHAPES=true; there is NO `record_param_comms` event, so
    no process-group name, group ranks or sequence number: such ops get comm_id "pg:?" and seq -1.
  * `record_param_comms` cpu_op events (NCCL builds; any backend that records them): "Collective name",
    "dtype" (c10 name, "Float"), "In/Out msg nelems", "Group size", "Process Group Name/Description",
    "Process Group Ranks" ("[0, 1]", elided past 30 ranks), "Rank", "Src Rank"/"Dst Rank", "Seq".
  * GPU traces: `kernel` events (args device, stream, correlation, grid, block; NCCL kernels of torch 2.x
    builds also carry the collective args above) and `cuda_runtime`/`cuda_driver` launch events with the
    same correlation id. torch 1.8/1.9 wrote the categories capitalised (`Kernel`, `Runtime`, `Operator`)
    and times as integer µs (kept exact: ×1000 in float would round to 256 ns).
  * Older NCCL builds (checked on HTA's 16- and 128-rank traces of 2023): record_param_comms carries only
    "Input Dims"/"Input type", kernels no collective args; the op is the `nccl:<op>` user_annotation inside
    the record_param_comms (`nccl:_all_gather_base` may also stand alone), its tensor that span's Input Dims.
  * `ProfilerStep#N` spans when the job steps a profiler schedule (duration windows usually have none).
Checked on real traces: tests/test_gpu_traces_real.py (origins in tests/fixtures/gpu-real/README.md).
Times: `baseTimeNanoseconds` + `ts` (µs) is CLOCK_REALTIME; the caller's `to_mono` converts.

One CommOp per call: a record_param_comms span (or, where none encloses it, an `nccl:<op>` span) with the
NCCL kernels launched inside it (timing gpu_kernel: start/end of its kernels, issue = first launch start;
cpu_enqueue when it launched none, e.g. a 0-byte all_to_all or a 1-rank group). A record_param_comms of
`work.wait()` ("Collective name" wait, or, in older builds, one that names nothing and encloses no
nccl:<op> span and no NCCL kernel) is not an op: counted in `waits`. A kernel with collective args whose
call the trace missed still becomes an op. gloo:<op> spans (timing backend_thread) are the calls only when
the trace has no record_param_comms at all. `seq` is the trace's "Seq" (seq_source "trace"); without one,
collectives are numbered 0, 1, ... in issue order per comm_id within the trace (seq_source "order"):
ranks whose traces cover the same steps match op for op. Where the trace names no process group (older
builds) every collective is in "pg:?", so ops of different groups share one numbering there.
"""

from __future__ import annotations

import bisect
import json
import os
import re
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Callable

from steplens.agent.commlog import dtype_bytes, normalize_op
from steplens.agent.records import CommOp, KernelRec


class TraceError(ValueError):
    """The file is not a usable Kineto trace (truncated, corrupt, too large, wrong shape)."""


# C++ type names ("Input type" of cpu ops) and c10 ScalarType names (record_param_comms "dtype")
_DTYPES = {
    "float": "float32", "double": "float64", "c10::half": "float16", "c10::bfloat16": "bfloat16",
    "long int": "int64", "long": "int64", "int64_t": "int64", "int": "int32", "short int": "int16",
    "short": "int16", "signed char": "int8", "unsigned char": "uint8", "bool": "bool",
    "c10::complex<float>": "complex64", "c10::complex<double>": "complex128",
    "half": "float16", "bfloat16": "bfloat16", "char": "int8", "byte": "uint8",
    "c10::float8_e4m3fn": "float8_e4m3fn", "c10::float8_e5m2": "float8_e5m2",
}
_EXTRA_BYTES = {"int16": 2}
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_COMM_SPAN = re.compile(r"^(?:nccl|gloo|ucc|mpi):", re.IGNORECASE)
# categories are lowercase from torch 1.10 on; torch 1.8/1.9 wrote "Kernel", "Runtime", "Operator"
_KERNEL_CATS = ("kernel",)
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver", "runtime")
_NOT_COLLECTIVES = ("wait",)          # record_param_comms of work.wait(): not a communication op


def torch_dtype(name: str) -> str:
    """'float' / 'Float' / 'long int' / 'Long' -> 'float32' / 'int64'; unknown names pass through."""
    n = str(name).strip()
    return _DTYPES.get(n.lower(), n.lower())


def elem_bytes(dtype: str) -> int:
    return dtype_bytes(dtype) or _EXTRA_BYTES.get(dtype, 0)


@dataclass
class ParsedTrace:
    ops: list[CommOp] = field(default_factory=list)
    kernels: list[KernelRec] = field(default_factory=list)
    steps: list[tuple[int, int, int]] = field(default_factory=list)   # (step, start_mono_ns, end_mono_ns)
    span_mono_ns: tuple[int, int] = (0, 0)                            # the profiler's window
    events: int = 0
    skipped: int = 0          # X events with missing or malformed fields
    waits: int = 0            # record_param_comms of work.wait() calls: not ops, left out


class _LongNumber(float):
    """A JSON number with more digits than a float holds (absolute µs with ns decimals, ~1.7e15 µs: a float
    steps by 0.25 µs there); keeps its text so that _us_ns() can convert it exactly."""


def _parse_float(text: str) -> float:
    if len(text) <= 15:
        return float(text)
    n = _LongNumber(text)
    n.text = text
    return n


def loads_json(data) -> object:
    """json.loads that keeps long numbers exact (see _LongNumber); the parsers' only JSON entry point."""
    return json.loads(data, parse_float=_parse_float)


def _us_ns(us) -> int:
    """µs (int, float or _LongNumber) -> ns, exact wherever the number's text is: integers past 2**53/1000 and
    long decimals would round to 256 ns / 250 ns steps through a float (a difference found against
    HolisticTraceAnalysis, bench/compare_hta.py)."""
    if type(us) is int:
        return us * 1000
    text = getattr(us, "text", None)
    if text is not None:
        return int((Decimal(text) * 1000).to_integral_value(ROUND_HALF_EVEN))
    us = float(us)
    whole = int(us)
    return whole * 1000 + int(round((us - whole) * 1000))


def load(path: str, max_bytes: int) -> dict:
    """Read and decode one trace file; TraceError for anything that is not a complete Kineto trace."""
    try:
        size = os.path.getsize(path)
        if size > max_bytes:
            raise TraceError(f"{size} bytes is over max_trace_bytes={max_bytes}")
        with open(path, "rb") as fh:
            doc = loads_json(fh.read())
    except TraceError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise TraceError(f"{type(exc).__name__}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError("no traceEvents list")
    if not isinstance(doc.get("baseTimeNanoseconds", 0), int):
        raise TraceError("baseTimeNanoseconds is not an integer")
    return doc


def _ranks(value) -> list[int]:
    """'[0, 1, 2]' or [0, 1, 2] -> ints; [] when elided ('...') or unreadable."""
    if isinstance(value, list):
        items = value
    elif isinstance(value, str) and "..." not in value:
        items = [v for v in value.strip("[] ").split(",") if v.strip()]
    else:
        return []
    try:
        return [int(v) for v in items]
    except (TypeError, ValueError):
        return []


def _int(value, default: int = -1) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _numel(dims) -> int:
    """Elements of 'Input Dims' of one argument: [1024] or a tensor list [[1024], [4, 4]]."""
    if not isinstance(dims, list):
        return 0
    if dims and all(isinstance(d, list) for d in dims):
        return sum(_numel(d) for d in dims)
    n = 1
    for d in dims:
        if not isinstance(d, int):
            return 0
        n *= d
    return n


def _tensor_sizes(args: dict) -> tuple[int, int, str]:
    """(elements, bytes, dtype) of the tensor arguments of an op's "Input Dims"/"Input type"; scalars,
    tensor lists without shapes and unknown types count nothing."""
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    count, nbytes, dtype = 0, 0, ""
    for d, ty in zip(dims, types):
        dt = torch_dtype(ty)
        size = elem_bytes(dt)
        if not size:
            continue
        n = _numel(d)
        dtype = dtype or dt
        count += n
        nbytes += n * size
    return count, nbytes, dtype


class _Spans:
    """CPU spans of one kind per (pid, tid), for 'which span contains this instant' lookups."""

    def __init__(self, events: list[dict]) -> None:
        self._by: dict[tuple, tuple[list, list]] = {}
        for ev in sorted(events, key=lambda e: float(e["ts"])):
            starts, evs = self._by.setdefault((ev.get("pid"), ev.get("tid")), ([], []))
            starts.append(float(ev["ts"]))
            evs.append(ev)

    def containing(self, pid, tid, ts: float) -> dict | None:
        starts, evs = self._by.get((pid, tid), ((), ()))
        i = bisect.bisect_right(starts, ts) - 1
        for j in range(i, max(i - 4, -1), -1):   # nested spans: the innermost one that still covers ts
            ev = evs[j]
            if float(ev["ts"]) + float(ev.get("dur", 0)) >= ts:
                return ev
        return None

    def first_inside(self, span: dict) -> dict | None:
        """The first span of this kind starting inside `span` on the same thread."""
        starts, evs = self._by.get((span.get("pid"), span.get("tid")), ((), ()))
        a = float(span["ts"])
        i = bisect.bisect_left(starts, a)
        if i < len(starts) and starts[i] <= a + float(span.get("dur", 0)):
            return evs[i]
        return None


def parse(doc: dict, to_mono: Callable[[int], int], pid: int, start_ticks: int = 0, rank: int = -1,
          job_key: str = "") -> ParsedTrace:
    """CommOps, KernelRecs and steps of one process's trace. `pid` is the traced process (GPU events
    carry the device as their pid); `rank`/`job_key` come from the workload registry, -1/"" if unknown
    (then the trace's distributedInfo.rank is used)."""
    base = doc.get("baseTimeNanoseconds", 0) or 0
    out = ParsedTrace()
    if rank < 0:
        rank = _int((doc.get("distributedInfo") or {}).get("rank"), -1)

    def t(ts, dur=None) -> int:
        """ts (µs) on this host's clock; with dur, the end ts + dur, each converted exactly on its own
        (a float sum of the two would round the end again)."""
        ns = base + _us_ns(ts)
        if dur is not None:
            ns += _us_ns(dur)
        return to_mono(ns)

    launches: dict[int, dict] = {}
    kernels: list[dict] = []
    param_comms: list[dict] = []
    comm_spans: list[dict] = []           # nccl:<op> / gloo:<op> CPU annotations
    for ev in doc["traceEvents"]:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        out.events += 1
        name, cat = ev.get("name", ""), ev.get("cat", "")
        if not isinstance(name, str):
            out.skipped += 1
            continue
        lcat = cat.lower() if isinstance(cat, str) else ""
        try:
            if cat == "Trace" and name.startswith("PyTorch Profiler"):
                out.span_mono_ns = (t(ev["ts"]), t(ev["ts"], ev["dur"]))
            elif lcat in _KERNEL_CATS:
                kernels.append(ev)
            elif lcat in _LAUNCH_CATS:
                corr = _int((ev.get("args") or {}).get("correlation"))
                if corr >= 0:
                    launches[corr] = ev
            elif name == "record_param_comms":
                float(ev["ts"]), float(ev.get("dur", 0))
                param_comms.append(ev)
            elif _COMM_SPAN.match(name) and lcat != "gpu_user_annotation":
                float(ev["ts"]), float(ev.get("dur", 0))
                comm_spans.append(ev)
            elif lcat != "gpu_user_annotation":
                # ProfilerStep#N is also mirrored on the GPU timeline (gpu_user_annotation, seen in torch 2.11
                # traces): a step is the CPU span, once
                m = _STEP.match(name)
                if m:
                    out.steps.append((int(m.group(1)), t(ev["ts"]), t(ev["ts"], ev["dur"])))
        except (KeyError, TypeError, ValueError):
            out.skipped += 1

    # One communication op per call: a record_param_comms span (it encloses the nccl:<op> annotation and
    # the kernel launches of its call), or, where no record_param_comms encloses it, an nccl:<op> span.
    rpc_index = _Spans(param_comms)
    span_index = _Spans(comm_spans)
    nccl_spans = [ev for ev in comm_spans if not ev["name"].lower().startswith("gloo:")]
    calls = list(param_comms)
    calls += [ev for ev in nccl_spans if rpc_index.containing(ev.get("pid"), ev.get("tid"), float(ev["ts"])) is None]
    if not param_comms:   # gloo on CPU records no record_param_comms: its gloo:<op> spans are the calls
        calls += [ev for ev in comm_spans if ev["name"].lower().startswith("gloo:")]
    call_index = _Spans(calls)
    call_kernels: dict[int, list] = {}

    for ev in kernels:
        try:
            args = ev.get("args") or {}
            kname = ev["name"]
            corr = _int(args.get("correlation"), 0)
            start, end = t(ev["ts"]), t(ev["ts"], ev["dur"])
            launch = launches.get(corr)
            l_start = t(launch["ts"]) if launch else 0
            l_end = t(launch["ts"], launch["dur"]) if launch else 0
            device = _int(args.get("device"), _int(ev.get("pid")))
            stream = max(_int(args.get("stream"), 0), 0)
            l_tid = _int(launch.get("tid"), 0) if launch else 0
            rec = KernelRec(end, pid, str(kname), start, end, start_ticks, l_tid, device, stream,
                            list(args.get("grid") or []), list(args.get("block") or []), corr,
                            launch.get("name", "") if launch else "", l_start, l_end,
                            max(_int(args.get("graph id"), 0), 0), rank)
            out.kernels.append(rec)
            if "nccl" not in str(kname).lower() and "Collective name" not in args:
                continue
            call = call_index.containing(launch.get("pid"), launch.get("tid"), float(launch["ts"])) if launch else None
            if call is not None:
                call_kernels.setdefault(id(call), []).append((rec, args))
            elif "Collective name" in args:   # a collective kernel whose call the trace did not record
                op = _comm_op(args, pid, start_ticks, rank, job_key, "gpu_kernel")
                op.start_mono_ns, op.end_mono_ns, op.mono_ns = start, end, end
                op.issue_mono_ns, op.device, op.stream, op.tid = l_start, device, stream, l_tid
                out.ops.append(op)
        except (KeyError, TypeError, ValueError):
            out.skipped += 1

    for ev in calls:
        try:
            op = _call_op(ev, span_index, call_kernels.get(id(ev), []), pid, start_ticks, rank, job_key, t)
        except (KeyError, TypeError, ValueError):
            out.skipped += 1
            continue
        if op is None:
            out.waits += 1
        else:
            out.ops.append(op)
    _number_by_order(out.ops)
    out.ops.sort(key=lambda o: (o.start_mono_ns, o.tid))
    out.kernels.sort(key=lambda k: k.start_mono_ns)
    out.steps.sort()
    return out


def _call_op(ev: dict, spans: _Spans, kernels: list, pid: int, start_ticks: int, rank: int, job_key: str,
             t: Callable) -> CommOp | None:
    """The CommOp of one call (a record_param_comms or an nccl:/gloo: span) with the NCCL kernels it
    launched; None when the call is not a communication op (work.wait())."""
    args = ev.get("args") or {}
    is_rpc = ev["name"] == "record_param_comms"
    info = args
    if "Collective name" not in args:
        info = next((a for _, a in kernels if "Collective name" in a), args)
    if "Collective name" in info:
        if str(info["Collective name"]).lower() in _NOT_COLLECTIVES:
            return None
        op = _comm_op(info, pid, start_ticks, rank, job_key, "cpu_enqueue")
    else:
        # older builds: the op is named by the nccl:<op> span (inside the record_param_comms, or the call
        # itself), its tensor by that span's Input Dims / Input type
        span = spans.first_inside(ev) if is_rpc else ev
        if span is None and not kernels:
            return None       # a record_param_comms that names nothing and launched nothing: work.wait()
        sized = span if span is not None and span.get("args", {}).get("Input Dims") else ev
        count, nbytes, dtype = _tensor_sizes(sized.get("args") or {})
        pg = args.get("Process Group Name", args.get("Process Group ID", ""))
        op = CommOp(0, "cpu_enqueue", pid, f"pg:{pg}" if pg != "" else "pg:?",
                    normalize_op(span["name"]) if span is not None else "unknown", start_ticks, 0, -1, "", rank,
                    count=count, dtype=dtype, bytes=nbytes, job_key=job_key)
        if op.op == "unknown" and kernels:
            op.op = _kernel_op(kernels[0][0].name)
    if ev["name"].lower().startswith("gloo:"):
        op.timing = "backend_thread"
    op.tid = _int(ev.get("tid"), 0)
    op.issue_mono_ns = op.start_mono_ns = t(ev["ts"])
    op.end_mono_ns = op.mono_ns = t(ev["ts"], ev["dur"])
    if kernels:
        first = min(kernels, key=lambda k: k[0].start_mono_ns)[0]
        op.timing = "gpu_kernel"
        op.issue_mono_ns, op.tid = first.launch_start_mono_ns, first.tid
        op.start_mono_ns = first.start_mono_ns
        op.end_mono_ns = op.mono_ns = max(k.end_mono_ns for k, _ in kernels)
        op.device, op.stream = first.device, first.stream
    return op


_KERNEL_OP = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", re.IGNORECASE)


def _kernel_op(name: str) -> str:
    """'ncclKernel_AllReduce_RING_LL_Sum_float(...)' -> 'all_reduce'; SendRecv kernels carry no op."""
    m = _KERNEL_OP.search(name)
    return normalize_op(m.group(1)) if m else "unknown"


def _number_by_order(ops: list[CommOp]) -> None:
    """Collectives whose trace carries no Seq are numbered 0, 1, ... in issue order per communicator
    (seq_source "order"): ranks whose traces cover the same steps match op for op. A communicator where
    the trace numbers some op is left as the trace numbered it. P2P ops are not numbered."""
    traced = {o.comm_id for o in ops if o.seq >= 0}
    by_comm: dict[str, list[CommOp]] = {}
    for o in ops:
        if o.seq >= 0:
            o.seq_source = "trace"
        elif o.comm_id not in traced and o.op not in ("send", "recv") and o.timing != "backend_thread":
            by_comm.setdefault(o.comm_id, []).append(o)
    for group in by_comm.values():
        group.sort(key=lambda o: (o.issue_mono_ns or o.start_mono_ns, o.tid))
        for i, o in enumerate(group):
            o.seq, o.seq_source = i, "order"


def _comm_op(args: dict, pid: int, start_ticks: int, rank: int, job_key: str, timing: str) -> CommOp:
    """A CommOp from record_param_comms-style args (times are filled in by the caller)."""
    members = _ranks(args.get("Process Group Ranks"))
    my_rank = _int(args.get("Rank"), rank)
    dtype = torch_dtype(args.get("dtype", ""))
    count = max(_int(args.get("In msg nelems"), 0), 0)
    op = normalize_op(str(args.get("Collective name", "")))
    peer = -1
    if op == "send":
        peer = _int(args.get("Dst Rank"))
    elif op == "recv":
        peer = _int(args.get("Src Rank"))
    pg = args.get("Process Group Name", args.get("Process Group ID", ""))
    return CommOp(0, timing, pid, f"pg:{pg}" if pg != "" else "pg:?", op, start_ticks, 0, -1,
                  str(args.get("Process Group Description", "")), my_rank,
                  members.index(my_rank) if my_rank in members else -1, max(_int(args.get("Group size"), 0), 0),
                  members, peer, -1, count, dtype, count * elem_bytes(dtype), _int(args.get("Seq")), -1,
                  job_key=job_key)
