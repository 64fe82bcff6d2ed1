"""The loop closed: a finding starts a synchronized deep dive on its job's nodes, and the dive's data is ranked into
root causes attached to the finding (LatencyPrism §4.7-4.8, with the policy the paper leaves open).

  trigger    a finding opened (the analysis engine's FindingsHub) whose kind, detector and severity pass the policy,
             or an operator (`steplens deep start --job JOB`). One cluster-time start `lead_ms` ahead, converted per
             agent by its clock model (control/trigger.py), on every node that hosts a live rank of the job, for
             `duration_seconds`. Refused, with the reason counted and logged: a job in its cool-down (one dive per
             job per `cooldown_seconds`), the cluster's rate limit (`max_per_hour`), the overhead budget (a job's
             nodes in deep mode at most `max_deep_fraction` of the last hour, the dive's own duration included),
             no node of the job connected, the job's last dive still running (`busy`).
  escalation a finding that grows `escalation_factor` times as severe as it was when its dive started, once that
             dive is analysed and blamed no resource (its top cause not a resource scoring `conclusive_score`),
             starts another dive past the cool-down (rate limit, budget and busy still apply), at most
             `max_dives_per_finding` for one finding; trigger "escalation". A false alarm's dive otherwise takes
             the cool-down from the fault that follows it within the same finding, and sees none of it (the
             inference bed: a 1.5x episode, then a 6x fault); a dive that found the cause is not redone because
             the sentinel's ratio kept rising through the same fault (its moving average fills). A finding of its
             own that is escalation_factor times as severe as the job's last dive's passes the cool-down too. A
             finding refused earlier is tried again when it escalates, or, refused for `busy` or the cool-down, at
             its first update after that lifted while it is still going on (its last output within max(10 s,
             2 x duration) of now). A hang (severity 0) and an operator's dive never escalate. Severity here is
             the finding's own or, where more, its recent part's (current_severity: the sentinel's last 5 s).
  reference  the `reference_seconds` that end `reference_gap_seconds` before the finding's onset (the job before it
             went wrong, at sentinel rates), or before the dive's start for an operator's dive without a finding;
             moved back past the job's other findings' episodes and its earlier dives' windows (quiet_reference,
             at most `reference_lookback_seconds`): a false alarm's spike or a deep window's own sampling in the
             reference is a rise the dive's own window no longer shows (the inference bed: a 6 s dive 4 s into a
             noisy neighbour ranked the engine's functions over its run-queue wait, 0.40 of the window, against a
             reference holding a false alarm's 0.18 and the end of another dive).
  result     after the window (plus `settle_seconds` for the agents' last batches): when each node switched (its
             ModeChange record, cluster time) and the spread; the ranks' raw Python stacks of both windows fetched
             from the agents (node-local detail), their steps, process and node counters, stop events and
             connections from the store; ranked by analysis/suspicion.py. Stored in deep_dives (store migration 13),
             shown as the finding's `deep_dive`; watchers get the finding again as `updated`.
A dive whose nodes all refuse or are offline is stored `failed` with their answers; one whose analysis fails is
stored `failed` with the error, its data still on the nodes (`steplens trace --finding`).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import time
import uuid
from dataclasses import asdict, dataclass, field

from steplens.collector.analysis import suspicion
from steplens.collector.analysis.base import ConfigError

log = logging.getLogger("steplens.collector.deepdive")

PROC_SHARES = {"runqueue": "process_runqueue_seconds_total", "throttled": "process_cpu_throttled_seconds_total",
               "gc": "python_gc_seconds_total"}
NODE_SHARES = {"memory": "pressure_memory_some_seconds_total"}
MAX_TRACKED = 10_000   # open findings remembered (their dives or refusals) until they resolve
CPUS_ALLOWED = "process_cpus_allowed"   # the "affinity" resource: the share of its CPUs a process lost (gauge)


@dataclass
class DeepDiveConfig:
    """The collector's [deep_dive] table."""

    enabled: bool = True
    kinds: list = field(default_factory=list)       # finding kinds that start one ([]: every kind)
    detectors: list = field(default_factory=list)   # detectors whose findings start one ([]: every detector)
    min_severity: float = 1.0                       # a finding below this step-time ratio starts none
    duration_seconds: float = 10.0
    lead_ms: int = 500                              # the start instant this far ahead: every agent gets it in time
    reference_seconds: float = 10.0
    reference_gap_seconds: float = 1.0
    reference_lookback_seconds: float = 120.0       # how far back a quiet reference is looked for
    cooldown_seconds: float = 600.0                 # per job
    max_per_hour: int = 12                          # every job together
    max_deep_fraction: float = 0.05                 # overhead budget: a job's deep time over the last hour
    settle_seconds: float = 3.0
    escalation_factor: float = 1.5                  # this much more severe: a dive past the cool-down (0: never)
    max_dives_per_finding: int = 3
    conclusive_score: float = 10.0                  # a dive whose top cause is a resource this strong: no escalation
    sources: list = field(default_factory=list)     # deep-mode sources ([]: all with a deep mode)

    def validate(self) -> None:
        for name in ("kinds", "detectors", "sources"):
            v = getattr(self, name)
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise ConfigError(f"{name} must be a list of strings, got {v!r}")
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"enabled must be true or false, got {self.enabled!r}")
        if not 0.5 <= self.duration_seconds <= 600:
            raise ConfigError(f"duration_seconds must be within 0.5..600, got {self.duration_seconds}")
        if not 50 <= self.lead_ms <= 60_000:
            raise ConfigError(f"lead_ms must be within 50..60000, got {self.lead_ms}")
        if not 0 <= self.reference_seconds <= 3600 or self.reference_gap_seconds < 0:
            raise ConfigError("reference_seconds must be within 0..3600 and reference_gap_seconds >= 0")
        if not 0 <= self.reference_lookback_seconds <= 86400:
            raise ConfigError(f"reference_lookback_seconds must be within 0..86400, got "
                              f"{self.reference_lookback_seconds}")
        if self.cooldown_seconds < 0 or self.max_per_hour < 1 or not 0 < self.max_deep_fraction <= 1:
            raise ConfigError("cooldown_seconds >= 0, max_per_hour >= 1 and max_deep_fraction within (0, 1]")
        if not 0 <= self.settle_seconds <= 120:
            raise ConfigError(f"settle_seconds must be within 0..120, got {self.settle_seconds}")
        if not (self.escalation_factor == 0 or 1 < self.escalation_factor <= 100) or self.max_dives_per_finding < 1:
            raise ConfigError("escalation_factor must be 0 (never) or within (1, 100], max_dives_per_finding >= 1")
        if not self.conclusive_score >= 0:
            raise ConfigError(f"conclusive_score must be >= 0, got {self.conclusive_score}")


@dataclass
class DeepDive:
    command_id: str
    job_key: str
    finding_id: str
    trigger: str                 # finding | escalation | operator
    requested_ns: int
    start_ns: int
    duration_ns: int
    reference_since_ns: int
    reference_until_ns: int
    nodes: list
    ranks: list
    status: str = "scheduled"    # scheduled | analysing | done | failed
    note: str = ""
    result: dict = field(default_factory=dict)
    delivered: list = field(default_factory=list)   # nodes that took the command (not stored: see note)
    messages: dict = field(default_factory=dict)    # node -> its answer

    def row(self) -> dict:
        return asdict(self)


class DeepDives:
    """Owned by the collector; runs on its event loop (where the agents' command channels live)."""

    def __init__(self, ingest, reader, writer, clock, hub, cfg: DeepDiveConfig | None = None) -> None:
        self.ingest, self.reader, self.writer, self.clock, self.hub = ingest, reader, writer, clock, hub
        self.cfg = cfg or DeepDiveConfig()
        self.cfg.validate()
        self.started: collections.deque = collections.deque()   # (cluster ns, job, duration ns) of the last hour
        self.last_by_job: dict[str, int] = {}
        self.last_dive: dict[str, tuple[int, float, str]] = {}   # job -> (its window's end + settle, severity, id)
        self.by_finding: dict[str, tuple] = {}   # open finding -> (dives, severity at the last, its id, DeepDive)
        self.refused: dict[str, tuple] = {}      # open finding -> (severity, reason, when it lifts ns) of its refusal
        self.skipped = collections.Counter()
        self.counts = collections.Counter()
        self._task: asyncio.Task | None = None
        self._pending: set[asyncio.Task] = set()
        self.last_refusal = ""
        self.refusal_lifts_ns = 0
        # a refused finding is tried again once the refusal lifts only while its detector still sees it going on
        self.fresh_ns = int(max(10.0, 2 * self.cfg.duration_seconds) * 1e9)

    # -- the finding stream ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self.cfg.enabled and self.hub is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        for t in [self._task, *self._pending]:
            if t is not None:
                t.cancel()
        self._task = None

    async def _watch(self) -> None:
        sub = self.hub.subscribe(asyncio.get_running_loop())
        try:
            while True:
                event, finding, _ = await sub.get()
                if event == "resolved":
                    self.by_finding.pop(finding.id, None)
                    self.refused.pop(finding.id, None)
                elif event in ("opened", "updated"):
                    try:
                        await self.on_finding(finding, event)
                    except Exception as exc:   # one bad dive never stops the watch
                        self._refuse(finding, "error")
                        log.error("deep dive for finding %s failed to start: %s", finding.id, exc)
        finally:
            self.hub.unsubscribe(sub)

    def policy(self, finding) -> str:
        """Why this finding starts no dive ('' when it does)."""
        c = self.cfg
        if c.kinds and finding.kind not in c.kinds:
            return "kind"
        if c.detectors and finding.detector not in c.detectors:
            return "detector"
        if finding.severity < c.min_severity and finding.kind != "hang":
            return "severity"
        return ""

    def _refuse(self, finding, why: str, lifts_ns: int = 0) -> None:
        """lifts_ns: when a refusal for the job's dive running (busy) or its cool-down lifts (0: never by itself);
        the finding is tried again at its first update after it, if it is still going on (fresh_ns)."""
        self.refused.pop(finding.id, None)
        self.refused[finding.id] = (current_severity(finding), why, lifts_ns)
        while len(self.refused) > MAX_TRACKED:   # a finding whose resolution never reached this watch
            self.refused.pop(next(iter(self.refused)))

    def conclusive(self, result: dict) -> bool:
        """A dive's ranking blames a resource (its top cause) at least conclusive_score: no escalation redoes it."""
        causes = result.get("causes") or []
        return bool(causes) and causes[0].get("kind") == "resource" and \
            causes[0].get("score", 0) >= self.cfg.conclusive_score

    def escalates(self, severity: float, than: float) -> bool:
        f = self.cfg.escalation_factor
        return f > 0 and than > 0 and severity >= f * than

    async def on_finding(self, finding, event: str = "opened") -> DeepDive | None:
        """A finding opened or updated: its dive, its escalation's, a retry of its refusal, or None (module
        docstring, trigger and escalation)."""
        why = self.policy(finding)
        mine, before = self.by_finding.get(finding.id), self.refused.get(finding.id)
        if why:
            if event == "opened":
                self.skipped[why] += 1
                self._refuse(finding, why)
            return None
        trigger, sev = "finding", current_severity(finding)
        if mine is not None:
            if mine[0] >= self.cfg.max_dives_per_finding or not self.escalates(sev, mine[1]):
                return None
            last = mine[3]
            if last.status in ("scheduled", "analysing") or (last.status == "done" and self.conclusive(last.result)):
                return None   # its result is not in yet (the next update after it), or it named a resource
            trigger = "escalation"
        elif event == "updated":
            if before is None:   # opened before this collector watched: a dive only once it escalates from here
                self._refuse(finding, "earlier")
                return None
            now = self.clock.now_ns()
            lifted = before[2] and now >= before[2] and now - finding.last_ns <= self.fresh_ns
            if not (lifted or before[1] == "severity" or self.escalates(sev, before[0])):
                return None
        ref_until = finding.onset_ns - int(self.cfg.reference_gap_seconds * 1e9)
        note = f"the finding escalated from {mine[1]:.2f} to {sev:.2f} after dive {mine[2]}" \
            if mine is not None else ""
        dd = await self.start_dive(finding.job_key, finding.id, trigger, ref_until, severity=sev,
                                   note=note)
        if dd is None or dd.status == "failed":
            if mine is None:
                self._refuse(finding, self.last_refusal if dd is None else "failed",
                             self.refusal_lifts_ns if dd is None else 0)
            return dd
        self.refused.pop(finding.id, None)
        self.by_finding[finding.id] = ((mine[0] if mine else 0) + 1, sev, dd.command_id, dd)
        while len(self.by_finding) > MAX_TRACKED:
            self.by_finding.pop(next(iter(self.by_finding)))
        return dd

    # -- starting one ---------------------------------------------------------------------------------------
    def admission(self, job_key: str, duration_ns: int, now: int, nodes: int, severity: float = 0.0) -> str:
        """Why a dive of the job may not start now ('' when it may); severity: the finding's (0: an operator's),
        which escalates past the cool-down when it is escalation_factor times the last dive's."""
        c = self.cfg
        hour = 3600 * 10**9
        while self.started and self.started[0][0] < now - hour:
            self.started.popleft()
        prev = self.last_dive.get(job_key)
        self.refusal_lifts_ns = 0
        if prev is not None and now < prev[0]:
            self.refusal_lifts_ns = prev[0]
            return f"busy: this job's dive {prev[2]} runs until {(prev[0] - now) / 1e9:.1f} s from now"
        last = self.last_by_job.get(job_key)
        if last is not None and now - last < c.cooldown_seconds * 1e9 and \
                not (prev is not None and self.escalates(severity, prev[1])):
            self.refusal_lifts_ns = last + int(c.cooldown_seconds * 1e9)
            return f"cooldown: this job's last dive started {(now - last) / 1e9:.0f} s ago " \
                   f"(cooldown_seconds {c.cooldown_seconds:.0f})"
        if len(self.started) >= c.max_per_hour:
            return f"rate limit: {len(self.started)} dives in the last hour (max_per_hour {c.max_per_hour})"
        spent = sum(d for _, j, d in self.started if j == job_key) + duration_ns
        if spent > c.max_deep_fraction * hour:
            return f"overhead budget: {spent / 1e9:.0f} s of deep mode in the hour would pass " \
                   f"max_deep_fraction {c.max_deep_fraction} ({c.max_deep_fraction * 3600:.0f} s)"
        if not nodes:
            return "no node of the job is connected"
        return ""

    async def start_dive(self, job_key: str, finding_id: str, trigger: str, ref_until_ns: int = 0,
                         duration_ns: int = 0, lead_ms: int = 0, force: bool = False,
                         severity: float = 0.0, note: str = "") -> DeepDive | None:
        """Start one dive on the job's nodes; None when the policy refuses it (counted in `skipped`, logged; the
        reason in `last_refusal`), or raises LookupError for a job with no live process. severity: the finding's
        (0: an operator's dive, which no finding escalates past: its cool-down holds)."""
        from steplens.collector.control.trigger import start_deep_mode
        from steplens.v1 import control_pb2 as cpb
        c = self.cfg
        procs = [p for p in await asyncio.to_thread(self.reader.procs) if p["job_key"] == job_key and p["alive"]]
        if not procs:
            raise LookupError(f"no live process of job {job_key!r} is known")
        nodes = sorted({p["node_id"] for p in procs})
        reachable = set(await self.ingest.connected_nodes())   # here or on another collector of the store
        connected = [n for n in nodes if n in reachable]
        duration = duration_ns or int(c.duration_seconds * 1e9)
        now = self.clock.now_ns()
        why = self.admission(job_key, duration, now, len(connected), severity)
        if why and not (force and connected):
            self.last_refusal = why.split(":")[0]
            self.skipped[self.last_refusal] += 1
            log.info("no deep dive for job %s (%s): %s", job_key, finding_id or trigger, why)
            return None
        command_id = "dd-" + uuid.uuid4().hex[:10]
        reply = await start_deep_mode(self.ingest, self.clock, cpb.DeepRequest(
            node_ids=nodes, enable=True, duration_ns=duration, lead_ms=lead_ms or c.lead_ms, sources=c.sources),
            command_id)
        ref_since, ref_until = await self.reference(job_key, ref_until_ns or
                                                    reply.start_ns - int(c.reference_gap_seconds * 1e9))
        dd = DeepDive(command_id, job_key, finding_id, trigger, now, reply.start_ns, duration, ref_since, ref_until,
                      nodes, sorted({p["rank"] for p in procs if p["rank"] is not None and p["rank"] >= 0}))
        messages = dict(reply.messages)
        dd.delivered, dd.messages = list(reply.delivered), messages
        if not reply.delivered:
            dd.status, dd.note = "failed", "no node took the command: " + "; ".join(
                f"{n}: {messages.get(n, 'offline')}" for n in nodes)
        else:
            self.started.append((now, job_key, duration))
            self.last_by_job[job_key] = now
            self.last_dive[job_key] = (reply.start_ns + duration + int(c.settle_seconds * 1e9),
                                       severity or float("inf"), command_id)   # 0: nothing escalates past it
            if reply.offline:
                dd.note = "not on: " + "; ".join(f"{n} ({messages.get(n, 'offline')})" for n in reply.offline)
        dd.note = "; ".join(x for x in (note, dd.note) if x)
        self.counts[dd.status] += 1
        await self._write(dd)
        log.info("deep dive %s for job %s (%s): %d node(s) from %d for %.1f s%s", command_id, job_key,
                 finding_id or trigger, len(reply.delivered), reply.start_ns, duration / 1e9,
                 f" ({dd.note})" if dd.note else "")
        if dd.status != "failed":
            task = asyncio.get_running_loop().create_task(self._finish(dd))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
        return dd

    async def reference(self, job_key: str, until_ns: int) -> tuple[int, int]:
        """The dive's reference window, ending at or before until_ns: quiet_reference over the job's findings'
        episodes and its dives' windows (+ settle) from the store. The store unreadable: the window at until_ns."""
        c = self.cfg
        length, gap = int(c.reference_seconds * 1e9), int(c.reference_gap_seconds * 1e9)
        lookback = int(c.reference_lookback_seconds * 1e9)
        settle = int(c.settle_seconds * 1e9)
        try:
            fs = await asyncio.to_thread(self.reader.findings, job_key, until_ns - lookback - length)
            dives = await asyncio.to_thread(self.reader.deep_dives, job_key, None, "", 200)
        except Exception as exc:   # an old or busy store: the plain window, said once per dive in the log
            log.warning("deep dive reference for job %s: the store's findings and dives unread (%s)", job_key, exc)
            return until_ns - length, until_ns
        busy = [(f.onset_ns, f.last_ns) for f in fs] + \
            [(d["start_ns"], d["start_ns"] + d["duration_ns"] + settle) for d in dives]
        return quiet_reference(busy, until_ns, length, gap, lookback)

    async def _write(self, dd: DeepDive) -> None:
        from steplens.collector.store import diagnosis as store
        from steplens.collector.store.writer import StoreJob, submit_and_wait
        outcome, _, note = await submit_and_wait(self.writer, lambda done: StoreJob(
            lambda conn: store.write_deep_dive(conn, dd.row(), self.clock.now_ns()), done))
        if outcome != "stored":
            log.error("deep dive %s not stored: %s", dd.command_id, note)

    # -- after the window ---------------------------------------------------------------------------------------
    async def _finish(self, dd: DeepDive) -> None:
        end = dd.start_ns + dd.duration_ns
        await asyncio.sleep(max(0.0, (end - self.clock.now_ns()) / 1e9) + self.cfg.settle_seconds)
        dd.status = "analysing"
        try:
            dd.result = await self.analyse(dd)
            dd.status = "done"
        except Exception as exc:
            dd.status, dd.note = "failed", f"analysis failed: {type(exc).__name__}: {exc}"
            log.error("deep dive %s: %s", dd.command_id, dd.note)
        self.counts[dd.status] += 1
        await self._write(dd)
        if dd.finding_id and self.hub is not None:
            from steplens.collector.analysis.findings import Change
            found = await asyncio.to_thread(self.reader.findings, dd.job_key, 0, False, 1, [dd.finding_id])
            if found:
                self.hub.publish([Change("updated", found[0])])

    async def analyse(self, dd: DeepDive) -> dict:
        from steplens.collector.control.fetch import fetch_paged
        t0 = time.perf_counter()
        end = dd.start_ns + dd.duration_ns
        deep = await fetch_paged(self.ingest, self.reader, self.clock, dd.job_key, [], dd.start_ns, end, ["stacks"])
        ref = await fetch_paged(self.ingest, self.reader, self.clock, dd.job_key, [], dd.reference_since_ns,
                                dd.reference_until_ns, ["stacks"]) if dd.reference_until_ns > dd.reference_since_ns \
            else None
        res = await asyncio.to_thread(analyse_dive, self.reader, dd, deep.rows, ref.rows if ref else [])
        res["fetch"] = {"messages": deep.messages, "offline": deep.offline}
        res["seconds"] = round(time.perf_counter() - t0, 3)
        return res

    def metrics(self) -> dict:
        return {"started": dict(self.counts), "skipped": dict(self.skipped), "pending": len(self._pending)}


def mode_switches(reader, dd: DeepDive) -> dict[str, int]:
    """When each node switched to deep mode for this dive: its ModeChange record (cluster time)."""
    out = {}
    for node in dd.nodes:
        for e in reader.node_events(node, ("mode",), dd.requested_ns - 10**9, dd.start_ns + dd.duration_ns + 10**9,
                                    limit=200):
            if (e.get("entity") or "") == "deep" and dd.command_id in (e.get("message") or ""):
                out[node] = e["ts_ns"]
                break
    return out


def current_severity(finding) -> float:
    """How severe a finding is now, for escalation and the cool-down's bypass: its severity, or its detector's figure
    for its recent part where that is more (the sentinel's recent_severity, its alarms of the last 5 s). A
    sentinel episode that a false alarm opened averages the fault's batches with the alarm's: on the inference bed
    a 2.05x false alarm's finding reached 3.16x only as a 5x noisy neighbour ended, 15 s in, and the escalation's
    dive saw none of it."""
    ev = finding.evidence if isinstance(finding.evidence, dict) else {}
    r = ev.get("recent_severity")
    if isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r):
        return max(finding.severity, float(r))
    return finding.severity


def quiet_reference(busy: list[tuple[int, int]], until_ns: int, length_ns: int, gap_ns: int,
                    lookback_ns: int) -> tuple[int, int]:
    """(since, until) of the latest window length_ns long that ends at or before until_ns and overlaps none of the
    busy spans (each moved past ends gap_ns before the span that it overlapped); the window at until_ns where none
    is quiet within lookback_ns of it (a job always busy: the reference as it was)."""
    end = until_ns
    while True:
        hit = [a for a, b in busy if a < end and b > end - length_ns]
        if not hit:
            return end - length_ns, end
        end = min(hit) - gap_ns
        if end - length_ns < until_ns - lookback_ns:
            return until_ns - length_ns, until_ns


def analyse_dive(reader, dd: DeepDive, deep_samples: list[dict], ref_samples: list[dict],
                 cfg: suspicion.SuspicionConfig | None = None) -> dict:
    """The dive's ranking from what the agents and the store hold (runs in a thread)."""
    started = mode_switches(reader, dd)
    a, b = dd.start_ns, dd.start_ns + dd.duration_ns
    ra, rb = dd.reference_since_ns, dd.reference_until_ns
    ranks = gather(reader, dd.job_key, (a, b), (ra, rb), deep_samples, ref_samples, cfg or suspicion.SuspicionConfig())
    ranking = suspicion.rank_causes(ranks, cfg)
    return {"started": started, "start_spread_ns": (max(started.values()) - min(started.values())) if started
            else None, "causes": ranking["causes"], "rank_scores": ranking["ranks"], "roles": ranking["roles"],
            "data": {"ranks": len(ranks), "deep_samples": sum(d.samples for d in ranks.values()),
                     "reference_samples": sum(d.ref_samples for d in ranks.values()),
                     "deep_cycles": sum(len(d.cycles) for d in ranks.values())}}


def gather(reader, job_key: str, deep: tuple[int, int], ref: tuple[int, int], deep_samples: list[dict],
           ref_samples: list[dict], cfg: suspicion.SuspicionConfig) -> dict[int, suspicion.RankData]:
    a, b = deep
    ra, rb = ref
    procs = {}
    rankless = []
    for p in reader.job_processes(job_key):
        if not p["exited_ns"] or p["exited_ns"] >= ra:
            if p["rank"] >= 0:
                procs[p["rank"]] = p
            else:
                rankless.append(p)
    if not procs:   # a job of no ranks (a serving engine): its processes, keyed -1, -2, ... (RankData.pid names them)
        for i, p in enumerate(sorted(rankless, key=lambda p: (p["node_id"], p["pid"]))):
            procs[-1 - i] = p
    steps = reader.steps(job_key, since_ns=min(a, ra) if rb > ra else a, with_comms=True)
    by_pid = {(p["node_id"], p["pid"]): r for r, p in procs.items()}

    def samples_of(rows):
        out: dict[int, list] = {}
        for s in rows:
            r = by_pid.get((s.get("node_id"), s["pid"]))
            if r is not None:
                out.setdefault(r, []).append(s)
        return out
    ds, rs = samples_of(deep_samples), samples_of(ref_samples)
    out = {}
    node_cache: dict[str, tuple] = {}
    for r, p in procs.items():
        d = suspicion.RankData(r, p["node_id"], pid=p["pid"])
        mine = sorted((s["start_ns"], s["end_ns"]) for s in steps if s["rank"] == r)
        in_deep = [(s0, s1) for s0, s1 in mine if s0 >= a and s1 <= b]
        for st in steps:
            if st["rank"] == r and st["end_ns"] >= min(a, ra):
                comms = st.get("comms")
                if comms is None:
                    comms = json.loads(st.get("comms_json") or "[]")
                d.comms.update(c["comm_id"] for c in comms if c.get("op") in suspicion.COLLECTIVES)
        main = suspicion.main_thread(ds.get(r, []))
        d.samples = len(main)
        d.cycles = suspicion.cycle_shares(main, in_deep if len(in_deep) >= 3 else suspicion.bins(a, b),
                                          cfg.max_frames)
        d.depth, d.within, d.held = suspicion.frame_nesting(main, cfg.max_frames)
        rmain = suspicion.main_thread(rs.get(r, []))
        d.ref_samples = len(rmain)
        d.profile = suspicion.leaf_profile(rmain if len(rmain) >= 20 else main)
        # reference bins where the rank was iterating (a step of it ended there): not its start-up or a stall
        ends = [s1 for _, s1 in mine]
        ref_bins = [(lo, hi) for lo, hi in suspicion.bins(ra, rb) if not mine or any(lo <= e < hi for e in ends)]
        d.ref_cycles = suspicion.cycle_shares(rmain, ref_bins, cfg.max_frames) if rb > ra else []
        node, pid, ticks = p["node_id"], p["pid"], p["start_ticks"]
        ent = f"pid:{pid}:{ticks}"
        pm = reader.metric_points(node, [*PROC_SHARES.values(), CPUS_ALLOWED], [ent], min(a, ra), b)
        for name, metric in PROC_SHARES.items():
            pts = pm.get((metric, ent), [])
            d.resources[name] = suspicion.interval_shares(pts, a, b)
            d.ref_resources[name] = suspicion.interval_shares(pts, ra, rb) if rb > ra else []
        cpus = pm.get((CPUS_ALLOWED, ent), [])
        if cpus:
            d.resources["affinity"] = suspicion.lost_shares(cpus, a, b)
            d.ref_resources["affinity"] = suspicion.lost_shares(cpus, ra, rb) if rb > ra else []
        if node not in node_cache:
            nm = reader.metric_points(node, list(NODE_SHARES.values()), [""], min(a, ra), b)
            conns = reader.conn_stats_of(node, min(a, ra), b) if hasattr(reader, "conn_stats_of") else []
            node_cache[node] = (nm, conns)
        nm, _ = node_cache[node]
        for name, metric in NODE_SHARES.items():
            pts = nm.get((metric, ""), [])
            d.resources[name] = suspicion.interval_shares(pts, a, b)
            d.ref_resources[name] = suspicion.interval_shares(pts, ra, rb) if rb > ra else []
        out[r] = d
    # the network: every node's connections, each node judged on those with its address at either end
    rows = [c for _, conns in node_cache.values() for c in conns]
    for r, d in out.items():
        mine = {c["src"] for c in node_cache[d.node][1] if c.get("src")}
        d.resources["network"] = suspicion.network_shares(rows, a, b, mine) if mine else []
        d.links = suspicion.network_links(rows, a, b, mine) if mine else []
        d.ref_resources["network"] = suspicion.network_shares(rows, ra, rb, mine) if mine and rb > ra else []
    for r, d in out.items():
        p = procs[r]
        node, pid, ticks = p["node_id"], p["pid"], p["start_ticks"]
        spans = stopped_spans(reader, node, pid, ticks, min(a, ra) - 60 * 10**9, b)
        d.resources["stopped"] = suspicion.stopped_shares(spans, a, b)
        d.ref_resources["stopped"] = suspicion.stopped_shares(spans, ra, rb) if rb > ra else []
        out[r] = d
    return out


def stopped_spans(reader, node: str, pid: int, ticks: int, a: int, b: int) -> list[tuple[int, int]]:
    """When the process was stopped: from each process_stopped Event to the next process_running (or b)."""
    spans, since = [], None
    for e in reader.process_events(a, b, [node], ("process_stopped", "process_running")):
        if e["pid"] != pid or e["start_ticks"] != ticks:
            continue
        if e["kind"] == "process_stopped" and since is None:
            since = e["ts_ns"]
        elif e["kind"] == "process_running" and since is not None:
            spans.append((since, e["ts_ns"]))
            since = None
    if since is not None:
        spans.append((since, b))
    return spans
