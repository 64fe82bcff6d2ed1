"""Findings, the product's answer, and their lifecycle: a pure merge of a detector's output into open findings.

A detector returns `Finding`s for one window of one job (what it sees now). `merge()` folds that output into
the findings the store holds for the same job and detector, the way Prometheus evaluates an alerting rule:
  * identity: (job, detector, kind, top suspect). The same identity seen again updates last_ns, severity
    (latest; peak_severity keeps the worst), summary, suspects and evidence, and counts a confirmation. Several
    outputs of one identity in one window (a detector that reports each episode still in its window: the
    sentinel's 60 s) are one: the most severe of those still going on (last_ns within resolve_after of the
    window's end), else the newest. The most severe of all hid a new, milder episode of a serving engine behind
    an earlier one that was over, until that one left the window (~40 s: on the inference bed a memory fault
    right after a CPU fault was found only then, too late for its deep dive); the newest of all let a fault's
    finding take the figures and cause of a mild blip just after it;
  * `for`: a new identity starts `pending` and opens once it has been confirmed for `for_ns` of data time
    (0: opens at once). A pending one not confirmed by the next window is dropped, as Prometheus drops a
    pending alert whose condition went false. `confirm=True` (an operator's `diagnose`) opens at once;
  * resolve: an open finding that no window has confirmed for `resolve_after_ns` of data time is resolved
    (status `resolved`, resolved_ns = the window's end): the job is back at its baseline. Only windows that
    ran on data count, so a job that stops sending data (a hang) never resolves by silence. An output whose
    own last_ns is already that old (a window reaching back over an event that is over) confirms nothing: a
    new one is stored straight as resolved (history, when it may open at all), an open one resolves.
Times are cluster ns taken from the window (data time), never the wall clock, so the same inputs give the
same changes in tests, in the loop and on demand. Cost: O(open findings + output) per call.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace

SUSPECT_KINDS = ("rank", "gpu", "node", "nic", "switch", "link", "process", "function")
STATUSES = ("pending", "open", "resolved")  # pending is internal: listings show open and resolved


@dataclass(frozen=True)
class Suspect:
    """Who is to blame, best first in a finding. id: a rank's global rank ("13"), a node's agent node id,
    a GPU/NIC/link/switch id from the topology file, a process "node:pid", a function "module:qualname"."""

    kind: str
    id: str
    score: float = 1.0
    cause: str = ""          # compute | network | cpu | hang | ...
    evidence: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in SUSPECT_KINDS:
            raise ValueError(f"suspect kind {self.kind!r} is not one of {', '.join(SUSPECT_KINDS)}")

    def to_json(self) -> dict:
        return {"kind": self.kind, "id": self.id, "score": self.score, "cause": self.cause, "evidence": self.evidence}

    @classmethod
    def from_json(cls, d: dict) -> "Suspect":
        return cls(d["kind"], str(d["id"]), float(d.get("score", 1.0)), d.get("cause", ""), d.get("evidence") or {})


@dataclass(frozen=True)
class Finding:
    """What a detector says about one job. A detector fills kind, onset_ns, last_ns, severity, summary,
    suspects and evidence (job_key and detector are set by the engine); the lifecycle fills the rest."""

    kind: str
    onset_ns: int
    last_ns: int
    severity: float
    summary: str
    suspects: tuple[Suspect, ...] = ()
    evidence: dict = field(default_factory=dict)
    job_key: str = ""
    detector: str = ""
    id: str = ""
    status: str = "open"
    resolved_ns: int = 0
    peak_severity: float = 0.0
    confirmations: int = 1
    first_seen_ns: int = 0   # window end when first seen (the `for` clock starts here)

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        top = self.suspects[0] if self.suspects else None
        return (self.job_key, self.detector, self.kind, top.kind if top else "", top.id if top else "")

    def to_json(self) -> dict:
        """The JSON shape of `steplens findings --json` (and of the Control API's Finding)."""
        return {"id": self.id, "job_key": self.job_key, "kind": self.kind, "detector": self.detector,
                "status": self.status, "onset_ns": self.onset_ns, "last_ns": self.last_ns,
                "resolved_ns": self.resolved_ns, "severity": self.severity,
                "peak_severity": max(self.peak_severity, self.severity), "summary": self.summary,
                "suspects": [s.to_json() for s in self.suspects], "evidence": self.evidence,
                "confirmations": self.confirmations}


def finding_id(key: tuple, onset_ns: int) -> str:
    """Stable and unique per (identity, onset): the same fault re-opened later gets a new id."""
    return hashlib.sha1(json.dumps([*key, onset_ns]).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Policy:
    """Lifecycle settings of one detector (from its config: for_seconds, resolve_after_seconds)."""

    for_ns: int = 0
    resolve_after_ns: int = 120 * 10**9


@dataclass(frozen=True)
class Change:
    action: str     # opened | updated | resolved | pending | dropped
    finding: Finding


def merge(current: list[Finding], emitted: list[Finding], until_ns: int, policy: Policy,
          confirm: bool = False, resolved: Callable[[], list[Finding]] = list) -> list[Change]:
    """Fold one window's output of one detector for one job into its pending/open findings.

    current: the stored pending and open findings of this (job, detector); emitted: the detector's output
    for a window ending at until_ns (job_key and detector set); resolved: reads its resolved findings of late,
    called only where an output that is over has no live finding (one that a resolved finding of the same identity
    already covers is the same event reported again by a window that still holds it: not stored a second time).
    Returns the changes to store and announce;
    findings neither confirmed nor due to resolve are left out (nothing to write)."""
    live = {f.key: f for f in current if f.status in ("pending", "open")}
    seen: dict[tuple, Finding] = {}
    past: list[Finding] | None = None   # resolved(), read at most once
    def rank(f: Finding) -> tuple:   # one finding per identity per window: see the module docstring
        fresh = until_ns - f.last_ns < policy.resolve_after_ns
        return (fresh, f.severity, f.last_ns) if fresh else (fresh, f.last_ns, f.severity)
    for f in emitted:
        if f.key not in seen or rank(f) > rank(seen[f.key]):
            seen[f.key] = f
    changes: list[Change] = []
    for key, f in seen.items():
        old = live.get(key)
        stale = until_ns - f.last_ns >= policy.resolve_after_ns  # seen, but over already (an old window)
        if old is None:
            first = until_ns
            onset = min(f.onset_ns, f.last_ns) or until_ns
            opens = confirm or policy.for_ns <= 0
            new = replace(f, id=finding_id(key, onset), onset_ns=onset, status="open" if opens else "pending",
                          peak_severity=f.severity, confirmations=1, first_seen_ns=first, resolved_ns=0)
            if stale:  # history: stored resolved when it may open (an operator's diagnose), else nothing
                if not confirm:
                    past = resolved() if past is None else past
                    if any(r.key == key and r.onset_ns <= f.last_ns and f.onset_ns <= r.last_ns for r in past):
                        continue   # reported already, and resolved: the same episode still in the detector's window
                if opens:
                    changes.append(Change("resolved", replace(new, status="resolved", resolved_ns=until_ns)))
                continue
            changes.append(Change("opened" if opens else "pending", new))
            continue
        status = old.status
        if status == "pending" and (confirm or until_ns - old.first_seen_ns >= policy.for_ns):
            status = "open"
        new = replace(f, id=old.id, onset_ns=min(old.onset_ns, f.onset_ns or old.onset_ns),
                      last_ns=max(old.last_ns, f.last_ns), status=status, resolved_ns=0,
                      peak_severity=max(old.peak_severity, old.severity, f.severity),
                      confirmations=old.confirmations + 1, first_seen_ns=old.first_seen_ns)
        if until_ns - new.last_ns >= policy.resolve_after_ns:  # re-reported nothing newer: resolve or drop
            if status == "open" and old.status == "open":
                changes.append(Change("resolved", replace(new, status="resolved", resolved_ns=until_ns)))
            elif old.status == "pending":
                changes.append(Change("dropped", old))
            continue
        changes.append(Change("opened" if old.status == "pending" and status == "open" else
                              "pending" if status == "pending" else "updated", new))
    for key, old in live.items():
        if key in seen:
            continue
        if old.status == "pending":
            changes.append(Change("dropped", old))
        elif until_ns - old.last_ns >= policy.resolve_after_ns:
            changes.append(Change("resolved", replace(old, status="resolved", resolved_ns=until_ns)))
    return changes
