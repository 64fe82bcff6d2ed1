"""The analysis loop's Step rows kept between passes (irregularity._rows with Reader.steps_after), through a real
store: each pass reads only what was stored since the last one, yet sees exactly the rows a full read of its window
sees (late rows of old steps and rows sent again included), and no row limit cuts a large job's window."""

from __future__ import annotations

import time

from steplens.agent.records import Step
from steplens.agent.transport.codec import encode_records
from steplens.collector.analysis import irregularity
from steplens.collector.analysis.base import Window
from steplens.collector.ingest.clock import ClockEstimate
from steplens.collector.store.queries import Reader
from steplens.collector.store.writer import BatchJob, StoreWriter

S = 10**9
T0 = 1_000 * S
JOB = "job-inc"


class _Feed:
    def __init__(self, path: str) -> None:
        self.path, self.seq = path, 0

    def add(self, node: str, steps: list[Step]) -> None:
        w = StoreWriter(self.path)
        w.start()
        got: list = []
        try:
            self.seq += 1
            job = BatchJob(node, "cd" * 8, self.seq, len(steps), encode_records([("flightrec", s) for s in steps]),
                           max(s.mono_ns for s in steps) + 1, ClockEstimate(0, 0.0, 0, 1, 1, 5), 0,
                           lambda *a: got.append(a))
            while not w.submit(job):
                time.sleep(0.01)
            deadline = time.monotonic() + 30
            while not got and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            w.stop()
        assert got


def _steps(ranks, first: int, last: int, slow: dict | None = None) -> list[Step]:
    out = []
    for k in range(first, last):
        for r in ranks:
            d = (slow or {}).get((r, k), 0.1)
            out.append(Step(T0 + k * S + int(d * S), 100 + r, 7, JOB, r, k, T0 + k * S, T0 + k * S + int(d * S),
                            "anchor", 0, 1))
    return out


class _Memo:
    """What the engine hands a detector: the store's reads plus the job's memo."""

    def __init__(self, reader: Reader) -> None:
        self._r, self.step_memo = reader, {}
        self.after_calls = 0

    def steps(self, *a, **k):
        return self._r.steps(*a, **k)

    def steps_after(self, *a, **k):
        self.after_calls += 1
        rows, top = self._r.steps_after(*a, **k)
        self.read = len(rows)
        self.total = getattr(self, "total", 0) + len(rows)
        return rows, top


def _view(js) -> list:
    return [(n, x, e, s) for n, x, e, s in zip(js.numbers, js.x_ns, js.end_ns, js.start_ns)]


def test_passes_read_only_what_arrived_and_see_what_a_full_read_sees(tmp_path):
    path = str(tmp_path / "inc.db")
    feed, rd = _Feed(path), Reader(path)
    inc = _Memo(rd)
    feed.add("n0", _steps([0, 1], 0, 30))
    feed.add("n1", _steps([2, 3], 0, 30))
    w1 = Window(JOB, T0, T0 + 40 * S)
    js = irregularity._load(inc, w1, irregularity.IrregularityConfig())
    assert inc.read == 120 and len(js.numbers) == 30
    # the next pass: 10 new steps, a late row of old step 5 for rank 3 (sent again: slower), and nothing else
    feed.add("n0", _steps([0, 1], 30, 40))
    feed.add("n1", _steps([2, 3], 30, 40) + _steps([3], 5, 6, slow={(3, 5): 0.5}))
    w2 = Window(JOB, T0 + 3 * S, T0 + 50 * S)
    js2 = irregularity._load(inc, w2, irregularity.IrregularityConfig())
    assert inc.read == 41                                     # only what was stored since the first pass
    cold = irregularity._load(rd, w2, irregularity.IrregularityConfig())   # a plain reader: one full read
    assert _view(js2) == _view(cold) and js2.numbers[0] >= 3
    assert js2.x_ns[js2.numbers.index(5)] == int(0.5 * S)     # the row sent again replaced the first
    # a window reaching further back than the kept rows: read again in full
    w0 = Window(JOB, T0, T0 + 50 * S)
    assert _view(irregularity._load(inc, w0, irregularity.IrregularityConfig())) == \
        _view(irregularity._load(rd, w0, irregularity.IrregularityConfig()))


def test_no_row_limit_cuts_the_window(tmp_path, monkeypatch):
    # Reader.steps keeps the newest `limit` rows (200k by default: ~24 steps of an 8,192-rank job); scaled down
    # here to 100 rows of a 4-rank job, the full read loses the window's oldest steps, the incremental one not
    path = str(tmp_path / "cut.db")
    feed, rd = _Feed(path), Reader(path)
    feed.add("n0", _steps([0, 1, 2, 3], 0, 60))
    real = Reader.steps
    monkeypatch.setattr(Reader, "steps", lambda self, *a, **k: real(self, *a, **{**k, "limit": 100}))
    w = Window(JOB, T0, T0 + 70 * S)
    cut = irregularity._load(rd, w, irregularity.IrregularityConfig())
    inc = irregularity._load(_Memo(rd), w, irregularity.IrregularityConfig())
    assert len(cut.numbers) == 25 and inc.numbers == list(range(60))


def test_the_engine_keeps_memos_within_a_row_budget(monkeypatch):
    # the kept rows of the least recently analysed jobs go first once all jobs' rows pass MEMO_ROWS; the job being
    # analysed keeps its own whatever its size
    from steplens.collector.analysis import engine as eng
    monkeypatch.setattr(eng, "MEMO_ROWS", 100)
    e = eng.AnalysisEngine(reader=None, writer=None, detectors={})

    def fill(job, n):
        e._memo(job)[irregularity.ROWS_KEY] = {"since": 0, "rowid": 0, "rows": dict.fromkeys(range(n))}
    fill("a", 60)
    fill("b", 30)
    assert list(e._memos) == ["a", "b"]
    e._memo("a")                    # a analysed again: b is now the oldest; 90 rows fit
    fill("c", 50)                   # 140 > 100: b goes (oldest), then 110 > 100: a goes; c stays
    e._memo("c")
    assert list(e._memos) == ["c"]
    fill("d", 500)
    e._memo("d")                    # alone over the budget: kept (it is the job being analysed), c goes
    assert list(e._memos) == ["d"]


def test_a_row_committed_during_the_read_is_not_skipped(tmp_path, monkeypatch):
    # the writer commits while a pass reads: a row stored between the read's statements must come in the next pass
    path = str(tmp_path / "race.db")
    feed, rd = _Feed(path), Reader(path)
    feed.add("n0", _steps([0, 1], 0, 10))
    real_db = Reader._db
    state = {"armed": True}

    def racing_db(self):
        db = real_db(self)
        if state["armed"]:
            conn, executed = db.conn, []

            class Conn:  # after the read's first statement, another batch lands
                def execute(self, sql, *a):
                    out = conn.execute(sql, *a)
                    executed.append(sql)
                    if len(executed) == 1 and state["armed"]:
                        state["armed"] = False
                        rows = _Rows(list(out))
                        rows.desc = out.description
                        feed.add("n0", _steps([0, 1], 10, 12))
                        return rows
                    return out

                def close(self):
                    conn.close()
            db = type("Db", (), {"conn": Conn()})()
        return db

    class _Rows(list):
        def fetchone(self):
            return self[0] if self else None

        def fetchall(self):
            return list(self)

        @property
        def description(self):
            return self.desc
    monkeypatch.setattr(Reader, "_db", racing_db)
    first, top = rd.steps_after(JOB, 0, 0)
    monkeypatch.setattr(Reader, "_db", real_db)
    second, _ = rd.steps_after(JOB, top, 0)
    assert {(r["rank"], r["step"]) for r in first + second} == {(r, k) for r in (0, 1) for k in range(12)}


def test_a_short_and_a_long_window_in_one_pass_share_the_kept_rows(tmp_path):
    # irregularity's window (40 s) and the hang detector's (300 s) in the same pass, pass after pass: each sees what
    # a full read of its window sees, and after the first pass the store is asked only for what arrived
    path = str(tmp_path / "alt.db")
    feed, rd = _Feed(path), Reader(path)
    inc = _Memo(rd)
    cfg = irregularity.IrregularityConfig()
    arrived = 0
    for k in range(0, 90, 3):
        steps = _steps([0, 1, 2, 3], k, k + 3, {(1, j): 0.1 + 0.01 * (j % 7) for j in range(k, k + 3)})
        feed.add("n0", steps)
        arrived += len(steps)
        before = getattr(inc, "total", 0)
        until = T0 + (k + 3) * S
        for win in (40, 300):
            w = Window(JOB, max(0, until - win * S), until + 1)
            assert _view(irregularity._load(inc, w, cfg)) == _view(irregularity._load(rd, w, cfg)), (k, win)
        if k:
            assert inc.total - before == len(steps)      # only the new rows: no re-read for the longer window
    assert inc.total == arrived


class _Stored:
    """Rows in storage order, read as the store reads them: incrementally (steps_after) or in one read of the
    window's newest row per (rank, evidence, source, step) (steps), in end order."""

    def __init__(self, memo: bool) -> None:
        self.rows: list[dict] = []
        if memo:
            self.step_memo = {}
            self.steps_after = self._after

    def _after(self, job, after, since_ns=0, limit=10**9, before_ns=0, upto_rowid=0):
        top = upto_rowid or len(self.rows)
        return [r for r in self.rows[after:top] if r["end_ns"] >= since_ns
                and (not before_ns or r["end_ns"] < before_ns)], max(top, after)

    def steps(self, job, since_ns=0, with_comms=True):
        last = {(r["rank"], r["evidence"], r["source"], r["step"]): r for r in self.rows}
        return sorted((r for r in last.values() if r["end_ns"] >= since_ns), key=lambda r: r["end_ns"])


def _whole(js) -> tuple:
    return (js.numbers, js.x_ns, js.end_ns, js.start_ns, js.fps, js.step_end, js.node_of,
            [(rank, [(s, id(r)) for s, r in steps.items()]) for rank, steps in js.rows.items()])


def test_a_kept_parse_is_what_one_parse_of_the_window_gives():
    # passes of random arrivals: late rows of old steps, rows sent again, ranks with two evidence series (the
    # better one, then the longer one chosen), ranks that stop and start, a rank number that is not one, a
    # window that moves back; two windows a pass. Each pass's parse brought up to date from the last (irregularity
    # ._View) is, field by field and in order (ranks in rank order, a rank's steps in end order), the parse of one
    # full read of its window
    import random
    for seed in range(60):
        rng = random.Random(seed)
        ranks, step = rng.randint(2, 10), 0
        cfg = irregularity.IrregularityConfig(complete_fraction=rng.choice([0.5, 1.0]), pivot_rank=rng.choice([-1, 1]))
        inc, full = _Stored(True), _Stored(False)
        two = {r for r in range(ranks) if rng.random() < 0.3}
        for p in range(20):
            for _ in range(rng.randint(1, 3)):
                for r in range(ranks):
                    if rng.random() < 0.1:
                        continue
                    for ev in (["anchor", "comm_pattern"] if r in two and rng.random() < 0.6 else ["anchor"]):
                        st = step if rng.random() > 0.1 else max(0, step - rng.randint(1, 4))
                        b = T0 + st * S + rng.randint(0, S // 3)
                        row = {"node_id": f"n{r // 2}", "source": "flightrec", "rank": r if rng.random() > 0.01
                               else -1, "step": st, "start_ns": b, "end_ns": b + rng.randint(S // 2, S),
                               "evidence": ev, "job_key": JOB, "comms": []}
                        inc.rows.append(row)
                        full.rows.append(row)
                step += 1
            until = T0 + step * S + rng.randint(-2 * S, S)
            for win in sorted(rng.sample([3, 8, 1000], 2)):
                w = Window(JOB, max(0, until - win * S), until)
                if rng.random() < 0.05:
                    w = Window(JOB, max(0, until - 30 * S), until - 3 * S)
                kept, one = irregularity._load(inc, w, cfg), irregularity._load(full, w, cfg)
                assert _whole(kept) == _whole(one), (seed, p, win)
                assert list(kept.rows) == sorted(kept.rows)
                assert all(list(map(lambda r: r["end_ns"], s.values())) == sorted(r["end_ns"] for r in s.values())
                           for s in kept.rows.values())
        assert len(inc.step_memo[irregularity.VIEWS_KEY]) <= irregularity.MAX_VIEWS
