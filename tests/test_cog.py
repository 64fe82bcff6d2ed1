"""The operator-graph walk (collector/analysis/cog.py) on simulated jobs in a real store, CommOps fetched from the
emulated agents as FetchDetail answers: it starts at the pivot's abnormal ops, follows the rank the others
waited for (step summaries) and the pipeline peers (fetched ops), and ends at the slow GPU, fetching only the
ranks it visits; the irregularity detector carries it as evidence `cog`."""

from __future__ import annotations

import os
import sys

from conftest import REPO
from steplens.collector.analysis import cog
from steplens.collector.analysis.base import Window
from steplens.collector.analysis.engine import AnalysisReader
from steplens.collector.analysis.irregularity import IrregularityConfig, detect, gate, load
from steplens.sim.faults import parse_fault
from steplens.sim.model import ModelConfig

sys.path.insert(0, os.path.join(REPO, "bench", "eval"))
import scoring


def job(tmp_path, spec: str, fetch: bool = True):
    cfg = ModelConfig(dp=8, pp=4, tp=2, micro_batches=8, iterations=40, gpus_per_node=8, nodes_per_leaf=2,
                      spines=2, seed=11, net_jitter_cv=0.02)
    faults = [parse_fault(spec, cfg.topology())]
    rd = scoring.feed(cfg, faults, str(tmp_path / "c.db"))
    return AnalysisReader(rd, scoring.sim_fetcher(cfg, faults) if fetch else None)


def walk(ar):
    js = load(ar, Window(scoring.JOB, 0, 2**62), IrregularityConfig())
    g = gate(js.x_ns, IrregularityConfig())
    flagged = [i for i, f in enumerate(g.flag) if f]
    ref = [i for i in range(flagged[0])]
    return cog.search(ar, scoring.JOB, js, flagged, ref, g.ratio)


def test_the_walk_follows_the_pipeline_to_the_slow_gpu(tmp_path):
    # rank 45 = stage 2, replica 6: rank 0 waits in its DP all-reduce for rank 12 (stage 0, replica 6), which
    # waited for its recv from stage 1, which waited for stage 2's, where rank 44 waited for its TP peer 45
    ar = job(tmp_path, "slow_gpu:45:20:40:2")
    res = walk(ar)
    assert res.causes[0][:2] == ("rank", "45") and res.causes[0][3] == "compute"
    assert res.path[0].startswith("0:dp.s0.t0:all_reduce") and any(h.startswith("28:") for h in res.path)
    assert 45 in res.ranks_fetched and len(res.ranks_fetched) <= 6 and sorted(ar.ranks_fetched) == res.ranks_fetched
    assert res.classifier == "lightgbm"


def test_a_slow_gpu_in_the_pivots_group_ends_at_it(tmp_path):
    res = walk(job(tmp_path, "slow_gpu:13:20:40:2"))
    assert res.causes[0][:2] == ("rank", "13") and len(res.ranks_fetched) <= 4


def test_without_fetching_it_says_why(tmp_path):
    res = walk(job(tmp_path, "slow_gpu:13:20:40:2", fetch=False))
    assert res.causes == [] and res.ranks_fetched == [] and "fetch" in res.note


def test_irregularity_carries_the_walk_as_evidence(tmp_path):
    ar = job(tmp_path, "slow_gpu:45:20:40:2")
    (f,) = detect(ar, Window(scoring.JOB, 0, 2**62), IrregularityConfig())
    assert f.suspects[0].id == "45" and f.evidence["cog"]["causes"][0][:2] == ["rank", "45"]
    assert f.evidence["cog"]["ranks_fetched"] <= 6
