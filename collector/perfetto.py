"""One Perfetto trace (protobuf TrackEvent format) of a job's ranks in cluster time, for `steplens trace`.

Pure: rows in, bytes out; what to put in comes from control/trace.py. Layout, as the Perfetto UI shows it:

  findings                          one slice per finding (onset .. last), its summary and top suspect as args
  node <id>                         one group per agent
    deep dives                      the node's deep-mode windows, from its ModeChange records
    <counter> ...                   NVML (DCGM_FI_*) and host counters (cumulative *_total turned into rates)
    rank <r> · pid <p>              one group per rank ("process · pid <p>" for a process of no rank: a server)
      steps / iterations            step and iteration slices
      python <tid>                  Python stacks as nested slices (consecutive samples sharing frames merge)
      comm <desc>                   comm ops; every member of a collective gets a flow arrow to the member that
                                    entered it last (the one the others waited for): n-1 flows per collective
      stream <device>:<stream>      GPU kernels
      <counter> ...                 the process's CPU, run-queue and memory counters

Slices on one track must nest; a row that would overlap the previous slice on its track is clipped to start where
that one ended (counted in `clipped`), so a wrong row never breaks the trace. Times are cluster ns.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from steplens.perfetto import trace_pb2 as pf

_BEGIN, _END, _INSTANT, _COUNTER = 1, 2, 3, 4
_SEQ = 0x5EED  # one trusted sequence for the whole file
_ORDER = {_END: 0, _COUNTER: 1, _INSTANT: 2, _BEGIN: 3}  # at one timestamp: close before open


def _uuid(*parts) -> int:
    return int.from_bytes(hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest(),
                          "little") >> 1 or 1


@dataclass
class TraceStats:
    tracks: int = 0
    slices: int = 0
    counters: int = 0
    flows: int = 0
    clipped: int = 0
    by_kind: dict = field(default_factory=dict)

    def count(self, kind: str, n: int = 1) -> None:
        self.by_kind[kind] = self.by_kind.get(kind, 0) + n


class TraceBuilder:
    def __init__(self) -> None:
        self._tracks: list[pf.TracePacket] = []
        self._events: list[tuple[int, int, int, pf.TracePacket]] = []  # (ts, order, n, packet)
        self._known: set[int] = set()
        self._last_end: dict[int, int] = {}   # track -> end of its last top-level slice
        self._next_flow = 1
        self.stats = TraceStats()

    # -- tracks ------------------------------------------------------------------------------------
    def track(self, key: tuple, name: str, parent: int = 0, counter_unit: str | None = None,
              description: str = "", order: int | None = None) -> int:
        uuid = _uuid(*key)
        if uuid in self._known:
            return uuid
        self._known.add(uuid)
        p = pf.TracePacket(trusted_packet_sequence_id=_SEQ)
        d = p.track_descriptor
        d.uuid, d.name = uuid, name
        if parent:
            d.parent_uuid = parent
        if description:
            d.description = description
        if order is not None:
            d.sibling_order_rank = order
        if counter_unit is not None:
            units = {"ns": pf.CounterDescriptor.UNIT_TIME_NS, "bytes": pf.CounterDescriptor.UNIT_SIZE_BYTES,
                     "count": pf.CounterDescriptor.UNIT_COUNT}
            if counter_unit in units:
                d.counter.unit = units[counter_unit]
            else:
                d.counter.unit_name = counter_unit
        else:
            d.child_ordering = pf.TrackDescriptor.EXPLICIT
        self._tracks.append(p)
        self.stats.tracks += 1
        return uuid

    # -- events ------------------------------------------------------------------------------------
    def _event(self, ts: int, typ: int, track: int, name: str = "", args: dict | None = None,
               flows=(), ends=(), value: float | None = None) -> None:
        p = pf.TracePacket(timestamp=int(ts), trusted_packet_sequence_id=_SEQ)
        e = p.track_event
        e.type, e.track_uuid = typ, track
        if name:
            e.name = name
        for k, v in (args or {}).items():
            if v is None:
                continue
            a = e.debug_annotations.add(name=str(k))
            if isinstance(v, bool):
                a.bool_value = v
            elif isinstance(v, int):
                a.int_value = v
            elif isinstance(v, float):
                a.double_value = v
            else:
                a.string_value = str(v)
        if flows:
            e.flow_ids.extend(flows)
        if ends:
            e.terminating_flow_ids.extend(ends)
        if value is not None:
            e.double_counter_value = float(value)
        self._events.append((int(ts), _ORDER[typ], len(self._events), p))

    def slice(self, track: int, start: int, end: int, name: str, args: dict | None = None, flows=(),
              ends=(), kind: str = "") -> bool:
        """A top-level slice on `track`; False (nothing written) for one with no length left after clipping."""
        last = self._last_end.get(track, 0)
        if start < last:
            self.stats.clipped += 1
            start = last
        if end <= start:
            return False
        self._event(start, _BEGIN, track, name, args, flows, ends)
        self._event(end, _END, track)
        self._last_end[track] = end
        self.stats.slices += 1
        if kind:
            self.stats.count(kind)
        return True

    def nested(self, track: int, spans: list[tuple[int, int, int, str, dict | None]], kind: str = "") -> None:
        """Slices that nest by construction (start, end, depth, name, args), sorted by start then depth."""
        last = self._last_end.get(track, 0)
        n = 0
        for start, end, _depth, name, args in spans:
            if start < last or end <= start:
                self.stats.clipped += start < last
                continue
            self._event(start, _BEGIN, track, name, args)
            self._event(end, _END, track)
            n += 1
        if spans:
            self._last_end[track] = max(last, max(s[1] for s in spans))
        self.stats.slices += n
        if kind:
            self.stats.count(kind, n)

    def instant(self, track: int, ts: int, name: str, args: dict | None = None) -> None:
        self._event(ts, _INSTANT, track, name, args)

    def counter(self, track: int, ts: int, value: float) -> None:
        self._event(ts, _COUNTER, track, value=value)
        self.stats.counters += 1

    def serialize(self) -> bytes:
        """Track descriptors first, then every event in time order (ends before begins at one instant)."""
        first = pf.TracePacket(trusted_packet_sequence_id=_SEQ, sequence_flags=1)
        self._events.sort(key=lambda e: (e[0], e[1], e[2]))
        trace = pf.Trace()
        trace.packet.append(first)
        trace.packet.extend(self._tracks)
        trace.packet.extend(e[3] for e in self._events)
        return trace.SerializeToString()


def stack_spans(samples: list[tuple[int, list[str]]], period_ns: int, until_ns: int = 0
                ) -> list[tuple[int, int, int, str, dict | None]]:
    """One thread's samples (ts, frame names outermost first) as nested slices: a frame stays open while the
    following samples keep it (the same frame at the same depth under the same parents); a sample stands for the
    time until the next one, at most 2 sampling periods (a longer gap is a gap); the last for one period."""
    spans: list[list] = []
    open_: list[list] = []   # per depth: [start, end, depth, name]
    for i, (ts, frames) in enumerate(samples):
        if i + 1 < len(samples):
            nxt = samples[i + 1][0]
            end = min(nxt, ts + 2 * period_ns) if period_ns else nxt
        else:  # the last sample stands for one period (not past the window's end)
            end = min(until_ns, ts + period_ns) if until_ns else ts + period_ns
        keep = 0
        while keep < len(open_) and keep < len(frames) and open_[keep][3] == frames[keep] \
                and open_[keep][1] >= ts:
            keep += 1
        del open_[keep:]
        for d, name in enumerate(frames):
            if d < keep:
                open_[d][1] = end
            else:
                s = [ts, end, d, name]
                spans.append(s)
                open_.append(s)
    return [(s[0], s[1], s[2], s[3], None) for s in sorted(spans, key=lambda s: (s[0], s[2]))]
