"""The hang detector (collector/analysis/hang.py): the wait-for graph over CommProgress names the rank the others
wait for (TP group, pipeline neighbours and other replicas' DP all-reduce, transitively), a collective every
member entered is a comm hang, and on simulated jobs (what agents send: Steps, CommProgress, process-state
Events; agentview) a stopped or a stuck rank is named within 20 s with its state, the finding says when the job
resumed, and a healthy job or a long step whose ops complete is not a hang."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from steplens.collector.analysis.base import ConfigError, Window
from steplens.collector.analysis.hang import HangConfig, culprits, detect, wait_for
from steplens.sim.faults import parse_fault
from steplens.sim.model import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "eval"))
import scale  # noqa: E402
import scoring  # noqa: E402

S = 10**9


def prog(rank, comm, enq, pending="", seq=-1, p2p=False, peer=-1, since=0, end=100 * S, node="n0"):
    return {"node_id": node, "pid": 100 + rank, "start_ticks": 1, "job_key": "j", "rank": rank, "comm_id": comm,
            "end_ns": end, "last_enqueued": enq, "last_started": enq, "last_completed": enq - (1 if pending else 0),
            "pending_op": pending, "pending_seq": seq, "pending_p2p": p2p, "pending_peer": peer,
            "pending_since_ns": since, "nranks": 0}


def test_the_sink_of_who_waits_for_whom_is_the_culprit():
    # rank 2 never entered tp seq 8; its TP peer 3 waits in it, rank 1 waits in a recv from 3, rank 0 in a recv
    # from 1, ranks 4-5 (another replica) wait in the DP all-reduce seq 5 that 2 and 3 never entered
    rows = [prog(2, "tp1", 7), prog(3, "tp1", 8, "all_reduce", 8, since=50 * S),
            prog(1, "pp", -1, "recv", 0, True, 3, since=50 * S), prog(0, "pp", -1, "recv", 0, True, 1, since=50 * S),
            prog(2, "dp", 4), prog(3, "dp", 4), prog(4, "dp", 5, "all_reduce", 5, since=60 * S),
            prog(5, "dp", 5, "all_reduce", 5, since=60 * S)]
    g = wait_for(rows)
    assert g.waits[3] == {2} and g.waits[0] == {1} and g.waits[4] == {2, 3}
    assert culprits(g) == [(2, 5)]
    assert not g.comm_stalls


def test_a_member_with_no_progress_at_all_counts_as_not_entered():
    # a stopped rank's Flight Recorder does not answer: it is known as a member from the job's comms only
    rows = [prog(1, "tp", 8, "all_reduce", 8, since=50 * S)]
    assert culprits(wait_for(rows, {"tp": {0, 1}})) == [(0, 1)]
    assert culprits(wait_for(rows)) == []  # nobody known to wait for: a comm stall
    assert wait_for(rows).comm_stalls == {"tp": {1}}


def test_every_member_inside_is_a_comm_hang():
    rows = [prog(r, "dp", 9, "all_reduce", 9, since=50 * S) for r in range(4)]
    g = wait_for(rows)
    assert culprits(g) == [] and g.comm_stalls == {"dp": {0, 1, 2, 3}}


def _reader(spec: str | None, mode: str = "stopped", seed: int = 3, dp: int = 8, pp: int = 4, tp: int = 2):
    cfg = ModelConfig(dp=dp, pp=pp, tp=tp, micro_batches=8, iterations=40, gpus_per_node=8, nodes_per_leaf=2,
                      spines=2, seed=seed)
    cfg.net_jitter_cv = 0.02
    faults = [parse_fault(spec, cfg.topology())] if spec else []
    return cfg, faults, scale.MemReader(cfg, faults, progress=True, hang_mode=mode)


@pytest.mark.parametrize("mode,state", [("stopped", "stopped"), ("stuck", "running, in no collective")])
def test_a_hung_rank_of_a_simulated_job_is_named_with_its_state(mode, state):
    _, faults, rd = _reader("hang:21:25:26:90", mode)
    stop = {r["step"]: r["end_ns"] for r in rd.rows if r["rank"] == 21}[24]
    early = detect(rd, Window(scoring.JOB, 0, stop + 10 * S), HangConfig())
    assert early == []  # under the 15 s floor: not yet
    (f,) = detect(rd, Window(scoring.JOB, 0, stop + 20 * S + 1), HangConfig())
    top = f.suspects[0]
    assert (f.kind, top.kind, top.id, top.cause) == ("hang", "rank", "21", "hang")
    assert top.evidence["state"] == state and f.evidence["hang_type"] == "non-comm" and f.evidence["ongoing"]
    assert top.evidence["waiting_on_it"] == 63  # everyone else, transitively
    assert 15 <= f.evidence["stalled_seconds"] <= 21 and f.severity > 10
    assert "culprit rank 21" in f.summary and f.evidence["waiting"]
    # after the job resumed: the same culprit, ongoing False, with when it resumed
    resume = max(r["end_ns"] for r in rd.rows if r["step"] == 25)
    after = detect(rd, Window(scoring.JOB, 0, resume + 20 * S), HangConfig())
    (g,) = [x for x in after if x.suspects[0].id == "21"]
    assert not g.evidence["ongoing"] and g.evidence["resumed_ns"] == resume and "resumed at step 25" in g.summary


def test_a_healthy_job_is_not_hung():
    _, _, rd = _reader(None)
    last = max(r["end_ns"] for r in rd.rows)
    for k in range(0, 40, 5):
        assert detect(rd, Window(scoring.JOB, 0, last - k * S), HangConfig()) == []


def test_a_long_step_whose_ops_complete_is_not_a_hang():
    # nothing pending (a checkpoint between steps): ranks report progress, none waits -> no hang
    _, _, rd = _reader(None)
    last = max(r["end_ns"] for r in rd.rows)
    rd.progress = [prog(r, "dp", 5, end=last + 30 * S) | {"job_key": scoring.JOB} for r in range(4)]
    assert detect(rd, Window(scoring.JOB, 0, last + 30 * S), HangConfig()) == []


def test_a_flight_recorder_read_long_ago_is_not_a_hang_until_a_read_shows_one():
    """The read schedule reads a healthy job's rings every ~20 s: its newest CommProgress, read 18 s before the
    window's end, shows the op then in flight (pending 5 ms). Measured to the window's end that op looked pending
    for 18 s (a false hang in the make-run demo); what counts is how long it had been pending when read. Once
    reads show it pending past the bound (the schedule re-reads a stalled ring every 5 s), it is a hang."""
    _, _, rd = _reader(None)
    last = max(r["end_ns"] for r in rd.rows)
    read_at = last + 1 * S
    rd.progress = [prog(r, "dp", 5, "all_reduce", 5, since=read_at - 5_000_000, end=read_at) | {"job_key": scoring.JOB}
                   for r in range(4)]
    assert detect(rd, Window(scoring.JOB, 0, read_at + 18 * S), HangConfig()) == []
    # the job hung at that op: later reads keep showing it pending
    rd.progress = [p | {"end_ns": read_at + 19 * S} for p in rd.progress]
    (f,) = detect(rd, Window(scoring.JOB, 0, read_at + 19 * S), HangConfig())
    assert f.kind == "hang" and f.evidence["ongoing"]


def test_bad_config_fails():
    for kw in ({"floor_seconds": 0.5}, {"step_multiple": 0.0}, {"frames": 0}, {"recent_steps": 0}):
        with pytest.raises(ConfigError):
            HangConfig(**kw).validate()


def test_the_stack_that_differs_from_its_group_is_named_without_comm_progress():
    # no Flight Recorder on the job: the step gap makes the finding, XPUTimer's stack diff the culprit
    _, _, rd = _reader(None)
    last = max(r["end_ns"] for r in rd.rows)

    def stack(rank, fn, file):
        return {"node_id": f"sim-node-{rank // 8}", "pid": 4000 + rank % 8, "end_ns": last + 25 * S,
                "stacks": [{"count": 40, "gil": 0, "running": 0,
                            "frames": [[fn, fn, file, 10], ["train_step", "train_step", "train.py", 50]]}]}
    rows = [stack(r, "wait", "torch/distributed/distributed_c10d.py") for r in range(64) if r != 9]
    rows.append(stack(9, "acquire", "loader.py"))
    rd.stacks = lambda node_id="", pid=0, since_ns=0, limit=200: sorted(rows, key=lambda x: -x["end_ns"])
    (f,) = detect(rd, Window(scoring.JOB, 0, last + 30 * S), HangConfig())
    top = f.suspects[0]
    assert (top.id, top.cause) == ("9", "hang") and top.evidence["frames"][0] == "acquire (loader.py:10)"
    assert "differs from the other 63" in top.evidence["why"]


class _Fake:
    """The reads hang.detect makes, from lists (a DP2 x PP2 gloo job as the testbed runs it)."""

    def __init__(self, steps, progress, events=(), stacks=()):
        self._steps, self._progress, self._events, self._stacks = steps, progress, list(events), list(stacks)

    def steps(self, job_key, ranks=None, since_ns=0, limit=0, with_comms=False):
        return [r for r in self._steps if r["end_ns"] >= since_ns]

    def jobs(self, job_key=""):
        return [{"job_key": "j", "ranks": [{"rank": r, "node_id": f"h{r}", "pid": 100 + r, "alive": True}
                                           for r in range(4)],
                 "comms": [{"comm_id": "pg:0", "ranks": [0, 1]}, {"comm_id": "pg:1", "ranks": [2, 3]}]}]

    def comm_progress_latest(self, job_key, until_ns=0):
        return [p for p in self._progress if p["end_ns"] <= until_ns]

    def process_events(self, since_ns=0, until_ns=0, node_ids=None, kinds=None, limit=0):
        return [e for e in self._events if since_ns <= e["ts_ns"] <= until_ns]

    def stacks(self, node_id="", pid=0, since_ns=0, limit=200):
        return [s for s in self._stacks if s["end_ns"] >= since_ns]


def _gloo_dp2pp2(stopped: bool):
    # rank 3 stops at 100 s: rank 2 waits in their DP all-reduce (seq 11, never entered by 3); rank 1 waits in
    # a recv from 3 that gloo's Flight Recorder does not record, so rank 0 waits for 1 in theirs: two sinks,
    # the wrong one first in rank order
    steps = [{"rank": r, "step": k, "start_ns": k * S, "end_ns": (k + 1) * S, "node_id": f"h{r}",
              "evidence": "anchor", "source": "flightrec", "comms": []} for r in range(4) for k in range(100)]
    end = 140 * S
    prog_rows = [prog(0, "pg:0", 11, "all_reduce", 11, since=100 * S, end=end, node="h0"),
                 prog(1, "pg:0", 10, end=end, node="h1"),
                 prog(2, "pg:1", 11, "all_reduce", 11, since=100 * S, end=end, node="h2"),
                 prog(3, "pg:1", 10, end=99 * S, node="h3")]
    for p in prog_rows:
        p["pid"] = 100 + p["rank"]

    def st(rank, fn, file):
        return {"node_id": f"h{rank}", "pid": 100 + rank, "end_ns": 130 * S,
                "stacks": [{"count": 90, "gil": 0, "running": 0,
                            "frames": [[fn, fn, file, 1], ["train", "train", "job.py", 9]]}]}
    stacks = [st(0, "all_reduce", "torch/distributed/distributed_c10d.py"),
              st(2, "all_reduce", "torch/distributed/distributed_c10d.py"),
              st(1, "recv", "torch/distributed/distributed_c10d.py")]
    events = []
    if stopped:
        events.append({"node_id": "h3", "ts_ns": 102 * S, "kind": "process_stopped", "pid": 103,
                       "start_ticks": 1, "message": "rank 3 stopped", "value": 0.0})
    else:
        stacks.append(st(3, "hold_in_python", "job.py"))
    return _Fake(steps, prog_rows, events, stacks), end


@pytest.mark.parametrize("stopped", [True, False])
def test_of_two_sinks_the_stopped_or_stuck_rank_leads_not_the_one_in_a_hidden_recv(stopped):
    rd, end = _gloo_dp2pp2(stopped)
    (f,) = detect(rd, Window("j", 0, end), HangConfig())
    assert [s.id for s in f.suspects[:2]] == ["3", "1"]
    lead = f.suspects[0].evidence
    if stopped:
        assert lead["state"] == "stopped"
    else:
        assert lead["state"] == "running, in no collective" and lead["frames"][0].startswith("hold_in_python")
    assert f.evidence["culprit_groups"]["pg:1"] == {"entered up to seq 10, nothing pending": "3",
                                                    "waiting in all_reduce seq 11": "2"}


def test_through_the_store_a_stopped_rank_is_named(tmp_path):
    # the same records through the real store (agent encoding -> StoreWriter -> SQLite -> Reader):
    # comm_progress_latest and process_events as the collector answers them
    cfg = ModelConfig(dp=4, pp=2, tp=2, micro_batches=8, iterations=40, gpus_per_node=8, nodes_per_leaf=2,
                      spines=2, seed=3)
    faults = [parse_fault("hang:6:25:26:60", cfg.topology())]
    rd = scoring.feed(cfg, faults, str(tmp_path / "hang.db"))
    stop = {r["step"]: r["end_ns"] for r in rd.steps(scoring.JOB, ranks=[6])}[24]
    assert rd.comm_progress_latest(scoring.JOB, until_ns=stop + 20 * S)
    (f,) = detect(rd, Window(scoring.JOB, 0, stop + 20 * S + 1), HangConfig())
    top = f.suspects[0]
    assert (top.id, top.evidence["state"]) == ("6", "stopped") and top.evidence["waiting_on_it"] == 15


def _comm_hang():
    """h1's link drops everything: ranks 0 and 1 are both inside their all-reduce (seq 11), none completes; rank 3
    waits in a recv from 1 (unrecorded, its stack inside a comm call), so rank 2 waits for 3."""
    rd, end = _gloo_dp2pp2(False)
    rd._progress[1] = prog(1, "pg:0", 11, "all_reduce", 11, since=100 * S, end=end, node="h1")
    rd._progress[1]["pid"] = 101
    rd._progress[3] = prog(3, "pg:1", 10, end=end, node="h3")
    rd._progress[3]["pid"] = 103
    rd._stacks = [x for x in rd._stacks if x["pid"] not in (101, 103)] + [
        {"node_id": "h3", "pid": 103, "end_ns": 130 * S, "stacks": [{"count": 90, "gil": 0, "running": 0, "frames": [
            ["recv", "recv", "torch/distributed/distributed_c10d.py", 1], ["train", "train", "job.py", 9]]}]}]
    return rd, end


def test_a_stalled_collective_with_only_a_hidden_recv_as_sink_is_a_comm_hang():
    # h1's link drops everything: ranks 0 and 1 are both inside their all-reduce (seq 11), none completes;
    # rank 3 waits in a recv from 1 (unrecorded), so rank 2 waits for 3: rank 3 is a sink, but inside a comm call
    rd, end = _comm_hang()
    (f,) = detect(rd, Window("j", 0, end), HangConfig())
    assert f.evidence["hang_type"] == "comm" and f.summary.startswith("Comm hang")
    assert [(s.kind, s.id, s.cause) for s in f.suspects] == [("node", "h0", "network"), ("node", "h1", "network"),
                                                             ("rank", "3", "network")]


def test_a_comm_hang_names_the_host_every_stuck_connection_touches():
    # the same comm hang with the tcpinfo source's Events: h1 (10.0.0.11) has a link dropping everything, so
    # h1's connections to h0 and h3 and h0's and h3's to h1 are stuck retransmitting; h0's connection to h2 was
    # stuck too but recovered. h1 is the only host at an end of every stuck one: it leads, then its NIC
    from steplens.collector.topology import from_dict

    rd, end = _comm_hang()

    def ev(t, kind, src, dst):
        return {"ts_ns": t * S, "kind": kind, "entity": f"{src}->{dst}", "message": "", "value": 0.0}
    events = {"h0": [ev(101, "tcp_stalled", "10.0.0.10:41000", "10.0.0.11:29500"),
                     ev(101, "tcp_stalled", "10.0.0.10:41002", "10.0.0.12:29502"),
                     ev(104, "tcp_recovered", "10.0.0.10:41002", "10.0.0.12:29502")],
              "h1": [ev(102, "tcp_stalled", "10.0.0.11:29500", "10.0.0.10:41000"),
                     ev(102, "tcp_stalled", "10.0.0.11:41003", "10.0.0.13:29503")],
              "h3": [ev(103, "tcp_stalled", "10.0.0.13:29503", "10.0.0.11:41003")]}
    rd.node_events = lambda node, kinds, since=0, until=0, limit=0: [
        e for e in events.get(node, []) if e["kind"] in kinds and since <= e["ts_ns"] <= until]
    nodes = [{"id": f"h{i}", "nics": [{"id": f"h{i}.eth0", "switch": "sw", "ip": f"10.0.0.1{i}"}]} for i in range(4)]
    topo = from_dict({"version": 1, "nodes": nodes, "switches": [{"id": "sw", "tier": "leaf"}]})
    rd.topology = lambda: topo
    (f,) = detect(rd, Window("j", 0, end), HangConfig())
    assert f.evidence["hang_type"] == "comm"
    assert [(s.kind, s.id, s.cause) for s in f.suspects[:3]] == [("node", "h1", "network"),
                                                                 ("nic", "h1.eth0", "network"),
                                                                 ("node", "h0", "network")]
    lead = f.suspects[0].evidence
    assert lead["why"] == "each of the 4 stalled TCP connection(s) has h1 at one end"
    assert "h1: 10.0.0.11:29500->10.0.0.10:41000" in lead["connections"]
    # one stuck connection alone: either end could be the broken one, nothing reordered
    events = {"h0": [ev(101, "tcp_stalled", "10.0.0.10:41000", "10.0.0.11:29500")]}
    (g,) = detect(rd, Window("j", 0, end), HangConfig())
    assert [(s.kind, s.id) for s in g.suspects[:2]] == [("node", "h0"), ("node", "h1")]


def test_a_culprit_on_a_host_whose_agent_fell_silent_leads_with_its_host():
    # rank 3 never entered seq 11, and h3's agent has sent nothing for 40 s while the others report: what is
    # known of rank 3 is 40 s old, the host (or its network) is the first suspect, then the rank
    rd, end = _gloo_dp2pp2(True)
    rd._events = []
    rd.nodes = lambda: [{"node_id": f"h{i}", "connected": i != 3, "last_seen_ns": end - (40 * S if i == 3 else 0)}
                        for i in range(4)]
    (f,) = detect(rd, Window("j", 0, end), HangConfig())
    assert [(s.kind, s.id, s.cause) for s in f.suspects[:2]] == [("node", "h3", "unreachable"), ("rank", "3", "hang")]
    assert f.suspects[0].evidence["why"].startswith("its agent has not been heard from for 40 s")
    assert f.evidence["hang_type"] == "non-comm" and "node h3: its agent has not been heard" in f.summary


def test_a_job_that_hung_then_died_says_so_with_its_culprit():
    # rank 3 stopped at ~100 s; at 160 s every process exited (gloo's timeout killed the job): the finding is the
    # hang as it stood before, with the culprit, saying the job died; one that exits right after its last step
    # (a normal end) is no hang at all
    rd, end = _gloo_dp2pp2(True)
    real = rd.jobs

    def died(at):
        def jobs(job_key=""):
            j = real(job_key)
            for r in j[0]["ranks"]:
                r["alive"], r["exited_ns"] = False, at + r["rank"] * S
            return j
        return jobs
    rd.jobs = died(160 * S)
    (f,) = detect(rd, Window("j", 0, 170 * S), HangConfig())
    assert (f.suspects[0].id, f.suspects[0].evidence["state"]) == ("3", "stopped")
    assert f.evidence["ongoing"] is False and f.evidence["died_ns"] == 160 * S and f.last_ns == 160 * S
    assert f.summary.endswith("then the job died: its processes exited 60 s into the hang.")
    rd.jobs = died(101 * S)
    assert detect(rd, Window("j", 0, 170 * S), HangConfig()) == []
    rd.jobs = died(160 * S)   # long ago: its finding has resolved, not re-sent
    assert detect(rd, Window("j", 0, 3600 * S), HangConfig()) == []


def test_a_dead_member_of_a_stalled_collective_is_the_culprit_not_the_network():
    # the comm hang of the test above, then rank 1's process died (a zombie): its last CommProgress says it is
    # inside the all-reduce, but that is stale; it holds rank 0 up, the hang is no longer the network's
    rd, end = _comm_hang()
    rd._events = [{"node_id": "h1", "ts_ns": 120 * S, "kind": "process_zombie", "pid": 101, "start_ticks": 1,
                   "message": "rank 1 zombie", "value": 0.0}]
    (f,) = detect(rd, Window("j", 0, end), HangConfig())
    assert (f.suspects[0].kind, f.suspects[0].id, f.suspects[0].evidence["state"]) == ("rank", "1", "zombie")
    assert f.evidence["hang_type"] == "non-comm"


def test_a_job_whose_processes_all_exited_does_not_hang():
    # `diagnose` long after a job ended: no step for an hour, no CommProgress (no flightrec), every rank gone
    rd, end = _gloo_dp2pp2(True)
    rd._progress = []
    assert detect(rd, Window("j", 0, 3600 * S), HangConfig())  # alive: a hang (the step gap alone)
    real = rd.jobs

    def gone(job_key=""):
        j = real(job_key)
        for r in j[0]["ranks"]:
            r["alive"] = False
        return j
    rd.jobs = gone
    assert detect(rd, Window("j", 0, 3600 * S), HangConfig()) == []


class _NothingPending:
    """The simulated job as gloo's pipeline shows it: the Flight Recorder reports nothing pending (the peers of the
    stopped rank wait in send/recv, which it does not record); only the process state tells."""

    def __init__(self, rd, events: bool) -> None:
        self._rd, self._events = rd, events

    def __getattr__(self, name):
        return getattr(self._rd, name)

    def comm_progress_latest(self, job_key, until_ns=0):
        return [{**p, "pending_op": "", "pending_seq": -1, "pending_since_ns": 0}
                for p in self._rd.comm_progress_latest(job_key, until_ns=until_ns)]

    def process_events(self, *a, **k):
        return self._rd.process_events(*a, **k) if self._events else []


def test_a_rank_stopped_after_its_last_step_is_a_hang_even_with_nothing_pending():
    _, _, rd = _reader("hang:21:25:26:90", "stopped")
    stop = {r["step"]: r["end_ns"] for r in rd.rows if r["rank"] == 21}[24]
    w = Window(scoring.JOB, 0, stop + 20 * S + 1)
    (f,) = detect(_NothingPending(rd, events=True), w, HangConfig())
    assert (f.kind, f.suspects[0].id, f.suspects[0].evidence["state"]) == ("hang", "21", "stopped")
    # nothing pending and no process stopped: ops complete (a long step), not a hang
    assert detect(_NothingPending(rd, events=False), w, HangConfig()) == []
