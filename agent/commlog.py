"""What every comm-op source shares: op-name normalization, CLOCK_REALTIME -> this host's monotonic
clock, per-step summaries, and handing the full CommOp/KernelRec stream to the node-local detail store.

Sources (kineto, flightrec, cupti) parse their own formats into CommOp/KernelRec and call
`CommLog.add()`; only the CommSummary and Step records it returns go upstream (Holmes: detail stays on the
node). Steps: every comm-op source's ops also feed one StepSegmenter per source (agent/steps.py), which turns
them into per-process step boundaries (ProfilerStep windows, where the trace has them, win).

`CommLog.add()` is also where every converted time is checked (`time_problem`): a CLOCK_REALTIME time from a
file or a dump does not always land inside this boot's CLOCK_MONOTONIC (a trace older than the boot, a wall
clock stepped since, a crafted file). Such a record is dropped and counted per reason, reported as an Event,
and never reaches the detail store or the encoder, whose unsigned fields would refuse it.
"""

from __future__ import annotations

import re
import time
from collections import Counter

from steplens.agent.records import CommOp, CommSummary, Event, KernelRec, Step
from steplens.agent.steps import StepSegmenter

# Normalized op names (the CommOp.op vocabulary) and the spellings the sources use for them:
# torch (c10d, Flight Recorder profiling names "nccl:all_reduce", "gloo:all_reduce"), NCCL API names,
# Kineto "record_param_comms" collective names, and the _coalesced / _base variants.
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather", "scatter",
       "send", "recv", "barrier", "coalesced", "unknown")
_ALIASES = {
    "allreduce": "all_reduce", "all_reduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "allreduce_sparse": "all_reduce",
    "allgather": "all_gather", "all_gather": "all_gather", "_allgather_base": "all_gather",
    "all_gather_base": "all_gather", "allgather_base": "all_gather", "allgather_into_tensor": "all_gather", "all_gather_into_tensor": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather", "allgather_coalesced": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reducescatter": "reduce_scatter", "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall": "all_to_all", "all_to_all": "all_to_all", "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all", "alltoallv": "all_to_all",
    "broadcast": "broadcast", "bcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "send": "send", "recv": "recv", "recv_any_source": "recv", "recvanysource": "recv",
    "barrier": "barrier", "coalesced": "coalesced",
    # ProcessGroupNCCL runs barrier() as a one-element all-reduce, profiled as "nccl:all_reduce_barrier"
    "all_reduce_barrier": "barrier", "allreduce_barrier": "barrier",
}
_PREFIX = re.compile(r"^(?:c10d::|nccl:|gloo:|ucc:|mpi:|nccl|c10d_functional::)", re.IGNORECASE)


def normalize_op(name: str) -> str:
    """'gloo:all_reduce', 'nccl:_allgather_base', 'ncclAllReduce', 'c10d::allreduce_' -> the OPS vocabulary."""
    n = _PREFIX.sub("", name.strip()).strip("_").lower()
    n = n.removesuffix("_")
    return _ALIASES.get(n, _ALIASES.get(n.replace("_", ""), "unknown"))


DTYPE_BYTES = {"float32": 4, "float": 4, "float64": 8, "double": 8, "float16": 2, "half": 2, "bfloat16": 2,
               "int8": 1, "uint8": 1, "char": 1, "int32": 4, "int": 4, "uint32": 4, "int64": 8, "long": 8,
               "uint64": 8, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8, "complex128": 16}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a torch/NCCL dtype name ('Float', 'torch.float32', 'ncclBfloat16'); 0 if unknown."""
    d = dtype.lower().removeprefix("torch.").removeprefix("ncclfloat").removeprefix("nccl")
    if dtype.lower().startswith("ncclfloat"):
        d = {"": "float32", "32": "float32", "16": "float16", "64": "float64"}.get(d, d)
    return DTYPE_BYTES.get(d, 0)


class RealtimeClock:
    """Converts CLOCK_REALTIME ns (Kineto, Flight Recorder, CUPTI) to this host's CLOCK_MONOTONIC ns.

    The offset is taken from the tightest of several back-to-back (mono, real, mono) reads and refreshed
    every `refresh_s` (NTP slews REALTIME; a step of the wall clock shows up at the next refresh).
    """

    def __init__(self, refresh_s: float = 10.0, monotonic_ns=time.monotonic_ns, realtime_ns=time.time_ns) -> None:
        self._mono, self._real = monotonic_ns, realtime_ns
        self.refresh_s = refresh_s
        self._offset = 0
        self._taken = None

    def _measure(self) -> int:
        best = None
        for _ in range(5):
            a = self._mono()
            r = self._real()
            b = self._mono()
            if best is None or b - a < best[0]:
                best = (b - a, r - (a + b) // 2)
        return best[1]

    @property
    def offset_ns(self) -> int:
        """realtime - monotonic."""
        now = self._mono()
        if self._taken is None or now - self._taken > self.refresh_s * 1e9:
            self._offset = self._measure()
            self._taken = now
        return self._offset

    def to_mono(self, realtime_ns: int) -> int:
        """0 (unknown) for 0; otherwise may be negative or past now: CommLog.add() checks the result."""
        return 0 if not realtime_ns else realtime_ns - self.offset_ns


# CLOCK_MONOTONIC fields (by their name) of the records a comm-op source converts from CLOCK_REALTIME
TIME_FIELDS = {t: tuple(n for n in t.__slots__ if n.endswith("mono_ns")) for t in (CommOp, KernelRec)}
INT64_MAX = (1 << 63) - 1
FUTURE_SLACK_NS = 60 * 10**9   # a trace is read after it was written: later than this past now is not a read-out
DROP_REASONS = {
    "not_a_time": "not an integer number of ns",
    "before_boot": "before this host booted (CLOCK_MONOTONIC < 0: an old file, or the wall clock stepped back)",
    "out_of_range": "outside the 64-bit range",
    "future": "in the future (the wall clock stepped forward since, or the file is not from this host)",
}


def time_problem(rec, now_mono_ns: int, future_slack_ns: int = FUTURE_SLACK_NS) -> tuple[str, str]:
    """("", "") when every CLOCK_MONOTONIC time of a CommOp/KernelRec is one of this boot (0 = unknown), else
    (reason, "field=value") for the first that is not; reasons are the keys of DROP_REASONS."""
    for name in TIME_FIELDS.get(type(rec), ("mono_ns",)):
        v = getattr(rec, name)
        if type(v) is not int:  # bool, float, str: a parser let a non-integer through
            return "not_a_time", f"{name}={v!r}"
        if v < 0:
            return ("out_of_range" if v < -INT64_MAX else "before_boot"), f"{name}={v}"
        if v > INT64_MAX:
            return "out_of_range", f"{name}={v}"
        if v > now_mono_ns + future_slack_ns:
            return "future", f"{name}={v} ({(v - now_mono_ns) / 1e9:.0f} s past now)"
    return "", ""


def summarize(ops: list[CommOp], kernels: list[KernelRec] = (), steps: list[tuple[int, int, int]] = ()) -> list[CommSummary]:
    """Per (pid, comm_id, op, step) summaries. steps: (step, start_mono_ns, end_mono_ns) windows from the
    trace (ProfilerStep#N); ops outside every step window get step -1 (one summary per call of this
    function, i.e. per trace window or poll interval). Kernel issue latency (start - launch start) is
    added to the summary of the process's comm ops for the same step, op "kernels"."""
    def step_of(t: int) -> int:
        for s, a, b in steps:
            if a <= t <= b:
                return s
        return -1

    groups: dict[tuple, CommSummary] = {}
    for op in ops:
        start = op.start_mono_ns or op.issue_mono_ns or op.mono_ns
        end = op.end_mono_ns or op.mono_ns
        dur = max(0, end - start) if op.start_mono_ns and op.end_mono_ns else 0
        key = (op.pid, op.comm_id, op.op, step_of(start))
        s = groups.get(key)
        if s is None:
            s = groups[key] = CommSummary(end, op.pid, op.comm_id, op.op, start, 0, 0, 0, 0, op.start_ticks,
                                          op.job_key, op.rank, key[3], op.seq, op.seq, op.timing)
        s.calls += 1
        s.bytes += op.bytes
        s.busy_ns += dur
        s.max_ns = max(s.max_ns, dur)
        s.start_mono_ns = min(s.start_mono_ns, start)
        s.mono_ns = max(s.mono_ns, end)
        if op.seq >= 0:
            s.seq_first = op.seq if s.seq_first < 0 else min(s.seq_first, op.seq)
            s.seq_last = max(s.seq_last, op.seq)
    for k in kernels:
        if not k.launch_start_mono_ns or not k.start_mono_ns:
            continue
        key = (k.pid, "", "kernels", step_of(k.start_mono_ns))
        s = groups.get(key)
        if s is None:
            s = groups[key] = CommSummary(k.end_mono_ns, k.pid, "", "kernels", k.start_mono_ns, 0, 0, 0, 0,
                                          k.start_ticks, "", k.rank, key[3], timing="gpu_kernel")
        s.calls += 1
        dur = max(0, k.end_mono_ns - k.start_mono_ns)
        s.busy_ns += dur
        s.max_ns = max(s.max_ns, dur)
        s.issue_latency_ns_sum += max(0, k.start_mono_ns - k.launch_start_mono_ns)
        s.kernels += 1
        s.start_mono_ns = min(s.start_mono_ns, k.start_mono_ns)
        s.mono_ns = max(s.mono_ns, k.end_mono_ns)
    return sorted(groups.values(), key=lambda s: (s.mono_ns, s.pid, s.comm_id, s.op))


class CommLog:
    """A comm-op source's sink: the full CommOp/KernelRec stream goes to the node-local detail store
    (state_dir/detail.db, a bounded ring), and the CommSummary records to send upstream come back, with an
    Event per (process, reason) for records dropped because a time of theirs is not one of this boot."""

    def __init__(self, state_dir: str, source: str, max_records: int = 2_000_000,
                 monotonic_ns=time.monotonic_ns, future_slack_ns: int = FUTURE_SLACK_NS) -> None:
        import os

        from steplens.agent.detail import open_shared
        self.source = source
        self.store = open_shared(os.path.join(state_dir, "detail.db"), max_records=max_records)
        self._mono = monotonic_ns
        self.future_slack_ns = future_slack_ns
        self.ops_total = 0
        self.kernels_total = 0
        self.rejected: Counter = Counter()   # reason (DROP_REASONS, "unencodable") -> records dropped
        self.segmenter = StepSegmenter()     # per-process step boundaries from the same ops (agent/steps.py)

    def add(self, ops: list[CommOp], kernels: list[KernelRec] = (), steps: list[tuple[int, int, int]] = (),
            final: bool = False, checked: bool = False) -> list[CommSummary | Step | Event]:
        """final: the ops are their processes' last (an exit dump; StepSegmenter.add). checked: every field of the
        ops but their times is known to be in the encoder's ranges (flightrec.OpConverter checks what varies per
        entry), so the detail store does not check each field again (DetailStore.add_records); the times are
        checked here either way."""
        if not ops and not kernels:
            return []
        now = self._mono()
        events: list[Event] = []
        ops, kernels = self._valid(ops, now, events), self._valid(kernels, now, events)
        steps = [s for s in steps if all(type(t) is int and 0 <= t <= INT64_MAX for t in s)]
        refused = self.store.add_records(self.source, ops, checked) + self.store.add_records(self.source, kernels)
        self.store.flush()
        if refused:  # another field out of range (a negative size in a crafted dump): the others stay
            gone = {id(rec) for rec, _ in refused}
            ops, kernels = [o for o in ops if id(o) not in gone], [k for k in kernels if id(k) not in gone]
            self.rejected["unencodable"] += len(refused)
            rec, why = refused[0]
            events.append(Event(now, f"{self.source}_records_dropped", f"pid:{getattr(rec, 'pid', 0)}:"
                                f"{getattr(rec, 'start_ticks', 0)}", f"unencodable: {len(refused)} record(s) "
                                f"dropped, a field out of range (first: {type(rec).__name__} {why})",
                                float(len(refused))))
        self.ops_total += len(ops)
        self.kernels_total += len(kernels)
        return summarize(ops, kernels, steps) + self.segmenter.add(ops, steps, final) + events

    def _valid(self, records, now: int, events: list[Event]) -> list:
        keep, bad = [], {}
        for rec in records:
            reason, detail = time_problem(rec, now, self.future_slack_ns)
            if not reason:
                keep.append(rec)
                continue
            key = (reason, type(rec).__name__, getattr(rec, "pid", 0), getattr(rec, "start_ticks", 0))
            n, first = bad.get(key, (0, detail))
            bad[key] = (n + 1, first)
        for (reason, kind, pid, ticks), (n, first) in bad.items():
            self.rejected[reason] += n
            events.append(Event(now, f"{self.source}_records_dropped", f"pid:{pid}:{ticks}",
                                f"{reason}: {n} {kind} record(s) dropped, a time {DROP_REASONS[reason]} "
                                f"(first: {first})", float(n)))
        return keep

    @property
    def dropped(self) -> int:
        return self.store.records_dropped

    def close(self) -> None:
        from steplens.agent.detail import release_shared
        release_shared(self.store)
