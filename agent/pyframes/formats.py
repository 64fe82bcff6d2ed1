"""Writes Python stack samples recorded at a known rate as collapsed stacks, speedscope or Chrome trace JSON.

Reads a list of `Sample` (model.py: threads with frames innermost first) and writes text to an open
file object; nothing else is touched. Cost: samples are copied into `mono_ns` order (stable, so input
already in order is unchanged); collapsed holds one counter per distinct stack; speedscope holds one
list of frame indexes per kept thread sample until it writes (the format puts all of a profile in one
array); chrome writes each event as it is made and holds only the open stack of each thread.

Choices, shared by the three writers:
- A thread is idle when `ThreadStack.active` is false (neither running nor holding the GIL). Like
  py-spy without `--idle`, idle threads are left out unless `include_idle=True`; in speedscope and
  chrome a thread that is idle (or absent) in a sample shows as an empty stack for that sample, so its
  timeline keeps its length and frames close at that time.
- A thread is identified by (pid, tid, thread_id), because tid is 0 when it could not be determined
  and several threads may then share it. It is labelled `thread <name> (<tid>)` with the name from
  the first sample it is kept in; the process is labelled `process <pid>` (a Sample has no name).
- A frame is rendered `qualname (file:line)` like py-spy's default, with the full path, and
  `qualname (file)` when the line is unknown (-1).
- Times: a sample stands for the time until the next sample of the same process; the last one of a
  process stands for `interval_ns`. Speedscope values and chrome `ts` are relative to the first sample.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Iterable, TextIO

from steplens.agent.pyframes.model import Frame, Sample, ThreadStack

FORMATS = ("collapsed", "speedscope", "chrome")
SPEEDSCOPE_SCHEMA = "https://www.speedscope.app/file-format-schema.json"

_ThreadKey = tuple[int, int, int]  # (pid, tid, thread_id)


def write(samples: Iterable[Sample], fh: TextIO, fmt: str, *, name: str = "steplens",
          interval_ns: int | None = None, include_idle: bool = False) -> None:
    """Write `samples` to `fh` in `fmt` (one of FORMATS); `interval_ns` is needed by all but collapsed."""
    if fmt == "collapsed":
        write_collapsed(samples, fh, include_idle=include_idle)
    elif fmt == "speedscope":
        write_speedscope(samples, fh, name, _check_interval(interval_ns), include_idle=include_idle)
    elif fmt == "chrome":
        write_chrome(samples, fh, _check_interval(interval_ns), include_idle=include_idle)
    else:
        raise ValueError(f"unknown stack format {fmt!r}: expected one of {', '.join(FORMATS)}")


# -- collapsed -------------------------------------------------------------------------------------

def write_collapsed(samples: Iterable[Sample], fh: TextIO, include_idle: bool = False) -> None:
    """Brendan Gregg's folded stacks: `process;thread;outermost;...;innermost COUNT`, lines sorted.

    `;`, newlines and backslashes in names are backslash-escaped (`\\x3b`, `\\n`, `\\r`, `\\\\`) rather
    than dropped: the escape holds no `;`, so flamegraph.pl, inferno and speedscope still split the line
    correctly, and it can be reversed.
    """
    counts: Counter[str] = Counter()
    # the sampler hands out the same frames list (and Frame objects) while a stack stays the same, so
    # rendered text is memoized by object identity (each entry holds its object, so an id stays its own)
    stack_text: dict[int, tuple] = {}
    frame_text: dict[int, tuple] = {}
    thread_text: dict[tuple, str] = {}
    for sample in samples:
        process = f"process {sample.pid}"
        for thread in sample.threads:
            if not (include_idle or thread.active):
                continue
            label = thread_text.get((thread.name, thread.tid))
            if label is None:
                label = thread_text[(thread.name, thread.tid)] = _escape(_thread_label(thread))
            frames = thread.frames
            memo = stack_text.get(id(frames))
            if memo is not None and memo[0] is frames:
                text = memo[1]
            else:
                parts = []
                for f in reversed(frames):
                    t = frame_text.get(id(f))
                    if t is None or t[0] is not f:
                        t = frame_text[id(f)] = (f, _escape(_frame_label(f)))
                    parts.append(t[1])
                text = ";".join(parts)
                stack_text[id(frames)] = (frames, text)
            counts[f"{process};{label};{text}" if text else f"{process};{label}"] += 1
    for stack in sorted(counts):
        fh.write(f"{stack} {counts[stack]}\n")


def _escape(text: str) -> str:
    return (text.replace("\\", "\\\\").replace(";", "\\x3b")
            .replace("\n", "\\n").replace("\r", "\\r"))


def _thread_label(thread: ThreadStack) -> str:
    return f"thread {thread.name} ({thread.tid})"


def _frame_label(frame: Frame) -> str:
    if frame.line < 0:
        return f"{frame.qualname} ({frame.file})"
    return f"{frame.qualname} ({frame.file}:{frame.line})"


# -- speedscope ------------------------------------------------------------------------------------

def write_speedscope(samples: Iterable[Sample], fh: TextIO, name: str, interval_ns: int,
                     include_idle: bool = False) -> None:
    """Speedscope file format: frames interned once in `shared.frames`, one sampled profile per thread.

    Every profile of a process has one entry per sample of that process (an empty stack where the
    thread is idle or absent), so its weights sum to `endValue - startValue`. A thread never kept gets
    no profile. Frames are told apart by (qualname, file, line), as py-spy does.
    """
    interval_ns = _check_interval(interval_ns)
    by_pid = _by_pid(samples)
    t0 = min((s[0].mono_ns for s in by_pid.values()), default=0)
    frames: list[dict] = []
    frame_index: dict[tuple[str, str, int], int] = {}

    def intern(frame: Frame) -> int:
        key = (frame.qualname, frame.file, frame.line)
        index = frame_index.get(key)
        if index is None:
            index = frame_index[key] = len(frames)
            entry = {"name": frame.qualname, "file": frame.file}
            if frame.line >= 0:
                entry["line"] = frame.line
            frames.append(entry)
        return index

    profiles = []
    for pid, process_samples in by_pid.items():
        weights = [b.mono_ns - a.mono_ns for a, b in zip(process_samples, process_samples[1:])]
        weights.append(interval_ns)
        stacks: dict[_ThreadKey, list[list[int]]] = {}
        labels: dict[_ThreadKey, str] = {}
        for i, sample in enumerate(process_samples):
            for thread in sample.threads:
                if not (include_idle or thread.active):
                    continue
                key = (pid, thread.tid, thread.thread_id)
                if key not in stacks:
                    stacks[key] = [[] for _ in range(len(process_samples))]
                    labels[key] = _thread_label(thread)
                stacks[key][i] = [intern(f) for f in reversed(thread.frames)]
        start = process_samples[0].mono_ns - t0
        end = process_samples[-1].mono_ns - t0 + interval_ns
        for key, thread_stacks in stacks.items():
            label = labels[key] if len(by_pid) == 1 else f"process {pid} {labels[key]}"
            profiles.append({"type": "sampled", "name": label, "unit": "nanoseconds",
                             "startValue": start, "endValue": end,
                             "samples": thread_stacks, "weights": list(weights)})
    doc = {"$schema": SPEEDSCOPE_SCHEMA, "shared": {"frames": frames}, "profiles": profiles,
           "name": name, "activeProfileIndex": 0, "exporter": "steplens"}
    json.dump(doc, fh, separators=(",", ":"))
    fh.write("\n")


# -- chrome ----------------------------------------------------------------------------------------

def write_chrome(samples: Iterable[Sample], fh: TextIO, interval_ns: int, include_idle: bool = False) -> None:
    """Chrome Trace Event JSON (opens in Perfetto and chrome://tracing): nested B/E events per thread.

    Consecutive samples of a thread become duration events: frames that left the stack are closed
    innermost first, new ones opened outermost first, all at the sample's time. Two frames are the same
    for nesting when (qualname, file) match, the line is ignored: a loop body sampled on many lines
    stays one event instead of thousands, and `args.line` is the line where the event was opened.
    Frames still open at the end close at the process's last sample plus `interval_ns`. Events are
    written as they are made, so the output is in time order.
    """
    interval_ns = _check_interval(interval_ns)
    ordered = sorted(samples, key=lambda s: s.mono_ns)
    t0 = ordered[0].mono_ns if ordered else 0
    open_stacks: dict[_ThreadKey, list[tuple[str, str]]] = {}
    threads_of: dict[int, list[_ThreadKey]] = {}
    last_mono_ns: dict[int, int] = {}
    out = _EventWriter(fh)

    for sample in ordered:
        pid = sample.pid
        ts = (sample.mono_ns - t0) / 1000
        if pid not in threads_of:
            threads_of[pid] = []
            out.emit({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                      "args": {"name": f"process {pid}"}})
        last_mono_ns[pid] = sample.mono_ns
        seen: set[_ThreadKey] = set()
        for thread in sample.threads:
            key = (pid, thread.tid, thread.thread_id)
            seen.add(key)
            frames = list(reversed(thread.frames)) if (include_idle or thread.active) else []
            if key not in open_stacks:
                if not frames:
                    continue  # never shown a stack: no thread_name event for it yet
                open_stacks[key] = []
                threads_of[pid].append(key)
                out.emit({"ph": "M", "name": "thread_name", "pid": pid, "tid": _chrome_tid(key),
                          "args": {"name": _thread_label(thread)}})
            _move_to(out, key, open_stacks[key], frames, ts)
        for key in threads_of[pid]:
            if key not in seen and open_stacks[key]:
                _move_to(out, key, open_stacks[key], [], ts)

    for pid, keys in threads_of.items():
        ts = (last_mono_ns[pid] + interval_ns - t0) / 1000
        for key in keys:
            _move_to(out, key, open_stacks[key], [], ts)
    out.close(displayTimeUnit="ms")


def _chrome_tid(key: _ThreadKey) -> int:
    _, tid, thread_id = key
    return tid if tid else thread_id


def _move_to(out: _EventWriter, key: _ThreadKey, stack: list[tuple[str, str]], frames: list[Frame],
             ts: float) -> None:
    """Close and open events so that `stack` (outermost first) matches `frames` (outermost first)."""
    common = 0
    for (qualname, file), frame in zip(stack, frames):
        if qualname != frame.qualname or file != frame.file:
            break
        common += 1
    pid, tid = key[0], _chrome_tid(key)
    while len(stack) > common:
        qualname, _ = stack.pop()
        out.emit({"ph": "E", "name": qualname, "pid": pid, "tid": tid, "ts": ts})
    for frame in frames[common:]:
        stack.append((frame.qualname, frame.file))
        out.emit({"ph": "B", "name": frame.qualname, "cat": "python", "pid": pid, "tid": tid, "ts": ts,
                  "args": {"file": frame.file, "line": frame.line}})


class _EventWriter:
    """Streams `{"traceEvents": [...], ...}` one event at a time."""

    def __init__(self, fh: TextIO) -> None:
        self._fh = fh
        self._first = True
        fh.write('{"traceEvents":[')

    def emit(self, event: dict) -> None:
        self._fh.write("\n" if self._first else ",\n")
        self._first = False
        self._fh.write(json.dumps(event, separators=(",", ":")))

    def close(self, **fields) -> None:
        self._fh.write("\n]")
        for k, v in fields.items():
            self._fh.write(f",{json.dumps(k)}:{json.dumps(v)}")
        self._fh.write("}\n")


# -- shared ----------------------------------------------------------------------------------------

def _by_pid(samples: Iterable[Sample]) -> dict[int, list[Sample]]:
    """Samples of each process in mono_ns order, processes in order of their first sample."""
    by_pid: dict[int, list[Sample]] = {}
    for sample in sorted(samples, key=lambda s: s.mono_ns):
        by_pid.setdefault(sample.pid, []).append(sample)
    return by_pid


def _check_interval(interval_ns: int | None) -> int:
    if interval_ns is None or isinstance(interval_ns, bool) or not isinstance(interval_ns, int) or interval_ns <= 0:
        raise ValueError(f"interval_ns must be a positive integer of nanoseconds, got {interval_ns!r}")
    return interval_ns
