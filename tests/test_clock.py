"""The clock model against synthetic exchanges with a known offset, drift and asymmetric delays."""

import random

from steplens.collector.ingest.clock import ClockModel


def _exchanges(model, offset_ns, drift_ppm, n, spacing_ns, seed, base_delay=100_000, jitter=2_000_000):
    rng = random.Random(seed)
    t_agent = 1_000_000_000_000
    for _ in range(n):
        t_agent += spacing_ns
        true_off = offset_ns + t_agent * drift_ppm * 1e-6
        up = base_delay + rng.expovariate(1 / jitter) * (rng.random() < 0.7)
        down = base_delay + rng.expovariate(1 / jitter) * (rng.random() < 0.7)
        t1 = int(t_agent + true_off - up)      # collector sends
        t2 = t_agent                           # agent receives
        t3 = t2 + 30_000                       # agent replies
        t4 = int(t3 + true_off + down)         # collector receives
        model.add(t1, t2, t3, t4)
    return t_agent


def test_offset_recovered_within_stated_uncertainty():
    m = ClockModel()
    _exchanges(m, offset_ns=-1_234_567_890_123, drift_ppm=0.0, n=40, spacing_ns=1_000_000_000, seed=1)
    est = m.estimate
    err = abs(est.offset_ns - (-1_234_567_890_123))
    assert err <= est.uncertainty_ns
    assert err < 20_000  # symmetric base delay: min-RTT filtering gets close
    assert est.best_rtt_ns >= 200_000


def test_drift_is_fitted_over_long_windows():
    m = ClockModel(min_span_for_drift_s=60)
    t_end = _exchanges(m, offset_ns=5_000_000_000, drift_ppm=25.0, n=200, spacing_ns=2_000_000_000, seed=2)
    est = m.estimate
    assert abs(est.drift_ppm - 25.0) < 1.0
    true_at_end = 5_000_000_000 + t_end * 25e-6
    assert abs(est.to_cluster(t_end) - (t_end + true_at_end)) < 50_000


def test_impossible_exchanges_are_ignored():
    m = ClockModel()
    assert not m.add(100, 50, 40, 200)     # agent replied before it received
    assert not m.add(100, 50, 60, 90)      # collector received before it sent
    assert m.estimate is None
    assert m.add(100, 1000, 1010, 300)
    assert m.estimate is not None


def test_to_agent_inverts_to_cluster():
    m = ClockModel(min_span_for_drift_s=1)
    _exchanges(m, offset_ns=777_000_000, drift_ppm=-40.0, n=50, spacing_ns=1_000_000_000, seed=3)
    est = m.estimate
    for mono in (10**12, 2 * 10**12, 5 * 10**12):
        assert abs(est.to_agent(est.to_cluster(mono)) - mono) <= 2
