"""`make eval`'s harness runs named simulator scenarios, reports their ground truth and effect, and scores the
registered detectors on them through a real store."""

import json
import os
import subprocess
import sys

from conftest import REPO
from steplens.collector.analysis import DETECTORS


def test_eval_reports_scenarios_with_truth():
    out = subprocess.run([sys.executable, os.path.join(REPO, "bench", "eval", "run.py"), "--scenario", "healthy",
                          "--scenario", "slow_gpu", "--scenario", "hang", "--iterations", "30"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    res = {r["scenario"]: r for r in last["results"]}
    assert res["healthy"]["worst_ratio"] == 1.0
    assert res["slow_gpu"]["worst_ratio"] > 1.5 and res["hang"]["worst_ratio"] > 5
    assert "slow_gpu 13 it 10-20" in out.stdout
    assert f"detectors ({', '.join(sorted(DETECTORS))}) through a real store" in out.stdout
    det = last["detection"]
    assert det["healthy_runs"] == 1 and det["healthy_findings"] == 0
    assert det["per_kind"]["slow_gpu"]["top1"] == 1.0 and det["recall"] > 0
    # a hang is the hang detector's: not scored here, and its run is not a healthy one
    assert det["excluded_faults"] == 1 and "hang" not in det["per_kind"] and "not scored: 1 fault(s)" in out.stdout
    assert det["visible"]["faults"] >= 1 and "faults visible in the job step time" in out.stdout


def _last_json(args: list[str], timeout: float) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                         cwd=os.path.join(REPO, "bench", "eval"))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stdout


def test_scale_eval_runs_and_reports_its_figures():
    # scale.py's machinery (in-memory store reads, fetching from the emulated agents, scoring) on a small job;
    # `make eval` runs it at 8,192 GPUs
    head, text = _last_json(["scale.py", "--scenarios", "2", "--shape", "8,4,2", "--iterations", "40"], 300)
    assert head["scenarios"] == 2 and head["gpus"] == 64
    for key in ("top1_fraction", "recall", "precision", "max_analysis_s", "max_fetch_s", "ranks_fetched_max",
                "median_end_to_end_s"):
        assert key in head
    assert text.count(" end to end ") == 2


def test_passtime_times_each_detector_per_pass():
    head, text = _last_json(["passtime.py", "--shape", "8,4,2", "--iterations", "30", "--profile", "lateness"], 300)
    assert head["gpus"] == 64 and head["passes"] == text.count("\nstep ") + text.startswith("step ")
    assert head["passes"] >= 5 and head["slowest_pass_s"] > 0
    assert all(f"{d}_max_s" in head for d in ("commtime", "irregularity", "lateness", "hang"))
    assert "lateness.py" in text   # the profile of the named detector


def test_wholepath_eval_streams_diagnoses_and_scores(tmp_path):
    # one scenario through emulated agents -> a real collector -> `steplens diagnose`
    head, text = _last_json(["wholepath.py", "--scenarios", "1", "--max-gpus", "64", "--iterations", "40",
                             "--linger", "6", "--seed", "4001"], 300)
    assert head["scenarios"] == 1 and head["median_diagnose_s"] > 0
    assert "diagnose" in text and head["precision"] is not None


def test_healthy_eval_finds_nothing_on_a_healthy_job():
    # healthy.py's machinery (the job fed into the store as it runs, every detector on the loop's windows) on a
    # small job; `make eval` runs it at 512 GPUs x 1,000 iterations
    head, text = _last_json(["healthy.py", "--runs", "1", "--shapes", "8,4,2", "--iterations", "60"], 120)
    assert head["runs"] == 1 and head["gpus"] == 64 and head["iterations"] == 60
    assert head["windows"] >= 3 and head["findings"] == 0 and head["false_positive_windows"] == 0
    assert head["steps_seen_max"] == 60 and " windows " in text
