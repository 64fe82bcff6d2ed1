"""The sentinel as a detector: Iteration records (what the agent's iters source sends) through the codec, the
collector's decode and store, to the sentinel detector in a real AnalysisEngine, and out as findings.

The iterations are a real serving engine's recorded batches (tests/fixtures/inference: vLLM's CPU build, 80 s, a
noisy neighbour from 50 s to 70 s), turned into the Iteration records an anchored engine sends: its times and
workload counts; the fault column is the ground truth the findings are scored against, never an input."""

from __future__ import annotations

import gzip
import json
import os
import sys
import time
from dataclasses import replace

import pytest

from steplens.agent import records as r
from steplens.agent.transport.codec import decode_records, encode_records
from steplens.collector.analysis import load_spec
from steplens.collector.analysis.base import ConfigError, build_config
from steplens.collector.analysis.engine import AnalysisEngine
from steplens.collector.analysis.sentinel import SentinelDetectorConfig, iteration_row
from steplens.collector.ingest.clock import ClockEstimate
from steplens.collector.ingest.decode import decode_batch
from steplens.collector.store.queries import Reader
from steplens.collector.store.writer import BatchJob, StoreWriter

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "inference",
                       "vllm-steps-noisy.jsonl.gz")
JOB = "pid:4242"
ANCHOR = "vllm.v1.engine.llm_engine:LLMEngine.step"
OFFSET = 5 * 10**12


def it(seq, start, end, phase="decode", **kw) -> r.Iteration:
    return r.Iteration(end, 4242, 77, JOB, -1, seq, start, end, ANCHOR, phase, **kw)


@pytest.fixture(scope="module")
def recording():
    return load_recording()


def load_recording():
    with gzip.open(FIXTURE, "rt") as fh:
        json.loads(fh.readline())
        rows = [json.loads(line) for line in fh]
    iters = []
    for i, x in enumerate(rows):
        b = x["batch_size"]
        iters.append(it(i, x["t0_ns"], x["t1_ns"], "decode" if x["mode"] == 2 else
                        "prefill" if x["decode_requests"] == 0 else "mixed",
                        batch_size=b, prefill_requests=x["prefill_requests"], prefill_tokens=x["prefill_tokens"],
                        decode_requests=x["decode_requests"], kv_tokens=x["kv_tokens"],
                        input_tokens=round(x["avg_input_length"] * b), output_tokens=round(x["avg_output_length"] * b),
                        tokens=x["prefill_tokens"] + x["decode_requests"]))
    return rows, iters


def _store(path, recs, seq=1):
    clock = ClockEstimate(offset_ns=OFFSET, drift_ppm=0.0, ref_mono_ns=0, uncertainty_ns=1, best_rtt_ns=1, samples=5)
    w = StoreWriter(path)
    w.start()
    done = []
    try:
        for k in range(0, len(recs), 2000):
            part = recs[k:k + 2000]
            w.submit(BatchJob("n1", "ab" * 8, seq + k, len(part), encode_records([("iters", x) for x in part]),
                              max(x.mono_ns for x in part) + 1, clock, time.time_ns(), lambda *a: done.append(a)))
        deadline = time.monotonic() + 30
        while len(done) < (len(recs) + 1999) // 2000 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        w.stop()
    assert done and all(d[0] == "stored" for d in done), done
    return Reader(path)


def test_iteration_round_trip_and_bad_records_rejected():
    good = it(1, 10**9, 2 * 10**9, batch_size=3, decode_requests=3, kv_tokens=900, tokens=3)
    assert decode_records(encode_records([("iters", good)])) == [("iters", good)]
    bad = [it(2, 3 * 10**9, 2 * 10**9),                      # starts after it ends
           it(3, 10**9, 2 * 10**9, phase="warmup"),          # not a phase
           r.Iteration(2 * 10**9, 1, 1, JOB, -1, 4, 10**9, 2 * 10**9, "", "decode"),   # no anchor
           r.Iteration(2 * 10**9, 1, 1, JOB, -1, 5, 0, 2 * 10**9, ANCHOR, "decode")]   # no start
    d = decode_batch(encode_records([("iters", x) for x in [good] + bad]), 5, 3 * 10**9)
    assert len(d.iterations) == 1 and d.rejected == {"iteration with bad times, phase or names": 4}
    row = iteration_row({"batch_size": 4, "input_tokens": 400, "output_tokens": 40, "phase": "decode", "tokens": 4})
    assert (row["avg_input_length"], row["avg_output_length"], row["mode"]) == (100, 10, 2)
    assert iteration_row({"phase": "train", "tokens": 8192})["mode"] == 0


def test_store_reads_and_retention(tmp_path):
    recs = [it(i, (10 + i) * 10**9, (10 + i) * 10**9 + 5 * 10**6, batch_size=2, tokens=2) for i in range(5)]
    reader = _store(str(tmp_path / "s.db"), recs)
    rows = reader.iterations(JOB)
    assert [x["seq"] for x in rows] == [0, 1, 2, 3, 4]
    assert rows[0]["start_ns"] == 10 * 10**9 + OFFSET and rows[0]["node_id"] == "n1" and rows[0]["anchor"] == ANCHOR
    assert [x["seq"] for x in reader.iterations(JOB, since_ns=11 * 10**9 + OFFSET + 5 * 10**6,
                                                until_ns=13 * 10**9 + OFFSET + 5 * 10**6)] == [2, 3]
    assert reader.new_data_since(0)[1][JOB] == 14 * 10**9 + 5 * 10**6 + OFFSET
    w = StoreWriter(reader.path)
    try:
        w.apply_retention(12 * 10**9 + OFFSET)
    finally:
        w.stop()
    assert [x["seq"] for x in reader.iterations(JOB)] == [2, 3, 4]


def test_config_is_validated():
    with pytest.raises(ConfigError, match="fit_iterations"):
        build_config(SentinelDetectorConfig, {"fit_iterations": 10}, "[detectors.sentinel]")
    with pytest.raises(ConfigError, match="unknown"):
        build_config(SentinelDetectorConfig, {"ucl": 0.2}, "[detectors.sentinel]")


def _passes(path, iters) -> tuple[list, int]:
    """The analysis engine over the stored recording, a pass every 5 s of data: (findings, the first batch's ns)."""
    reader = _store(path, iters)
    writer = StoreWriter(path)
    writer.start()
    try:
        eng = AnalysisEngine(Reader(path), writer, detectors={"sentinel": load_spec("sentinel")})
        t0 = iters[0].start_mono_ns + OFFSET
        end = iters[-1].end_mono_ns + OFFSET
        until = t0 + 5 * 10**9
        while until < end + 5 * 10**9:
            eng.run_job(JOB, until_ns=until, data_ns=min(until, end))
            until += 5 * 10**9
        assert eng.stats["sentinel"].errors == 0
    finally:
        writer.stop()
    return reader.findings(), t0


def test_noisy_neighbour_is_one_finding_on_the_engine_process(tmp_path, recording):
    """Passes every 5 s of data over the recording: the model fits on the first 1,500 decode batches, the noisy
    neighbour (50-70 s) opens one slowdown finding on the serving process within a few batches of its start; the
    quiet batches open none that lasts (a shared 2-core host: a short episode may pass, the figures per batch are
    bench/sentinel.py's)."""
    rows, iters = recording
    found, t0 = _passes(str(tmp_path / "s.db"), iters)
    on = [f for f in found if f.detector == "sentinel" and (f.onset_ns - t0) / 1e9 >= 49]
    assert len(on) == 1, [(f.summary, (f.onset_ns - t0) / 1e9) for f in found]
    f = on[0]
    assert f.kind == "slowdown" and (f.suspects[0].kind, f.suspects[0].id) == ("process", "n1:4242")
    onset_s = (f.onset_ns - t0) / 1e9
    first_noisy = next(x["t_s"] for x in rows if x["fault"] == "noisy" and x["mode"] == 2)
    decode_before = sum(1 for x in rows if x["mode"] == 2 and first_noisy <= x["t_s"] < onset_s)
    assert 50 <= onset_s <= 52 and decode_before <= 2, (onset_s, decode_before)
    assert f.severity > 1.15 and f.evidence["alarmed_iterations"] >= 50 and 0 < f.evidence["ucl"] <= 0.5
    assert f.evidence["fit_r2"] > 0.2 and (f.last_ns - t0) / 1e9 <= 71
    false = [x for x in found if x is not f]
    assert len(false) <= 1 and all(x.evidence["alarmed_iterations"] < 20 for x in false), \
        [(x.summary, (x.onset_ns - t0) / 1e9) for x in false]


def test_an_episode_says_how_slow_its_last_seconds_were(tmp_path, recording):
    """recent_severity: the episode's alarms of its last recent_seconds (5 s), what a deep dive escalates by. On the
    recording as it is, the noisy neighbour's (50-70 s) last seconds are about as slow as all of it; with every
    batch of its last 5 s made 3x longer (the rest of the recording shifted after them), the recent figure more than
    doubles and stands well over the whole episode's (its first 15 s weigh in its severity, not in the recent
    figure)."""
    rows, iters = recording
    (f,) = [f for f in _passes(str(tmp_path / "a.db"), iters)[0] if f.evidence["alarmed_iterations"] >= 50]
    assert 0.6 * f.severity <= f.evidence["recent_severity"] <= 1.6 * f.severity, f.evidence
    longer, shift = [], 0
    for x, i in zip(rows, iters):
        d = i.end_mono_ns - i.start_mono_ns
        extra = 2 * d if x["fault"] == "noisy" and x["t_s"] >= 65 else 0
        longer.append(replace(i, mono_ns=i.end_mono_ns + shift + extra, start_mono_ns=i.start_mono_ns + shift,
                              end_mono_ns=i.end_mono_ns + shift + extra))
        shift += extra
    (g,) = [f for f in _passes(str(tmp_path / "b.db"), longer)[0] if f.evidence["alarmed_iterations"] >= 50]
    # 2026-12-07: 6.06 and 5.47 as recorded; 8.92 and 13.49 with the last 5 s 3x longer
    assert g.evidence["recent_severity"] > 2 * f.evidence["recent_severity"], (f.evidence, g.evidence)
    assert g.evidence["recent_severity"] > 1.3 * g.severity, g.evidence


TRAINING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "training")


@pytest.fixture(scope="module")
def score():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.sentinel import score_iterations
    return score_iterations


def test_training_steps_slower_than_their_workload_predicts_are_one_job_finding(score):
    """The testbed's recorded DP2 job (tests/fixtures/training: 2-6 micro-batches per step, the step's workload in
    each Iteration), every rank 1.39x slower for 60 s after 120 s: replayed through the detector one pass per
    second, the slowdown is one finding on the job within a second of its start, and the quiet 120 s + 40 s open
    none (measured: the first alarm 0.35 s in, per-step F1 0.87, 0 false findings)."""
    res = score(os.path.join(TRAINING, "testbed-iters-slow30.jsonl.gz"), {})
    assert res["series"] == 2 and res["step_log"]["slowdown"] > 1.3
    assert res["faults_found"] == 1 and res["false_findings"] == 0, res
    assert res["first_alarm_after_s"] is not None and res["first_alarm_after_s"] <= 1.0, res
    assert res["f1"] >= 0.8 and res["fpr_pct"] <= 5, res


def test_a_five_percent_slowdown_is_inside_this_hosts_noise_and_raises_no_false_finding(score):
    """The same job 1.057x slower: on this VM the steps' own jitter (MAPE 11-17 % after the workload model, their
    200-step medians wandering 6 % in the quiet) hides it; the detector stays quiet rather than guess (0 findings).
    The issue's 5 % acceptance is not met on this host (bench/README.md "testbed_sentinel.py")."""
    res = score(os.path.join(TRAINING, "testbed-iters-slow5.jsonl.gz"), {})
    assert 1.03 < res["step_log"]["slowdown"] < 1.08
    assert res["false_findings"] == 0, res
