"""Live: the real testbed (DP=2 x PP=2, 4 netns hosts, gloo) for a baseline and three faults, next to the simulator
configured from this very run's baselines and the faults' sizes. Prints the table; same bounds as
tests/test_sim_testbed.py (step-time ratio within 25 %, same per-rank wait pattern).

    flock /tmp/steplens-cpu.lock .venv/bin/pytest -q -s tests/test_testbed_sim.py
"""

from __future__ import annotations

import sys

import pytest

from conftest import REPO, skip_module_unless_testbed

pytestmark = [pytest.mark.testbed, pytest.mark.privileged, pytest.mark.slow]

skip_module_unless_testbed()

sys.path.insert(0, REPO)
from bench.sim import testbed as tb  # noqa: E402
from bench.testbed import calibrate, netns  # noqa: E402


def test_live_testbed_vs_simulator(tmp_path):
    live = calibrate.record(["link", "cpu", "gc_storm"], state_dir=str(tmp_path / "bed"))
    assert netns.list_namespaces() == [] and netns.cgroups_left() == []
    rows = tb.compare(live)
    print(f"\nlive testbed {live['date']} ({live['seconds']} s of faults)\n" + tb.table(rows))
    bad = [r["fault"] for r in rows if not (tb.ratio_ok(r) and tb.pattern_ok(r))]
    assert not bad, tb.table(rows)
