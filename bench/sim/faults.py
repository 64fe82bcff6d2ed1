"""Fault specs of the simulator: parsing `KIND:TARGET:START:END[:VALUE[:PERIOD]]` and the factor a
fault applies in a given iteration.

Kinds and what VALUE means (defaults in DEFAULT_VALUE):
  slow_gpu          compute of rank TARGET takes VALUE x as long, iterations [START, END)
  slow_link         NIC link TARGET (`n12.nic3`, or a rank = that rank's NIC) has 1/VALUE of its bandwidth
  congested_switch  every flow through switch TARGET (`leaf4`, `spine1`) gets 1/VALUE of its bandwidth
  hang              rank TARGET stops at the start of iteration START for VALUE seconds (default: END-START
                    nominal steps); everything that depends on it waits
  fluctuation       periodic: factor 1 + (VALUE-1) * (1 - cos(2 pi (i-START)/PERIOD)) / 2 on TARGET
                    (a rank: compute; a link or switch: bandwidth), iterations [START, END)
  degradation       persistent: factor ramps linearly from 1 at START to VALUE at END, then stays to the end
TARGET is a global rank (an integer), a link id or a switch id.
A link or switch fault slows every collective whose traffic crosses it: PP send/recv, the DP ring, and with
expert parallelism the EP all-to-alls and the expert-gradient rings (model.Network indexes them all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .topology import Topology

KINDS = ("slow_gpu", "slow_link", "congested_switch", "hang", "fluctuation", "degradation")
DEFAULT_VALUE = {"slow_gpu": 4.0, "slow_link": 10.0, "congested_switch": 8.0, "hang": 0.0,
                 "fluctuation": 3.0, "degradation": 2.0}
DEFAULT_PERIOD = 10.0


@dataclass(frozen=True)
class Fault:
    kind: str
    target: str          # as given
    start: int
    end: int
    value: float
    period: float = DEFAULT_PERIOD
    resource: str = ""   # "rank" | "link" | "switch"
    rank: int = -1       # for resource == "rank"
    link: str = ""
    switch: str = ""

    def factor(self, it: int) -> float:
        """Multiplier on duration (rank) or divisor of bandwidth (link/switch) in iteration `it`; 1.0 = none."""
        if it < self.start:
            return 1.0
        if self.kind == "degradation":
            span = max(1, self.end - self.start)
            return 1.0 + (self.value - 1.0) * min(1.0, (it - self.start + 1) / span)
        if it >= self.end:
            return 1.0
        if self.kind == "fluctuation":
            return 1.0 + (self.value - 1.0) * (1.0 - math.cos(2 * math.pi * (it - self.start) / self.period)) / 2
        if self.kind == "hang":
            return 1.0
        return self.value

    def active(self, it: int) -> bool:
        return it >= self.start if self.kind == "degradation" else self.start <= it < self.end


def parse_fault(spec: str, topo: Topology) -> Fault:
    parts = spec.split(":")
    if not 4 <= len(parts) <= 6:
        raise ValueError(f"fault {spec!r}: want KIND:TARGET:START:END[:VALUE[:PERIOD]]")
    kind, target = parts[0], parts[1]
    if kind not in KINDS:
        raise ValueError(f"fault {spec!r}: kind must be one of {', '.join(KINDS)}")
    try:
        start, end = int(parts[2]), int(parts[3])
        value = float(parts[4]) if len(parts) > 4 and parts[4] else DEFAULT_VALUE[kind]
        period = float(parts[5]) if len(parts) > 5 else DEFAULT_PERIOD
    except ValueError:
        raise ValueError(f"fault {spec!r}: START/END must be integers, VALUE/PERIOD numbers") from None
    if start < 0 or end < start:
        raise ValueError(f"fault {spec!r}: need 0 <= START <= END")
    if period <= 0 or (kind != "hang" and value <= 0):
        raise ValueError(f"fault {spec!r}: VALUE and PERIOD must be positive")
    res, rank, link, switch = _target(kind, target, topo, spec)
    return Fault(kind, target, start, end, value, period, res, rank, link, switch)


def _target(kind: str, target: str, topo: Topology, spec: str) -> tuple[str, int, str, str]:
    if target.lstrip("-").isdigit():
        r = int(target)
        if not 0 <= r < topo.gpus:
            raise ValueError(f"fault {spec!r}: rank {r} outside 0..{topo.gpus - 1}")
        if kind == "slow_link":
            return "link", -1, topo.link_of(r), ""
        if kind == "congested_switch":
            raise ValueError(f"fault {spec!r}: congested_switch needs a switch id (leaf<k>, spine<k>)")
        return "rank", r, "", ""
    if target.startswith(("leaf", "spine")):
        if target not in topo.switches():
            raise ValueError(f"fault {spec!r}: no switch {target!r} (have {', '.join(topo.switches()[:6])} ...)")
        if kind not in ("congested_switch", "fluctuation", "degradation"):
            raise ValueError(f"fault {spec!r}: {kind} needs a rank or link, not a switch")
        return "switch", -1, "", target
    try:
        topo.rank_of_link(target)
    except ValueError as exc:
        raise ValueError(f"fault {spec!r}: {exc}") from None
    if kind not in ("slow_link", "fluctuation", "degradation"):
        raise ValueError(f"fault {spec!r}: {kind} needs a rank, not a link")
    return "link", -1, target, ""
