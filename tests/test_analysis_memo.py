"""The analysis loop's per-job memo (irregularity.per_step, kept by the engine across passes): passes over growing
windows with the memo find exactly what passes from cold find, compute each step's per-step results once while
its rows stay the same, recompute a step whose rows changed, and forget the steps that left the window; the
store's Reader keeps the parsed topology until a new version is imported."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

from steplens.collector.analysis import commtime, irregularity
from steplens.collector.analysis.base import Window
from steplens.collector.analysis.engine import AnalysisReader
from steplens.collector.store import diagnosis as dstore
from steplens.collector.topology import from_dict
from steplens.sim.faults import parse_fault
from steplens.sim.model import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "eval"))
import scoring  # noqa: E402


def _job(tmp_path, spec: str, seed: int = 3):
    cfg = ModelConfig(dp=4, pp=2, tp=2, micro_batches=8, iterations=60, gpus_per_node=8, nodes_per_leaf=2,
                      spines=2, seed=seed)
    cfg.net_jitter_cv = 0.02
    faults = [parse_fault(spec, cfg.topology())]
    return cfg, faults, scoring.feed(cfg, faults, str(tmp_path / "memo.db"))


def _found(out) -> list:
    return sorted((d, f.kind, f.onset_ns, f.severity, tuple((s.id, s.score) for s in f.suspects)) for d, f in out)


def _counting(monkeypatch) -> dict:
    calls = {"margins": 0, "transfer": 0, "skew": 0}
    real_m, real_t, real_s = irregularity._step_margins, commtime._step_transfer, irregularity._step_skew

    def margins(js, i, picks):
        calls["margins"] += 1
        return real_m(js, i, picks)

    def transfer(js, i):
        calls["transfer"] += 1
        return real_t(js, i)

    def skew(js, i, picks, tie_ns):
        calls["skew"] += 1
        return real_s(js, i, picks, tie_ns)
    monkeypatch.setattr(irregularity, "_step_margins", margins)
    monkeypatch.setattr(irregularity, "_step_skew", skew)
    monkeypatch.setattr(commtime, "_step_transfer", transfer)
    return calls


def test_passes_with_the_memo_find_what_cold_passes_find(tmp_path, monkeypatch):
    cfg, faults, reader = _job(tmp_path, "slow_link:n1.nic0:25:45:2.0")
    ends = {r["step"]: r["end_ns"] for r in reader.steps(scoring.JOB, ranks=[0])}
    fetch = scoring.sim_fetcher(cfg, faults)
    memo: dict = {}
    calls = _counting(monkeypatch)
    per_pass, any_found = [], False
    for c in range(20, 60, 10):
        before = dict(calls)
        warm, _ = scoring.run_detectors(AnalysisReader(reader, fetch, memo), ends[c] + 1)
        per_pass.append({k: calls[k] - before[k] for k in calls})
        cold, _ = scoring.run_detectors(AnalysisReader(reader, fetch), ends[c] + 1)
        assert _found(warm) == _found(cold), c
        any_found = any_found or bool(warm)
    assert any_found  # the slow link is found: the comparison is not between two empty lists
    # every step is in the window of every pass (since 0): after the first pass each pass computes its 10 new
    # steps only (the last one's, seen incomplete before, counted), not the whole window again; the skew of
    # each step as it arrives too (warm_skew), so the pass that localizes the link reads its steps from the memo
    assert per_pass[0]["transfer"] >= 19 and per_pass[0]["margins"] >= 19 and per_pass[0]["skew"] >= 19, per_pass
    for k, got in enumerate(per_pass[1:], start=1):
        assert all(1 <= got[x] <= 11 for x in ("transfer", "margins", "skew")), (k, per_pass)
    assert {k[0] for k in memo} >= {"transfer"} and any(k[0].startswith("margins:") for k in memo)
    assert any(k[0].startswith("skew:") for k in memo)


def test_a_step_whose_rows_change_is_recomputed_and_old_steps_are_forgotten(tmp_path, monkeypatch):
    cfg, faults, reader = _job(tmp_path, "slow_gpu:5:25:45:1.5")
    rows = reader.steps(scoring.JOB, with_comms=True)
    ends = sorted({r["end_ns"] for r in rows if r["rank"] == 0})

    class Edited:  # the store's rows, one step of one rank replaced (a late, corrected row)
        steps_after = None   # rows edited in steps(): no incremental read past them (test_steps_incremental.py)

        def __init__(self, edit):
            self.edit = edit

        def __getattr__(self, name):
            return getattr(reader, name)

        def steps(self, job_key, ranks=None, since_ns=0, limit=200_000, with_comms=False):
            out = reader.steps(job_key, ranks, since_ns, limit, with_comms)
            return [self.edit(dict(r)) if r["rank"] == 3 and r["step"] == 30 else r for r in out]

    memo: dict = {}
    icfg = irregularity.IrregularityConfig()
    calls = _counting(monkeypatch)
    w = Window(scoring.JOB, 0, ends[50] + 1)
    irregularity.detect(AnalysisReader(Edited(lambda r: r), None, memo), w, icfg)
    n0 = calls["margins"]
    irregularity.detect(AnalysisReader(Edited(lambda r: r), None, memo), w, icfg)
    assert calls["margins"] == n0  # nothing changed: nothing recomputed

    def later(r):
        r["end_ns"] += 1000
        return r
    irregularity.detect(AnalysisReader(Edited(later), None, memo), w, icfg)
    assert calls["margins"] == n0 + 1  # step 30 only
    # a window starting later: the memo forgets the steps before it
    irregularity.detect(AnalysisReader(Edited(later), None, memo), Window(scoring.JOB, ends[40], ends[55] + 1),
                        icfg)
    assert memo and min(k[1] for k in memo if type(k[1]) is int) >= 39   # (other keys: layouts, rows)


def test_the_reader_keeps_the_parsed_topology_until_a_new_version(tmp_path):
    cfg, _, reader = _job(tmp_path, "slow_gpu:5:25:45:1.5")
    t1 = reader.topology()
    assert t1 is not None and reader.topology() is t1  # parsed once
    rec = reader.topology_record()
    rec["version"] = -1  # a caller's copy: editing it changes nothing kept
    assert reader.topology_record()["version"] != -1
    other = ModelConfig(dp=2, pp=2, tp=2, micro_batches=4, iterations=10, gpus_per_node=8, nodes_per_leaf=2,
                        spines=2, seed=1)
    conn = sqlite3.connect(str(tmp_path / "memo.db"))
    with conn:
        dstore.write_topology(conn, from_dict(other.topology().topology_file()), "test", 1)
    conn.close()
    t2 = reader.topology()
    assert t2 is not t1 and t2.counts()["gpus"] == other.gpus
