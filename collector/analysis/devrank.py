"""Device ranking across iterations (Holmes §3.7, App. D): MAP with the topology decay, erratum fixed.

Per-iteration verdicts are noisy and cannot separate concurrent faults, so the evidence of a window's
iterations is accumulated per device d (GPU = rank, NIC link, switch link, switch, host) and ranked by the MAP
numerator (the denominator is the same for every device):

    I(d) = sum over causes x that use d of R(x) * H(d)  +  alpha * p(d)

  R(x)  the irregularity rate of a cause: the Pearson correlation of its series (a rank's lateness per step,
        a communicator's transfer time per step) with the job's step time over the window, clipped to [0, 1],
        NaN (a constant series) -> 0;
  H(d)  the topology decay for a network device with C(d) NICs below it: ln(1 + C) / (C ln 2) (monotone,
        H(1) = 1; the paper's ln(C + eps - 1) / C is negative at C = 1 and non-monotone: ALGORITHMS.md §3.7
        erratum); links to a NIC and GPUs/ranks have H = 1. Without it a spine above two bad leaves collects
        their sum and wins;
  p(d)  the prior: the device type's share of incidents (App. A census: GPU 58.7 %, NIC 18.3 %, link 9.5 %,
        switch 4.8 %) divided by the number of devices of that type in the job; alpha scales it (default 1:
        a tie-break, not evidence).
A network cause spreads R(x) over the devices on its paths (irregularity._devices: the ring's hops, every
equal-cost path weighted 1/#paths). Pure: rank(causes, ...) -> [(kind, id, score)], best first.
"""

from __future__ import annotations

import math

PRIOR_SHARE = {"rank": 0.587, "gpu": 0.587, "node": 0.032, "nic": 0.183, "link": 0.095, "switch": 0.048}


def pearson(x: list[float], y: list[float]) -> float:
    """Pearson correlation clipped to [0, 1]; 0 for a constant series or fewer than 3 points."""
    n = min(len(x), len(y))
    if n < 3:
        return 0.0
    mx, my = sum(x[:n]) / n, sum(y[:n]) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x[:n])
    syy = sum((b - my) ** 2 for b in y[:n])
    if sxx <= 0 or syy <= 0:
        return 0.0
    return max(0.0, min(1.0, sxy / math.sqrt(sxx * syy)))


def decay(kind: str, dev: str, topo) -> float:
    """H(d): 1 for ranks, nodes and NIC links; ln(1 + C) / (C ln 2) for a switch or switch link with C NICs
    below it (C from the topology; 1 without one)."""
    if topo is None or kind in ("rank", "gpu", "node"):
        return 1.0
    if kind == "switch" and dev in topo.switches:
        c = max(1, topo.downstream_nics(dev))
    elif kind == "link" and dev in getattr(topo, "links", {}):
        ln = topo.links[dev]
        c = max(1, min(topo.downstream_nics(ln.a) if ln.a in topo.switches else 1,
                       topo.downstream_nics(ln.b) if ln.b in topo.switches else 1))
    else:
        return 1.0
    return math.log(1 + c) / (c * math.log(2))


def rank(causes: list[tuple[float, dict[tuple[str, str], float]]], topo=None, counts: dict[str, int] | None = None,
         alpha: float = 1.0) -> list[tuple[str, str, float]]:
    """causes: (R(x), {device: weight}) per localized cause (weight: 1 for the rank of a compute cause,
    1/#paths for a network device); counts: devices per kind in the job (for p(d)). Returns (kind, id, I(d))
    for every device some cause uses, best first."""
    acc: dict[tuple[str, str], float] = {}
    for r, devs in causes:
        if r <= 0:
            continue
        for d, w in devs.items():
            acc[d] = acc.get(d, 0.0) + r * w * decay(d[0], d[1], topo)
    out = []
    for (kind, dev), v in acc.items():
        n = max(1, (counts or {}).get(kind, 1))
        out.append((kind, dev, round(v + alpha * PRIOR_SHARE.get(kind, 0.05) / n, 6)))
    out.sort(key=lambda t: (-t[2], t[0], t[1]))
    return out
