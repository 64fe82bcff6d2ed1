"""The analysis engine's fetch cache (collector/control/fetch.py, DetailCache): a window asked again is answered
from what was fetched, the agent is asked only for what it has not answered, on its own clock so nothing at the
seam is lost or doubled; the newest seconds (not settled) are asked again; truncated answers, row limits and a
rebooted node are not served from it; its bounds hold. The agents here answer from a list of records as a real
agent's store does (records with mono_ns in the asked range, both ends included)."""

from __future__ import annotations

import asyncio
import random

from steplens.collector.control.fetch import DetailCache, fetch_commops
from steplens.collector.ingest.clock import ClockEstimate
from steplens.v1 import ingest_pb2 as ipb
from steplens.v1 import records_pb2 as pb

JOB = "job-1"
S = 1_000_000_000


class Agent:
    """One node's agent: CommOps of rank `rank` every `gap` ns of its clock; answers FetchDetail like a real one."""

    def __init__(self, node: str, rank: int, offset_ns: int, drift_ppm: float = 0.0, boot: str = "b1") -> None:
        self.node, self.rank, self.boot_id = node, rank, boot
        self.clock = ClockEstimate(offset_ns, drift_ppm, 5 * S, 1000, 1000, 10)
        self.records: list[int] = []      # mono_ns of each op; seq = index
        self.asks: list[tuple[int, int]] = []
        self.truncate = False
        self.delay = 0.0                  # seconds before an answer comes

    def add(self, start: int, end: int, gap: int, jitter: bool = True) -> None:
        rnd = random.Random(start)
        t = start
        while t < end:
            self.records.append(t)
            t += gap + (rnd.randrange(-(gap // 4), gap // 4) if jitter and gap >= 4 else 0)

    def send_command(self, cmd: ipb.Command):
        f = cmd.fetch
        self.asks.append((f.since_mono_ns, f.until_mono_ns))
        hits = [(i, m) for i, m in enumerate(self.records) if f.since_mono_ns <= m <= f.until_mono_ns]
        if f.limit:
            hits = hits[:f.limit]
        if self.truncate:
            hits = hits[:len(hits) // 2]
        rl = pb.RecordList(records=[pb.Record(mono_ns=m, source="flightrec", commop=pb.CommOp(
            rank=self.rank, comm_id="pg:0", op="all_reduce", seq=i, issue_mono_ns=m, pid=100 + self.rank,
            job_key=JOB)) for i, m in hits])
        note = f"{len(hits)} commops records" + (" (truncated: narrow the time range)" if self.truncate else "")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        loop.call_later(self.delay, fut.set_result, ipb.CommandResult(command_id=cmd.command_id, ok=True, message=note,
                                                                      payload=rl.SerializeToString()))
        return fut


class Cluster:
    def __init__(self, agents: list[Agent]) -> None:
        self.agents = {a.node: a for a in agents}
        self.now = 0

    # the reader's procs, the ingest's sessions and the collector's clock, as fetch_commops uses them
    def procs(self):
        return [{"job_key": JOB, "rank": a.rank, "node_id": a.node, "pid": 100 + a.rank}
                for a in self.agents.values()]

    async def session(self, node: str):
        return self.agents.get(node)

    def now_ns(self) -> int:
        return self.now

    def fetch(self, ranks, since, until, cache, limit=0, stats=None):
        got = asyncio.run(fetch_commops(self, self, self, JOB, ranks, since, until, limit, cache=cache, stats=stats))
        return [(r["node_id"], r["seq"]) for r in got.rows], got


def _same(c: Cluster, cache: DetailCache, ranks, since, until, limit=0):
    """The cached answer equals the uncached one (same ops, same order); how many asks it took."""
    asks = sum(len(a.asks) for a in c.agents.values())
    cached, got = c.fetch(ranks, since, until, cache, limit)
    after = sum(len(a.asks) for a in c.agents.values())
    plain, _ = c.fetch(ranks, since, until, None, limit)
    assert cached == plain
    assert len(set(cached)) == len(cached)
    return after - asks, got


def _one(offset_s: int, until_s: int, gap: int, settle_s: int, now_s: int) -> tuple[Agent, Cluster, DetailCache]:
    """One node with rank 0's ops from 1 s to until_s of its clock, every `gap` ns; the collector's now."""
    a = Agent("n1", 0, offset_s * S)
    a.add(1 * S, until_s * S, gap)
    c = Cluster([a])
    c.now = (offset_s + now_s) * S
    return a, c, DetailCache(settle_ns=settle_s * S)


def test_a_window_asked_again_is_answered_from_what_was_fetched():
    a, b = Agent("n1", 0, 1_700_000_000 * S), Agent("n2", 1, 1_700_000_000 * S - 37 * S, drift_ppm=3.0)
    for ag in (a, b):
        ag.add(6 * S, 200 * S, 7_000_000)
    c = Cluster([a, b])
    cache = DetailCache(settle_ns=10 * S)
    base = 1_700_000_000 * S
    c.now = base + 120 * S
    asks, _ = _same(c, cache, [0, 1], base + 20 * S, base + 60 * S)
    assert asks == 2                                         # one per node
    asks, got = _same(c, cache, [0, 1], base + 25 * S, base + 55 * S)
    assert asks == 0 and "kept from earlier asks" in got.messages["n1"]
    assert cache.asks_saved == 2 and cache.rows_served > 0
    # the window slides on: only what lies after the kept span is asked, starting right after it on the
    # agent's own clock (each node's), and the answer is the same as a fetch of the whole window
    a.asks.clear(), b.asks.clear()
    asks, _ = _same(c, cache, [0, 1], base + 30 * S, base + 90 * S)
    assert asks == 2
    for ag in (a, b):
        (lo, hi), = ag.asks[:1]
        assert lo == ag.clock.to_agent(base + 60 * S) + 1
    # and before it: the part before the kept span is asked
    a.asks.clear(), b.asks.clear()
    asks, _ = _same(c, cache, [0, 1], base + 10 * S, base + 40 * S)
    assert asks == 2 and a.asks[0][1] == a.clock.to_agent(base + 20 * S) - 1
    stats = {"asks": 0, "rows_agents": 0, "rows_kept": 0}   # what the collector's /metrics counts
    rows, _ = c.fetch([0, 1], base + 25 * S, base + 100 * S, cache, stats=stats)
    assert stats["asks"] == 2 and stats["rows_agents"] + stats["rows_kept"] == len(rows)
    assert 0 < stats["rows_agents"] < stats["rows_kept"]


def test_the_newest_seconds_are_asked_again_until_they_settle():
    a, c, cache = _one(1_000, 60, 5_000_000, settle_s=10, now_s=50)
    a.records = [m for m in a.records if m <= 48 * S]   # what the agent has now
    _same(c, cache, [0], 1_000 * S + 20 * S, 1_000 * S + 48 * S)
    a.add(45 * S + 1, 45 * S + 2, 1, jitter=False)      # an op of 45 s that reaches the store late (retired, read)
    a.add(49 * S, 70 * S, 5_000_000)
    a.asks.clear()
    c.now = 1_000 * S + 65 * S
    # kept only up to the first ask's now - settle (40 s): the rest is asked again, the late op with it (the
    # cached answer equals a plain fetch's)
    asks, got = _same(c, cache, [0], 1_000 * S + 20 * S, 1_000 * S + 60 * S)
    assert asks == 1 and a.asks[0] == (40 * S + 1, 60 * S)
    late = a.records.index(45 * S + 1)
    assert ("n1", late) in [(r["node_id"], r["seq"]) for r in got.rows]


def test_truncated_answers_limits_and_a_rebooted_node_are_not_served_from_the_cache():
    a, c, cache = _one(5_000, 100, 10_000_000, settle_s=1, now_s=200)
    a.truncate = True
    c.fetch([0], 5_000 * S + 10 * S, 5_000 * S + 50 * S, cache)
    assert not cache.spans                                       # a truncated answer is not kept
    a.truncate = False
    c.fetch([0], 5_000 * S + 10 * S, 5_000 * S + 50 * S, cache)
    assert cache.rows > 0
    n = len(a.asks)
    asks, _ = _same(c, cache, [0], 5_000 * S + 10 * S, 5_000 * S + 50 * S, limit=100)
    assert asks == 1 and len(a.asks) == n + 2                    # a row limit: asked (and the plain fetch too)
    # the host rebooted: its clock starts again, the offset moves by its uptime; nothing kept is served
    a.clock = ClockEstimate(5_000 * S + 150 * S, 0.0, 0, 1000, 1000, 10)
    a.records = []
    a.add(1 * S, 40 * S, 10_000_000)
    asks, _ = _same(c, cache, [0], 5_000 * S + 160 * S, 5_000 * S + 180 * S)
    assert asks == 1


def test_the_cache_keeps_within_its_bounds():
    agents = [Agent(f"n{i}", i, 10_000 * S) for i in range(4)]
    for ag in agents:
        ag.add(1 * S, 1_000 * S, 50_000_000)                     # 20 ops a second
    c = Cluster(agents)
    cache = DetailCache(settle_ns=1 * S, span_ns=100 * S, max_rows=5_000)
    c.now = 10_000 * S + 1_100 * S
    for t in range(0, 900, 50):                                  # a window sliding over 15 minutes
        for r in range(4):
            _same(c, cache, [r], 10_000 * S + t * S, 10_000 * S + (t + 120) * S)
        spans = [sp for sps in cache.spans.values() for sp in sps]
        assert cache.rows == sum(len(sp.items) for sp in spans) <= 5_000
        for sp in spans:
            assert sp.hi - sp.lo <= 100 * S and all(sp.lo <= m <= sp.hi for m, _ in sp.items)
        for sps in cache.spans.values():
            assert all(a.hi + 1 < b.lo for a, b in zip(sps, sps[1:]))   # in order, none adjoining another


def test_two_windows_asked_in_turn_are_both_kept():
    """Two episodes of one job localized at every pass: each pass asks for both windows; after the first pass
    neither is asked of the agent again (one span each), and a window between them joins the three."""
    a, c, cache = _one(7_000, 300, 10_000_000, settle_s=5, now_s=400)
    first, second = (7_000 * S + 20 * S, 7_000 * S + 60 * S), (7_000 * S + 120 * S, 7_000 * S + 150 * S)
    assert _same(c, cache, [0], *first)[0] == 1 and _same(c, cache, [0], *second)[0] == 1
    for _ in range(3):
        assert _same(c, cache, [0], *first)[0] == 0 and _same(c, cache, [0], *second)[0] == 0
    assert len(cache.spans[next(iter(cache.spans))]) == 2
    asks, _ = _same(c, cache, [0], 7_000 * S + 40 * S, 7_000 * S + 140 * S)
    assert asks == 1 and a.asks[-2] == (a.clock.to_agent(first[1]) + 1, a.clock.to_agent(second[0]) - 1)
    (sp,) = cache.spans[next(iter(cache.spans))]               # the three joined
    assert (sp.lo, sp.hi) == (a.clock.to_agent(first[0]), a.clock.to_agent(second[1]))
    assert _same(c, cache, [0], 7_000 * S + 10 * S, 7_000 * S + 160 * S)[0] == 2   # what lies before and after


def test_two_asks_in_flight_at_once_keep_each_record_once():
    a, c, cache = _one(3_000, 100, 10_000_000, settle_s=1, now_s=200)
    window = (3_000 * S + 10 * S, 3_000 * S + 50 * S)
    a.delay = 0.2

    async def both():
        return await asyncio.gather(*(fetch_commops(c, c, c, JOB, [0], *window, cache=cache) for _ in range(2)))

    first, second = asyncio.run(both())
    assert len(a.asks) == 2                                      # both planned before either stored
    items = [m for sps in cache.spans.values() for sp in sps for m, _ in sp.items]
    assert len(items) == len(set(items)) == len(first.rows) == cache.rows
    assert _same(c, cache, [0], *window)[0] == 0
