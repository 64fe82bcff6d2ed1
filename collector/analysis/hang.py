"""hang: a job whose ranks stop making progress, with the culprit rank named long before the collective's
timeout (NCCL 10 min, gloo 30 min), and a comm hang told from a non-comm one (XPUTimer §2, ALGORITHMS.md).

Hung: no rank has completed a step for longer than the bound, bound = max(floor_seconds, step_multiple x the
job's step time (median of its last steps)), and some rank has been waiting in one op for longer than the
bound (CommProgress: the oldest op it enqueued and has not completed, from the Flight Recorder). Without
CommProgress (no flightrec on the job) the step gap alone makes the finding, with no culprit but what process
states say. "Now" is the window's end: the job's newest data (CommProgress keeps coming while a job hangs,
every poll while something is pending, so the loop keeps running the job).

Culprit: a wait-for graph over each rank's newest CommProgress per communicator, the XPUTimer sequence
diff generalized to every group at once:
  * a rank waiting in collective seq q of comm c waits for the members of c whose last enqueued seq < q
    (they never entered it; a member with no CommProgress at all counts as not entered);
  * a rank waiting in a send/recv waits for its peer;
  * a collective every member has entered and none completes is a comm hang on c: its members wait for the
    network (suspects: their nodes and NICs from the topology), not for a rank.
Culprits are the sinks: ranks others wait for, transitively, that wait for nobody; a stopped / blocked / gone
process first, then one whose stack is not inside a communication call, then by how many ranks wait on them
(the whole job, in a hang of one rank). A sink inside a communication call the Flight Recorder does not record
(gloo's send/recv) waits for a peer too: when every sink is such a one and a collective stalls with all its
members inside, the hang is that comm hang (its nodes first, those sinks after). Which host's link is broken:
the one every TCP connection stuck retransmitting has at one end (the tcpinfo source's tcp_stalled Events of
the stalled members' nodes); it leads, with its NICs from the topology. Each culprit's cause comes from its
process state (the procs source's process_stopped / process_blocked / process_zombie events, or its exit) and
its Python stack (the newest stack summary of its process: the frames it is stuck in, in the finding).
Non-comm hang: the culprit is a rank not inside the collective the others wait in (stopped, stuck in compute,
data loading, a lock); comm hang: every member inside it.

A hang that ended inside the window (the job completed steps again after a gap longer than the bound) is
reported with `resumed_ns` and ongoing False, so the finding says it resumed and then resolves; one whose
processes all exited after hanging (its collective timed out, or it was killed) with `died_ns`, saying it died.
Evidence kept with the finding (it outlives the job), compact at any scale (ranks as ranges, "0-51,53-63"): per
culprit its process state, frames and where it stands on each of its communicators; its groups member by member
(who entered which seq, who waits in what: the sequence diff itself); every waiting rank grouped by the op it
waits in; the process states; every rank's stack grouped into the distinct stacks (most ranks first).

Cost: one read of the newest CommProgress per (process, comm); the window's Step rows as the pass's other
detectors parsed them (irregularity.load, kept on the reader for the pass); O(ranks x comms) for the graph.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from operator import itemgetter
from statistics import median

from steplens.collector.analysis.base import ConfigError, DetectorConfig, DetectorSpec, Window, nic_addresses, nics_of
from steplens.collector.analysis.findings import Finding, Suspect
from steplens.collector.analysis.irregularity import IrregularityConfig, JobSteps, load

_END = itemgetter("end_ns")

FRESH_PROGRESS_NS = 10 * 10**9   # a CommProgress this recent stands for now (flightrec re-reads a stalled ring every 5 s)
STATE_EVENTS = {"process_stopped": "stopped", "process_blocked": "blocked in D state", "process_zombie": "zombie"}


@dataclass
class HangConfig(DetectorConfig):
    resolve_after_seconds: float = 15.0  # resumed this long (data time): resolved
    floor_seconds: float = 15.0          # never hung before this long without progress
    step_multiple: float = 10.0          # ... nor before this many of the job's step times
    recent_steps: int = 20               # the job's step time: median over its last steps
    max_suspects: int = 8
    max_ranks_listed: int = 64           # ranks' process states kept in the evidence
    frames: int = 12                     # innermost frames of a culprit's stack kept

    def validate(self) -> None:
        super().validate()
        if not 1.0 <= self.floor_seconds <= 86400 or not 1.0 <= self.step_multiple <= 10_000:
            raise ConfigError("need 1 <= floor_seconds <= 86400 and 1 <= step_multiple <= 10000")
        if self.recent_steps < 1 or self.max_suspects < 1 or self.max_ranks_listed < 1 or self.frames < 1:
            raise ConfigError("recent_steps, max_suspects, max_ranks_listed and frames must be >= 1")


# -- reading -----------------------------------------------------------------------------------------------

def _steps(reader, window: Window) -> tuple[JobSteps, dict[int, int], dict[int, int], list[int]]:
    """The window's Step rows as the other detectors of the pass read them (irregularity.load: parsed once per
    pass), per rank its newest step end (cluster ns), per step number its latest end, and the gaps between
    consecutive steps' ends (the job's step times, ns), oldest first."""
    js = load(reader, window, IrregularityConfig())
    last: dict[int, int] = {}
    for rank, steps in js.rows.items():
        e = max(map(_END, steps.values()), default=0)
        if e > 0:
            last[rank] = e
    ends = {s: e for s, e in js.step_end.items() if e > 0}
    seq = [ends[s] for s in sorted(ends)]
    gaps = [b - a for a, b in zip(seq, seq[1:]) if b > a]
    return js, last, ends, gaps


def _step_members(js: JobSteps, lo_ns: int, hi_ns: int) -> dict[str, set[int]]:
    """Communicator members from the ranks' Step records ending within [lo_ns, hi_ns] (their per-communicator
    summaries): a rank that stopped answering still ran ops on its groups before, so it is known as a member
    that never entered."""
    out: dict[str, set[int]] = {}
    for rank, steps in js.rows.items():
        for r in reversed(steps.values()):  # newest first (a rank's steps are kept in end order)
            if r["end_ns"] < lo_ns:
                break
            if r["end_ns"] > hi_ns:
                continue
            for c in r.get("comms") or ():
                if c.get("op") not in ("send", "recv"):
                    out.setdefault(c["comm_id"], set()).add(rank)
    return out


def _progress(reader, window: Window) -> list[dict]:
    fn = getattr(reader, "comm_progress_latest", None)
    if fn is None:
        return []
    return [p for p in fn(window.job_key, until_ns=window.until_ns)
            if p["rank"] is not None and p["rank"] >= 0 and p["end_ns"] >= window.since_ns]


def _states(reader, window: Window, procs: dict[tuple[str, int], int], since_ns: int) -> dict[int, dict]:
    """rank -> {"state", "since_ns"} for ranks whose process is stopped / blocked / a zombie now (the newest
    state event of its process within [since_ns, until], not followed by process_running), or exited."""
    out: dict[int, dict] = {}
    fn = getattr(reader, "process_events", None)
    if fn is not None and procs:
        nodes = sorted({n for n, _ in procs})
        for e in fn(since_ns=since_ns, until_ns=window.until_ns, node_ids=nodes):
            rank = procs.get((e["node_id"], e["pid"]))
            if rank is None:
                continue
            if e["kind"] == "process_running":
                out.pop(rank, None)
            elif e["kind"] in STATE_EVENTS:
                out[rank] = {"state": STATE_EVENTS[e["kind"]], "since_ns": e["ts_ns"], "message": e["message"]}
    return out


# -- the wait-for graph ----------------------------------------------------------------------------------

@dataclass
class Graph:
    waits: dict[int, set]               # rank -> ranks it waits for
    waiting_in: dict[int, list[dict]]   # rank -> its pending ops (oldest first)
    comm_stalls: dict[str, set[int]]    # comm -> ranks inside a collective every member entered
    members: dict[str, set[int]]


def wait_for(progress: list[dict], comm_ranks: dict[str, set[int]] | None = None) -> Graph:
    """The wait-for graph of a job from its ranks' newest CommProgress per communicator (see the module
    docstring). comm_ranks: members known otherwise (jobs(): comm members), joined with who reports on c."""
    newest: dict[tuple[int, str], dict] = {}
    for p in progress:
        k = (p["rank"], p["comm_id"])
        if k not in newest or p["end_ns"] >= newest[k]["end_ns"]:
            newest[k] = p
    members: dict[str, set[int]] = {c: set(m) for c, m in (comm_ranks or {}).items()}
    for rank, comm in newest:
        members.setdefault(comm, set()).add(rank)
    waits: dict[int, set] = {}
    waiting_in: dict[int, list[dict]] = {}
    stalls: dict[str, set[int]] = {}
    for (rank, comm), p in newest.items():
        if not p["pending_op"]:
            continue
        waiting_in.setdefault(rank, []).append(p)
        w = waits.setdefault(rank, set())
        if p["pending_p2p"]:
            if p["pending_peer"] >= 0 and p["pending_peer"] != rank:
                w.add(p["pending_peer"])
            continue
        q = p["pending_seq"]
        behind = {m for m in members.get(comm, ()) if m != rank and
                  (newest.get((m, comm)) is None or newest[(m, comm)]["last_enqueued"] < q)}
        if behind:
            w |= behind
        else:
            stalls.setdefault(comm, set()).add(rank)
    for ops in waiting_in.values():
        ops.sort(key=lambda p: p["pending_since_ns"] or p["end_ns"])
    return Graph(waits, waiting_in, stalls, members)


def culprits(g: Graph) -> list[tuple[int, int]]:
    """(rank, ranks waiting on it, transitively) for each sink of the graph: waited for, waiting for nobody
    (a rank whose only pending op is a comm stall counts as waiting for nobody: the stall is reported apart).
    Best first."""
    waited: dict[int, set[int]] = {}
    for r, ws in g.waits.items():
        for w in ws:
            waited.setdefault(w, set()).add(r)
    sinks = [r for r in waited if not g.waits.get(r)]
    out = []
    for s in sinks:
        seen, q = {s}, deque([s])
        while q:
            x = q.popleft()
            for y in waited.get(x, ()):
                if y not in seen:
                    seen.add(y)
                    q.append(y)
        out.append((s, len(seen) - 1))
    out.sort(key=lambda t: (-t[1], t[0]))
    return out


# -- the finding -------------------------------------------------------------------------------------------

def rank_stacks(reader, procs: dict[tuple[str, int], int], since_ns: int, until_ns: int = 0,
                limit: int = 20_000) -> dict[int, dict]:
    """Each rank's busiest stack in its newest stack summary within [since_ns, until_ns] (one read for the
    job; until 0: no bound): rank -> {"count", "frames": [[function, qualname, file, line], ...] innermost
    first}."""
    fn = getattr(reader, "stacks", None)
    if fn is None or not procs:
        return {}
    try:
        rows = fn(since_ns=since_ns, limit=limit)
    except Exception:  # a reader without stacks
        return {}
    best: dict[int, dict] = {}
    newest: dict[int, int] = {}
    for row in rows:
        rank = procs.get((row["node_id"], row["pid"]))
        if rank is None or row["end_ns"] < newest.get(rank, 0) or (until_ns and row["end_ns"] > until_ns):
            continue
        for st in row.get("stacks") or ():
            if st.get("frames") and (row["end_ns"] > newest.get(rank, 0) or st["count"] > best[rank]["count"]):
                best[rank] = st
                newest[rank] = row["end_ns"]
    return best


COMM_FILES = ("/distributed/", "distributed_c10d", "/nccl", "/gloo")


def in_comm(stack: dict | None, depth: int = 4) -> bool:
    """Whether a stack is inside a communication call: one of its innermost frames is torch.distributed's."""
    return bool(stack) and any(any(m in (f[2] or "") for m in COMM_FILES) for f in stack["frames"][:depth])


def _fmt(frames, n: int) -> list[str]:
    return [f"{f[1] or f[0]} ({f[2]}:{f[3]})" for f in frames[:n]]


def stack_outliers(stacks: dict[int, dict], n: int) -> list[tuple[int, list[str]]]:
    """XPUTimer's stack diff: ranks keyed by their stack's innermost frame; the ranks whose key differs from a
    majority's, with their frames (none when no key holds a majority)."""
    if len(stacks) < 2:
        return []
    key = {r: tuple(st["frames"][0][:3]) for r, st in stacks.items()}
    counts: dict[tuple, int] = {}
    for k in key.values():
        counts[k] = counts.get(k, 0) + 1
    common = max(counts.items(), key=lambda kv: kv[1])[0]
    if counts[common] * 2 <= len(key):
        return []
    return [(r, _fmt(stacks[r]["frames"], n)) for r in sorted(key) if key[r] != common]


def stack_groups(stacks: dict[int, dict], n: int, groups: int = 8) -> list[dict]:
    """Every rank's stack, grouped: the distinct stacks (innermost n frames), most ranks first."""
    by: dict[tuple, list[int]] = {}
    for r, st in stacks.items():
        by.setdefault(tuple(tuple(f) for f in st["frames"][:n]), []).append(r)
    out = sorted(by.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    return [{"ranks": ranges(rs), "count": len(rs), "frames": _fmt(list(k), n)} for k, rs in out[:groups]]


def ranges(ranks) -> str:
    """Ranks as a compact string: 0-5,7,9-12."""
    xs = sorted(set(ranks))
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def _ongoing(reader, window: Window, cfg: HangConfig, js: JobSteps, last: dict[int, int], step_ns: float,
             bound_ns: float, progress: list[dict], job: dict) -> list[Finding]:
    now = window.until_ns
    newest_step = max(last.values(), default=0)
    # a rank is stuck where its report says so: the op it waits in had been pending for the bound when its
    # Flight Recorder was read (end_ns), or the report is fresh (the ring was read within FRESH_PROGRESS_NS: a
    # stalled ring is re-read every 5 s) and the op has been pending for the bound by the window's end. The read
    # schedule reads a healthy job's ring every 20 s at most, so its newest CommProgress can be that old with
    # the op then in flight; measuring that op's wait to the window's end found hangs in healthy jobs (the
    # make-run demo: "no step completed for 17 s").
    stuck = [p for p in progress if p["pending_op"] and p["pending_since_ns"] and
             (p["end_ns"] - p["pending_since_ns"] >= bound_ns or
              (now - p["end_ns"] <= FRESH_PROGRESS_NS and now - p["pending_since_ns"] >= bound_ns))]
    if not last or now - newest_step < bound_ns:
        return []
    ranks = {r["rank"]: r for r in job.get("ranks", []) if r.get("rank", -1) >= 0}
    if ranks and all(r.get("alive") is False for r in ranks.values()):
        return []  # every process has exited: the job ended (or died), it does not hang
    procs = {(r["node_id"], r["pid"]): k for k, r in ranks.items() if r.get("pid")}
    for p in progress:
        procs.setdefault((p["node_id"], p["pid"]), p["rank"])
    states = _states(reader, window, procs, max(window.since_ns, newest_step - int(bound_ns)))
    # nothing pending in the Flight Recorder: ops complete (a long step, a checkpoint), not a hang, unless a
    # rank's process stopped, blocked or went away after its own newest step. Its peers then wait in ops the
    # recorder does not keep (gloo's send/recv of a pipeline) and report nothing pending (testbed: a stopped
    # stage-1 rank; its CommProgress shows nothing pending while the job stands still).
    halted = [k for k, st in states.items() if st["since_ns"] >= last.get(k, 0)]
    if progress and not stuck and not halted:
        return []
    onset = min([p["pending_since_ns"] for p in stuck] or [newest_step])
    onset = max(onset, newest_step) if stuck else newest_step
    for k, r in ranks.items():
        if r.get("alive") is False and k not in states:
            states[k] = {"state": "exited", "since_ns": 0, "message": ""}
    comm_ranks = {c["comm_id"]: set(c.get("ranks") or ()) for c in job.get("comms", [])}
    span = max(int(3 * step_ns), 2 * 10**9)  # the last few steps of every rank
    for c, mem in _step_members(js, newest_step - span, window.until_ns).items():  # who ran ops on which comm
        comm_ranks.setdefault(c, set()).update(mem)
    g = wait_for(progress, comm_ranks)
    node_of = {k: r["node_id"] for k, r in ranks.items()}
    for p in progress:
        node_of.setdefault(p["rank"], p["node_id"])
    sus: list[Suspect] = []
    stacks = rank_stacks(reader, procs, onset, now)
    # sinks in order: a process that is stopped / blocked / gone, then one whose stack is not inside a
    # communication call (a recv the Flight Recorder does not record, gloo's p2p: it waits for a peer too),
    # then the most ranks waiting on it
    found = sorted(culprits(g), key=lambda t: (t[0] not in states, in_comm(stacks.get(t[0])), -t[1], t[0]))
    total = len(set(g.waits) | {r for r, _ in found}) or 1
    # a sink inside a communication call, its process fine, waits for a peer too (a recv the Flight Recorder
    # does not record): where a collective stalls with every member inside, that stall is the hang (a comm
    # hang), and these sinks are listed after its nodes
    hidden = [t for t in found if t[0] not in states and in_comm(stacks.get(t[0]))]
    if g.comm_stalls and len(hidden) == len(found):
        # ... unless a member of a stalled collective is stopped, blocked or gone: what it last reported (inside
        # the collective) is stale, and it holds the others up, not the network (n: the members it holds)
        gone = sorted({r for inside in g.comm_stalls.values() for r in inside if r in states})
        found = [(r, sum(len(ins) - 1 for ins in g.comm_stalls.values() if r in ins)) for r in gone]
    for rank, n in found[:cfg.max_suspects]:
        st = states.get(rank)
        frames = _fmt(stacks[rank]["frames"], cfg.frames) if rank in stacks else []
        mine = {}
        for p in progress:
            if p["rank"] == rank:
                mine[p["comm_id"]] = {"last_enqueued": p["last_enqueued"], "last_completed": p["last_completed"],
                                      "as_of_ns": p["end_ns"]}
        for c, mem in g.members.items():  # its groups' members: where each stands (the sequence diff)
            if rank in mem and c not in mine:
                mine[c] = {"last_enqueued": None, "last_completed": None, "as_of_ns": None}
        sus.append(Suspect("rank", str(rank), round(n / total, 4), "hang",
                           {"node": node_of.get(rank, ""), "waiting_on_it": n,
                            "state": st["state"] if st else ("in a collective" if rank in g.waiting_in else
                                                              "in a communication call the Flight Recorder "
                                                              "does not record" if in_comm(stacks.get(rank))
                                                              else "running, in no collective"),
                            "frames": frames, "comms": mine}))
    # a collective every member entered and none completes: the network between them (a comm hang), named
    # only when no rank holds the others up (a stopped rank's own pending op is not a network fault)
    stalled = sorted(g.comm_stalls.items(), key=lambda kv: (-len(kv[1]), kv[0])) if not found else []
    for comm, inside in stalled:
        if len(sus) >= cfg.max_suspects:
            break
        for node in sorted({node_of.get(r, "") for r in inside} - {""}):
            sus.append(Suspect("node", node, round(len(inside) / total / 2, 4), "network",
                               {"comm": comm, "ranks_inside": sorted(inside)[:32],
                                "why": "every member entered the collective and none completes"}))
    # the network under a hang: TCP connections stuck retransmitting (tcpinfo) and hosts whose agent fell silent
    culprit_nodes = [node_of.get(r, "") for r, _ in found if node_of.get(r)]
    net_lead = None
    if stalled or culprit_nodes:
        down = unreachable_nodes(reader, now)
        asked = set(node_of.values()) - {""} - set(down)
        if len(asked) > 64:   # a large job: the nodes of who waits and where collectives stall
            asked = ({node_of.get(r, "") for r in g.waits} | {node_of.get(r, "") for _, ins in stalled for r in ins}
                     | {node_of.get(r, "") for r, _ in hidden} | set(culprit_nodes)) - {""} - set(down)
        tcp = stalled_connections(reader, sorted(asked)[:64], onset - 30 * 10**9, now)
        common = tcp.get("common")
        if common and common in set(node_of.values()) and (stalled or common in culprit_nodes):
            net_lead = (common, "network", {"why": f"each of the {tcp['count']} stalled TCP connection(s) has "
                                            f"{common} at one end", "connections": tcp["connections"][:16]})
        elif culprit_nodes and culprit_nodes[0] in down:
            node = culprit_nodes[0]
            net_lead = (node, "unreachable", {"why": f"its agent has not been heard from for "
                                              f"{(now - down[node]) / 1e9:.0f} s while the others report: the "
                                              "host or its network is down (what the others' data says of its "
                                              "ranks is as of then)", "connections": tcp.get("connections", [])[:16]})
    if net_lead:
        node, cause, ev = net_lead
        old = [x for x in sus if x.kind == "node" and x.id == node]
        sus = [x for x in sus if not (x.kind == "node" and x.id == node)]
        sus.insert(0, Suspect("node", node, 1.0, cause, {**(old[0].evidence if old else {}), **ev}))
        for k, nic in enumerate(nics_of(reader, node)[:2]):
            sus.insert(1 + k, Suspect("nic", nic, 0.9, cause, {"node": node, "why": "its link to its switch"}))
    if stalled:
        for rank, n in hidden[:max(0, cfg.max_suspects - len(sus))]:
            sus.append(Suspect("rank", str(rank), round(n / total / 4, 4), "network",
                               {"node": node_of.get(rank, ""), "waiting_on_it": n,
                                "state": "in a communication call the Flight Recorder does not record",
                                "frames": _fmt(stacks[rank]["frames"], cfg.frames)}))
    if not sus:  # no CommProgress: the stack diff, then who the process states blame
        odd, seen = stack_outliers(stacks, cfg.frames), len(stacks)
        if odd and len(odd) <= max(1, seen // 4):
            for rank, frames in odd[:cfg.max_suspects]:
                st = states.get(rank)
                sus.append(Suspect("rank", str(rank), round(1.0 / len(odd), 4), "hang",
                                   {"node": node_of.get(rank, ""), "state": st["state"] if st else "running",
                                    "frames": frames, "why": f"its stack differs from the other {seen - 1} ranks'"}))
        for rank, st in sorted(states.items()):
            if str(rank) not in {x.id for x in sus}:
                sus.insert(0, Suspect("rank", str(rank), 1.0, "hang", {"node": node_of.get(rank, ""),
                                                                       "state": st["state"]}))
        sus = sus[:cfg.max_suspects]
    sus = sus[:cfg.max_suspects]
    comm_hang = bool(stalled) and not found or bool(net_lead) and net_lead[1] == "network"
    seconds = (now - onset) / 1e9
    waiting: dict[str, list[int]] = {}
    for r, ops in g.waiting_in.items():
        p = ops[0]
        waiting.setdefault(f"{p['pending_op']} {p['comm_id']} "
                           f"{'p2p ' if p['pending_p2p'] else ''}seq {p['pending_seq']}", []).append(r)
    # each culprit's groups, member by member: who entered which seq (the evidence of the sequence diff)
    groups: dict[str, dict[str, str]] = {}
    newest = {(p["rank"], p["comm_id"]): p for p in progress}
    for s_ in sus:
        if s_.kind != "rank":
            continue
        for c in sorted(s_.evidence.get("comms", {}))[:16]:
            by: dict[str, list[int]] = {}
            for m in g.members.get(c, ()):
                p = newest.get((m, c))
                what = ("no progress reported" if p is None else
                        f"waiting in {p['pending_op']} seq {p['pending_seq']}" if p["pending_op"] else
                        f"entered up to seq {p['last_enqueued']}, nothing pending")
                by.setdefault(what, []).append(m)
            groups[c] = {k: ranges(v) for k, v in sorted(by.items())}
    lead = sus[0] if sus else None
    if lead is None:
        who = "; no culprit: no rank reports where it waits"
    elif lead.kind == "rank":
        who = (f"; culprit rank {lead.id} ({lead.evidence.get('state')}"
               + (f", in {lead.evidence['frames'][0]}" if lead.evidence.get("frames") else "")
               + f"), {lead.evidence.get('waiting_on_it', 0)} rank(s) waiting on it")
    elif lead.evidence.get("connections") is not None and lead.cause in ("network", "unreachable"):
        who = f"; {lead.kind} {lead.id}: {lead.evidence['why']}"
    else:
        who = f"; a comm hang on {lead.evidence.get('comm')}: every member is inside it, none completes"
    summary = (f"{'Comm' if comm_hang else 'Job'} hang: no step completed for {seconds:.0f} s "
               f"({seconds * 1e9 / step_ns:.0f}x the step time){who}." if step_ns else
               f"{'Comm' if comm_hang else 'Job'} hang: no step completed for {seconds:.0f} s{who}.")
    ev = {"hang_type": "comm" if comm_hang else "non-comm", "ongoing": True, "stalled_seconds": round(seconds, 1),
          "bound_seconds": round(bound_ns / 1e9, 1), "step_ns": int(step_ns), "last_step_ns": newest_step,
          "waiting": {k: ranges(v) for k, v in sorted(waiting.items(), key=lambda kv: -len(kv[1]))[:32]},
          "waiting_ranks": len(g.waiting_in), "culprit_groups": groups,
          "process_states": {str(r): s["state"] for r, s in sorted(states.items())[:cfg.max_ranks_listed]},
          "stacks": stack_groups(stacks, cfg.frames)}
    sev = (now - onset) / step_ns if step_ns else 1.0
    return [Finding(kind="hang", onset_ns=onset, last_ns=now, severity=round(max(1.0, sev), 2), summary=summary,
                    suspects=tuple(sus), evidence=ev)]


def _resumed(reader, window: Window, cfg: HangConfig, js: JobSteps, ends: dict[int, int], step_ns: float,
             bound_ns: float, job: dict) -> list[Finding]:
    """Hangs that ended lately (within 2 x resolve_after_seconds of the window's end): a gap between two
    consecutive steps' ends longer than the bound; the culprit is taken from the progress as it stood just
    before the job resumed. The finding is re-sent until it resolves, then left alone (history)."""
    out = []
    seq = sorted(ends.items())
    recent = window.until_ns - 2 * int(cfg.resolve_after_seconds * 1e9)
    for (s0, e0), (s1, e1) in zip(seq, seq[1:]):
        if e1 - e0 < bound_ns or e1 < recent:  # an older one: its finding has resolved (not re-sent each pass)
            continue
        w = Window(window.job_key, e0, e1 - 1)  # as the window ending just before the resume saw it
        for f in _ongoing(reader, w, cfg, js, {-1: e0}, step_ns, bound_ns, _progress(reader, w), job):
            ev = {**f.evidence, "ongoing": False, "resumed_ns": e1, "resumed_at_step": s1,
                  "stalled_seconds": round((e1 - f.onset_ns) / 1e9, 1)}
            out.append(Finding(kind="hang", onset_ns=f.onset_ns, last_ns=e1, severity=f.severity,
                               summary=f.summary[:-1] + f"; resumed at step {s1} after "
                                                        f"{(e1 - f.onset_ns) / 1e9:.0f} s.",
                               suspects=f.suspects, evidence=ev))
    return out


def _died(reader, window: Window, cfg: HangConfig, js: JobSteps, last: dict[int, int], step_ns: float,
          bound_ns: float, job: dict) -> list[Finding]:
    """A job that hung and then died: every process exited (procs), the first exit more than the bound after the
    newest step, lately (within 2 x resolve_after_seconds of the window's end). The hang as it stood just before
    the first exit, saying the job died (its collective timed out, or it was killed); re-sent until it resolves."""
    ranks = [r for r in job.get("ranks", []) if r.get("rank", -1) >= 0]
    if not ranks or not all(r.get("alive") is False and r.get("exited_ns") for r in ranks):
        return []
    died = min(r["exited_ns"] for r in ranks)
    newest_step = max(last.values(), default=0)
    if not newest_step or died - newest_step < bound_ns or died < window.until_ns - 2 * int(cfg.resolve_after_seconds
                                                                                         * 1e9):
        return []
    alive = {**job, "ranks": [{**r, "alive": True} for r in job.get("ranks", [])]}   # as they were before
    w = Window(window.job_key, window.since_ns, died - 1)
    out = []
    for f in _ongoing(reader, w, cfg, js, last, step_ns, bound_ns, _progress(reader, w), alive):
        ev = {**f.evidence, "ongoing": False, "died_ns": died, "stalled_seconds": round((died - f.onset_ns) / 1e9, 1)}
        out.append(Finding(kind="hang", onset_ns=f.onset_ns, last_ns=died, severity=f.severity,
                           summary=f.summary[:-1] + f"; then the job died: its processes exited "
                                                    f"{(died - f.onset_ns) / 1e9:.0f} s into the hang.",
                           suspects=f.suspects, evidence=ev))
    return out


def _endpoint(text: str) -> tuple[str, int] | None:
    addr, _, port = text.strip().rpartition(":")
    return (addr.strip("[]"), int(port)) if addr and port.isdigit() else None


def stalled_connections(reader, nodes: list[str], since_ns: int, until_ns: int) -> dict:
    """TCP connections of the given nodes that were stuck retransmitting in [since_ns, until_ns] (the tcpinfo
    source's tcp_stalled Events, entity "src:sport->dst:dport", not followed by tcp_recovered or tcp_stall_closed)
    and the host every one of them touches, if one does: {"count", "connections": [...], "common": node id or
    remote address}.
    An address is a node's when that node reported a connection from it (its own side)."""
    fn = getattr(reader, "node_events", None)
    if fn is None or not nodes:
        return {}
    conns: dict[tuple, tuple[str, tuple, tuple]] = {}
    owner: dict[str, str] = {}
    for node in nodes:
        try:
            evs = fn(node, ("tcp_stalled", "tcp_recovered", "tcp_stall_closed"), since_ns, until_ns)
        except Exception:  # a reader without events
            return {}
        for e in evs:
            src_t, _, dst_t = (e.get("entity") or "").partition("->")
            src, dst = _endpoint(src_t), _endpoint(dst_t)
            if not src or not dst:
                continue
            owner[src[0]] = node
            key = (node, src, dst)
            if e["kind"] == "tcp_stalled":
                conns[key] = (node, src, dst)
            else:
                conns.pop(key, None)
    if not conns:
        return {}
    for ip, node in nic_addresses(reader).items():
        owner.setdefault(ip, node)
    counts: dict[str, int] = {}
    for node, _src, dst in conns.values():
        for end in {node, owner.get(dst[0], dst[0])}:
            counts[end] = counts.get(end, 0) + 1
    best = max(counts.values())
    tops = sorted(k for k, v in counts.items() if v == best)
    out = {"count": len(conns), "connections": sorted(f"{n}: {s[0]}:{s[1]}->{d[0]}:{d[1]}"
                                                     for n, s, d in conns.values())}
    if best == len(conns) and len(tops) == 1:   # one connection alone: either end, not told apart
        out["common"] = tops[0]
    return out


def unreachable_nodes(reader, now_ns: int, silent_ns: int = 10 * 10**9) -> dict[str, int]:
    """Nodes whose agent is disconnected or has sent nothing for silent_ns before now: node -> last seen (ns)."""
    fn = getattr(reader, "nodes", None)
    if fn is None:
        return {}
    try:
        rows = fn()
    except Exception:  # a reader without agents
        return {}
    return {r["node_id"]: r["last_seen_ns"] for r in rows
            if r.get("last_seen_ns") and (not r.get("connected") or r["last_seen_ns"] < now_ns - silent_ns)}


def detect(reader, window: Window, cfg: HangConfig) -> list[Finding]:
    js, last, ends, gaps = _steps(reader, window)
    if not ends:
        return []
    recent = gaps[-cfg.recent_steps:]
    step_ns = float(median(recent)) if recent else 0.0
    bound_ns = max(cfg.floor_seconds * 1e9, cfg.step_multiple * step_ns)
    jobs = reader.jobs(window.job_key) if hasattr(reader, "jobs") else []
    job = jobs[0] if jobs else {}
    out = _resumed(reader, window, cfg, js, ends, step_ns, bound_ns, job)
    out += _died(reader, window, cfg, js, last, step_ns, bound_ns, job)
    out += _ongoing(reader, window, cfg, js, last, step_ns, bound_ns, _progress(reader, window), job)
    return out


SPEC = DetectorSpec(
    name="hang",
    description="a job that stopped making progress, with the culprit rank from the communicators' sequence "
                "numbers (who never entered the collective the others wait in), its process state and stack",
    kinds=("hang",),
    config_class=HangConfig,
    detect=detect,
    on_idle=True,
)
