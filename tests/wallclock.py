"""Recorded fixtures that carry CLOCK_REALTIME times, rebased at load.

A trace recorded on some day converts to a negative CLOCK_MONOTONIC on any machine whose uptime is shorter than
the fixture's age (every fresh CI machine, soon after it was recorded): a test that feeds such a fixture through
a RealtimeClock must shift its times to "just now" first. Tests that check the parser's own arithmetic (an
identity or fixed to_mono) keep the recorded times.
"""

from __future__ import annotations

import copy
import json
import time


def kineto_end_ns(doc: dict) -> int:
    """The latest CLOCK_REALTIME ns an X event of a Kineto trace reaches (baseTimeNanoseconds + ts + dur)."""
    base = doc.get("baseTimeNanoseconds", 0) or 0
    ends = [float(e["ts"]) + float(e.get("dur", 0)) for e in doc["traceEvents"]
            if isinstance(e, dict) and e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))]
    return base + int(max(ends) * 1000)


def rebase_kineto(doc: dict, end_ns: int | None = None) -> dict:
    """A copy of a Kineto trace whose last event ends at `end_ns` (default: 1 s ago); times relative to each
    other are unchanged. Traces with baseTimeNanoseconds shift it; older ones (absolute `ts` in µs) shift every
    event's ts."""
    end_ns = time.time_ns() - 10**9 if end_ns is None else end_ns
    shift = end_ns - kineto_end_ns(doc)
    out = copy.deepcopy(doc)
    if out.get("baseTimeNanoseconds"):
        out["baseTimeNanoseconds"] += shift
    else:
        for e in out["traceEvents"]:
            if isinstance(e, dict) and isinstance(e.get("ts"), (int, float)):
                e["ts"] = e["ts"] + shift / 1000
    return out


def rebased_kineto_bytes(path: str, end_ns: int | None = None) -> bytes:
    with open(path, "rb") as fh:
        return json.dumps(rebase_kineto(json.load(fh), end_ns)).encode()


FLIGHTREC_TIME_KEYS = ("time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns")


def rebase_flightrec(dump: dict, end_ns: int | None = None) -> dict:
    """A copy of a Flight Recorder dump whose latest entry time is `end_ns` (default: 1 s ago)."""
    end_ns = time.time_ns() - 10**9 if end_ns is None else end_ns
    times = [e[k] for e in dump.get("entries", []) for k in FLIGHTREC_TIME_KEYS if isinstance(e.get(k), int) and e[k]]
    out = copy.deepcopy(dump)
    if not times:
        return out
    shift = end_ns - max(times)
    for e in out.get("entries", []):
        for k in FLIGHTREC_TIME_KEYS:
            if isinstance(e.get(k), int) and e[k]:
                e[k] += shift
    return out
