"""Step division of a flow time series: where one training step's traffic ends and the next one's begins.

LLMPrism (ALGORITHMS.md §1.3) splits the flows of an endpoint pair into steps by Bayesian online change-point
detection over the intervals between consecutive flow starts, Δt: inside a step the flows follow each other
closely, between steps there is the step's compute. Two interchangeable segmenters behind one interface
(`boundaries(starts) -> indices i where flow i opens a new step`), so they can be compared on the same data:

  GapSplit  the cheap one the digest recommends for this strongly bimodal data: the natural break of sorted
            log Δt, at its largest jump between consecutive values (each side holding >= min_side of them);
            Δt above it are step boundaries. Not Otsu's variance split: inside a step the intervals may spread
            over two decades themselves (a gloo all-reduce split into bursts 0.1-20 ms apart, steps 70 ms
            apart), and Otsu then cuts inside the step. A series whose largest jump is under a factor
            `min_gap_ratio`, or whose two sides' means are not `min_ratio` apart (one regime: evenly spaced
            sends, Poisson arrivals), has no boundary.
  Bocd      the reference: Adams & MacKay's run-length recursion with a Normal-Gamma model (Student-t
            predictive) on log Δt and a constant hazard 1 / (expected flows per step).
            Erratum handled: in the textbook recursion the change hypothesis is scored with the predictive of
            the run it ends, so the posterior P(r_t = 0 | x_1:t) is identically the hazard H and the paper's
            "P(r_t = 0) > 0.95" never fires. Here the change hypothesis scores x_t under the prior predictive
            (x_t opens a new regime: Fearnhead & Liu's form), so an interval far outside the current run's
            predictive but plausible a priori takes the posterior mass; the paper's 0.95 threshold then means
            what it says. A step boundary is one long interval between two runs of short ones, not a lasting
            regime change, so after a declared boundary the recursion restarts from the prior without that
            interval (it belongs to neither step). The prior is fitted to the series (empirical Bayes: its
            median and spread), so the model needs no unit.
Cost: GapSplit O(n log n) in numpy (~30 µs for 100 intervals); Bocd O(n x max_run) numpy work, ~30 µs per
interval at max_run 64: the reference, used where n is small and to check GapSplit (the eval prints their
agreement), not over a cluster's million flows.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import gammaln

FLOOR_NS = 1_000  # intervals are clipped at 1 µs before the log (two flows starting together: Δt = 0)
# intervals up to 200 µs are flows that start together (a ring's hops, both directions of an exchange, give or
# take the capture's timestamp error): never a boundary, and left out of the fit, else "together" vs "one after
# the other" would be the two classes found
TOGETHER_LOG = math.log(200_000)


def log_intervals(starts) -> np.ndarray:
    s = np.sort(np.asarray(starts, dtype=np.float64))
    return np.log(np.maximum(np.diff(s), FLOOR_NS))


class GapSplit:
    """The natural break of log Δt: short (inside a step) and long (between steps) intervals, split at the
    largest jump between consecutive sorted values."""

    def __init__(self, min_ratio: float = 4.0, min_gap_ratio: float = 2.0, min_side: float = 0.05,
                 min_intervals: int = 3) -> None:
        self.min_log_gap = math.log(min_ratio)
        self.min_jump = math.log(min_gap_ratio)
        self.min_side = min_side
        self.min_intervals = min_intervals

    def threshold(self, x: np.ndarray) -> float | None:
        """The log Δt above which an interval is a step boundary; None: one regime only."""
        v = np.sort(x[x > TOGETHER_LOG])
        n = len(v)
        if n < self.min_intervals:
            return None
        lo = max(1, int(self.min_side * n))          # each side keeps >= min_side of the intervals, so a tail's
        jumps = np.diff(v)[lo - 1:n - lo]            # stray value is no regime of its own
        if not len(jumps):
            return None
        i = int(np.argmax(jumps)) + lo - 1
        if jumps[i - lo + 1] < self.min_jump or float(v[i + 1:].mean() - v[:i + 1].mean()) < self.min_log_gap:
            return None
        return float((v[i] + v[i + 1]) / 2)

    def boundaries(self, starts) -> list[int]:
        x = log_intervals(starts)
        t = self.threshold(x)
        if t is None:
            return []
        return [int(i) + 1 for i in np.flatnonzero(x > t)]


class Bocd:
    """Bayesian online change-point detection on log Δt (see the module docstring for the erratum)."""

    def __init__(self, flows_per_step: float = 20.0, threshold: float = 0.95, max_run: int = 64,
                 min_ratio: float = 4.0) -> None:
        self.hazard = 1.0 / max(2.0, flows_per_step)
        self.threshold = threshold
        self.max_run = max_run
        self.min_log_gap = math.log(min_ratio)

    @staticmethod
    def _student(x: float, mu, kappa, alpha, beta):
        scale2 = beta * (kappa + 1.0) / (alpha * kappa)
        df = 2.0 * alpha
        z = (x - mu) ** 2 / (df * scale2)
        return np.exp(gammaln((df + 1) / 2) - gammaln(df / 2) - 0.5 * np.log(df * math.pi * scale2)
                      - (df + 1) / 2 * np.log1p(z))

    def boundaries(self, starts) -> list[int]:
        x = log_intervals(starts)
        n = len(x)
        if n < 3:
            return []
        # empirical-Bayes priors: a run's on the series' typical regime (median, robust spread: the few
        # between-step intervals do not widen it); the change hypothesis's wide enough that a between-step
        # interval is plausible a priori (the whole series' spread)
        fit = x[x > TOGETHER_LOG]
        if len(fit) < 3:
            return []
        mu0 = float(np.median(fit))
        mad = 1.4826 * float(np.median(np.abs(fit - mu0)))
        k0, a0, b0 = 1.0, 1.0, max(mad, 0.05) ** 2
        wide = (np.array([mu0]), np.array([0.1]), np.array([1.0]), np.array([max(float(np.std(fit)), mad, 0.05) ** 2]))
        H = self.hazard
        out = []

        def fresh():
            return (np.array([1.0]), np.array([mu0]), np.array([k0]), np.array([a0]), np.array([b0]))
        p, mu, kappa, alpha, beta = fresh()
        for t in range(n):
            xt = x[t]
            if xt <= TOGETHER_LOG:
                continue
            pred = self._student(xt, mu, kappa, alpha, beta)
            prior = float(self._student(xt, *wide)[0])
            grow = p * (1.0 - H) * pred
            change = H * prior * p.sum()
            total = grow.sum() + change
            if total <= 0 or not math.isfinite(total):
                p, mu, kappa, alpha, beta = fresh()
                continue
            cp = change / total
            # a boundary is a long interval: a short one that surprises a run (the first few of a step) is not
            if cp > self.threshold and xt > float(np.sum(p * mu) / p.sum()):
                out.append(t + 1)
                p, mu, kappa, alpha, beta = fresh()
                continue
            # update every run with x_t, and open run 0 (prior + x_t)
            p = np.concatenate(([change], grow)) / total
            mu_all = np.concatenate(([mu0], mu))
            k_all = np.concatenate(([k0], kappa))
            a_all = np.concatenate(([a0], alpha))
            b_all = np.concatenate(([b0], beta))
            beta = b_all + k_all * (xt - mu_all) ** 2 / (2.0 * (k_all + 1.0))
            mu = (k_all * mu_all + xt) / (k_all + 1.0)
            kappa = k_all + 1.0
            alpha = a_all + 0.5
            if len(p) > self.max_run:  # the longest runs merged into the last kept one
                p = np.concatenate((p[:self.max_run - 1], [p[self.max_run - 1:].sum()]))
                mu, kappa, alpha, beta = (a[:self.max_run] for a in (mu, kappa, alpha, beta))
        return out


def segments(starts_sorted, cuts: list[int]) -> list[tuple[int, int]]:
    """[lo, hi) index ranges of the steps, given the boundary indices of a sorted series."""
    edges = [0] + list(cuts) + [len(starts_sorted)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


SEGMENTERS = {"gap": GapSplit, "bocd": Bocd}
