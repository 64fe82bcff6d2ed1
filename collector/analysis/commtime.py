"""Slow communicators per job from their transfer time, even when the job's step time hides them.

Reads the window's Step records (their per-communicator summaries) and, for suspects, the stored topology and
the job's processes (rank -> node, local rank -> GPU -> NIC), through irregularity.load and
irregularity.nic_map; nothing else. Pure: `detect(reader, window, cfg) -> list[Finding]`, no writes, no
clock, no state across windows.

Why: many network faults (a slow link, a congested switch) barely move the job's step time, since
communication overlaps compute, so the irregularity gate never fires; the communicators crossing the bad
device still take longer to transfer.
Transfer time of a collective communicator in step s: the min over its members of busy_ns (the member that
waited least spent only the transfer; a slow GPU arrives last and waits least, so a compute straggler does not
raise it). Point-to-point communicators count by their sends (`<comm id>#send`: the agent summarizes sends
apart from receives; a send starts when its data is ready, its receiver mostly waits already, so its busy time
is mostly transfer; a receive's is mostly waiting and is left out). A pipeline pair's sends that did not slow
are no alibi for the devices on their path (a small transfer is latency-bound), so they count only when slow.
Per communicator, over the steps before the last recent_steps: a trailing baseline (median of the last
baseline_steps steps not flagged, a step being flagged at >= ratio x the baseline then in force, as the
irregularity gate does for the job). The communicator is slow when the median of its last recent_steps
transfer times is >= ratio x that baseline AND the excess is >= min_step_fraction of the job's step time
(median over the same steps): a 20 % rise on a communicator that takes 0.1 % of the step is noise.
Finding: one per window, kind `network`, onset at the first step of the slow run (flagged steps back from
the recent ones, one-step gaps allowed), severity = the largest transfer-time ratio (not the step-time ratio
the other kinds carry; the summary says so), suspects: NICs, links and switches scored by
irregularity.score_devices over the slow vs all collective communicators' ring paths; the members' nodes
without a stored topology.
No duplicate of the irregularity detector: when the job's step time over the recent steps is itself
>= gate_ratio x its baseline (the gate's delta), the gate fires and irregularity localizes slow communicators
with the same scoring, so this detector stays silent (gate_ratio = 0: report anyway).
Ties: one slow ring implicates all of its links alike (a ring runs at its slowest link's pace). When the best
suspects tie, irregularity.refine asks the agents of the ranks on them for their CommOps (progressive
fetching, probe.py) and scores their pipeline pairs' measured transfer times beside the rings: the slow link
comes first; the evidence says how many ranks were fetched. Without fetching (no agents connected) the tie
stays and the evidence says why. A link crossed by one pipeline pair only stays tied with its peer's link.
Cost: one pass over ranks x steps x communicators in plain Python: 2.2-2.4 s per window for 512 ranks x 100
steps on this 2-core VM (with an eval running beside it), ~70 % of it reading the Step records (load).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import median

from steplens.collector.analysis.base import ConfigError, DetectorConfig, DetectorSpec, Window
from steplens.collector.analysis.findings import Finding
from steplens.collector.analysis.irregularity import (P2P_OPS, IrregularityConfig, comm_key, load, nic_map,
                                                      refine, score_devices)


@dataclass
class CommtimeConfig(DetectorConfig):
    ratio: float = 1.2                   # recent transfer time >= ratio x the communicator's baseline: slow
    recent_steps: int = 5                # N: the median of the last N steps is compared with the baseline
    baseline_steps: int = 100            # trailing unflagged steps in a communicator's baseline (median)
    min_baseline_steps: int = 10         # no verdict before this many baseline steps
    min_step_fraction: float = 0.01      # excess transfer time per step at least this share of the step time
    gate_ratio: float = 1.1              # job step time this far above baseline: irregularity's (0: ignore)
    complete_fraction: float = 0.9       # a step counts once this share of the ranks has reported it
    max_suspects: int = 5

    def validate(self) -> None:
        super().validate()
        if not 1.0 < self.ratio <= 10.0:
            raise ConfigError(f"ratio must be within (1, 10], got {self.ratio}")
        if not 1 <= self.recent_steps <= 1000:
            raise ConfigError(f"recent_steps must be within 1..1000, got {self.recent_steps}")
        if not 2 <= self.min_baseline_steps <= self.baseline_steps <= 100_000:
            raise ConfigError("need 2 <= min_baseline_steps <= baseline_steps <= 100000")
        if not 0.0 <= self.min_step_fraction < 1.0:
            raise ConfigError(f"min_step_fraction must be within [0, 1), got {self.min_step_fraction}")
        if self.gate_ratio != 0 and not 1.0 < self.gate_ratio <= 10.0:
            raise ConfigError(f"gate_ratio must be 0 or within (1, 10], got {self.gate_ratio}")
        if not 0.0 < self.complete_fraction <= 1.0:
            raise ConfigError(f"complete_fraction must be within (0, 1], got {self.complete_fraction}")
        if self.max_suspects < 1:
            raise ConfigError("max_suspects must be >= 1")


def transfer_times(js, numbers_idx: range) -> tuple[dict[str, dict[int, int]], dict[str, set[int]]]:
    """Per collective communicator, and per point-to-point one's sends (`<id>#send`): step index -> min busy_ns
    over its members, and its members."""
    t: dict[str, dict[int, int]] = {}
    members: dict[str, set[int]] = {}
    numbers = js.numbers
    for rank, steps in js.rows.items():
        mine: set[str] = set()
        for i in numbers_idx:
            row = steps.get(numbers[i])
            if row is None:
                continue
            for c in row["comms"]:
                op = c["op"]
                if op in P2P_OPS:
                    if op != "send":
                        continue  # a receive's busy time is mostly waiting for its sender
                    cid = comm_key(c)
                else:
                    cid = c["comm_id"]
                mine.add(cid)
                b = c["busy_ns"]
                if b > 0:
                    per = t.get(cid)
                    if per is None:
                        per = t[cid] = {}
                    if b < per.get(i, 1 << 62):
                        per[i] = b
        for cid in mine:
            members.setdefault(cid, set()).add(rank)
    return t, {c: m for c, m in members.items() if len(m) >= 2}


def baseline(series: list[tuple[int, int]], cfg: CommtimeConfig) -> tuple[float, list[bool]]:
    """Trailing median of unflagged values at the end of series, and each value's flag against the baseline
    in force when it came (0.0 and no flags before min_baseline_steps values)."""
    hist: deque = deque(maxlen=cfg.baseline_steps)
    flags = []
    for _, v in series:
        b = median(hist) if len(hist) >= cfg.min_baseline_steps else 0.0
        f = bool(b) and v >= cfg.ratio * b
        flags.append(f)
        if not f:
            hist.append(v)
    return (median(hist) if len(hist) >= cfg.min_baseline_steps else 0.0), flags


def slow_comms(trans: dict[str, dict[int, int]], members: dict[str, set[int]], lo: int, step_now: float,
               cfg: CommtimeConfig) -> tuple[dict[str, float], dict[str, int], dict[str, dict]]:
    """Communicators whose median transfer time from step index lo on is >= ratio x their baseline before it,
    by >= min_step_fraction of step_now: (comm -> ratio, comm -> onset index, comm -> evidence)."""
    N = cfg.recent_steps
    slow: dict[str, float] = {}
    onset_idx: dict[str, int] = {}
    ev: dict[str, dict] = {}
    for cid, per in trans.items():
        if cid not in members:
            continue
        before = sorted((i, v) for i, v in per.items() if i < lo)
        recent = [v for i, v in per.items() if i >= lo]
        if len(recent) < math.ceil(N / 2):
            continue
        base, _ = baseline(before, cfg)
        if not base:
            continue
        now = median(recent)
        if now < cfg.ratio * base or now - base < cfg.min_step_fraction * step_now:
            continue
        slow[cid] = now / base
        # onset: back from the recent steps over values still >= ratio x baseline (one-step gaps allowed)
        first = min(i for i, v in per.items() if i >= lo and v >= cfg.ratio * base) if any(
            v >= cfg.ratio * base for i, v in per.items() if i >= lo) else lo
        k = len(before) - 1
        while k >= 0 and (before[k][1] >= cfg.ratio * base or (k > 0 and before[k - 1][1] >= cfg.ratio * base)):
            if before[k][1] >= cfg.ratio * base:
                first = before[k][0]
            k -= 1
        onset_idx[cid] = first
        ev[cid] = {"ratio": round(now / base, 3), "baseline_ns": int(base), "recent_ns": int(now)}
    return slow, onset_idx, ev


def detect(reader, window: Window, cfg: CommtimeConfig) -> list[Finding]:
    js = load(reader, window, IrregularityConfig(complete_fraction=cfg.complete_fraction))
    n = len(js.numbers)
    N = cfg.recent_steps
    if n < cfg.min_baseline_steps + N:
        return []
    lo = n - N
    step_now = median(js.x_ns[lo:])
    if cfg.gate_ratio:
        _, job_flags = baseline(list(enumerate(js.x_ns[:lo])), CommtimeConfig(
            ratio=cfg.gate_ratio, baseline_steps=cfg.baseline_steps, min_baseline_steps=cfg.min_baseline_steps))
        healthy = [x for x, f in zip(js.x_ns[:lo], job_flags) if not f][-cfg.baseline_steps:]
        if len(healthy) >= cfg.min_baseline_steps and step_now >= cfg.gate_ratio * median(healthy):
            return []  # the irregularity gate fires on these steps and localizes slow communicators itself
    trans, members = transfer_times(js, range(n))
    slow, onset_idx, ev = slow_comms(trans, members, lo, step_now, cfg)
    if not slow:
        return []
    topo, nic_of = nic_map(reader, window.job_key, js)
    sus = score_devices(slow, members, js.node_of, topo, nic_of)
    first = min(onset_idx.values())
    ref = [i for i in range(first) if i < lo][-cfg.baseline_steps:]
    sus, pev = refine(reader, window.job_key, js, sus, slow, members, topo, nic_of, ref, list(range(lo, n)))
    sus.sort(key=lambda s: (-s.score, s.kind, s.id))
    sus = sus[:cfg.max_suspects]
    sev = max(slow.values())
    top = f"; top suspect {sus[0].kind} {sus[0].id}" if sus else ""
    worst = sorted(slow, key=lambda c: -slow[c])
    summary = (f"{len(slow)} communicator(s) transfer slowly: up to {sev:.2f}x their baseline transfer time "
               f"(severity is this transfer-time ratio; job step time {step_now / 1e6:.1f} ms){top}.")
    return [Finding(kind="network", onset_ns=js.start_ns[first], last_ns=js.end_ns[-1], severity=round(sev, 4),
                    summary=summary, suspects=tuple(sus),
                    evidence={"first_step": js.numbers[first], "recent_steps": N, "ratio": cfg.ratio,
                              "step_ns": int(step_now), "slow_comms": {c: ev[c] for c in worst[:10]},
                              "slow_count": len(slow), "comms": len(members),
                              **({"probe": pev} if pev else {})})]


SPEC = DetectorSpec(
    name="commtime",
    description="communicators whose transfer time (min busy time over members) rose against their own "
                "baseline, localized to NICs, links and switches over their paths",
    kinds=("network",),
    config_class=CommtimeConfig,
    detect=detect,
)
