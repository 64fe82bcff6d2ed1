"""The abnormal-operator model (collector/analysis/opmodel.py) on real simulator output (bench/sim): a 16-GPU
DP4 x PP2 x TP2 job whose CommOps and Steps come from bench/sim/agentview.py (what agents send and serve), the
flagged steps from the collector's δ gate. The model learns from its own labels on one window and flags the
ops of a slowed rank's group on the next; its labels agree with the simulator's truth (the same job run without
the fault), which it never sees; it retrains; tune() shifts split thresholds and undoes a timing drift; bad
input is skipped and counted; the config validates."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from simutil import REPO  # noqa: F401  (puts the repository on sys.path for bench.sim)
from bench.sim.agentview import agent_records, commops
from bench.sim.faults import parse_fault
from bench.sim.model import ModelConfig
from steplens.collector.analysis import opmodel as om
from steplens.collector.analysis.irregularity import IrregularityConfig, gate
from steplens.collector.analysis.opmodel import (OperatorModel, OpModelConfig, bootstrap_labels, op_identity,
                                                 three_sigma)

SPLIT = 40                    # window A: iterations 0..39, window B: 40..79
SLOW_A, SLOW_B = 5, 10        # slow GPUs (2x) in window A and window B; rank 10's TP peer is 11, DP peers 8/12/14


def cfg_job(iterations: int = 80) -> ModelConfig:
    return ModelConfig(dp=4, pp=2, tp=2, micro_batches=4, gpus_per_node=8, nodes_per_leaf=1, spines=1,
                       iterations=iterations, seed=7)


def run(cfg: ModelConfig, specs: list[str], scale: float = 1.0):
    """(ops_by_rank as FetchDetail dicts, steps_by_rank, flagged steps) of every rank; times (cluster ns from
    the job start) multiplied by `scale` to emulate a drift that slows everything alike."""
    faults = [parse_fault(s, cfg.topology()) for s in specs]
    base = cfg.base_ns

    def t(x: int) -> int:
        return base + round((x - base) * scale) if x else 0

    ops: dict[int, list[dict]] = {r: [] for r in range(cfg.gpus)}
    for c in commops(cfg, faults, list(range(cfg.gpus)), base, 0, base):
        ops[c.rank].append({"rank": c.rank, "comm_id": c.comm_id, "op": c.op, "seq": c.seq, "p2p_seq": c.p2p_seq,
                            "peer": c.peer, "nranks": c.nranks, "members": c.members, "bytes": c.bytes,
                            "issue_ns": t(c.issue_mono_ns), "start_ns": t(c.start_mono_ns), "end_ns": t(c.end_mono_ns)})
    steps: dict[int, list[tuple[int, int, int]]] = {}
    job: dict[int, int] = {}
    for _, st in agent_records(cfg, faults, mono_base=base, kinds=frozenset({"step"})):
        steps.setdefault(st.rank, []).append((st.step, t(st.start_mono_ns), t(st.end_mono_ns)))
        job[st.step] = max(job.get(st.step, 0), st.end_mono_ns - st.start_mono_ns)
    numbers = sorted(job)
    flags = gate([job[n] for n in numbers], IrregularityConfig(delta=1.1)).flag
    return ops, steps, {n for n, f in zip(numbers, flags) if f}


def window(ops: dict, steps: dict, lo: int, hi: int):
    out_ops, out_steps = {}, {}
    for r, st in steps.items():
        mine = [s for s in st if lo <= s[0] < hi]
        a, b = mine[0][1], mine[-1][2]
        out_steps[r] = mine
        out_ops[r] = [o for o in ops[r] if a <= o["issue_ns"] <= b]
    return out_ops, out_steps


def truth(faulted: dict, clean: dict) -> dict[int, list[bool]]:
    """The simulator's truth, for scoring only: an op took >= 1.1x and >= 0.1 ms longer than without the fault."""
    def key(o):
        return (o["rank"], o["comm_id"], o["op"], o["seq"], o["p2p_seq"])
    base = {key(o): o["end_ns"] - o["start_ns"] for v in clean.values() for o in v}
    return {r: [(d := o["end_ns"] - o["start_ns"]) >= 1.1 * base[key(o)] and d - base[key(o)] >= 100_000 for o in v]
            for r, v in faulted.items()}


def f1(t: dict, p: dict, thr: float = 0.5) -> tuple[float, float, float]:
    tp = fp = fn = 0
    for r in t:
        for a, b in zip(t[r], p[r]):
            hit = b >= thr               # NaN (skipped op) is not a hit
            tp, fp, fn = tp + (a and hit), fp + (hit and not a), fn + (a and not hit)
    prec, rec = tp / max(1, tp + fp), tp / max(1, tp + fn)
    return prec, rec, 2 * prec * rec / max(1e-9, prec + rec)


@pytest.fixture(scope="module")
def job():
    cfg = cfg_job()
    specs = [f"slow_gpu:{SLOW_A}:15:22:2.0", f"slow_gpu:{SLOW_B}:55:62:2.0"]
    ops, steps, flagged = run(cfg, specs)
    clean, _, _ = run(cfg, [])
    a, b = window(ops, steps, 0, SPLIT), window(ops, steps, SPLIT, 10**9)
    fa, fb = {n for n in flagged if n < SPLIT}, {n for n in flagged if n >= SPLIT}
    model = OperatorModel(OpModelConfig(trees=60))
    summary = model.fit(*a, fa)
    return {"cfg": cfg, "a": a, "b": b, "fa": fa, "fb": fb, "clean": clean, "model": model, "summary": summary}


def test_fault_steps_are_flagged_by_the_gate(job):
    assert job["fa"] and job["fa"] <= set(range(15, 23)), job["fa"]
    assert job["fb"] and job["fb"] <= set(range(55, 63)), job["fb"]


def test_learns_and_flags_the_slowed_ranks_group_on_the_next_window(job):
    model, (ops, steps) = job["model"], job["b"]
    s = job["summary"]
    assert model.ready and s["trained"] and s["trees"] == 60, s
    assert s["positives"] > 20 and s["negatives"] > 1000, s
    p = model.predict(ops, steps)
    assert {r: len(v) for r, v in p.items()} == {r: len(v) for r, v in ops.items()}
    t = truth(ops, job["clean"])
    prec, rec, score = f1(t, p)
    assert prec >= 0.5 and rec >= 0.9, (prec, rec)
    assert f1(t, three_sigma(ops, steps))[2] < score      # the paper's 3-sigma baseline on the same window
    # the slowed rank's TP peer waits in every TP all-reduce of the fault's steps: flagged there, not elsewhere;
    # the slowed rank itself arrives last there: it did not wait, its TP all-reduces are normal
    for r, want_in in ((SLOW_B + 1, True), (SLOW_B, False)):
        in_fault, outside = [], []
        for o, pr in zip(ops[r], p[r]):
            if o["comm_id"].startswith("tp."):
                step = next(n for n, a, b in steps[r] if a <= o["issue_ns"] <= b)
                (in_fault if 55 <= step < 62 else outside).append(pr >= 0.5)
        assert np.mean(in_fault) == (1.0 if want_in else 0.0), (r, np.mean(in_fault))
        if want_in:
            assert np.mean(outside) < 0.05


def test_labels_are_bootstrapped_without_truth_and_agree_with_it(job):
    (ops, steps), fa = job["a"], job["fa"]
    lab = bootstrap_labels(ops, steps, fa)
    t = truth(ops, job["clean"])
    pos = [(r, i) for r, v in lab.items() for i, x in enumerate(v) if x == 1.0]
    neg = [(r, i) for r, v in lab.items() for i, x in enumerate(v) if x == 0.0]
    assert len(pos) == job["summary"]["positives"] and len(neg) == job["summary"]["negatives"]
    # abnormal labels are mostly right (the misses here: TP=2 members that waited > 6 IQR for jitter alone)
    assert sum(t[r][i] for r, i in pos) / len(pos) >= 0.75
    assert sum(not t[r][i] for r, i in neg) / len(neg) >= 0.99     # normal labels are right
    src = job["summary"]["label_sources"]
    assert src["abnormal_flagged_outlier"] > 0 and src["normal_in_range"] > 0, src
    # no flagged step: cross-rank evidence alone (a member that waited > 6 IQR longer than the last arrival)
    lab0 = bootstrap_labels(ops, steps, set())
    pos0 = [(r, i) for r, v in lab0.items() for i, x in enumerate(v) if x == 1.0]
    assert pos0 and sum(t[r][i] for r, i in pos0) / len(pos0) >= 0.75


def test_retrain_on_newer_window_replaces_the_model(job):
    model = OperatorModel(OpModelConfig(trees=30, max_samples=5000))
    first = model.fit(*job["a"], job["fa"])
    ops, steps = job["b"]
    p1 = model.predict(ops, steps)
    second = model.fit(ops, steps, job["fb"])
    assert first["trained"] and second["trained"] and model.ready
    assert first["samples"] == 5000 and second["samples"] == 5000          # bounded
    assert second["positives"] > 0 and second["seconds"] > 0
    p2 = model.predict(ops, steps)
    assert any(abs(x - y) > 1e-6 for r in p1 for x, y in zip(p1[r], p2[r]))
    assert f1(truth(ops, job["clean"]), p2)[2] >= 0.6                      # in-sample after retraining
    # a window with labels of one class keeps the previous model, and says so: the fault-free job, no flagged
    # step, and no wait counted as marked (waited_iqrs high)
    clean_a = window(*run(job["cfg"], [])[:2], 0, SPLIT)
    model.cfg.waited_iqrs = 1000.0
    third = model.fit(*clean_a, set())
    assert not third["trained"] and "one class" in third["reason"] and "previous model is kept" in third["reason"]
    assert model.ready


def test_deterministic(job):
    ops, steps = job["b"]
    m2 = OperatorModel(OpModelConfig(trees=60))
    m2.fit(*job["a"], job["fa"])
    assert m2.predict(ops, steps) == job["model"].predict(ops, steps)


def test_order_of_ops_does_not_matter(job):
    ops, steps = job["b"]
    p = job["model"].predict(ops, steps)
    rng = random.Random(3)
    perm = {r: rng.sample(range(len(v)), len(v)) for r, v in ops.items()}
    shuffled = {r: [ops[r][i] for i in perm[r]] for r in ops}
    q = job["model"].predict(shuffled, steps)
    assert all(q[r][k] == p[r][i] for r in ops for k, i in enumerate(perm[r]))


def test_threshold_shift_is_exact_for_the_shifted_feature(job):
    """Editing the dumped model: shifting a feature's split thresholds by d and the feature itself by d gives the
    same predictions; shifting only the thresholds changes them. (The model's most used feature, so it shows.)"""
    import lightgbm as lgb
    booster = job["model"]._booster
    tab = om._table(*job["b"], set(), job["model"].cfg)
    j = int(np.argmax(booster.feature_importance("gain")))
    d = 0.5 * float(np.nanstd(tab.X[:, j]))
    shifted = lgb.Booster(model_str=om._shift_thresholds(booster.model_to_string(), {j: d}))
    X2 = tab.X.copy()
    X2[:, j] += d
    assert np.allclose(booster.predict(tab.X), shifted.predict(X2), atol=1e-12)
    assert np.abs(booster.predict(tab.X) - shifted.predict(tab.X)).max() > 0.5


def test_tune_undoes_a_drift_that_slows_everything(job):
    """Window B again with every time stretched by 6 % (ops and steps 6 % longer). Untuned, the model's
    predictions move (a little: on this job it leans on scale-free features); tune() on the drifted window
    shifts the location features' thresholds by log10(1.06) more than tune() on the undrifted one, and its
    predictions come back to the undrifted ones (that assertion fails if tune does nothing)."""
    model = OperatorModel(OpModelConfig(trees=60))
    model.fit(*job["a"], job["fa"])
    ops, steps = job["b"]
    d_ops, d_steps, _ = run(job["cfg"], [f"slow_gpu:{SLOW_A}:15:22:2.0", f"slow_gpu:{SLOW_B}:55:62:2.0"],
                            scale=1.06)
    d_ops, d_steps = window(d_ops, d_steps, SPLIT, 10**9)

    def flat(p):
        return np.array([x for r in sorted(p) for x in p[r]])
    un0, un1 = flat(model.predict(ops, steps)), flat(model.predict(d_ops, d_steps))
    d0 = model.tune(ops, steps)            # Holmes' Δ also holds window A -> B's own shift: take it out
    t0 = flat(model.predict(ops, steps))
    d1 = model.tune(d_ops, d_steps)
    t1 = flat(model.predict(d_ops, d_steps))
    assert set(d1) == set(om.TUNED) and model.shift == d1
    for f in ("step_log_s", "duration_log_s", "q2_log_s", "step_op_mean_log_s"):
        assert d1[f] - d0[f] == pytest.approx(math.log10(1.06), abs=0.003), (f, d0, d1)
    moved, back = np.abs(un1 - un0).mean(), np.abs(t1 - t0).mean()
    assert moved > 0 and back < 0.5 * moved, (moved, back)      # tuned: back towards the undrifted predictions
    assert model.tune(d_ops, d_steps) == pytest.approx(d1)          # from the trained model: no compounding


def test_bad_input_is_skipped_and_counted(job):
    model = OperatorModel()
    assert not model.ready
    with pytest.raises(RuntimeError, match="not trained"):
        model.predict({}, {})
    s = model.fit({}, {}, set())
    assert not s["trained"] and "no usable ops" in s["reason"] and not model.ready
    ops, steps = job["a"]
    r = 0
    bad = [dict(ops[r][0], end_ns=ops[r][0]["start_ns"] - 1), {k: v for k, v in ops[r][1].items() if k != "bytes"},
           dict(ops[r][2], issue_ns=0, start_ns=0), dict(ops[r][3], issue_ns=1, start_ns=1, end_ns=2), "not a dict",
           dict(ops[r][4], comm_id=["unhashable"])]
    mixed = dict(ops)
    mixed[r] = bad + ops[r][5:]
    bad_steps = dict(steps)
    bad_steps[r] = steps[r] + [("x", 1, 2), (99, 5, 5)]
    s = model.fit(mixed, bad_steps, job["fa"])
    assert s["trained"] and s["skipped"] == {"malformed": 4, "end_before_start": 1, "outside_steps": 1,
                                             "bad_steps": 2}, s
    p = job["model"].predict(mixed, bad_steps)
    assert len(p[r]) == len(mixed[r]) and all(math.isnan(x) for x in p[r][:6]) and not math.isnan(p[r][6])
    few = window(ops, steps, 0, 10)
    s = OperatorModel().fit(*few, job["fa"])
    assert not s["trained"] and "min_train_steps" in s["reason"]
    assert op_identity(ops[0][0], 3) == (ops[0][0]["comm_id"], ops[0][0]["op"], ops[0][0]["bytes"], 3)


@pytest.mark.parametrize("field,value", [
    ("history_steps", 0), ("min_history_steps", 2), ("min_history_steps", 500), ("trees", 0), ("leaves", 1),
    ("leaves", 10_000), ("learning_rate", 0.0), ("threshold", 1.0), ("normal_iqrs", 0.0), ("abnormal_iqrs", 9.0),
    ("min_iqr_seconds", -1.0), ("max_samples", 10), ("threads", 0), ("trees", "100"), ("threshold", float("nan")),
])
def test_config_validation(field, value):
    cfg = OpModelConfig(**{field: value})
    with pytest.raises(ValueError, match=field if field != "max_samples" else "max_samples"):
        cfg.validate()
    with pytest.raises(ValueError):
        OperatorModel(cfg)
    OpModelConfig().validate()
