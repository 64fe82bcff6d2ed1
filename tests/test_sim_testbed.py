"""The simulator configured like the testbed against a recorded testbed run (bench/sim/calibration/): per fault,
the step-time ratio of every rank within 25 % and the same per-rank wait pattern. Prints both side by side.

The simulator's costs come from the recording's baseline phases and each fault's size only (bench/sim/testbed.py
says how); the fault phases are what it is checked against. No torch, no root: a plain CPU test.
"""

from __future__ import annotations

import copy
import sys

import pytest

from conftest import REPO

sys.path.insert(0, REPO)
from bench.sim import testbed as tb  # noqa: E402

FIXTURE = tb.load()
ROWS = tb.compare(FIXTURE)


def test_prints_side_by_side():
    print(f"\nrecorded {FIXTURE['date']} on {FIXTURE['machine']['node']}: {FIXTURE['command']}\n" + tb.table(ROWS))
    assert {r["kind"] for r in ROWS} == {"link", "cpu", "stop", "gc_storm", "extra_sync", "noisy"}


@pytest.mark.parametrize("row", ROWS, ids=[r["fault"] for r in ROWS])
def test_step_time_ratio_within_25_percent(row):
    assert tb.ratio_ok(row), tb.table([row])


@pytest.mark.parametrize("row", ROWS, ids=[r["fault"] for r in ROWS])
def test_same_wait_pattern(row):
    assert tb.pattern_ok(row), tb.table([row])


def test_config_comes_from_the_baseline():
    cfg = tb.config_from_baseline(FIXTURE)
    base = tb.pooled_baseline(FIXTURE)
    assert cfg.schedule == "gpipe" and cfg.send_rendezvous and (cfg.dp, cfg.pp) == (2, 2)
    # the flat all-reduce's pure cost (last arriver's all-reduce time) sets the link speed
    ar = min(base[0]["allreduce_seconds"], base[1]["allreduce_seconds"])
    assert abs(cfg.grad_bytes * 8 / (cfg.nic_gbps * 1e9) - ar) < 0.2 * ar + 0.01
    sim_step = tb._median_step(cfg)
    rec_step = sorted(b["step_seconds"] for b in base.values())
    assert rec_step[0] * 0.8 < sim_step < rec_step[-1] * 1.2


def test_the_check_can_fail():
    # the same recording with the link fault's size misread (2 Gbit instead of 200 Mbit): the simulator then
    # predicts almost no slowdown and the comparison must say so
    fx = copy.deepcopy(FIXTURE)
    fx["faults"] = {"link": fx["faults"]["link"]}
    fx["faults"]["link"]["params"]["rate"] = "2000mbit"
    row = tb.compare(fx)[0]
    assert not tb.ratio_ok(row)
    # and a fault on the other replica flips the pattern (rank 0's link: the same wait kinds, but a CPU quota
    # on rank 2, the next stage, makes rank 3 wait in the all-reduce instead of the pipeline)
    fx = copy.deepcopy(FIXTURE)
    fx["faults"] = {"cpu": fx["faults"]["cpu"]}
    fx["faults"]["cpu"]["target"] = "rank2"
    assert not tb.pattern_ok(tb.compare(fx)[0])
