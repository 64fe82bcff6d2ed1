"""Per-agent clock model: maps an agent's CLOCK_MONOTONIC to cluster time, with a stated uncertainty.

Fed by NTP-style four-timestamp exchanges on the agent's stream: t1 (collector send), t2 (agent
receive), t3 (agent send), t4 (collector receive). For one exchange
    offset = ((t1 - t2) + (t4 - t3)) / 2      (cluster - agent)
    delay  = (t4 - t1) - (t3 - t2)
and the true offset lies within ±delay/2 of the estimate, however asymmetric the path.
Queueing only ever adds delay, so the exchanges with the smallest delay are the most trustworthy
(min-RTT filtering): the model keeps a window of exchanges, keeps those whose delay is within a
margin of the window's minimum, and fits offset + drift to them by least squares once the window
spans long enough to see drift. The stated uncertainty is half the best delay plus the fit's
residual spread.

Cluster time is the collector's CLOCK_MONOTONIC shifted by a fixed anchor to the Unix epoch taken
at collector start, so it never jumps when the collector's wall clock is stepped.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass


class ClusterClock:
    """The collector's notion of cluster time (ns since the Unix epoch, monotonic)."""

    def __init__(self) -> None:
        mono = time.monotonic_ns()
        self.anchor_ns = time.time_ns() - mono

    def now_ns(self) -> int:
        return time.monotonic_ns() + self.anchor_ns


@dataclass
class ClockEstimate:
    offset_ns: int          # cluster_ns - agent_mono_ns at ref_mono_ns
    drift_ppm: float        # d(offset)/d(agent time), parts per million
    ref_mono_ns: int
    uncertainty_ns: int
    best_rtt_ns: int
    samples: int

    def to_cluster(self, mono_ns: int) -> int:
        return mono_ns + self.offset_ns + int((mono_ns - self.ref_mono_ns) * self.drift_ppm * 1e-6)

    def to_agent(self, cluster_ns: int) -> int:
        d = self.drift_ppm * 1e-6
        return int(round(cluster_ns - self.offset_ns - d * (cluster_ns - self.offset_ns - self.ref_mono_ns) / (1 + d)))


class ClockModel:
    def __init__(self, window: int = 256, min_span_for_drift_s: float = 60.0, rtt_margin: float = 1.5,
                 rtt_margin_ns: int = 20_000) -> None:
        self._samples: collections.deque = collections.deque(maxlen=window)  # (t_mono_agent, offset, rtt)
        self._min_span_ns = int(min_span_for_drift_s * 1e9)
        self._margin = rtt_margin
        self._margin_ns = rtt_margin_ns
        self.estimate: ClockEstimate | None = None

    def add(self, t1: int, t2: int, t3: int, t4: int) -> bool:
        """Add one exchange; returns False (and ignores it) when its timestamps are impossible."""
        rtt = (t4 - t1) - (t3 - t2)
        if t4 < t1 or t3 < t2 or rtt < 0:
            return False
        offset2 = (t1 - t2) + (t4 - t3)  # twice the offset, kept integral
        mid_agent = (t2 + t3) // 2
        self._samples.append((mid_agent, offset2 / 2.0, rtt))
        self.estimate = self._fit()
        return True

    def _fit(self) -> ClockEstimate:
        samples = list(self._samples)
        best = min(s[2] for s in samples)
        limit = best * self._margin + self._margin_ns
        good = [s for s in samples if s[2] <= limit]
        span = good[-1][0] - good[0][0] if len(good) > 1 else 0
        if len(good) >= 4 and span >= self._min_span_ns:
            # weighted least squares, weight 1/rtt^2: the tighter the exchange, the more it counts
            ref = good[-1][0]
            w = [1.0 / max(1.0, float(s[2])) ** 2 for s in good]
            sw = sum(w)
            mx = sum(wi * (s[0] - ref) for wi, s in zip(w, good)) / sw
            my = sum(wi * s[1] for wi, s in zip(w, good)) / sw
            sxx = sum(wi * ((s[0] - ref) - mx) ** 2 for wi, s in zip(w, good))
            sxy = sum(wi * ((s[0] - ref) - mx) * (s[1] - my) for wi, s in zip(w, good))
            slope = sxy / sxx if sxx > 0 else 0.0
            intercept = my - slope * mx
            resid = [s[1] - (intercept + slope * (s[0] - ref)) for s in good]
            spread = math.sqrt(sum(wi * r * r for wi, r in zip(w, resid)) / sw)
            return ClockEstimate(int(round(intercept)), slope * 1e6, ref, int(best / 2 + spread), best, len(good))
        # not enough span to see drift: the offset of the tightest exchanges
        tight = sorted(good, key=lambda s: s[2])[:max(1, min(5, len(good)))]
        off = sorted(s[1] for s in tight)[len(tight) // 2]
        spread = max(abs(s[1] - off) for s in tight)
        ref = max(s[0] for s in tight)
        return ClockEstimate(int(round(off)), 0.0, ref, int(best / 2 + spread), best, len(good))
