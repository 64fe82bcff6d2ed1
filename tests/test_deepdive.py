"""The deep-dive trigger (analysis/deepdive.py): its policy and admission (kinds, severity, cool-down, rate limit,
overhead budget), its config's errors; and the loop in one process on a real store: a finding opened on the
analysis engine's hub -> one DeepMode command with the same cluster-time start to every node of the job -> the
ModeChange records' spread, the ranking from the stored counters, the dive attached to the finding."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from dataclasses import replace

import pytest

from steplens.collector.analysis.base import ConfigError, build_config
from steplens.collector.analysis.deepdive import DeepDiveConfig, DeepDives
from steplens.collector.analysis.engine import FindingsHub
from steplens.collector.analysis.findings import Change, Finding, Suspect
from steplens.collector.store.queries import Reader
from steplens.collector.store.writer import StoreWriter
from steplens.v1 import ingest_pb2 as ipb

S = 10**9


class _Clock:
    def now_ns(self) -> int:
        return time.time_ns()


class _NodeClock:
    offset = 5 * S     # this agent's monotonic clock reads cluster time - 5 s

    def to_agent(self, ns: int) -> int:
        return ns - self.offset

    def to_cluster(self, mono: int) -> int:
        return mono + self.offset


class _Session:
    def __init__(self, node: str, sent: list) -> None:
        self.node, self.sent, self.clock = node, sent, _NodeClock()

    def send_command(self, cmd):
        self.sent.append((self.node, cmd))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(ipb.CommandResult(command_id=cmd.command_id, ok=True, message="ok"))
        return fut


class _Ingest:
    def __init__(self, nodes) -> None:
        self.sent: list = []
        self.sessions = {n: _Session(n, self.sent) for n in nodes}

    async def session(self, node: str):
        return self.sessions.get(node)

    async def connected_nodes(self) -> list[str]:
        return sorted(self.sessions)


def _dives(cfg=None, nodes=("h0", "h1")):
    return DeepDives(_Ingest(nodes), None, None, _Clock(), None, cfg or DeepDiveConfig())


def _finding(kind="slowdown", severity=1.3, detector="lateness", fid="f1", job="j"):
    return Finding(kind, time.time_ns() - 5 * S, time.time_ns(), severity, "slow", (Suspect("rank", "1", 1.0),),
                   job_key=job, detector=detector, id=fid)


def test_policy_filters_kind_detector_and_severity_but_not_hangs():
    d = _dives(DeepDiveConfig(kinds=["slowdown", "hang"], detectors=["lateness", "hang"], min_severity=1.2))
    assert d.policy(_finding()) == ""
    assert d.policy(_finding(kind="network")) == "kind"
    assert d.policy(_finding(detector="flows")) == "detector"
    assert d.policy(_finding(severity=1.1)) == "severity"
    assert d.policy(_finding(kind="hang", detector="hang", severity=0.0)) == ""


def test_admission_cooldown_rate_limit_and_budget():
    now = 10_000 * S
    d = _dives(DeepDiveConfig(cooldown_seconds=600, max_per_hour=3, max_deep_fraction=0.01))
    assert d.admission("j", 10 * S, now, 2) == ""
    assert "no node" in d.admission("j", 10 * S, now, 0)
    assert d.admission("j", 40 * S, now, 2).startswith("overhead budget")   # 40 s > 1 % of an hour
    d.started.append((now - 100 * S, "j", 10 * S))
    d.last_by_job["j"] = now - 100 * S
    assert d.admission("j", 10 * S, now, 2).startswith("cooldown")
    assert d.admission("k", 10 * S, now, 2) == ""
    d.started.extend([(now - 50 * S, "k", S), (now - 40 * S, "m", S)])
    assert d.admission("n", 10 * S, now, 2).startswith("rate limit")
    assert d.admission("n", 10 * S, now + 3600 * S, 2) == ""   # the hour moved on: old dives leave the count


class _Procs:
    def procs(self):
        return [{"job_key": "j", "alive": True, "node_id": n, "rank": r} for r, n in enumerate(("h0", "h1"))]


def _cause(kind: str, score: float) -> dict:
    return {"kind": kind, "id": "runqueue" if kind == "resource" else "step (train.py)", "rank": 1,
            "cause": "cpu-contention" if kind == "resource" else "compute", "score": score}


class _Unrun(DeepDives):
    """The trigger alone: nothing stored, no window waited for."""
    async def _write(self, dd) -> None:
        self.written.append((dd.command_id, dd.trigger, dd.note))

    async def _finish(self, dd) -> None:
        pass


def test_a_finding_that_escalates_dives_again_past_the_cool_down():
    """A false alarm's dive (1.5x) then the fault in the same finding (5x): a second dive past the cool-down, once the
    first is over and blamed no resource; a milder rise none, nor a rise after a dive that found the cause; another
    finding past the cool-down only as an escalation of the job's last dive; at most max_dives_per_finding per
    finding; a finding opened before the watch dives only once it escalates from there; one refused for the
    cool-down once that lifts, while it is still going on."""
    cfg = DeepDiveConfig(cooldown_seconds=600, duration_seconds=2.0, settle_seconds=1.0, max_dives_per_finding=3)
    d = _Unrun(_Ingest(["h0", "h1"]), _Procs(), None, _Clock(), None, cfg)
    d.written = []
    f = _finding(severity=1.5, fid="F")

    def over():   # the job's last dive window (and its settle) ended
        end, sev, cid = d.last_dive["j"]
        d.last_dive["j"] = (time.time_ns() - 1, sev, cid)

    async def run():
        first = await d.on_finding(f, "opened")
        assert first is not None and first.trigger == "finding"
        assert await d.on_finding(replace(f, severity=2.0), "updated") is None        # < 1.5 x 1.5
        assert await d.on_finding(replace(f, severity=5.0), "updated") is None        # its first dive still runs
        over()
        assert await d.on_finding(replace(f, severity=5.0), "updated") is None        # not analysed yet
        first.status, first.result = "done", {"causes": [_cause("function", 40.0)]}  # it blamed no resource
        second = await d.on_finding(replace(f, severity=5.0), "updated")
        assert second is not None and second.trigger == "escalation" and first.command_id in second.note
        assert second.reference_until_ns == first.reference_until_ns   # the job before the finding began
        over()
        g = _finding(severity=6.0, fid="G", kind="network")
        assert await d.on_finding(g, "opened") is None and d.skipped["cooldown"] == 1   # 6 < 1.5 x 5
        assert await d.on_finding(replace(g, severity=7.0), "updated") is None
        third = await d.on_finding(replace(g, severity=9.5), "updated")
        assert third is not None and third.trigger == "finding" and third.finding_id == "G"
        over()
        second.status, second.result = "done", {"causes": [_cause("resource", 50.0)]}
        assert await d.on_finding(replace(f, severity=20.0), "updated") is None   # it found the cause: not redone
        second.result = {"causes": [_cause("resource", 3.0)]}                    # too weak to say
        fourth = await d.on_finding(replace(f, severity=20.0), "updated")   # F's third
        fourth.status = "done"
        over()
        assert fourth is not None and await d.on_finding(replace(f, severity=100.0), "updated") is None
        h = _finding(severity=3.0, fid="H", kind="stall")
        assert await d.on_finding(h, "updated") is None and d.refused["H"] == (3.0, "earlier", 0)
        assert await d.on_finding(replace(h, severity=4.0), "updated") is None
        assert await d.on_finding(replace(h, severity=150.0), "updated") is not None
        over()
        # refused for the cool-down: tried again once it lifts, while the finding is still going on
        k = _finding(severity=2.0, fid="K", kind="memory")
        assert await d.on_finding(k, "opened") is None and d.refused["K"][1] == "cooldown"
        assert d.refused["K"][2] == d.last_by_job["j"] + 600 * S
        assert await d.on_finding(k, "updated") is None          # not yet
        d.last_by_job["j"] -= 600 * S
        d.refused["K"] = (*d.refused["K"][:2], time.time_ns() - 1)
        stale = replace(k, last_ns=time.time_ns() - 60 * S)      # over a minute ago: a dive would see none of it
        assert await d.on_finding(stale, "updated") is None
        later = await d.on_finding(k, "updated")
        assert later is not None and later.finding_id == "K" and "K" not in d.refused
    asyncio.run(run())
    assert [t for _, t, _ in d.written] == ["finding", "escalation", "finding", "escalation", "finding", "finding"]
    assert [n for _, t, n in d.written if t == "escalation"][0].startswith("the finding escalated from 1.50 to 5.00")
    assert d.by_finding["F"][0] == 3 and d.by_finding["G"][0] == 1


def test_operator_dives_set_a_cool_down_no_finding_escalates_past():
    d = _dives(DeepDiveConfig(cooldown_seconds=600))
    now = 10_000 * S
    d.last_by_job["j"], d.last_dive["j"] = now - 100 * S, (now - 50 * S, float("inf"), "dd-op")
    assert d.admission("j", 10 * S, now, 2, severity=50.0).startswith("cooldown")
    d.last_dive["j"] = (now - 50 * S, 2.0, "dd-1")
    assert d.admission("j", 10 * S, now, 2, severity=2.9).startswith("cooldown")
    assert d.admission("j", 10 * S, now, 2, severity=3.0) == ""
    d.last_dive["j"] = (now + S, 2.0, "dd-1")
    assert d.admission("j", 10 * S, now, 2, severity=30.0).startswith("busy")
    d.last_dive["j"] = (now - S, 0.0, "dd-hang")          # a hang's dive (severity 0): nothing escalates past it
    assert d.admission("j", 10 * S, now, 2, severity=30.0).startswith("cooldown")
    d.cfg.escalation_factor = 0
    d.last_dive["j"] = (now - S, 2.0, "dd-1")
    assert d.admission("j", 10 * S, now, 2, severity=30.0).startswith("cooldown")


@pytest.mark.parametrize("table, why", [({"kinds": "slowdown"}, "kinds must be a list"),
                                        ({"duration_seconds": 0}, "duration_seconds"),
                                        ({"bogus": 1}, "unknown key"), ({"max_deep_fraction": 2}, "max_deep_fraction"),
                                        ({"enabled": "yes"}, "enabled"), ({"escalation_factor": 1}, "escalation"),
                                        ({"max_dives_per_finding": 0}, "max_dives_per_finding"),
                                        ({"conclusive_score": -1}, "conclusive_score")])
def test_config_errors_are_clear(table, why):
    with pytest.raises(ConfigError, match=why):
        build_config(DeepDiveConfig, table, "[deep_dive]")


def _seed(path: str, t0: int) -> None:
    """Two ranks of job j on h0/h1; rank 1's run-queue wait rises from 2 % to 40 % at t0."""
    conn = sqlite3.connect(path)
    for r, node in enumerate(("h0", "h1")):
        conn.execute("INSERT INTO processes(agent_id, pid, start_ticks, job_key, rank, local_rank, world_size,"
                     " started_ns) VALUES (?,?,?,?,?,?,?,?)", (node, 100 + r, 7, "j", r, 0, 2, t0 - 60 * S))
        cur = conn.execute("INSERT INTO series(agent_id, name, entity) VALUES (?,?,?)",
                           (node, "process_runqueue_seconds_total", f"pid:{100 + r}:7"))
        sid, v = cur.lastrowid, 0.0
        for k in range(-40, 40):
            t = t0 + k * S // 4
            v += (0.4 if (r == 1 and k >= 0) else 0.02) / 4
            conn.execute("INSERT INTO metrics(series_id, ts_ns, value) VALUES (?,?,?)", (sid, t, v))
    conn.commit()
    conn.close()


def test_a_finding_starts_one_synchronized_dive_and_gets_its_ranked_causes(tmp_path):
    db = str(tmp_path / "c.db")
    writer = StoreWriter(db)
    writer.start()
    t0 = time.time_ns()
    _seed(db, t0)
    reader = Reader(db)
    hub = FindingsHub()
    ingest = _Ingest(["h0", "h1"])
    cfg = DeepDiveConfig(duration_seconds=2.0, lead_ms=200, reference_seconds=5.0, settle_seconds=0.0)

    async def run():
        dives = DeepDives(ingest, reader, writer, _Clock(), hub, cfg)
        dives.start()
        await asyncio.sleep(0.05)
        f = Finding("slowdown", t0, t0 + S, 1.4, "rank 1 is late", (Suspect("rank", "1", 1.0),), job_key="j",
                    detector="lateness", id="f-1")
        hub.publish([Change("opened", f)])
        t_end = time.monotonic() + 15
        while time.monotonic() < t_end and dives.counts.get("done", 0) + dives.counts.get("failed", 0) == 0:
            if len(ingest.sent) >= 2 and not getattr(run, "modes", False):
                # the agents' ModeChange records, as the writer stores them (1.5 ms apart)
                cid = ingest.sent[0][1].command_id
                start = ingest.sent[0][1].deep.start_ns
                conn = sqlite3.connect(db)
                for i, node in enumerate(("h0", "h1")):
                    conn.execute("INSERT INTO events(agent_id, ts_ns, source, kind, entity, message, value) VALUES"
                                 " (?,?,?,?,?,?,?)", (node, start + i * 1_500_000, "agent", "mode", "deep",
                                                      f"deep (command) command {cid}", 0))
                conn.commit()
                conn.close()
                run.modes = True
            await asyncio.sleep(0.05)
        # the same finding again starts nothing more; another one of the job, no more severe, is in the cool-down
        hub.publish([Change("updated", f), Change("opened", replace(f, id="f-2", kind="stall"))])
        await asyncio.sleep(0.2)
        await dives.stop()
        return dives
    dives = asyncio.run(run())
    writer.stop()
    assert dives.counts["done"] == 1 and dives.skipped["cooldown"] == 1
    deep = [(n, c) for n, c in ingest.sent if c.WhichOneof("kind") == "deep"]
    assert [n for n, _ in deep] == ["h0", "h1"]
    starts = {cmd.deep.start_ns for _, cmd in deep}
    monos = {cmd.deep.start_mono_ns for _, cmd in deep}
    assert len(starts) == 1 and monos == {next(iter(starts)) - _NodeClock.offset}
    assert all(cmd.deep.duration_ns == 2 * S for _, cmd in deep)
    # the window's stacks were asked of both nodes (node-local detail), converted to each one's clock
    fetches = [c.fetch for n, c in ingest.sent if c.WhichOneof("kind") == "fetch"]
    assert {tuple(f.kinds) for f in fetches} == {("stacks",)} and len(fetches) >= 4
    assert all(len(f.pids) == len(f.ranks) > 0 for f in fetches)   # the ranks' pids, for ranks that exited
    (d,) = reader.deep_dives(finding_ids=["f-1"])
    assert d["status"] == "done" and d["trigger"] == "finding" and d["nodes"] == ["h0", "h1"] and d["ranks"] == [0, 1]
    assert d["start_spread_ns"] == 1_500_000 and set(d["started"]) == {"h0", "h1"}
    assert d["reference_until_ns"] == t0 - S and d["reference_since_ns"] == t0 - 6 * S
    top = d["causes"][0]
    assert (top["rank"], top["kind"], top["id"], top["cause"]) == (1, "resource", "runqueue", "cpu-contention"), top


@pytest.mark.parametrize("fault,cause", [("pin", "cpu-affinity"), ("burners", "cpu-contention")])
def test_a_serving_engine_of_no_rank_is_ranked_on_its_own_past(tmp_path, fault, cause):
    """A job whose only process has no rank (a serving engine; issue 17's inference loop): its resources are candidates
    against its own reference window. Pinned to one of its two CPUs at t0 (the inference bed's `slow` fault), its
    threads queue for the one left: the lost CPUs lead, not the run-queue wait they cause; with burners beside it
    (no pin) the run-queue wait does."""
    from steplens.collector.analysis import deepdive
    db = str(tmp_path / "c.db")
    StoreWriter(db).start()   # the schema
    t0 = time.time_ns()
    conn = sqlite3.connect(db)
    conn.execute("INSERT INTO processes(agent_id, pid, start_ticks, job_key, rank, local_rank, world_size, started_ns)"
                 " VALUES ('n0', 4242, 7, 'e', -1, -1, -1, ?)", (t0 - 60 * S,))
    for name, before, during in (("process_runqueue_seconds_total", 0.03, 0.45), ("process_cpus_allowed", 2, 1)):
        sid = conn.execute("INSERT INTO series(agent_id, name, entity) VALUES ('n0', ?, 'pid:4242:7')",
                           (name,)).lastrowid
        v = 0.0
        for k in range(-40, 40):
            if name == "process_cpus_allowed":
                v = during if k >= 0 and fault == "pin" else before
            else:
                v += (during if k >= 0 else before) / 4
            conn.execute("INSERT INTO metrics(series_id, ts_ns, value) VALUES (?,?,?)", (sid, t0 + k * S // 4, v))
    conn.commit()
    conn.close()
    dd = deepdive.DeepDive("dd-x", "e", "f", "finding", t0, t0 + S // 2, 8 * S, t0 - 9 * S, t0 - S, ["n0"], [])
    res = deepdive.analyse_dive(Reader(db), dd, [], [])
    top = res["causes"][0]
    assert (top["rank"], top["pid"], top["node"], top["kind"], top["cause"]) == (-1, 4242, "n0", "resource", cause), \
        res["causes"]
    assert res["data"]["ranks"] == 1 and list(res["rank_scores"]) == ["n0:4242"]


def test_the_reference_is_moved_back_past_other_episodes_and_dives():
    """The window before the onset held a false alarm's episode and the end of an earlier dive (the inference bed's
    noisy-neighbour dive): the reference is the latest quiet 10 s before them; none quiet within the lookback (a job
    always busy): the window at the onset as before."""
    from steplens.collector.analysis.deepdive import quiet_reference
    until, ten, gap, look = 1000 * S, 10 * S, S, 120 * S
    assert quiet_reference([], until, ten, gap, look) == (990 * S, until)
    assert quiet_reference([(1000 * S, 1010 * S), (900 * S, 950 * S)], until, ten, gap, look) == (990 * S, until)
    # a dive's window + settle ending 4 s before, a false-alarm episode 11..9 s before: 10 s ending 12 s before
    assert quiet_reference([(991 * S, 996 * S), (989 * S, 991 * S)], until, ten, gap, look) == (978 * S, 988 * S)
    # a gap too short between two spans is skipped too
    assert quiet_reference([(995 * S, 999 * S), (980 * S, 987 * S)], until, ten, gap, look) == (969 * S, 979 * S)
    busy = [(t * S, t * S + 9 * S) for t in range(850, 1000, 9)]   # back to back: nothing quiet in reach
    assert quiet_reference(busy, until, ten, gap, look) == (990 * S, until)


def test_a_dive_s_reference_avoids_the_job_s_stored_episodes_and_dives(tmp_path):
    """Through the real store: a finding of the job (another job's is no obstacle) and an earlier dive (+ its 3 s
    settle) in the 10 s before the onset push the reference back; a store that cannot be read leaves it there."""
    from steplens.collector.analysis.deepdive import DeepDive
    from steplens.collector.store import diagnosis as store
    db = str(tmp_path / "c.db")
    w = StoreWriter(db)
    w.start()
    w.stop()   # the schema
    until = 1000 * S
    conn = sqlite3.connect(db)
    store.write_changes(conn, [Change("opened", replace(_finding(), onset_ns=989 * S, last_ns=991 * S)),
                               Change("opened", replace(_finding(fid="o", job="other"), onset_ns=976 * S,
                                                        last_ns=980 * S))], until)
    store.write_deep_dive(conn, DeepDive("dd-1", "j", "f1", "finding", 0, 985 * S, 6 * S, 0, 0, ["h0"], []).row(),
                          until)
    conn.commit()
    conn.close()
    cfg = DeepDiveConfig(reference_seconds=10.0, settle_seconds=3.0)
    d = DeepDives(_Ingest(["h0"]), Reader(db), None, _Clock(), None, cfg)
    assert asyncio.run(d.reference("j", until)) == (974 * S, 984 * S)     # busy 985..994 and 989..991
    assert asyncio.run(d.reference("other", until)) == (990 * S, until)   # j's finding and dive are not its
    d.reader = Reader(str(tmp_path / "none" / "c.db"))
    assert asyncio.run(d.reference("j", until)) == (990 * S, until)


def test_a_finding_escalates_by_its_recent_severity():
    """A sentinel finding that a 2x false alarm opened averages the fault's batches with the alarm's: its severity
    moves slowly, its recent_severity (the last 5 s of alarms) at once. The escalation goes by the more of them."""
    from steplens.collector.analysis.deepdive import current_severity
    d = _Unrun(_Ingest(["h0"]), _Procs(), None, _Clock(), None,
               DeepDiveConfig(cooldown_seconds=600, duration_seconds=2.0, settle_seconds=1.0))
    d.written = []
    f = replace(_finding(severity=2.0, fid="S", detector="sentinel"), evidence={"recent_severity": 2.0})

    async def run():
        first = await d.on_finding(f, "opened")
        first.status, first.result = "done", {"causes": [_cause("function", 40.0)]}
        end, sev, cid = d.last_dive["j"]
        d.last_dive["j"] = (time.time_ns() - 1, sev, cid)
        assert await d.on_finding(replace(f, severity=2.3, evidence={"recent_severity": 2.6}), "updated") is None
        again = await d.on_finding(replace(f, severity=2.3, evidence={"recent_severity": 5.0}), "updated")
        assert again is not None and again.trigger == "escalation" and "from 2.00 to 5.00" in again.note
    asyncio.run(run())
    assert d.by_finding["S"][1] == 5.0
    for ev, want in (({}, 2.0), ({"recent_severity": 1.2}, 2.0), ({"recent_severity": float("nan")}, 2.0),
                     ({"recent_severity": True}, 2.0), ({"recent_severity": "9"}, 2.0), ({"recent_severity": 3}, 3.0)):
        assert current_severity(replace(f, evidence=ev)) == want, ev
