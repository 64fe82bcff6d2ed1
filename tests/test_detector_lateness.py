"""The lateness detector (collector/analysis/lateness.py) on simulated jobs fed through the real writer (as
bench/eval feeds them): a rank late into every collective it joins against its own history is found when the
job's step time does not show it (a GPU fluctuating under the gate, a GPU slowing while another is slower
still), and not when the irregularity detector names it already; healthy jobs with jittering compute and
transfers give nothing."""

from __future__ import annotations

import os
import sys

import pytest
from conftest import REPO
from steplens.collector.analysis.base import ConfigError, Window
from steplens.collector.analysis.irregularity import IrregularityConfig
from steplens.collector.analysis.irregularity import detect as irregularity
from steplens.collector.analysis.lateness import LatenessConfig, detect
from steplens.sim.faults import parse_fault
from steplens.sim.model import ModelConfig

sys.path.insert(0, os.path.join(REPO, "bench", "eval"))  # scoring.py: the eval feed through StoreWriter
import scoring


def store(tmp_path, specs: list[str], seed: int = 11, cv: float = 0.02, shape=(8, 4, 2)):
    dp, pp, tp = shape
    cfg = ModelConfig(dp=dp, pp=pp, tp=tp, micro_batches=8, iterations=100, gpus_per_node=8, nodes_per_leaf=2,
                      spines=2, seed=seed, net_jitter_cv=cv)
    return scoring.feed(cfg, [parse_fault(x, cfg.topology()) for x in specs], str(tmp_path / f"l{seed}.db"))


def run(reader, **kw) -> list:
    return detect(reader, Window(scoring.JOB, 0, 2**62), LatenessConfig(**kw))


@pytest.mark.parametrize("seed,cv,shape", [(3, 0.04, (8, 4, 2)), (4, 0.01, (8, 2, 4))])
def test_healthy_jobs_give_nothing(tmp_path, seed, cv, shape):
    assert run(store(tmp_path, [], seed, cv, shape)) == []


def test_a_gpu_fluctuating_under_the_gate_is_found(tmp_path):
    # 1.2x at the top of an 8-step cycle: the job's step time moves < 10 % (the gate's delta), irregularity
    # says nothing; rank 13 arrives late at both of its groups on the slow steps (1.15x is not found: 4 flagged
    # steps at 5 sigma are needed, as 3 at 4 sigma let a 64-rank job's compute-jitter tails make a finding)
    rd = store(tmp_path, ["fluctuation:13:30:60:1.2:8"])
    assert irregularity(rd, Window(scoring.JOB, 0, 2**62), IrregularityConfig()) == []
    (f,) = run(rd)
    assert (f.kind, f.suspects[0].id, f.suspects[0].cause) == ("fluctuation", "13", "compute")
    assert 30 <= f.evidence["first_step"] <= 34 and 56 <= f.evidence["last_step"] <= 60
    assert f.evidence["pattern"] == "fluctuating" and not f.evidence["ongoing"] and "(over)" in f.summary
    assert 1.02 < f.severity < 1.3 and f.evidence["gate_flagged_share"] < 0.5


def test_a_slow_fluctuation_is_one_span_over_its_peaks(tmp_path):
    # 1.15x with a period of 12: its first peak a run of 5 flagged steps, the next ones 2-3 each, 11-12 steps
    # apart; within fluctuation_steps (16) of each other they are one fluctuating span, not a slowdown of the
    # first peak (fluctuation_steps 12 left the later peaks out: 3 flags in any 12 steps)
    rd = store(tmp_path, ["fluctuation:13:30:70:1.15:12"])
    (f,) = run(rd)
    assert (f.kind, f.suspects[0].id, f.evidence["pattern"]) == ("fluctuation", "13", "fluctuating")
    assert 30 <= f.evidence["first_step"] <= 36 and 56 <= f.evidence["last_step"] <= 70
    (f,) = run(rd, fluctuation_steps=12)
    assert (f.kind, f.evidence["last_step"]) == ("slowdown", 38)


class NewestStepLate:
    """The store as a pass sees it while one rank has not reported the newest step yet (it ends last)."""

    def __init__(self, reader, rank: int, step: int) -> None:
        self.reader, self.rank, self.step = reader, rank, step

    def steps(self, *a, **kw):
        return [r for r in self.reader.steps(*a, **kw) if r["step"] <= self.step
                and not (r["rank"] == self.rank and r["step"] == self.step)]

    def __getattr__(self, name):
        return getattr(self.reader, name)


def test_a_rank_that_has_not_reported_the_newest_step_is_still_judged(tmp_path):
    # the slow rank ends its steps last, so at a pass it is the one most often without the newest step (taken
    # once 90 % of the ranks reported it): judged up to the newest step every rank reported, it is found
    rd = store(tmp_path, ["fluctuation:13:30:100:1.2:8"])   # under the gate: irregularity names nobody
    (f,) = run(NewestStepLate(rd, 13, 45))
    assert (f.suspects[0].id, f.kind) == ("13", "fluctuation") and f.evidence["last_step"] <= 44
    assert run(NewestStepLate(rd, 13, 45), max_lag_steps=0) == []   # as before: rank 13 not judged at all


def test_a_gpu_masked_by_a_slower_one_is_found_and_the_slower_one_not_twice(tmp_path):
    # rank 13 is 2.5x slow from step 20 (irregularity: a degradation naming it); rank 40 fluctuates up to 2x
    # from 30 to 50 and is never the last to arrive while 13 is slower: the job's step time cannot show it
    rd = store(tmp_path, ["slow_gpu:13:20:80:2.5", "fluctuation:40:30:50:2.0:5"])
    irr = irregularity(rd, Window(scoring.JOB, 0, 2**62), IrregularityConfig())
    assert [f.suspects[0].id for f in irr] == ["13"]
    (f,) = run(rd)
    assert f.suspects[0].id == "40" and 29 <= f.evidence["first_step"] <= 32
    assert f.evidence["masked_by"] == "13" and "hidden while rank 13 slows the job" in f.summary
    assert f.evidence["gate_flagged_share"] > 0.5 and f.evidence["last_share"] < 0.5


def test_ranks_in_one_collective_group_are_not_judged(tmp_path):
    # TP = 1: a rank's only group is its DP ring, where a rank waiting on its pipeline looks late too
    rd = store(tmp_path, ["slow_gpu:5:30:60:1.3"], shape=(8, 4, 1))
    assert run(rd) == []


def test_bad_config_fails():
    for bad in ({"noise_k": -1}, {"min_step_fraction": 0.0}, {"fluctuation_min": 1}, {"max_rank_steps": 10},
                {"complete_fraction": 0.0}, {"max_collectives_per_step": 0}, {"max_lag_steps": -1},
                {"noise_k_every": 6.0}):
        with pytest.raises(ConfigError):
            LatenessConfig(**bad).validate()


def test_candidates_are_exactly_the_ranks_flags_would_flag():
    """candidates() (all ranks at once, numpy) names exactly the ranks whose flags() has a flagged step: late
    ranks of both widths, one late before the baseline exists, one late on a single comm only, jitter of
    several scales, steps without a baseline step (0)."""
    import random

    from steplens.collector.analysis.lateness import LatenessConfig, candidates, flags
    rng = random.Random(5)
    cfg = LatenessConfig()
    steps = 30
    base = [0.0] * 3 + [1e8] * 12 + [0.0] + [1e8] * 14
    cols_of, want_late = {}, set()
    for rank in range(300):
        width = 2 if rank % 3 else 4
        jitter = rng.choice((2e4, 2e5, 1e6)) if rank % 37 != 5 else 2e5
        cols = [[(rng.gauss(0.0, jitter), rng.choice((4, 8))) for _ in range(steps)] for _ in range(width)]
        if rank % 37 == 5:   # late into every comm from step 20: flagged
            for col in cols:
                for p in range(20, steps):
                    col[p] = (col[p][0] + 5e6, col[p][1])
            want_late.add(rank)
        elif rank % 37 == 6:   # late into one comm only: not flagged
            for p in range(20, steps):
                cols[0][p] = (cols[0][p][0] + 5e6, cols[0][p][1])
        elif rank % 37 == 7:   # late from the start: its baseline is late too
            for col in cols:
                for p in range(steps):
                    col[p] = (col[p][0] + 5e6, col[p][1])
        cols_of[rank] = cols
    truth = {r for r, cols in cols_of.items() if any(flags(cols, base, cfg)[0])}
    assert want_late <= truth
    assert candidates(cols_of, base, cfg) == truth
    assert candidates(cols_of, [0.0] * steps, cfg) == set()


def test_late_by_five_sigma_in_one_group_and_three_in_every_group():
    """A rank 5.4 sigma late into its small group and 3.4 sigma into its wide, noisier one is flagged (noise_k in
    one, noise_k_every in all); with noise_k_every = noise_k (every group at 5 sigma) it is not; 2 sigma into one
    group, or 4 into both, is not enough."""
    from steplens.collector.analysis.lateness import LatenessConfig, candidates, flags
    sd = (1e5, 2e6)   # the small group's margins swing +-1e5, the wide group's +-2e6: noise = 1.4826 x that

    def cols_for(late_sigmas):
        cols = [[((-1) ** p * s, 1) for p in range(30)] for s in sd]
        for col, k, s in zip(cols, late_sigmas, sd):
            for p in range(20, 30):
                col[p] = (k * 1.4826 * s, 1)
        return cols
    base = [1e8] * 30
    for late, cfg, want in (((5.4, 3.4), LatenessConfig(), True),
                            ((5.4, 3.4), LatenessConfig(noise_k_every=5.0), False),
                            ((5.4, 2.0), LatenessConfig(), False), ((4.0, 4.0), LatenessConfig(), False)):
        cols = cols_for(late)
        fl, _ = flags(cols, base, cfg)
        assert fl == [False] * 20 + [want] * 10, (late, cfg.noise_k_every, fl)
        assert (0 in candidates({0: cols}, base, cfg)) == want
