"""The sentinel's model: a workload-aware latency baseline and a control chart on its positive errors
(LatencyPrism, ALGORITHMS.md §4.5-4.6), for inference batches and training steps alike.

A scikit-learn-style object: `Sentinel(...).fit(X, y)` on normal iterations, then `update(x, y) -> alarm` per
iteration (or `score(X, y)` over a series). No clock, no store: the detector that feeds it iterations from the
store (and the agent-side recognition that produces them) is separate.

  Baseline   LightGBM regression of the iteration's duration on its workload features. Beside the raw features
             the physically informed ones of §4.5: real KV length, Workload_KV = 1[decode] x B x KV (the memory
             bandwidth a decode step moves), prefill compute B x L_in and attention B x KV^2 for prefill.
             Trained on decode-only iterations when `decode_only` (LatencyPrism's choice: prefill time depends
             on the cache layout) and on every iteration otherwise (training steps).
  PPE        positive prediction error, relative to the actual: max(0, (y - ŷ) / y), in [0, 1).
  Window     moving average over the last `window` judged iterations (W = 10).
  UCL        min(max(μ + k σ, its 99.9th percentile), tau_max) of the moving average over the training
             iterations (SPC phase I; k = 3, tau_max = 0.5; the percentile because a shared host's latency has
             heavier tails than a normal law), over out-of-fold predictions (5 folds), so the limit reflects the
             model's error on data it did not see, not its training fit; and at least `min_ucl`.
  Alarm      beyond LatencyPrism, two rules of SPC practice (an individuals chart beside the moving average):
             the moving average is over the UCL and this iteration's own PPE is at least `current_share` x UCL
             (so the window - 1 fast iterations after a fault, whose average still holds it, pass), or this
             iteration alone is over max(`single_factor` x UCL, the 99.9th percentile of the training PPE)
             (the first iteration of a large slowdown, before the average has risen). On three vLLM recordings
             (bench/sentinel.py; the rule chosen on one): lag 1-2 -> 0 iterations, F1 0.955-0.975 -> 0.981-0.995,
             and the refit's out-of-fold R² 0.15 -> 0.94-0.96, since the unalarmed first batch of every fault no
             longer entered the normal history the model refits on.
  Drift      a workload outside what the model was trained on (a feature beyond the training range by
             `drift_margin`) is not judged but kept with the normal ones: `drift_refit` of them refit the model
             at once (its range grows with the workload: before, a load that rose after the fit was never
             judged again, since unjudged iterations never reached a refit); `refit_every` normal iterations
             later the model is refit on the newest `max_train` kept ones (alarmed iterations never feed it;
             a fault that starts together with a new workload is learnt as that workload's normal: the price
             of judging nothing the model has not seen).
Cost: fit ~0.2 s for 5,000 rows (5 folds + final); update is one LightGBM prediction (~50 µs) per iteration,
batched in `score`.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from steplens.collector.analysis.base import ConfigError, DetectorConfig, DetectorSpec, Window
from steplens.collector.analysis.findings import Finding, Suspect

RAW = ("batch_size", "prefill_requests", "prefill_tokens", "decode_requests", "kv_tokens", "avg_input_length",
       "avg_output_length", "mode")
EXTRA = ("tokens", "micro_batches")   # a training step's workload (and an inference batch's scheduled tokens)


def features(rows: list[dict]) -> np.ndarray:
    """The model's feature matrix from iteration rows (keys of RAW; missing ones are 0)."""
    raw = np.array([[float(r.get(k, 0.0)) for k in RAW] for r in rows], dtype=np.float64).reshape(-1, len(RAW))
    B, pre_tok, dec, kv, l_in, l_out, mode = (raw[:, i] for i in (0, 2, 3, 4, 5, 6, 7))
    decode = (mode == 2).astype(np.float64)
    real_kv = l_in + l_out
    workload_kv = decode * B * real_kv
    attn_quad = (1 - decode) * B * real_kv ** 2
    compute_tokens = (1 - decode) * pre_tok
    extra = np.array([[float(r.get(k, 0.0)) for k in EXTRA] for r in rows], dtype=np.float64).reshape(-1, len(EXTRA))
    return np.column_stack([raw, real_kv, workload_kv, attn_quad, compute_tokens, dec * kv, extra])


def iteration_row(it: dict) -> dict:
    """An Iteration row (store: agent/records.py Iteration) as the model's raw workload: averages from the
    sums, mode 1 with prompt tokens in the batch (prefill or mixed), 2 decode only, 0 a training step."""
    b = max(int(it.get("batch_size") or 0), 1)
    phase = it.get("phase", "")
    return {"batch_size": it.get("batch_size", 0), "prefill_requests": it.get("prefill_requests", 0),
            "prefill_tokens": it.get("prefill_tokens", 0), "decode_requests": it.get("decode_requests", 0),
            "kv_tokens": it.get("kv_tokens", 0), "avg_input_length": (it.get("input_tokens") or 0) / b,
            "avg_output_length": (it.get("output_tokens") or 0) / b,
            "mode": 2 if phase == "decode" else 1 if phase in ("prefill", "mixed") else 0,
            "tokens": it.get("tokens", 0), "micro_batches": it.get("micro_batches", 0)}


@dataclass
class SentinelConfig:
    window: int = 10              # W: the moving average of PPE
    k: float = 3.0                # UCL = min(mu + k sigma, tau_max)
    tau_max: float = 0.5
    ucl_quantile: float = 0.999   # ... and at least this quantile of the training moving average (heavy tails)
    current_share: float = 0.5    # an MA alarm also needs this iteration's own PPE >= current_share x UCL (0: off):
                                  # the window - 1 fast iterations after a fault, whose average still holds it, pass
    single_factor: float = 4.0    # one iteration alone alarms when its PPE > max(single_factor x UCL, the
                                  # training PPE's ucl_quantile): an individuals chart beside the MA for the first
                                  # iteration of a large slowdown, before the average has risen (0: off)
    min_ucl: float = 0.15         # ... and at least this: a shared host's own jitter holds a 10-batch average 5-10 %
                                  # over its baseline for a moment now and then (LatencyPrism's fixed window: 0.15)
    decode_only: bool = True      # inference: judge decode iterations only (prefill is cache-layout dependent)
    drift_margin: float = 0.10    # a feature beyond the training range by this share is not judged (drift)
    refit_every: int = 500        # normal iterations between refits
    drift_refit: int = 100        # drifted (unjudged) iterations that refit the model at once
    max_train: int = 20000        # newest normal iterations a refit uses
    n_estimators: int = 200
    learning_rate: float = 0.1
    num_leaves: int = 15
    seed: int = 0


class Sentinel:
    def __init__(self, cfg: SentinelConfig | None = None) -> None:
        self.cfg = cfg or SentinelConfig()
        self.model = None
        self.ucl = self.single = 0.0
        self.mu = self.sigma = 0.0
        self.lo = self.hi = None
        self.fit_r2 = self.fit_mape = float("nan")
        self._ppe: deque = deque(maxlen=self.cfg.window)
        self._normal_x: deque = deque(maxlen=self.cfg.max_train)
        self._normal_y: deque = deque(maxlen=self.cfg.max_train)
        self._since_fit = self._drifted = 0
        self.refits = 0

    # -- model -------------------------------------------------------------------------------------------
    def _judged(self, X: np.ndarray) -> np.ndarray:
        return X[:, RAW.index("mode")] == 2 if self.cfg.decode_only else np.ones(len(X), dtype=bool)

    def _train(self, X: np.ndarray, y: np.ndarray):
        """A LightGBM booster (the native API: no scikit-learn needed) for y on X."""
        import lightgbm as lgb
        c = self.cfg
        params = {"objective": "regression", "learning_rate": c.learning_rate, "num_leaves": c.num_leaves,
                  "min_data_in_leaf": 10, "seed": c.seed, "verbosity": -1, "num_threads": 1}
        return lgb.train(params, lgb.Dataset(X, label=y), num_boost_round=c.n_estimators)

    def fit(self, X: np.ndarray, y: np.ndarray, keep: bool = True) -> "Sentinel":
        """Fit the baseline on normal iterations and set the UCL from out-of-fold moving-average PPE; keep: add
        them to the normal history later refits use (a refit passes that history itself)."""
        X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)
        m = self._judged(X)
        X, y = X[m], y[m]
        if len(y) < 50:
            raise ValueError(f"need >= 50 judged iterations to fit, got {len(y)}")
        oof = np.empty(len(y))
        folds = np.arange(len(y)) % 5
        for f in range(5):
            tr = folds != f
            oof[~tr] = self._train(X[tr], y[tr]).predict(X[~tr])
        ppe = np.maximum(0.0, (y - np.maximum(oof, 0.0)) / (y + 1e-9))
        ma = np.convolve(ppe, np.ones(self.cfg.window) / self.cfg.window, mode="valid")
        self.mu, self.sigma = float(ma.mean()), float(ma.std())
        self.single = float(np.quantile(ppe, self.cfg.ucl_quantile))
        self.ucl = min(max(self.mu + self.cfg.k * self.sigma, float(np.quantile(ma, self.cfg.ucl_quantile)),
                           self.cfg.min_ucl), self.cfg.tau_max)
        ss = float(((y - y.mean()) ** 2).sum())
        self.fit_r2 = 1.0 - float(((y - oof) ** 2).sum()) / ss if ss else float("nan")
        self.fit_mape = float(np.mean(np.abs(y - oof) / np.maximum(y, 1e-9)))
        self.model = self._train(X, y)
        self.lo, self.hi = X.min(axis=0), X.max(axis=0)
        if keep:
            self._normal_x.extend(X)
            self._normal_y.extend(y)
        self._since_fit = self._drifted = 0
        return self

    # -- judging -----------------------------------------------------------------------------------------
    def drifted(self, x: np.ndarray) -> bool:
        span = np.maximum(self.hi - self.lo, 1e-9)
        return bool(np.any(x < self.lo - self.cfg.drift_margin * span) or
                    np.any(x > self.hi + self.cfg.drift_margin * span))

    def score(self, X: np.ndarray, y: np.ndarray) -> dict:
        """Judge a series in order: per iteration the prediction, PPE, moving average and alarm (False where not
        judged: prefill with decode_only, or a drifted workload). Refits as update() does."""
        X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)
        pred = np.full(len(y), np.nan)
        ma = np.full(len(y), np.nan)
        alarm = np.zeros(len(y), dtype=bool)
        judged = self._judged(X)
        for i in range(len(y)):
            if not judged[i]:
                continue
            a, p, m = self.update(X[i], float(y[i]))
            pred[i], ma[i], alarm[i] = p, m, a
        return {"pred": pred, "ma": ma, "alarm": alarm, "judged": judged}

    def update(self, x: np.ndarray, y: float) -> tuple[bool, float, float]:
        """One judged iteration: (alarm, prediction, moving-average PPE)."""
        if self.model is None:
            raise RuntimeError("fit() first")
        if self.drifted(x):
            self._normal_x.append(x)
            self._normal_y.append(y)
            self._drifted += 1
            if self._drifted >= self.cfg.drift_refit:
                self.fit(np.asarray(self._normal_x), np.asarray(self._normal_y), keep=False)
                self.refits += 1
            return False, float("nan"), float("nan")
        p = max(float(self.model.predict(x.reshape(1, -1))[0]), 0.0)
        e = max(0.0, (y - p) / (y + 1e-9))
        self._ppe.append(e)
        m = float(np.mean(self._ppe))
        c = self.cfg
        alarm = (len(self._ppe) == c.window and m > self.ucl and e >= c.current_share * self.ucl) or \
            (c.single_factor > 0 and e > max(c.single_factor * self.ucl, self.single))
        if not alarm:
            self._normal_x.append(x)
            self._normal_y.append(y)
            self._since_fit += 1
            if self._since_fit >= self.cfg.refit_every:
                self.fit(np.asarray(self._normal_x), np.asarray(self._normal_y), keep=False)
                self.refits += 1
        return alarm, p, m


# -- the detector: iterations from the store -> the model per process -> findings ---------------------------------
@dataclass
class SentinelDetectorConfig(DetectorConfig):
    fit_iterations: int = 1500       # judged iterations of a serving engine before its first fit (phase I: at
                                     # 600 the recorded vLLM engine's load was still rising, and the model's
                                     # first minutes gave 1.2x false episodes of over a second)
    fit_iterations_training: int = 200   # ... of a training process (steps vary less than batches)
    min_alarms: int = 3              # an episode is a finding with at least this many alarmed iterations
    min_episode_seconds: float = 1.0  # ... lasting at least this long (first to last alarm)
    merge_gap_iterations: int = 10   # alarms this many judged iterations apart or closer are one episode
    recent_seconds: float = 5.0      # an episode's evidence also says how slow its alarms of this long were
    window: int = 10                 # the model's (SentinelConfig) moving average, serving engines
    window_training: int = 10        # ... training steps
    min_ucl: float = 0.15            # the UCL's floor for serving engines (a shared host's batch jitter)
    min_ucl_training: float = 0.01   # ... for training steps (their own residuals set the limit; 1 % floor)
    tau_max: float = 0.5
    refit_every: int = 500
    idle_series_seconds: float = 3600.0   # a process with no iteration this long (data time) is forgotten
    resolve_after_seconds: float = 30.0

    def validate(self) -> None:
        super().validate()
        if min(self.fit_iterations, self.fit_iterations_training) < 50 or self.min_alarms < 1 or \
                self.merge_gap_iterations < 0:
            raise ConfigError("fit_iterations and fit_iterations_training must be >= 50, min_alarms >= 1, "
                              "merge_gap_iterations >= 0")
        if not 1 <= self.window <= 1000 or not 1 <= self.window_training <= 1000 or \
                not 0 < self.min_ucl <= self.tau_max <= 10 or \
                not 0 < self.min_ucl_training <= self.tau_max:
            raise ConfigError("window and window_training must be within 1..1000 and 0 < min_ucl, "
                              "min_ucl_training <= tau_max <= 10")
        if self.min_episode_seconds < 0:
            raise ConfigError("min_episode_seconds must be >= 0")
        if not 0 < self.recent_seconds <= 3600:
            raise ConfigError(f"recent_seconds must be within (0, 3600], got {self.recent_seconds}")
        if self.refit_every < 10 or self.idle_series_seconds <= 0:
            raise ConfigError("refit_every must be >= 10 and idle_series_seconds > 0")


@dataclass
class _Episode:
    first_i: int                     # judged-iteration index of the first and last alarm
    last_i: int
    onset_ns: int
    last_ns: int
    alarms: int = 0
    actual_ns: float = 0.0           # sums over the alarmed iterations
    predicted_ns: float = 0.0
    peak_ma: float = 0.0
    recent: deque = field(default_factory=deque)   # (end ns, actual, predicted) of the alarms in its last
                                                   # recent_seconds


@dataclass
class _Series:
    """One process's anchored iterations: its model once fitted, its warm-up rows before, its episodes."""
    key: tuple
    rank: int
    anchor: str
    decode_only: bool
    model: Sentinel | None = None
    warm_x: list = field(default_factory=list)
    warm_y: list = field(default_factory=list)
    judged: int = 0
    last_end_ns: int = 0
    episodes: deque = field(default_factory=lambda: deque(maxlen=64))
    trace: list | None = None        # (end_ns, alarm) per judged iteration, when the detector traces (benches)


class SentinelDetector:
    """Stateful (one instance per collector, as base.py allows; a collector restart fits anew): per process (and
    anchor), the Iteration rows since the last pass are judged in order by that process's model. Rows without
    a workload (phase "": no reader ran) are left out. A serving engine (its rows have prefill / decode / mixed
    phases) is judged on its decode iterations, fitted on its first `fit_iterations` of them; a training
    process on every step, fitted on its first `fit_iterations_training` (their normal behaviour is assumed
    then: LatencyPrism's phase I), each with its own window and UCL floor. Then every iteration is one update
    (one LightGBM prediction, ~50 µs), refits as the model says. Consecutive alarms (gaps up to
    merge_gap_iterations) are an episode; an episode of >= min_alarms over >= min_episode_seconds is a
    `slowdown` finding, severity = actual / predicted latency over the alarmed iterations (the step-time ratio
    against the workload's own baseline), evidence: the alarmed iterations, the UCL, the model's fit (R², MAPE).
    A serving process of no rank is the suspect ("node:pid"); the ranks of a training job make one finding on
    the job, without a suspect (see _job_findings). A window that reaches back before what a process has judged
    (diagnose --since) reports the episodes kept (the last 64 per process) that overlap it. trace=True keeps
    every judged iteration's verdict (bench/sentinel.py --iterations scores them)."""

    def __init__(self, trace: bool = False) -> None:
        self.series: dict[tuple, _Series] = {}
        self._lock = threading.Lock()
        self.trace = trace   # keep every judged iteration's verdict per process (bench/sentinel.py scores them)

    def detect(self, reader, window: Window, cfg: SentinelDetectorConfig) -> list[Finding]:
        with self._lock:
            return self._detect(reader, window, cfg)

    def _detect(self, reader, window: Window, cfg: SentinelDetectorConfig) -> list[Finding]:
        if getattr(reader, "iterations", None) is None:   # a reader of no Iteration rows (the simulator's)
            return []
        job = (getattr(reader, "path", ""), window.job_key)   # one store's job (tests run several collectors)
        mine = [s for s in self.series.values() if s.key[0] == job]
        low = min((s.last_end_ns for s in mine), default=0) if mine else 0
        rows = reader.iterations(window.job_key, since_ns=max(window.since_ns, low) if low else window.since_ns,
                                 until_ns=window.until_ns)
        by: dict[tuple, list[dict]] = {}
        for r in rows:   # an iteration with no workload (phase "": no feature reader ran, e.g. vLLM's front end
            if r["phase"]:   # waiting for its engine-core process) gives a workload-aware baseline nothing
                by.setdefault((job, r["node_id"], r["pid"], r["start_ticks"], r["anchor"]), []).append(r)
        for key, rs in by.items():
            s = self.series.get(key)
            if s is None:
                s = self.series[key] = _Series(key, rs[0]["rank"], rs[0]["anchor"],
                                               any(r["phase"] in ("prefill", "decode", "mixed") for r in rs),
                                               trace=[] if self.trace else None)
            self._judge(s, [r for r in rs if r["end_ns"] > s.last_end_ns], cfg)
        idle = window.until_ns - int(cfg.idle_series_seconds * 1e9)
        for key in [k for k, s in self.series.items() if k[0] == job and s.last_end_ns < idle]:
            del self.series[key]
        series = [s for s in self.series.values() if s.key[0] == job]
        out = [f for s in series if s.rank < 0 for f in self._findings(s, window, cfg)]
        return out + self._job_findings([s for s in series if s.rank >= 0], window, cfg)

    def _job_findings(self, series: list[_Series], window: Window, cfg: SentinelDetectorConfig) -> list[Finding]:
        """The ranks of one job: a synchronous job's ranks all take as long as its slowest (each waits for the
        others at its collectives), so one slow rank makes every rank alarm. Their overlapping episodes are one
        finding on the job, with no suspect (who is to blame is the other detectors' to say: irregularity,
        lateness); the evidence lists each alarmed rank's ratio."""
        eps = sorted(((ep, s) for s in series for ep in s.episodes
                      if ep.alarms >= cfg.min_alarms and ep.last_ns - ep.onset_ns >= cfg.min_episode_seconds * 1e9
                      and ep.last_ns >= window.since_ns and ep.onset_ns <= window.until_ns),
                     key=lambda e: e[0].onset_ns)
        groups: list[list] = []
        for ep, s in eps:
            if groups and ep.onset_ns <= max(e.last_ns for e, _ in groups[-1]):
                groups[-1].append((ep, s))
            else:
                groups.append([(ep, s)])
        out = []
        for g in groups:
            onset, last = min(e.onset_ns for e, _ in g), max(e.last_ns for e, _ in g)
            alarms = sum(e.alarms for e, _ in g)
            sev = sum(e.actual_ns for e, _ in g) / sum(e.predicted_ns for e, _ in g)
            ranks = {str(s.rank): round(e.actual_ns / e.predicted_ns, 4) for e, s in g}
            ongoing = any(s.judged - e.last_i <= cfg.merge_gap_iterations for e, s in g)
            m = g[0][1].model
            out.append(Finding(
                kind="slowdown", onset_ns=onset, last_ns=last, severity=round(sev, 4),
                summary=(f"The job's steps take {sev:.2f}x what their workload predicts on {len(ranks)} of "
                         f"{len(series)} ranks{'' if ongoing else ' (over)'}: slower than its own workload-aware "
                         f"baseline, not busier."),
                evidence={"ranks": ranks, "alarmed_iterations": alarms, "ongoing": ongoing,
                          "anchor": g[0][1].anchor, "ucl": round(m.ucl, 4) if m else None,
                          "fit_r2": round(m.fit_r2, 4) if m else None,
                          "fit_mape": round(m.fit_mape, 4) if m else None, "judged": "every step"}))
        return out

    def _judge(self, s: _Series, rows: list[dict], cfg: SentinelDetectorConfig) -> None:
        if not rows:
            return
        X = features([iteration_row(r) for r in rows])
        y = np.array([r["end_ns"] - r["start_ns"] for r in rows], dtype=np.float64)
        judged = X[:, RAW.index("mode")] == 2 if s.decode_only else np.ones(len(rows), dtype=bool)
        recent_ns = int(cfg.recent_seconds * 1e9)
        for i in np.flatnonzero(judged & (y > 0)):
            r = rows[i]
            if s.model is None:
                s.warm_x.append(X[i])
                s.warm_y.append(y[i])
                if len(s.warm_y) >= (cfg.fit_iterations if s.decode_only else cfg.fit_iterations_training):
                    floor = cfg.min_ucl if s.decode_only else cfg.min_ucl_training
                    w = cfg.window if s.decode_only else cfg.window_training
                    s.model = Sentinel(SentinelConfig(window=w, min_ucl=floor, tau_max=cfg.tau_max,
                                                      refit_every=cfg.refit_every, decode_only=s.decode_only))
                    s.model.fit(np.asarray(s.warm_x), np.asarray(s.warm_y))
                    s.warm_x, s.warm_y = [], []
                continue
            s.judged += 1
            alarm, pred, ma = s.model.update(X[i], float(y[i]))
            if s.trace is not None:
                s.trace.append((r["end_ns"], bool(alarm)))
            if not alarm:
                continue
            ep = s.episodes[-1] if s.episodes else None
            if ep is None or s.judged - ep.last_i > cfg.merge_gap_iterations + 1:
                ep = _Episode(s.judged, s.judged, r["start_ns"], r["end_ns"])
                s.episodes.append(ep)
            ep.last_i, ep.last_ns = s.judged, r["end_ns"]
            ep.alarms += 1
            ep.actual_ns += y[i]
            ep.predicted_ns += max(pred, 1.0)
            ep.peak_ma = max(ep.peak_ma, ma)
            ep.recent.append((r["end_ns"], y[i], max(pred, 1.0)))
            while ep.recent[0][0] < r["end_ns"] - recent_ns:
                ep.recent.popleft()
        s.last_end_ns = max(s.last_end_ns, rows[-1]["end_ns"])

    def _findings(self, s: _Series, window: Window, cfg: SentinelDetectorConfig) -> list[Finding]:
        out = []
        node, pid = s.key[1], s.key[2]
        for ep in s.episodes:
            if (ep.alarms < cfg.min_alarms or ep.last_ns - ep.onset_ns < cfg.min_episode_seconds * 1e9
                    or ep.last_ns < window.since_ns or ep.onset_ns > window.until_ns):
                continue
            sev = ep.actual_ns / ep.predicted_ns
            recent = sum(x[1] for x in ep.recent) / sum(x[2] for x in ep.recent) if ep.recent else sev
            ongoing = s.judged - ep.last_i <= cfg.merge_gap_iterations
            who = f"rank {s.rank}" if s.rank >= 0 else f"process {pid} on {node}"
            what = "batches" if s.decode_only else "steps"
            suspect = (Suspect("rank", str(s.rank), 1.0, "", {"node": node, "pid": pid}) if s.rank >= 0 else
                       Suspect("process", f"{node}:{pid}", 1.0, "", {"node": node, "pid": pid}))
            m = s.model
            out.append(Finding(
                kind="slowdown", onset_ns=ep.onset_ns, last_ns=ep.last_ns, severity=round(sev, 4),
                summary=(f"The {what} of {who} ({s.anchor}) take {sev:.2f}x what their workload predicts over "
                         f"{ep.alarms} alarmed {what}{'' if ongoing else ' (over)'}: slower than its own "
                         f"workload-aware baseline, not busier."),
                suspects=(suspect,),
                evidence={"anchor": s.anchor, "alarmed_iterations": ep.alarms, "ongoing": ongoing,
                          "iterations_span": ep.last_i - ep.first_i + 1,
                          "actual_mean_ns": int(ep.actual_ns / ep.alarms),
                          "predicted_mean_ns": int(ep.predicted_ns / ep.alarms), "peak_ppe_ma": round(ep.peak_ma, 4),
                          "recent_severity": round(recent, 4),
                          "ucl": round(m.ucl, 4) if m else None, "fit_r2": round(m.fit_r2, 4) if m else None,
                          "fit_mape": round(m.fit_mape, 4) if m else None, "refits": m.refits if m else 0,
                          "judged": "decode iterations" if s.decode_only else "every iteration"}))
        return out


_DETECTOR = SentinelDetector()

SPEC = DetectorSpec(
    name="sentinel",
    description="an iteration (a serving engine's batch, a training step) slower than its workload predicts: "
                "LightGBM baseline on the anchored iterations' workload, moving-average PPE against a UCL",
    kinds=("slowdown",),
    config_class=SentinelDetectorConfig,
    detect=_DETECTOR.detect,
)
