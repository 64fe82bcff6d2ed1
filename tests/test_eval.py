"""`make eval`'s harness runs named simulator scenarios and reports their ground truth and effect."""

import json
import os
import subprocess
import sys

from conftest import REPO


def test_eval_reports_scenarios_with_truth():
    out = subprocess.run([sys.executable, os.path.join(REPO, "bench", "eval", "run.py"), "--scenario", "healthy",
                          "--scenario", "slow_gpu", "--scenario", "hang", "--iterations", "30"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    res = {r["scenario"]: r for r in last["results"]}
    assert res["healthy"]["worst_ratio"] == 1.0
    assert res["slow_gpu"]["worst_ratio"] > 1.5 and res["hang"]["worst_ratio"] > 5
    assert "slow_gpu 13 it 10-20" in out.stdout and "detectors: none registered yet" in out.stdout
