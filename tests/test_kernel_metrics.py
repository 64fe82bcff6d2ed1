"""XPUTimer's per-rank kernel metrics (collector/analysis/kernels.py) on a real GPU trace (../shared/fixtures/
gpu-traces/nccl-2rank-rank0.json.gz: rank 0 of a 2-rank NCCL job, recorded by HTA's authors; parsed by steplens'
Kineto parser), checked against the same figures counted straight from the trace's JSON here, plus the void and
KS rules on small hand-made cases whose answers are worked out in the comments."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from conftest import REPO
from steplens.agent.parse import parse_file
from steplens.collector.analysis import kernels as km

TRACE = os.path.join(REPO, "..", "shared", "fixtures", "gpu-traces", "nccl-2rank-rank0.json.gz")
pytestmark = pytest.mark.skipif(not os.path.exists(TRACE), reason="the shared GPU trace fixtures are not here")


def _raw():
    """Kernels and their launch calls read straight from the JSON (µs floats): (name, start_us, dur_us,
    launch_start_us or None)."""
    with gzip.open(TRACE) as fh:
        ev = json.load(fh)["traceEvents"]
    launch = {e["args"]["correlation"]: e["ts"] for e in ev if e.get("cat") == "cuda_runtime"
              and e.get("name", "").startswith("cudaLaunchKernel") and "correlation" in e.get("args", {})}
    return [(e["name"], e["ts"], e["dur"], launch.get(e["args"].get("correlation")))
            for e in ev if e.get("cat") == "kernel"]


@pytest.fixture(scope="module")
def parsed():
    return parse_file(TRACE).kernels


def test_issue_latency_distribution_matches_the_trace(parsed):
    raw = _raw()
    lat_us = sorted(k[1] - k[3] for k in raw if k[3] is not None)
    d = km.distribution(km.issue_latencies(parsed))
    assert d["count"] == len(lat_us) == 2700
    for q, key in ((0.1, "p10_ns"), (0.5, "p50_ns"), (0.9, "p90_ns"), (0.99, "p99_ns")):
        want = lat_us[int(round(q * (len(lat_us) - 1)))] * 1000
        assert abs(d[key] - want) <= 2, (key, d[key], want)
    assert d["below_50us_fraction"] == round(sum(1 for x in lat_us if x < 50) / len(lat_us), 4)
    # measured on this trace: the CPU barely runs ahead (p50 12.8 µs, 79 % under 50 µs)
    assert 12_000 <= d["p50_ns"] <= 13_500 and 0.75 <= d["below_50us_fraction"] <= 0.85
    nccl = km.distribution(km.issue_latencies(parsed, comm=True))
    assert nccl["count"] == sum(1 for k in raw if "nccl" in k[0].lower() and k[3] is not None) == 21


def test_per_kernel_name_timing_matches_the_trace(parsed):
    raw = _raw()
    got = km.per_name(parsed)
    assert len(got) == len({k[0] for k in raw})
    for name in list(got)[:5]:
        durs = sorted(k[2] for k in raw if k[0] == name)
        t = got[name]
        assert t["count"] == len(durs)
        assert abs(t["total_ns"] - sum(durs) * 1000) <= 2 * len(durs)
        assert abs(t["p50_ns"] - durs[int(round(0.5 * (len(durs) - 1)))] * 1000) <= 2
    top = next(iter(got))
    assert top.startswith("ncclKernel_AllReduce_RING_LL_Sum_float") and got[top]["count"] == 15


def test_minority_void_counts_launched_but_waiting_time_nothing_else_covers():
    def k(stream, start, end, issue):
        return {"name": "k", "device": 0, "stream": stream, "start_mono_ns": start, "end_mono_ns": end,
                "launch_start_mono_ns": issue, "launch_end_mono_ns": issue + 1}
    ks = [k(7, 0, 100, 0),
          k(7, 150, 200, 120),  # launched at 120, the stream idle from 100: void [120, 150) = 30
          k(7, 300, 400, 210),  # idle from 200, launched at 210: [210, 300) = 90, minus [250, 280) on stream 9
          k(9, 250, 280, 240),
          k(7, 450, 500, 420)]  # idle from 400, launched at 420: [420, 450) = 30
    v = km.minority_void(ks)[0]
    assert v["void_ns"] == 30 + 60 + 30 and v["span_ns"] == 500 and v["v_minority"] == 0.24


def test_ks_distance():
    assert km.ks_distance([1, 2, 3], [1, 2, 3]) == 0.0
    assert km.ks_distance([1, 2, 3], [10, 20, 30]) == 1.0
    assert km.ks_distance([1, 2, 3, 4], [3, 4, 5, 6]) == 0.5   # at 2: 0.5 vs 0
    by = {0: [{"name": "ncclKernel", "start_mono_ns": 100, "launch_start_mono_ns": 90}] * 4,
          1: [{"name": "ncclKernel", "start_mono_ns": 100, "launch_start_mono_ns": 10}] * 4}
    assert km.compare_ranks(by)[0]["ks_issue_latency_comm"] == 1.0
