"""How well the abnormal-operator model (collector/analysis/opmodel.py) finds abnormal CommOps on simulated jobs,
against Holmes' 3-sigma baseline and its own labelling rule, with and without timing drift.

Each scenario is one 64-GPU job (bench/sim ModelConfig dp=8 pp=4 tp=2, 8 micro-batches, 8 GPUs per node, 2 nodes
per leaf, 2 spines, 120 iterations, the scenario's seed). CommOps are fetched for 32 of the 64 ranks (DP replicas
0-3 of every stage: whole TP and PP groups, half of each DP group), as the collector fetches a subset; Step
records come from every rank. Window A (iterations 0-59) holds two transient faults (slow_gpu, slow_link,
congested_switch or fluctuation), window B (60-119) one fault whose kind cycles through slow_gpu, slow_link,
congested_switch, fluctuation, degradation, and every other scenario a second, transient one; targets, onsets,
lengths and sizes are drawn from the seed.
The model fits on window A's ops and steps with the flagged steps of the collector's own δ gate
(irregularity.gate, δ = 1.1, over the job step time = max over all 64 ranks of their step duration) and
predicts window B, which it never saw. Drift: the same job where from iteration 60 every rank computes 6 % slower
(a `degradation` fault of 1.06 on all 64 ranks), fitted on the same window A (identical: the drift starts at 60),
predicted on the drifted window B untuned, then after `tune` on that window B.
Truth (never shown to the model): the simulator is deterministic given the seed, jitter included (one draw per
rank per iteration whatever the faults; checked here on every scenario), so the same job is simulated again
without window B's faults (with the drift, for the drifted figures); an op of window B is abnormal when its
duration with the faults is >= 1.1 x and >= 0.1 ms longer than without them. Scores are per op over the 32
fetched ranks' window-B ops, pooled over the scenarios: precision, recall, F1 of P(abnormal) >= 0.5; the
same for three_sigma() (duration > mean + 3 std of its identity over window B) and bootstrap_labels() (the
labelling rule applied to window B with its flagged steps: what the model adds over its own teacher).
Seeds: the model's rules and defaults were developed on the FIT set (--set fit, seeds 100-109); the figures
reported are the REPORT set's (--set report, the default, seeds 200-209), never tuned on.

Report set, 2-core VM (78,720 scored ops per scenario): precision 0.808, recall 0.595, F1 0.685; 3-sigma 0.053;
the labelling rule alone 0.674; drift 0.685 untuned, 0.671 tuned; by the scored window's fault: slow_gpu 0.83,
congested_switch 0.78, fluctuation 0.67, slow_link 0.54, degradation 0.12; fit 0.88-0.93 s, predict
150-165k ops/s; 148-154 s in all. (Fit set, for comparison: F1 0.712, drift 0.708 untuned, 0.702 tuned.)

    .venv/bin/python bench/opmodel.py                      # report set, 10 scenarios, ~2.5 min on 2 cores
    .venv/bin/python bench/opmodel.py --set fit --scenarios 4

The last stdout line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.sim.agentview import agent_records, commops  # noqa: E402
from bench.sim.faults import parse_fault  # noqa: E402
from bench.sim.model import ModelConfig  # noqa: E402
from steplens.collector.analysis.irregularity import IrregularityConfig, gate  # noqa: E402
from steplens.collector.analysis.opmodel import (  # noqa: E402
    OperatorModel, OpModelConfig, bootstrap_labels, three_sigma)

ITERATIONS, SPLIT, DRIFT = 120, 60, 1.06
B_KINDS = ("slow_gpu", "slow_link", "congested_switch", "fluctuation", "degradation")
TRANSIENT = B_KINDS[:4]
SEEDS = {"fit": 100, "report": 200}
TRUTH_RATIO, TRUTH_FLOOR_NS = 1.1, 100_000


def job_config(seed: int) -> ModelConfig:
    return ModelConfig(dp=8, pp=4, tp=2, micro_batches=8, gpus_per_node=8, nodes_per_leaf=2, spines=2,
                       iterations=ITERATIONS, seed=seed)


def fetched_ranks(cfg: ModelConfig) -> list[int]:
    return [cfg.rank(s, d, t) for s in range(cfg.pp) for d in range(cfg.dp // 2) for t in range(cfg.tp)]


def fault_spec(rng: random.Random, cfg: ModelConfig, kind: str, lo: int, hi: int) -> str:
    topo = cfg.topology()
    r = rng.randrange(cfg.gpus)
    start, length = rng.randrange(lo, hi), rng.randint(4, 12)
    if kind == "slow_gpu":
        return f"slow_gpu:{r}:{start}:{start + length}:{rng.uniform(1.2, 3.0):.2f}"
    if kind == "slow_link":
        return f"slow_link:{topo.link_of(r)}:{start}:{start + length}:{rng.uniform(3.0, 10.0):.1f}"
    if kind == "congested_switch":
        return f"congested_switch:{rng.choice(topo.switches())}:{start}:{start + length}:{rng.uniform(3.0, 8.0):.1f}"
    if kind == "fluctuation":
        return f"fluctuation:{r}:{start}:{start + 2 * length}:{rng.uniform(1.3, 2.5):.2f}:{rng.randint(4, 8)}"
    start = rng.randrange(hi - 5, hi + 5)   # persistent to the end: keep it to ~20 iterations of window B
    return f"degradation:{r}:{start}:{start + 5}:{rng.uniform(1.2, 2.0):.2f}"


def scenario(seed: int, i: int) -> tuple[ModelConfig, list[str], list[str]]:
    rng = random.Random(seed)
    cfg = job_config(seed)
    a = [fault_spec(rng, cfg, rng.choice(TRANSIENT), 12, 40) for _ in range(2)]
    b = [fault_spec(rng, cfg, B_KINDS[i % len(B_KINDS)], SPLIT + 10, SPLIT + 40)]
    if i % 2:
        b.append(fault_spec(rng, cfg, rng.choice(TRANSIENT), SPLIT + 10, SPLIT + 40))
    return cfg, a, b


def simulate(cfg: ModelConfig, specs: list[str], ranks: list[int]):
    """(ops_by_rank as FetchDetail dicts, steps_by_rank of the fetched ranks, flagged step numbers)."""
    faults = [parse_fault(s, cfg.topology()) for s in specs]
    ops: dict[int, list[dict]] = {r: [] for r in ranks}
    for c in commops(cfg, faults, ranks, cfg.base_ns, 0, cfg.base_ns):
        ops[c.rank].append({"rank": c.rank, "comm_id": c.comm_id, "op": c.op, "seq": c.seq, "p2p_seq": c.p2p_seq,
                            "peer": c.peer, "nranks": c.nranks, "members": c.members, "bytes": c.bytes,
                            "issue_ns": c.issue_mono_ns, "start_ns": c.start_mono_ns, "end_ns": c.end_mono_ns})
    steps: dict[int, list[tuple[int, int, int]]] = {}
    job: dict[int, int] = {}
    for _, st in agent_records(cfg, faults, mono_base=cfg.base_ns, kinds=frozenset({"step"})):
        steps.setdefault(st.rank, []).append((st.step, st.start_mono_ns, st.end_mono_ns))
        job[st.step] = max(job.get(st.step, 0), st.end_mono_ns - st.start_mono_ns)
    numbers = sorted(job)
    g = gate([job[n] for n in numbers], IrregularityConfig(delta=1.1))
    flagged = {n for n, f in zip(numbers, g.flag) if f}
    return ops, {r: steps[r] for r in ranks}, flagged


def split(ops: dict, steps: dict) -> tuple[tuple[dict, dict], tuple[dict, dict]]:
    """(window A, window B): steps < SPLIT and >= SPLIT, ops by issue time against the rank's step SPLIT start."""
    a, b = ({}, {}), ({}, {})
    for r, st in steps.items():
        cut = min(s[1] for s in st if s[0] >= SPLIT)
        a[1][r], b[1][r] = [s for s in st if s[0] < SPLIT], [s for s in st if s[0] >= SPLIT]
        a[0][r] = [o for o in ops[r] if o["issue_ns"] < cut]
        b[0][r] = [o for o in ops[r] if o["issue_ns"] >= cut]
    return a, b


def key(o: dict) -> tuple:
    return (o["rank"], o["comm_id"], o["op"], o["seq"], o["p2p_seq"])


def truth(faulted: dict, clean: dict) -> dict[int, list[bool]]:
    base = {key(o): o["end_ns"] - o["start_ns"] for lst in clean.values() for o in lst}
    out = {}
    for r, lst in faulted.items():
        out[r] = []
        for o in lst:
            d, d0 = o["end_ns"] - o["start_ns"], base[key(o)]
            out[r].append(d >= TRUTH_RATIO * d0 and d - d0 >= TRUTH_FLOOR_NS)
    return out


class Score:
    def __init__(self) -> None:
        self.tp = self.fp = self.fn = 0

    def add(self, truth_by_rank: dict, pred_by_rank: dict, threshold: float = 0.5) -> Score:
        for r, ts in truth_by_rank.items():
            for t, p in zip(ts, pred_by_rank[r]):
                hit = p >= threshold          # NaN (skipped op) is not a hit
                self.tp += t and hit
                self.fp += hit and not t
                self.fn += t and not hit
        return self

    def figures(self) -> dict:
        p = self.tp / (self.tp + self.fp) if self.tp + self.fp else 0.0
        r = self.tp / (self.tp + self.fn) if self.tp + self.fn else 0.0
        return {"precision": round(p, 3), "recall": round(r, 3), "f1": round(2 * p * r / (p + r) if p + r else 0.0, 3),
                "abnormal_ops": self.tp + self.fn}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=sorted(SEEDS), default="report")
    ap.add_argument("--scenarios", type=int, default=10)
    args = ap.parse_args()
    t_all = time.perf_counter()
    names = ("model", "three_sigma", "rule", "model_drift", "model_drift_tuned", "three_sigma_drift")
    total = {n: Score() for n in names}
    per_kind: dict[str, Score] = {}
    fit_s, pred_s, pred_ops, labelled = [], [], 0, Score()
    for i in range(args.scenarios):
        seed = SEEDS[args.set] + i
        cfg, fa, fb = scenario(seed, i)
        ranks = fetched_ranks(cfg)
        drift = [f"degradation:{r}:{SPLIT}:{SPLIT + 1}:{DRIFT}" for r in range(cfg.gpus)]
        ops, steps, flagged = simulate(cfg, fa + fb, ranks)
        again, _, _ = simulate(cfg, fa + fb, ranks)
        if any((o["start_ns"], o["end_ns"]) != (p["start_ns"], p["end_ns"]) for r in ranks
               for o, p in zip(ops[r], again[r])):
            raise SystemExit(f"seed {seed}: the simulator is not deterministic; the truth would be meaningless")
        (a_ops, a_steps), (b_ops, b_steps) = split(ops, steps)
        clean = simulate(cfg, [], ranks)[0]
        d_ops, d_steps, _ = simulate(cfg, fa + fb + drift, ranks)
        (_, _), (bd_ops, bd_steps) = split(d_ops, d_steps)
        t_b, t_bd = truth(b_ops, clean), truth(bd_ops, simulate(cfg, drift, ranks)[0])

        model = OperatorModel(OpModelConfig())
        summary = model.fit(a_ops, a_steps, {n for n in flagged if n < SPLIT})
        fit_s.append(summary["seconds"])
        t0 = time.perf_counter()
        p_b = model.predict(b_ops, b_steps) if model.ready else {r: [float("nan")] * len(v) for r, v in b_ops.items()}
        pred_s.append(time.perf_counter() - t0)
        pred_ops += sum(len(v) for v in b_ops.values())
        total["model"].add(t_b, p_b)
        total["three_sigma"].add(t_b, three_sigma(b_ops, b_steps))
        total["rule"].add(t_b, bootstrap_labels(b_ops, b_steps, {n for n in flagged if n >= SPLIT}))
        labelled.add(truth(a_ops, clean), bootstrap_labels(a_ops, a_steps, {n for n in flagged if n < SPLIT}))
        per_kind.setdefault(fb[0].split(":")[0], Score()).add(t_b, p_b)
        if model.ready:
            total["model_drift"].add(t_bd, model.predict(bd_ops, bd_steps))
            shift = model.tune(bd_ops, bd_steps)
            total["model_drift_tuned"].add(t_bd, model.predict(bd_ops, bd_steps))
        else:
            shift = {}
        total["three_sigma_drift"].add(t_bd, three_sigma(bd_ops, bd_steps))
        one = Score().add(t_b, p_b).figures()
        print(f"seed {seed}  A {fa}  B {fb}: fit {summary['samples']} samples "
              f"({summary['positives']} abnormal) {summary['seconds']:.2f} s; B: {one}; "
              f"step shift {shift.get('step_log_s', 0.0):+.4f}", flush=True)
    fig = {n: s.figures() for n, s in total.items()}
    for n, f in fig.items():
        print(f"{n:20s} {f}")
    for k, s in sorted(per_kind.items()):
        print(f"  B fault {k:17s} {s.figures()}")
    print(f"labels on window A vs truth (abnormal = 1, NaN = not labelled -> counted as normal): {labelled.figures()}")
    n_ops = pred_ops / max(1, args.scenarios)
    out = {"set": args.set, "scenarios": args.scenarios, "ops_per_window": round(n_ops),
           "f1": fig["model"]["f1"], "precision": fig["model"]["precision"], "recall": fig["model"]["recall"],
           "f1_3sigma": fig["three_sigma"]["f1"], "precision_3sigma": fig["three_sigma"]["precision"],
           "recall_3sigma": fig["three_sigma"]["recall"], "f1_rule": fig["rule"]["f1"],
           "f1_untuned_drift": fig["model_drift"]["f1"], "f1_tuned_drift": fig["model_drift_tuned"]["f1"],
           "f1_3sigma_drift": fig["three_sigma_drift"]["f1"],
           "f1_by_kind": {k: s.figures()["f1"] for k, s in sorted(per_kind.items())},
           "label_precision": labelled.figures()["precision"],
           "fit_seconds": round(sum(fit_s) / len(fit_s), 2),
           "predict_ops_per_s": round(pred_ops / max(1e-9, sum(pred_s))),
           "wall_seconds": round(time.perf_counter() - t_all, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
