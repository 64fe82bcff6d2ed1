"""The overhead governor: what each source costs and what the agent costs in all, kept under a CPU budget.

Measured every `period` seconds: each source's CPU time (its thread's CPU clock, read once per step, so what the
source itself burns), and the agent process's whole CPU time (every thread: sources, batcher, transport, gRPC).
On a host whose cores the job keeps busy, the agent's CPU is time the job's ranks do not get, so the budget is a
share of the host's CPUs: `budget_fraction` in sentinel mode (0 by default: not governed), `deep_budget_fraction`
while deep mode is on (1 % of the host: the deep-dive goal is <= 3 % of step time, and a job whose threads fill
the cores it runs on loses more than the agent's share: on the inference bed 3 % of the host's CPUs cost a vLLM
engine 5-11 % of its batch time, 1 % cost it ~1.8 %, bench/README.md).
Over the budget, the sources that can wait (governed: pystacks, host, procs, gpu, tcpinfo, ...; never the ones
that drain kernel buffers or rings that would wrap, nor the iteration rings) have their intervals stretched in
proportion (scale < 1: a 1 kHz stack sampler at scale 0.3 samples at 300 Hz), at most 4x per period, down to
`min_scale`, and in deep mode never past the source's sentinel interval (agent/runner.py: a dive ranks causes by
the host's counters, which the 1 % budget had stretched from 4 per second to one per 5 s, a single interval in a
6 s window); under 70 % of it the scales recover by 1.25x per period. A mode switch resets them (a new budget).
What it did is in the agent's status: per source its CPU (cores) and scale, the agent's CPU and its budget
(`steplens nodes`).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field


_PR_SET_NAME = 15


def name_native_thread(name: str) -> None:
    """Give the calling thread a kernel-visible name (/proc/PID/task/TID/comm, `top -H`, `ps -L`; 15 bytes), so an
    operator and bench/agent_footprint.py can tell which of the agent's threads costs what. Best effort."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


@dataclass
class GovernorSettings:
    enabled: bool = True
    budget_fraction: float = 0.0         # sentinel mode: the agent's CPU at most this share of the host's CPUs
                                         # (0: not governed; sentinel rates are the configured ones)
    deep_budget_fraction: float = 0.01   # deep mode (bench/README.md, inference/bed.py --dive-cost)
    period_seconds: float = 1.0
    min_scale: float = 0.05


@dataclass
class SourceCost:
    cpu_acc: float = 0.0     # step CPU seconds since the last tick
    cores: float = 0.0       # last period: CPU seconds per second
    scale: float = 1.0       # interval divisor (1: as configured)
    governed: bool = True


@dataclass
class Governor:
    settings: GovernorSettings = field(default_factory=GovernorSettings)
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)

    def __post_init__(self) -> None:
        self.costs: dict[str, SourceCost] = {}
        self.agent_cores = 0.0
        self.deep = False
        self.over_periods = 0
        self._lock = threading.Lock()
        self._last = (time.monotonic(), time.process_time())
        self._deep_scales: dict[str, float] = {}   # each source's scale when the last deep window ended

    def register(self, name: str, governed: bool) -> None:
        self.costs.setdefault(name, SourceCost(governed=governed))

    @property
    def budget_cores(self) -> float:
        s = self.settings
        return (s.deep_budget_fraction if self.deep else s.budget_fraction) * self.cpus

    def add_cpu(self, name: str, seconds: float) -> None:
        c = self.costs.get(name)
        if c is not None and seconds > 0:
            with self._lock:
                c.cpu_acc += seconds

    def scale(self, name: str) -> float:
        c = self.costs.get(name)
        return c.scale if c is not None and self.settings.enabled else 1.0

    def set_deep(self, deep: bool) -> None:
        """A mode switch: sentinel mode starts from the configured rates; deep mode from the scales the last deep
        window ended with (a new budget, but the same sources on the same processes: starting at 1 kHz, the
        sampler overshot the budget for the first 1-2 s of every 6 s window while the scale came down 4x a period)."""
        with self._lock:
            if deep != self.deep:
                if self.deep:
                    self._deep_scales = {n: c.scale for n, c in self.costs.items()}
                self.deep = deep
                for n, c in self.costs.items():
                    c.scale = self._deep_scales.get(n, 1.0) if deep and self.settings.enabled else 1.0

    def tick(self, now: float | None = None, process_cpu: float | None = None) -> None:
        """One period: the figures, then the scales."""
        now = time.monotonic() if now is None else now
        cpu = time.process_time() if process_cpu is None else process_cpu
        t0, c0 = self._last
        self._last = (now, cpu)
        dt = now - t0
        if dt <= 0:
            return
        s = self.settings
        with self._lock:
            self.agent_cores = max(0.0, (cpu - c0) / dt)
            for c in self.costs.values():
                c.cores, c.cpu_acc = c.cpu_acc / dt, 0.0
            budget = self.budget_cores
            if not s.enabled or budget <= 0:
                for c in self.costs.values():
                    c.scale = 1.0
                return
            governed = [c for c in self.costs.values() if c.governed and c.cores > 0]
            g_used = sum(c.cores for c in governed)
            if self.agent_cores > budget and g_used > 0:
                self.over_periods += 1
                room = max(budget - (self.agent_cores - g_used), 0.1 * budget)
                factor = max(0.25, min(1.0, room / g_used))
                for c in governed:
                    c.scale = max(s.min_scale, c.scale * factor)
            elif self.agent_cores < 0.7 * budget:
                for c in self.costs.values():
                    c.scale = min(1.0, c.scale * 1.25)

    def figures(self) -> dict:
        with self._lock:
            return {"agent_cores": self.agent_cores, "budget_cores": self.budget_cores, "deep": self.deep,
                    "over_periods": self.over_periods,
                    "sources": {n: {"cores": c.cores, "scale": c.scale, "governed": c.governed}
                                for n, c in self.costs.items()}}
