"""The agent's overhead governor (agent/governor.py): per-source CPU and the agent's, intervals stretched over the
budget and recovered under it, a mode switch resetting them, ungoverned sources left alone; and in a real Runner,
a source that would burn a core in deep mode held near the budget."""

from __future__ import annotations

import time

from steplens.agent.governor import Governor, GovernorSettings
from steplens.agent.records import Mode
from steplens.agent.runner import BatchPolicy, Runner
from steplens.agent.sources.base import Availability, HostContext, Source, SourceConfig


def _gov(**kw) -> Governor:
    g = Governor(GovernorSettings(**kw), cpus=2)
    g.register("pystacks", True)
    g.register("sched", False)
    g.tick(now=0.0, process_cpu=0.0)
    return g


def test_over_the_budget_governed_sources_slow_down_in_proportion():
    g = _gov(deep_budget_fraction=0.03)
    g.set_deep(True)   # budget 0.06 cores on 2 CPUs
    g.add_cpu("pystacks", 0.18)
    g.add_cpu("sched", 0.01)
    g.tick(now=1.0, process_cpu=0.20)
    f = g.figures()
    assert f["budget_cores"] == 0.06 and abs(f["agent_cores"] - 0.2) < 1e-9
    assert abs(f["sources"]["pystacks"]["cores"] - 0.18) < 1e-9
    # room for governed work: 0.06 - (0.20 - 0.18) = 0.04 of 0.18 used -> 0.25x at most per period
    assert f["sources"]["pystacks"]["scale"] == 0.25 and f["sources"]["sched"]["scale"] == 1.0
    g.add_cpu("pystacks", 0.05)
    g.tick(now=2.0, process_cpu=0.27)   # 0.07 > 0.06: room 0.04 of 0.05 -> x0.8
    assert abs(g.scale("pystacks") - 0.2) < 1e-9
    g.add_cpu("pystacks", 0.02)
    g.tick(now=3.0, process_cpu=0.30)   # 0.03 < 0.7 x budget: recover x1.25
    assert abs(g.scale("pystacks") - 0.25) < 1e-9 and g.over_periods == 2


def test_mode_switch_resets_and_sentinel_is_ungoverned_by_default():
    g = _gov()
    g.set_deep(True)
    g.add_cpu("pystacks", 0.5)
    g.tick(now=1.0, process_cpu=0.5)
    assert g.scale("pystacks") < 1
    left = g.scale("pystacks")
    g.set_deep(False)
    assert g.scale("pystacks") == 1.0 and g.budget_cores == 0.0
    g.add_cpu("pystacks", 0.9)
    g.tick(now=2.0, process_cpu=1.4)
    assert g.scale("pystacks") == 1.0          # budget 0: not governed
    g.set_deep(True)                           # the next deep window starts where the last one ended
    assert g.scale("pystacks") == left and g.scale("sched") == 1.0
    g.set_deep(False)
    off = _gov(enabled=False)
    off.set_deep(True)
    off.add_cpu("pystacks", 0.9)
    off.tick(now=1.0, process_cpu=0.9)
    assert off.scale("pystacks") == 1.0 and off.figures()["sources"]["pystacks"]["cores"] > 0.8


class _Burner(Source):
    name = "burner"

    @classmethod
    def probe(cls, ctx):
        return Availability.yes("test")

    def start(self) -> None:
        pass

    def step(self) -> list:
        end = time.thread_time() + 0.002
        while time.thread_time() < end:
            pass
        return []

    def stop(self) -> None:
        pass


class _Spool:
    def append(self, *a, **k):
        pass

    def count_lost(self, n):
        pass


def _deep_steps(tmp_path, cfg: SourceConfig, gov: Governor):
    """A real Runner with the burner: into deep mode, 3 s to settle (12 governor periods), then its steps per
    second over 2 s and its state."""
    r = Runner(HostContext("n0", state_dir=str(tmp_path)), {"burner": (_Burner, cfg)}, lambda items: b"", _Spool(),
               BatchPolicy(), governor=gov)
    r.start()
    try:
        time.sleep(0.3)
        r.set_mode(Mode.DEEP)
        time.sleep(3.0)
        s0, t0 = r.states["burner"].steps, time.monotonic()
        time.sleep(2.0)
        return (r.states["burner"].steps - s0) / (time.monotonic() - t0), r.states["burner"]
    finally:
        r.stop()


def test_a_runner_holds_a_source_that_would_burn_a_core_near_the_deep_budget(tmp_path):
    rate, st = _deep_steps(tmp_path, SourceConfig(interval_seconds=1.0, deep_interval_seconds=0.001),
                           Governor(GovernorSettings(deep_budget_fraction=0.05, period_seconds=0.25), cpus=2))
    # unchecked it would step ~330-500 times a second (2 ms of CPU each): a core; held near 0.1 cores = ~50/s
    assert st.rate_scale < 0.3 and rate < 120, (rate, st.rate_scale, st.cpu_cores)
    assert st.cpu_cores < 0.25, st.cpu_cores


def test_deep_mode_never_reads_a_source_less_often_than_sentinel_mode(tmp_path):
    """A budget too small for even the sentinel rate (2 ms steps at 20 a second: 0.04 cores against 0.01) stretches
    the deep interval only as far as the sentinel one: a dive ranks causes by the host's counters, and one read per
    5 s (what the inference bed's 1 % budget made of them) is a single interval in a 6 s window."""
    rate, st = _deep_steps(tmp_path, SourceConfig(interval_seconds=0.05, deep_interval_seconds=0.001),
                           Governor(GovernorSettings(deep_budget_fraction=0.005, period_seconds=0.25, min_scale=0.001),
                                    cpus=2))
    # the budget alone would allow ~5 steps a second (0.01 cores / 2 ms); the sentinel interval is 20 a second
    assert st.rate_scale < 0.05 and 9 < rate < 40, (rate, st.rate_scale, st.cpu_cores)
