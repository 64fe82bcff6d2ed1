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
             model's error on data it did not see, not its training fit.
  Drift      a workload outside what the model was trained on (a feature beyond the training range by
             `drift_margin`) is not judged; `refit_every` normal iterations later the model is refit on the
             newest `max_train` normal ones (retrained as the workload drifts; alarmed iterations never feed it).
Cost: fit ~0.2 s for 5,000 rows (5 folds + final); update is one LightGBM prediction (~50 µs) per iteration,
batched in `score`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

RAW = ("batch_size", "prefill_requests", "prefill_tokens", "decode_requests", "kv_tokens", "avg_input_length",
       "avg_output_length", "mode")


def features(rows: list[dict]) -> np.ndarray:
    """The model's feature matrix from iteration rows (keys of RAW; missing ones are 0)."""
    raw = np.array([[float(r.get(k, 0.0)) for k in RAW] for r in rows], dtype=np.float64).reshape(-1, len(RAW))
    B, pre_tok, dec, kv, l_in, l_out, mode = (raw[:, i] for i in (0, 2, 3, 4, 5, 6, 7))
    decode = (mode == 2).astype(np.float64)
    real_kv = l_in + l_out
    workload_kv = decode * B * real_kv
    attn_quad = (1 - decode) * B * real_kv ** 2
    compute_tokens = (1 - decode) * pre_tok
    return np.column_stack([raw, real_kv, workload_kv, attn_quad, compute_tokens, dec * kv])


@dataclass
class SentinelConfig:
    window: int = 10              # W: the moving average of PPE
    k: float = 3.0                # UCL = min(mu + k sigma, tau_max)
    tau_max: float = 0.5
    ucl_quantile: float = 0.999   # ... and at least this quantile of the training moving average (heavy tails)
    min_ucl: float = 0.15         # ... and at least this: a shared host's own jitter holds a 10-batch average 5-10 %
                                  # over its baseline for a moment now and then (LatencyPrism's fixed window: 0.15)
    decode_only: bool = True      # inference: judge decode iterations only (prefill is cache-layout dependent)
    drift_margin: float = 0.10    # a feature beyond the training range by this share is not judged (drift)
    refit_every: int = 500        # normal iterations between refits
    max_train: int = 20000        # newest normal iterations a refit uses
    n_estimators: int = 200
    learning_rate: float = 0.1
    num_leaves: int = 15
    seed: int = 0


class Sentinel:
    def __init__(self, cfg: SentinelConfig | None = None) -> None:
        self.cfg = cfg or SentinelConfig()
        self.model = None
        self.ucl = 0.0
        self.mu = self.sigma = 0.0
        self.lo = self.hi = None
        self.fit_r2 = self.fit_mape = float("nan")
        self._ppe: deque = deque(maxlen=self.cfg.window)
        self._normal_x: deque = deque(maxlen=self.cfg.max_train)
        self._normal_y: deque = deque(maxlen=self.cfg.max_train)
        self._since_fit = 0
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
        self._since_fit = 0
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
            return False, float("nan"), float("nan")
        p = max(float(self.model.predict(x.reshape(1, -1))[0]), 0.0)
        self._ppe.append(max(0.0, (y - p) / (y + 1e-9)))
        m = float(np.mean(self._ppe))
        alarm = len(self._ppe) == self.cfg.window and m > self.ucl
        if not alarm:
            self._normal_x.append(x)
            self._normal_y.append(y)
            self._since_fit += 1
            if self._since_fit >= self.cfg.refit_every:
                self.fit(np.asarray(self._normal_x), np.asarray(self._normal_y), keep=False)
                self.refits += 1
        return alarm, p, m
