"""Helpers shared by the simulator tests."""

from __future__ import annotations

import sys

from conftest import REPO

sys.path.insert(0, REPO)

from bench.sim.faults import parse_fault  # noqa: E402
from bench.sim.model import simulate  # noqa: E402
from bench.sim.output import Rows  # noqa: E402


def run_rows(cfg, specs, kinds=("steps", "commops", "flows")):
    """Simulate and collect the rows of each kind per iteration: {kind: {iteration: [row, ...]}}."""
    faults = [parse_fault(s, cfg.topology()) for s in specs]
    rows = Rows(cfg)
    out = {k: {} for k in kinds}

    def sink(it):
        for k in kinds:
            out[k][it.it] = list(getattr(rows, k)(it))
    res = simulate(cfg, faults, sink)
    return res, out
