"""The sentinel's model (collector/analysis/sentinel.py) on a real serving engine's recorded batches
(tests/fixtures/inference: vLLM's CPU build, 80 s, a noisy neighbour from 50 s to 70 s): fitted on the first 45 s,
it alarms on the neighbour's first batch, and its baseline explains the workload. The figures of
the whole 240 s run (four faults) are bench/sentinel.py's."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

from steplens.collector.analysis.sentinel import Sentinel, SentinelConfig, features

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "inference",
                       "vllm-steps-noisy.jsonl.gz")


@pytest.fixture(scope="module")
def recording():
    with gzip.open(FIXTURE, "rt") as fh:
        head = json.loads(fh.readline())
        rows = [json.loads(line) for line in fh]
    assert head["vllm"] == "0.32.0" and len(rows) > 5000
    return rows


def test_features_are_the_physical_ones(recording):
    X = features(recording[:50])
    r = recording[10]
    decode = r["mode"] == 2
    kv = r["avg_input_length"] + r["avg_output_length"]
    assert X.shape == (50, 15)
    assert X[10, 9] == pytest.approx(decode * r["batch_size"] * kv)          # Workload_KV
    assert X[10, 11] == pytest.approx((not decode) * r["prefill_tokens"])    # prefill compute tokens


def test_noisy_neighbour_alarms_and_quiet_batches_mostly_do_not(recording):
    X = features(recording)
    y = np.array([r["dur_ns"] for r in recording], dtype=np.float64)
    t = np.array([r["t_s"] for r in recording])
    fault = np.array([r["fault"] for r in recording])
    s = Sentinel(SentinelConfig()).fit(X[t < 45], y[t < 45])
    assert 0.0 < s.ucl <= 0.5 and s.fit_mape < 0.15 and s.fit_r2 > 0.2
    rest = t >= 45
    out = s.score(X[rest], y[rest])
    judged = out["judged"] & ~np.isnan(out["ma"])
    on = fault[rest] == "noisy"
    alarms_on = out["alarm"][judged & on]
    assert alarms_on.mean() >= 0.9, alarms_on.mean()
    first = int(np.argmax(out["alarm"][judged & on]))
    assert first == 0   # the individuals chart (single_factor): the neighbour's first decode batch (4-8x) alarms
    alone = Sentinel(SentinelConfig(single_factor=0)).fit(X[t < 45], y[t < 45]).score(X[rest], y[rest])
    assert int(np.argmax(alone["alarm"][judged & on])) >= 1   # the moving average alone needs a batch or two more
    # false alarms on the quiet batches of this shared 2-core host: bounded, not yet the 0.5 %
    assert out["alarm"][judged & ~on].mean() < 0.2


def test_prefill_is_not_judged_with_decode_only(recording):
    X = features(recording[:2000])
    y = np.array([r["dur_ns"] for r in recording[:2000]], dtype=np.float64)
    s = Sentinel().fit(X, y)
    out = s.score(X[:200], y[:200])
    prefill = X[:200, 7] == 1
    assert prefill.any() and not out["alarm"][prefill].any() and not out["judged"][prefill].any()
    with pytest.raises(ValueError):
        Sentinel().fit(X[:20], y[:20])
