"""The abnormal-operator model of a job (Holmes §4.2.2, ALGORITHMS.md §3.4-3.5): a LightGBM forest that gives each
communication operator (CommOp) a probability of being abnormal, trained on labels it bootstraps itself.

A library for the collector's localisation (the graph search asks it whether an op on a rank is abnormal), not
a registered detector. It reads CommOps as FetchDetail answers give them (plain dicts, collector/ingest/decode.py
`detail_json`: comm_id, op, seq, p2p_seq, nranks, bytes, issue_ns, start_ns, end_ns in cluster ns; the rank is
the dict key) and each rank's steps (rank -> [(step, start_ns, end_ns)]); it writes nothing and keeps no clock.
One model per job: `fit` on one window, `predict` on the next, `tune` when the job's timings drift, `fit` again
on newer data. Cost: ~0.9 s to fit on 79k ops (32 ranks x 60 steps, 77k labelled, 100 trees, 2 threads),
~160k ops/s to predict, ~0.35 s to tune (2-core VM); a Python pass over the op dicts (~5 µs per op) is most of
it, then numpy, the booster predicts at ~1.7M ops/s. numpy and lightgbm are imported here only.

Operators. An op belongs to the rank's step whose [start, end] holds its issue time (ops outside every step are
skipped and counted). Its identity is `op_identity`: (comm_id, op, bytes, ordinal of that triple within the
rank's step, in issue order), per rank, so "the same operator" is compared across steps. Duration = end - start
(issue when start is 0): for a collective that is the member's wait for the last arrival plus the transfer.
Features (FEATURES; *_log_s are log10(seconds + 1 µs)):
  operator  its duration; over its identity's history (the rank's last history_steps steps in the input, the op
            itself included) mean, std, z-score (in seconds), Q1 / Q2 / Q3, IQR, and (duration - Q3) / IQR;
  fixed     nranks, bytes, op type (a fixed integer code, categorical), p2p or not;
  global    the rank's step duration, the mean duration of the rank's ops in that step (Holmes' "average
            operator elapsed time"; the window's mean would be one constant per rank), where the op was issued
            in the step (share of the step time);
  cross-rank when several members of the same collective instance (comm_id + seq; send/recv: comm_id + p2p_seq)
            are in the input: how much longer it took than the member that arrived last (the one that did not
            wait), and whether it is that last arrival (NaN when it is alone).
Seconds enter as logs because operator times span orders of magnitude (Holmes' argument against 3-sigma): a
drift that scales time then moves each such feature by about the same amount, which shifting thresholds undoes.

Labels, no human (Holmes labels by hand and suggests the first rule for a human to confirm). IQR is floored at
min_iqr_seconds (a constant-time op has IQR 0) and, if min_iqr_step_share > 0, at that share of the rank's
median step; identities with fewer than min_history_steps samples in the window get no statistics, no label.
  abnormal  duration > Q3 + abnormal_iqrs x IQR and its step is in flagged_steps (the δ-irregularity gate's,
            given by the caller); or, in any step, > Q3 + waited_iqrs x IQR by a member that took > waited_iqrs
            x IQR longer than its instance's last arrival (it waited for someone);
  normal    within Q1 - normal_iqrs x IQR .. Q3 + normal_iqrs x IQR and its step not flagged, or in a flagged
            step no longer than its median (it did not get slower), or the last arrival of an instance whose
            other members waited (what they waited for: Holmes' COMPUTE case);
  neither   left out of training.
Chosen on the bench's FIT seeds (100-109, F1 per op against the simulator's truth): normal_iqrs 3 and not the
Tukey 1.5 (0.695 -> 0.712; with 1.5 the untrained band 1.5-3 IQR fell to "abnormal", and the model leaned on the
step time, so a 6 % drift cost 0.06 F1); normal ops in flagged steps (at 1.5: 0.622 -> 0.695; without them
the model learnt "long step = abnormal"); waited_iqrs 6, not 3 (3 labels members' ordinary jitter waits abnormal). A
step-share IQR floor of 0.001 cleans the labels (precision 0.92 -> 0.97) but loses small ops' real slowdowns
(F1 0.712 -> 0.671): off by default; on a small job with 2-member TP groups (a member last half the time, IQR
~0) it removes jitter waits (tests/test_opmodel.py's job: F1 0.77 -> 0.94).
Training: LightGBM binary, `trees` rounds, deterministic (seed, deterministic=True, `threads`); at most
max_samples labelled ops (all positives up to half of it, negatives evenly subsampled). Nothing is trained with
fewer than min_train_steps steps per rank or one class only: `ready` stays as it was and the summary says why.
`fit` again retrains from scratch on the new window (bounded the same way).

Drift (Holmes §3.5): `tune` computes the features of a newer window, takes the ops the model predicts normal,
and shifts the threshold of every numerical split on a location feature (TUNED: the *_log_s ones but std and
IQR, which are scale, as z, fence and shares are scale-free) by Δ_f = mean_f(those ops) - mean_f(the training
window's ops predicted normal, the same selection); the booster is dumped (`model_to_string`), edited and
reloaded. Each tune starts from the trained model, so tunes do not compound.

Also: `three_sigma` (the paper's baseline: duration > mean + 3 std of its identity over the same window, std
floored at min_iqr_seconds) and `bootstrap_labels` (the labelling rule alone), in predict's shape.
Assumptions: a rank's ops carry cluster times consistent with its steps; an op type not in OP_CODES shares one
code; a window holds mostly healthy steps (the quartiles are the baseline: a fault covering > ~1/4 of it moves
them).

Figures (`.venv/bin/python bench/opmodel.py`, REPORT seeds 200-209, never tuned on; 64-GPU DP8 x PP4 x TP2 jobs,
32 ranks fetched, fit on 60 steps with two faults, scored per op on the next 60 steps with other faults, truth =
the same job simulated without them, an op >= 1.1x and >= 0.1 ms longer): precision 0.808, recall 0.595, F1
0.685; Holmes' 3-sigma 0.053 (a fault of a few steps inflates the std it is judged by); the labelling rule
alone, given that window's flagged steps, 0.674; labels on the fit window: precision 0.93, recall 0.50. By fault
in the scored window: slow_gpu 0.83, congested_switch 0.78, fluctuation 0.67, slow_link 0.54, degradation 0.12
(a degradation persists ~20 steps: it becomes the quartiles). Missed: ops lengthened within their natural
spread (a slower DP ring under several ms of wait); false: small ops' jitter waits. Drift (every rank 6 %
slower from the scored window on): F1 0.685 untuned, 0.671 tuned. Tuning does not help here: the model leans on
scale-free features (fence, z) and a mean shift over a mix of ops is not each op's shift.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from dataclasses import dataclass, fields
from operator import itemgetter

import numpy as np

P2P = frozenset({"send", "recv", "sendrecv"})
OP_CODES = {name: i for i, name in enumerate((
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "barrier", "gather",
    "scatter", "send", "recv", "sendrecv"))}
OTHER_OP = len(OP_CODES)
FEATURES = ("duration_log_s", "mean_log_s", "std_log_s", "z", "q1_log_s", "q2_log_s", "q3_log_s", "iqr_log_s",
            "fence_iqrs", "nranks", "bytes", "op_code", "p2p", "step_log_s", "step_op_mean_log_s",
            "start_share", "wait_log_s", "last_arrival")
TUNED = ("duration_log_s", "mean_log_s", "q1_log_s", "q2_log_s", "q3_log_s", "step_log_s", "step_op_mean_log_s",
         "wait_log_s")  # location features (seconds); std / IQR are scale, z / fence / shares scale-free
LOG_EPS_S = 1e-6


@dataclass
class OpModelConfig:
    history_steps: int = 100          # an identity's statistics are over the rank's last this many steps
    min_history_steps: int = 8        # fewer samples of an identity there: no statistics, no label
    min_train_steps: int = 20         # fit() trains only on at least this many steps per rank
    trees: int = 100                  # boosting rounds
    max_depth: int = 8
    leaves: int = 31                  # LightGBM num_leaves (<= 2 ** max_depth)
    learning_rate: float = 0.1
    min_leaf_samples: int = 20
    threshold: float = 0.5            # P(abnormal) >= threshold: abnormal
    abnormal_iqrs: float = 3.0        # abnormal label above Q3 + this x IQR (flagged step, or it waited)
    normal_iqrs: float = 3.0          # normal label within Q1 - this x IQR .. Q3 + this x IQR
    waited_iqrs: float = 6.0          # abnormal label in any step: above Q3 + this x IQR and it waited this x
                                      # IQR longer than its instance's last arrival
    min_iqr_seconds: float = 20e-6    # IQR (and the 3-sigma std) floor: a constant-time op has IQR 0
    min_iqr_step_share: float = 0.0   # > 0: also floor IQR at this share of the rank's median step (see Labels)
    max_samples: int = 200_000        # labelled ops trained on, at most
    threads: int = 2
    seed: int = 0

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"{f.name} must be a finite number, got {v!r}")
        for name in ("history_steps", "min_history_steps", "min_train_steps", "trees", "max_depth",
                     "min_leaf_samples", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.min_history_steps < 4 or self.min_history_steps > self.history_steps:
            raise ValueError("need 4 <= min_history_steps <= history_steps (quartiles need a few samples)")
        if not 2 <= self.leaves <= 2 ** min(self.max_depth, 16):
            raise ValueError(f"leaves must be within 2 .. 2 ** max_depth, got {self.leaves}")
        if not 0.0 < self.learning_rate <= 1.0:
            raise ValueError(f"learning_rate must be within (0, 1], got {self.learning_rate}")
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must be within (0, 1), got {self.threshold}")
        if not (0.0 < self.normal_iqrs <= self.waited_iqrs and 0.0 < self.abnormal_iqrs <= self.waited_iqrs):
            raise ValueError("need 0 < normal_iqrs <= waited_iqrs and 0 < abnormal_iqrs <= waited_iqrs")
        if self.min_iqr_seconds <= 0 or not 0 <= self.min_iqr_step_share < 1:
            raise ValueError("need min_iqr_seconds > 0 and 0 <= min_iqr_step_share < 1")
        if self.max_samples < 2 * self.min_leaf_samples:
            raise ValueError("max_samples must be >= 2 x min_leaf_samples")


def op_identity(op: dict, ordinal: int) -> tuple:
    """The operator an op is an instance of, per rank: (comm_id, op, bytes, ordinal of this triple in the step)."""
    return (op["comm_id"], op["op"], int(op["bytes"]), ordinal)


@dataclass
class _Table:
    """The usable ops of one input, column-wise: features, bootstrapped labels and where each op came from."""
    X: np.ndarray                      # (n, len(FEATURES))
    label: np.ndarray                  # 1 abnormal, 0 normal, -1 neither
    source: np.ndarray                 # which rule labelled it (SOURCES index), -1 none
    where: list                        # (rank, index in ops_by_rank[rank]) per row
    skipped: dict
    steps: int                         # distinct (rank, step) pairs with ops

    def expand(self, ops_by_rank: dict, values) -> dict[int, list[float]]:
        out = {r: [math.nan] * len(ops) for r, ops in ops_by_rank.items()}
        for (r, i), v in zip(self.where, values):
            out[r][i] = float(v)
        return out


SOURCES = ("abnormal_flagged_outlier", "abnormal_waited", "normal_in_range", "normal_last_arrival")


def _log(x):
    return np.log10(np.maximum(x, 0.0) + LOG_EPS_S)


def _table(ops_by_rank: dict, steps_by_rank: dict, flagged: set, cfg: OpModelConfig) -> _Table:
    """Features and labels of every usable op: one pass over the dicts, then column-wise numpy."""
    skipped = {"malformed": 0, "end_before_start": 0, "outside_steps": 0, "bad_steps": 0}
    gids: dict[tuple, int] = {}
    insts: dict[tuple, int] = {}
    steps_seen: dict[tuple, int] = {}
    where, cols = [], []
    for r in sorted(ops_by_rank or {}):
        st = []
        for s in steps_by_rank.get(r) or ():
            try:
                n, a, b = int(s[0]), int(s[1]), int(s[2])
            except (TypeError, ValueError, IndexError):
                skipped["bad_steps"] += 1
                continue
            if b <= a:
                skipped["bad_steps"] += 1
                continue
            st.append((a, b, n))
        st.sort()
        starts = [s[0] for s in st]
        med_step_s = float(np.median([b - a for a, b, _ in st])) * 1e-9 if st else 0.0
        floor_s = max(cfg.min_iqr_seconds, cfg.min_iqr_step_share * med_step_s)
        rows = []
        for i, o in enumerate(ops_by_rank[r] or ()):
            try:
                cid, name, nb, nr = o["comm_id"], o["op"], int(o["bytes"]), int(o["nranks"])
                iss, a, b, seq = int(o["issue_ns"]), int(o["start_ns"]), int(o["end_ns"]), int(o["seq"])
                pseq = int(o.get("p2p_seq", -1))
                hash(cid), hash(name)
            except (KeyError, TypeError, ValueError, AttributeError):
                skipped["malformed"] += 1
                continue
            a, iss = a or iss, iss or a
            if not a or not b:
                skipped["malformed"] += 1
                continue
            if b < a:
                skipped["end_before_start"] += 1
                continue
            k = bisect_right(starts, iss) - 1
            if k < 0 or iss > st[k][1]:
                skipped["outside_steps"] += 1
                continue
            rows.append((iss, i, k, o, cid, name, nb, nr, a, b, seq, pseq))
        rows.sort(key=itemgetter(0, 1))
        seen: dict[tuple, int] = {}
        for iss, i, k, o, cid, name, nb, nr, a, b, seq, pseq in rows:
            key = (k, cid, name, nb)
            ordinal = seen[key] = seen.get(key, -1) + 1
            g = gids.setdefault((r,) + op_identity(o, ordinal), len(gids))
            p2p = name in P2P
            ikey = (cid, "p2p", pseq) if p2p and pseq >= 0 else (cid, seq) if not p2p and seq >= 0 else None
            inst = insts.setdefault(ikey, len(insts)) if ikey is not None else -1
            sa, sb, sn = st[k]
            rs = steps_seen.setdefault((r, k), len(steps_seen))
            cols.append((g, inst, rs, k, (b - a) * 1e-9, (iss - sa) / (sb - sa), (sb - sa) * 1e-9, sn in flagged,
                         a, OP_CODES.get(name, OTHER_OP), p2p, nr, nb, floor_s))
            where.append((r, i))
    n = len(cols)
    if not n:
        return _Table(np.zeros((0, len(FEATURES))), np.zeros(0, np.int8), np.zeros(0, np.int8), [], skipped, 0)
    (g, inst, rs, k, dur, share, step_s, flag, start, code, p2p, nr, nb, floor) = (np.array(c) for c in zip(*cols))
    G = len(gids)
    # the window: each rank's last history_steps steps (positions k) that have ops
    ranks = [w[0] for w in where]
    kmax: dict = {}
    for r_, k_ in zip(ranks, k.tolist()):
        if k_ > kmax.get(r_, -1):
            kmax[r_] = k_
    in_win = k > np.array([kmax[r_] for r_ in ranks]) - cfg.history_steps
    w = np.flatnonzero(in_win)
    order = w[np.lexsort((dur[w], g[w]))]
    cnt = np.bincount(g[order], minlength=G)
    first = np.concatenate(([0], np.cumsum(cnt)[:-1]))
    vals = dur[order]
    ok = cnt >= cfg.min_history_steps

    def quant(p):
        pos = first + p * np.maximum(cnt - 1, 0)
        lo = np.minimum(np.floor(pos).astype(np.int64), len(vals) - 1)
        hi = np.minimum(lo + 1, first + np.maximum(cnt - 1, 0))
        hi = np.minimum(hi, len(vals) - 1)
        q = vals[lo] + (pos - np.floor(pos)) * (vals[hi] - vals[lo])
        return np.where(ok, q, np.nan)

    q1, q2, q3 = quant(0.25), quant(0.5), quant(0.75)
    safe = np.maximum(cnt, 1)
    mean = np.bincount(g[w], weights=dur[w], minlength=G) / safe
    var = np.bincount(g[w], weights=(dur[w] - mean[g[w]]) ** 2, minlength=G) / np.maximum(cnt - 1, 1)
    mean, std = np.where(ok, mean, np.nan), np.where(ok, np.sqrt(var), np.nan)
    iqr = q3 - q1
    iqr_eff = np.maximum(iqr[g], floor)
    q1, q3, mean_g, std_eff = q1[g], q3[g], mean[g], np.maximum(std, cfg.min_iqr_seconds)[g]
    # the rank's step: mean op duration
    step_mean = (np.bincount(rs, weights=dur) / np.bincount(rs))[rs]
    # cross-rank: the last arrival of each instance (latest start) and how much longer each member took
    wait = np.full(n, np.nan)
    last = np.full(n, np.nan)
    has = inst >= 0
    if has.any():
        h = np.flatnonzero(has)
        present = np.bincount(inst[h])
        by_start = h[np.lexsort((-dur[h], start[h], inst[h]))]   # per instance by start: its last row arrived last
        last_row = np.full(len(present), -1)
        last_row[present > 0] = by_start[(np.cumsum(present) - 1)[present > 0]]
        multi = has & (present[np.maximum(inst, 0)] >= 2)
        lr = last_row[inst[multi]]
        wait[multi] = dur[multi] - dur[lr]
        last[multi] = (lr == np.flatnonzero(multi)).astype(float)
    X = np.column_stack([
        _log(dur), _log(mean_g), _log(std[g]), (dur - mean_g) / std_eff, _log(q1), _log(q2[g]), _log(q3),
        _log(iqr[g]), (dur - q3) / iqr_eff, nr, nb, code, p2p, _log(step_s), _log(step_mean), share,
        np.where(np.isnan(wait), np.nan, _log(wait)), last]).astype(np.float64)
    # labels: each rule a mask; abnormal rules win over normal ones
    with np.errstate(invalid="ignore"):
        outlier = ok[g] & (dur > q3 + cfg.abnormal_iqrs * iqr_eff)
        within = ok[g] & (dur >= q1 - cfg.normal_iqrs * iqr_eff) & (dur <= q3 + cfg.normal_iqrs * iqr_eff)
        waited = ok[g] & (dur > q3 + cfg.waited_iqrs * iqr_eff) & (last == 0) & (wait > cfg.waited_iqrs * iqr_eff)
        not_slower = dur <= q2[g]
    pos_flag = outlier & flag
    pos_wait = waited & ~pos_flag
    neg_step = within & ~waited & (~flag | not_slower)
    awaited = np.zeros(int(inst.max()) + 1 if has.any() else 1, dtype=bool)
    awaited[inst[waited]] = True
    neg_last = within & has & (last == 1) & awaited[np.maximum(inst, 0)] & ~neg_step & ~pos_flag
    label = np.full(n, -1, np.int8)
    source = np.full(n, -1, np.int8)
    for j, m in enumerate((pos_flag, pos_wait, neg_step, neg_last)):
        label[m] = 1 if j < 2 else 0
        source[m] = j
    return _Table(X, label, source, where, skipped, len(steps_seen))


def _means(X: np.ndarray) -> dict[int, float]:
    """Mean of each TUNED feature over the rows of X (feature index -> mean), where it has any value."""
    out = {}
    for f in TUNED:
        col = X[:, FEATURES.index(f)]
        if np.isfinite(col).any():
            out[FEATURES.index(f)] = float(np.nanmean(col))
    return out


def _shift_thresholds(model_str: str, shift: dict[int, float]) -> str:
    """The model string with delta added to the threshold of every numerical split on feature index f. The
    header's tree_sizes (byte offsets for a parallel load) no longer hold once numbers change length: dropped,
    LightGBM then reads the trees one after the other."""
    lines = model_str.split("\n")
    feats, at = None, -1
    for j, line in enumerate(lines):
        if line.startswith("tree_sizes="):
            lines[j] = None
        elif line.startswith("split_feature="):
            feats = [int(x) for x in line[14:].split()]
        elif line.startswith("threshold="):
            at = j
        elif line.startswith("decision_type=") and feats is not None and at >= 0:
            dtypes = [int(x) for x in line[14:].split()]
            th = lines[at][10:].split()
            for i, (f, d) in enumerate(zip(feats, dtypes)):
                if not d & 1 and f in shift:          # bit 0: categorical split (threshold is a category index)
                    th[i] = repr(float(th[i]) + shift[f])
            lines[at] = "threshold=" + " ".join(th)
            feats, at = None, -1
    return "\n".join(x for x in lines if x is not None)


class OperatorModel:
    """One per job. Bootstraps its own labels, (re)trains as the job runs, tunes split thresholds on drift."""

    def __init__(self, cfg: OpModelConfig | None = None) -> None:
        self.cfg = cfg or OpModelConfig()
        self.cfg.validate()
        self._booster = None
        self._trained_str = ""
        self._normal_means: dict[int, float] = {}
        self.shift: dict[str, float] = {}
        self.summary: dict = {"trained": False, "reason": "not fitted yet"}

    @property
    def ready(self) -> bool:
        return self._booster is not None

    def fit(self, ops_by_rank: dict[int, list[dict]], steps_by_rank: dict[int, list[tuple[int, int, int]]],
            flagged_steps: set[int]) -> dict:
        """Trains (or retrains from scratch) on the labels bootstrapped from this window; returns a summary."""
        import lightgbm as lgb

        t0 = time.perf_counter()
        cfg = self.cfg
        tab = _table(ops_by_rank, steps_by_rank, set(flagged_steps or ()), cfg)
        use = np.flatnonzero(tab.label >= 0)
        pos, neg = use[tab.label[use] == 1], use[tab.label[use] == 0]
        out = {"trained": False, "reason": "", "ops": len(tab.where), "skipped": tab.skipped,
               "steps": tab.steps, "labelled": len(use), "positives": len(pos),
               "negatives": len(neg),
               "label_sources": {s: int((tab.source == j).sum()) for j, s in enumerate(SOURCES)},
               "samples": 0, "trees": 0, "seconds": 0.0}
        ranks = max(1, len({w[0] for w in tab.where}))
        if not tab.where:
            out["reason"] = "no usable ops (empty input, or every op skipped: see skipped)"
        elif tab.steps / ranks < cfg.min_train_steps:
            out["reason"] = f"{tab.steps / ranks:.1f} steps per rank, fewer than min_train_steps={cfg.min_train_steps}"
        elif not len(pos) or not len(neg):
            out["reason"] = (f"one class only ({len(pos)} abnormal, {len(neg)} normal labels): nothing to learn "
                             "from (no flagged step with outliers, no waiting member?)")
        if out["reason"]:
            if self.ready:
                out["reason"] += "; the previous model is kept"
            out["seconds"] = round(time.perf_counter() - t0, 3)
            self.summary = out
            return out
        rng = np.random.default_rng(cfg.seed)
        if len(pos) > cfg.max_samples // 2:
            pos = np.sort(rng.choice(pos, cfg.max_samples // 2, replace=False))
        if len(pos) + len(neg) > cfg.max_samples:
            neg = np.sort(rng.choice(neg, cfg.max_samples - len(pos), replace=False))
        rows = np.concatenate([pos, neg])
        X, y = tab.X[rows], (tab.label[rows] == 1).astype(np.int8)
        params = {"objective": "binary", "num_leaves": cfg.leaves, "max_depth": cfg.max_depth,
                  "learning_rate": cfg.learning_rate, "min_data_in_leaf": cfg.min_leaf_samples,
                  "seed": cfg.seed, "deterministic": True, "force_col_wise": True, "num_threads": cfg.threads,
                  "verbose": -1}
        ds = lgb.Dataset(X, label=y, feature_name=list(FEATURES), categorical_feature=["op_code"],
                         params={"verbose": -1})
        booster = lgb.train(params, ds, num_boost_round=cfg.trees)
        self._trained_str = booster.model_to_string()
        self._booster = booster
        self._normal_means = _means(tab.X[booster.predict(tab.X, num_threads=cfg.threads) < cfg.threshold])
        self.shift = {}
        out.update(trained=True, samples=len(rows), trees=booster.num_trees(),
                   seconds=round(time.perf_counter() - t0, 3))
        self.summary = out
        return out

    def _need(self) -> None:
        if not self.ready:
            raise RuntimeError(f"the operator model is not trained: {self.summary.get('reason')}")

    def predict(self, ops_by_rank: dict[int, list[dict]],
                steps_by_rank: dict[int, list[tuple[int, int, int]]]) -> dict[int, list[float]]:
        """P(abnormal) per op, in the order given; NaN for an op skipped (malformed, outside every step)."""
        self._need()
        tab = _table(ops_by_rank, steps_by_rank, set(), self.cfg)
        p = self._booster.predict(tab.X, num_threads=self.cfg.threads) if len(tab.where) else []
        return tab.expand(ops_by_rank, p)

    def tune(self, ops_by_rank: dict[int, list[dict]], steps_by_rank: dict[int, list[tuple[int, int, int]]]) -> dict:
        """Drift: shifts the thresholds of the TUNED features' splits by the shift of their mean over the ops
        predicted normal here against those of the training window; returns {feature: delta} (log10 seconds)."""
        import lightgbm as lgb

        self._need()
        tab = _table(ops_by_rank, steps_by_rank, set(), self.cfg)
        if not len(tab.where):
            return {}
        p = self._booster.predict(tab.X, num_threads=self.cfg.threads)
        now = _means(tab.X[p < self.cfg.threshold])
        shift = {j: now[j] - m0 for j, m0 in self._normal_means.items() if j in now}
        if not shift:
            return {}
        self._booster = lgb.Booster(model_str=_shift_thresholds(self._trained_str, shift))
        self.shift = {FEATURES[j]: d for j, d in shift.items()}
        return dict(self.shift)


def three_sigma(ops_by_rank: dict, steps_by_rank: dict, cfg: OpModelConfig | None = None) -> dict[int, list[float]]:
    """Holmes' baseline, per op: 1.0 when its duration > mean + 3 std of its identity (same window and std floor
    as the model's features), else 0.0; NaN when skipped or without statistics."""
    tab = _table(ops_by_rank, steps_by_rank, set(), cfg or OpModelConfig())
    z = tab.X[:, FEATURES.index("z")] if len(tab.where) else np.zeros(0)
    return tab.expand(ops_by_rank, np.where(np.isnan(z), np.nan, (z > 3.0).astype(float)))


def bootstrap_labels(ops_by_rank: dict, steps_by_rank: dict, flagged_steps: set[int],
                     cfg: OpModelConfig | None = None) -> dict[int, list[float]]:
    """The labels fit() would train on, per op: 1.0 abnormal, 0.0 normal, NaN neither (or skipped)."""
    tab = _table(ops_by_rank, steps_by_rank, set(flagged_steps or ()), cfg or OpModelConfig())
    return tab.expand(ops_by_rank, np.where(tab.label < 0, np.nan, tab.label.astype(float)))
