"""Holmes' cross-iteration device ranking (collector/analysis/devrank.py): the erratum-fixed topology decay,
the irregularity rate R, and a spine above two bad leaves not winning by their sum."""

from __future__ import annotations

import math

from steplens.collector.analysis import devrank
from steplens.collector.topology import from_dict
from steplens.sim.model import ModelConfig


def topo():
    cfg = ModelConfig(dp=8, pp=4, tp=2, micro_batches=8, iterations=4, gpus_per_node=8, nodes_per_leaf=2, spines=2)
    return from_dict(cfg.topology().topology_file())


def test_decay_is_monotone_and_one_for_a_single_nic():
    h = [math.log(1 + c) / (c * math.log(2)) for c in range(1, 200)]
    assert h[0] == 1.0 and all(a > b for a, b in zip(h, h[1:])) and min(h) > 0
    # the printed H(d) = ln(C + eps - 1) / C is negative at C = 1 (the erratum this fixes)
    assert math.log(1 + 1e-6 - 1) / 1 < 0
    t = topo()
    assert devrank.decay("rank", "3", t) == 1.0 and devrank.decay("link", "n0.nic0", t) == 1.0
    leaf, spine = devrank.decay("switch", "leaf0", t), devrank.decay("switch", "spine0", t)
    assert 0 < spine < leaf < 1  # a spine has more NICs below it than a leaf


def test_pearson_is_clipped_and_safe():
    assert devrank.pearson([1, 2, 3, 4], [2, 4, 6, 8]) == 1.0
    assert devrank.pearson([1, 2, 3, 4], [8, 6, 4, 2]) == 0.0  # anti-correlated: clipped to 0
    assert devrank.pearson([5, 5, 5], [1, 2, 3]) == 0.0      # constant: NaN -> 0
    assert devrank.pearson([1, 2], [1, 2]) == 0.0            # too short


def test_a_spine_above_two_bad_leaves_does_not_win_by_their_sum():
    t = topo()
    # each leaf's slow traffic also crosses spine0: without the decay spine0 collects both (2.0 vs 1.0 each)
    causes = [(1.0, {("switch", "leaf0"): 1.0, ("switch", "spine0"): 1.0}),
              (1.0, {("switch", "leaf2"): 1.0, ("switch", "spine0"): 1.0})]
    plain = devrank.rank(causes, None)
    assert plain[0][1] == "spine0"
    ranked = devrank.rank(causes, t, counts={"switch": len(t.switches)})
    assert {ranked[0][1], ranked[1][1]} == {"leaf0", "leaf2"} and ranked[2][1] == "spine0"


def test_a_compute_cause_outranks_links_and_r_weights_it():
    causes = [(0.9, {("rank", "13"): 1.0})] * 5 + [(0.2, {("link", "n1.nic0"): 1.0})] * 5
    ranked = devrank.rank(causes, topo(), counts={"rank": 64, "link": 64})
    assert ranked[0][:2] == ("rank", "13") and ranked[0][2] > ranked[1][2] and ranked[1][:2] == ("link", "n1.nic0")
    assert devrank.rank([(0.0, {("rank", "1"): 1.0})]) == []  # R = 0 contributes nothing
