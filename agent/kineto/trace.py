"""Parse a Kineto Chrome-trace JSON file into CommOp, KernelRec and step windows.

What a trace holds depends on the build and the backend (checked on torch 2.13 CPU, see
tests/fixtures/kineto/README.md):
  * gloo (CPU): `gloo:<op>` user_annotation spans on the pt_gloo_runloop worker threads, with "Input Dims"
    and "Input type" when PROFILE_REPORT_INPUT_SHAPES=true; there is NO `record_param_comms` event, so
    no process-group name, group ranks or sequence number: such ops get comm_id "pg:?" and seq -1.
  * `record_param_comms` cpu_op events (NCCL builds; any backend that records them): "Collective name",
    "dtype" (c10 name, "Float"), "In/Out msg nelems", "Group size", "Process Group Name/Description",
    "Process Group Ranks" ("[0, 1]", elided past 30 ranks), "Rank", "Src Rank"/"Dst Rank", "Seq".
  * GPU traces: `kernel` events (args device, stream, correlation, grid, block; NCCL kernels also carry the
    collective args above) and `cuda_runtime`/`cuda_driver` launch events with the same correlation id.
    Written against the documented format and a hand-built fixture only; no GPU trace was parsed here.
  * `ProfilerStep#N` spans when the job steps a profiler schedule (duration windows usually have none).
Times: `baseTimeNanoseconds` + `ts` (µs, float) is CLOCK_REALTIME; the caller's `to_mono` converts.

Which events become CommOps, so that one collective is counted once: per communicator, GPU kernels
that carry collective args (timing gpu_kernel, issue = launch start) win over record_param_comms
(timing cpu_enqueue); gloo:* annotations (timing backend_thread) are used only when the trace has no
record_param_comms at all.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
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
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


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


def load(path: str, max_bytes: int) -> dict:
    """Read and decode one trace file; TraceError for anything that is not a complete Kineto trace."""
    try:
        size = os.path.getsize(path)
        if size > max_bytes:
            raise TraceError(f"{size} bytes is over max_trace_bytes={max_bytes}")
        with open(path, "rb") as fh:
            doc = json.load(fh)
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


def parse(doc: dict, to_mono: Callable[[int], int], pid: int, start_ticks: int = 0, rank: int = -1,
          job_key: str = "") -> ParsedTrace:
    """CommOps, KernelRecs and steps of one process's trace. `pid` is the traced process (GPU events
    carry the device as their pid); `rank`/`job_key` come from the workload registry, -1/"" if unknown."""
    base = doc.get("baseTimeNanoseconds", 0) or 0
    out = ParsedTrace()

    def t(ts) -> int:
        return to_mono(base + int(round(float(ts) * 1000)))

    launches: dict[int, dict] = {}
    kernels: list[dict] = []
    param_comms: list[dict] = []
    gloo: list[dict] = []
    for ev in doc["traceEvents"]:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        out.events += 1
        name, cat = ev.get("name", ""), ev.get("cat", "")
        if not isinstance(name, str):
            out.skipped += 1
            continue
        try:
            if cat == "Trace" and name.startswith("PyTorch Profiler"):
                out.span_mono_ns = (t(ev["ts"]), t(ev["ts"] + ev["dur"]))
            elif cat == "kernel":
                kernels.append(ev)
            elif cat in _LAUNCH_CATS:
                corr = _int((ev.get("args") or {}).get("correlation"))
                if corr >= 0:
                    launches[corr] = ev
            elif name == "record_param_comms":
                param_comms.append(ev)
            elif name.startswith("gloo:"):
                gloo.append(ev)
            else:
                m = _STEP.match(name)
                if m:
                    out.steps.append((int(m.group(1)), t(ev["ts"]), t(ev["ts"] + ev["dur"])))
        except (KeyError, TypeError, ValueError):
            out.skipped += 1

    kernel_comms: set[str] = set()
    for ev in kernels:
        try:
            args = ev.get("args") or {}
            corr = _int(args.get("correlation"), 0)
            start, end = t(ev["ts"]), t(ev["ts"] + ev["dur"])
            launch = launches.get(corr)
            l_start = t(launch["ts"]) if launch else 0
            l_end = t(launch["ts"] + launch["dur"]) if launch else 0
            device = _int(args.get("device"), _int(ev.get("pid")))
            stream = _int(args.get("stream"), 0)
            out.kernels.append(KernelRec(
                end, pid, name, start, end, start_ticks, _int(launch.get("tid"), 0) if launch else 0, device,
                max(stream, 0), list(args.get("grid") or []), list(args.get("block") or []), corr,
                launch.get("name", "") if launch else "", l_start, l_end, max(_int(args.get("graph id"), 0), 0),
                rank))
            if "Collective name" in args:
                op = _comm_op(args, pid, start_ticks, rank, job_key, "gpu_kernel")
                op.start_mono_ns, op.end_mono_ns, op.mono_ns = start, end, end
                op.issue_mono_ns, op.device, op.stream = l_start, device, max(stream, 0)
                op.tid = _int(launch.get("tid"), 0) if launch else 0
                kernel_comms.add(op.comm_id)
                out.ops.append(op)
        except (KeyError, TypeError, ValueError):
            out.skipped += 1
    for ev in param_comms:
        try:
            op = _comm_op(ev.get("args") or {}, pid, start_ticks, rank, job_key, "cpu_enqueue")
            if op.comm_id in kernel_comms:
                continue
            op.issue_mono_ns = op.start_mono_ns = t(ev["ts"])
            op.end_mono_ns = op.mono_ns = t(ev["ts"] + ev["dur"])
            op.tid = _int(ev.get("tid"), 0)
            out.ops.append(op)
        except (KeyError, TypeError, ValueError):
            out.skipped += 1
    if not param_comms:
        for ev in gloo:
            try:
                args = ev.get("args") or {}
                dims, types = args.get("Input Dims") or [], args.get("Input type") or []
                count, nbytes, dtype = 0, 0, ""
                for d, ty in zip(dims, types):
                    n = _numel(d)
                    dtype = dtype or torch_dtype(ty)
                    count += n
                    nbytes += n * elem_bytes(torch_dtype(ty))
                start, end = t(ev["ts"]), t(ev["ts"] + ev["dur"])
                out.ops.append(CommOp(end, "backend_thread", pid, "pg:?", normalize_op(ev["name"]), start_ticks,
                                      _int(ev.get("tid"), 0), -1, "", rank, count=count, dtype=dtype,
                                      bytes=nbytes, start_mono_ns=start, end_mono_ns=end, job_key=job_key))
            except (KeyError, TypeError, ValueError):
                out.skipped += 1
    out.ops.sort(key=lambda o: (o.start_mono_ns, o.tid))
    out.kernels.sort(key=lambda k: k.start_mono_ns)
    out.steps.sort()
    return out


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
    pg = args.get("Process Group Name", "")
    return CommOp(0, timing, pid, f"pg:{pg}" if pg != "" else "pg:?", op, start_ticks, 0, -1,
                  str(args.get("Process Group Description", "")), my_rank,
                  members.index(my_rank) if my_rank in members else -1, max(_int(args.get("Group size"), 0), 0),
                  members, peer, -1, count, dtype, count * elem_bytes(dtype), _int(args.get("Seq")), -1,
                  job_key=job_key)
