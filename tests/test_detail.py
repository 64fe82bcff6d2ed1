"""The node-local detail store: interned stacks, bounded ring with counted drops, survives reopen."""

from steplens.agent.detail import DetailStore

FRAMES_A = (("f", "f", "a.py", 1), ("g", "g", "a.py", 9))
FRAMES_B = (("h", "K.h", "b.py", 3),)


def test_ring_bound_and_drop_count(tmp_path):
    path = str(tmp_path / "detail.db")
    store = DetailStore(path, max_stack_samples=1000)
    for i in range(3000):
        store.add_stack_sample(i, 7, 8, FRAMES_A if i % 2 else FRAMES_B, i % 3 == 0, "running")
        if i % 500 == 499:
            store.flush()
    store.flush()
    rows = store.stack_samples()
    assert len(rows) <= 1000 and rows[-1]["mono_ns"] == 2999
    assert store.dropped == 3000 - len(rows)
    assert rows[-1]["frames"] == list(FRAMES_A) and rows[-1]["pid"] == 7
    store.close()
    again = DetailStore(path, max_stack_samples=1000)
    assert again.dropped == 3000 - len(rows)
    assert len(again.stack_samples(since_mono_ns=2990)) == 10
    # the stack table holds each distinct stack once
    assert again._db.execute("SELECT COUNT(*) FROM stacks").fetchone()[0] == 2
    again.close()


def _op(mono: int, pid: int = 7, rank: int = 0, **kw):
    from steplens.agent import records as r
    return r.CommOp(mono, "backend_thread", pid, "pg:0", "all_reduce", rank=rank, seq=mono, **kw)


def _back(blobs: list[bytes]) -> list:
    from steplens.agent.transport.codec import decode_records, records_payload
    return decode_records(records_payload(blobs))


def test_records_come_back_in_time_order_across_processes_with_the_limit(tmp_path):
    """Records are kept a row per (source, kind, process, rank) and flush; what comes back is every record in
    the range, oldest first, cut at the limit, whatever rows they were kept in."""
    from steplens.agent import records as r
    store = DetailStore(str(tmp_path / "detail.db"))
    for flush in range(5):   # three processes interleaved in time, one flush each round
        store.add_records("flightrec", [_op(flush * 100 + i * 3 + p, pid=10 + p, rank=p, members=[0, 1, 2])
                                        for i in range(30) for p in range(3)])
        store.flush()
    store.add_records("kineto", [r.KernelRec(250, 10, "gemm", 240, 250, grid=[4, 1, 1], rank=0)])
    store.flush()
    every = _back(store.records(["commop"]))
    assert [rec.mono_ns for _, rec in every] == sorted(f * 100 + i * 3 + p for f in range(5) for i in range(30)
                                                       for p in range(3))
    assert every[0][1] == _op(0, pid=10, rank=0, members=[0, 1, 2]) and every[0][0] == "flightrec"
    cut = _back(store.records(["commop"], since_mono_ns=150, until_mono_ns=400, limit=7))
    assert [rec.mono_ns for _, rec in cut] == [150, 151, 152, 153, 154, 155, 156]
    assert [rec.mono_ns for _, rec in _back(store.records(["commop"], ranks={2}, limit=3))] == [2, 5, 8]
    (src, k), = _back(store.records(["kernelrec"]))
    assert src == "kineto" and k.grid == [4, 1, 1] and k.name == "gemm"
    assert store.records(["commop", "kernelrec"], since_mono_ns=250, until_mono_ns=250) != []
    assert store.records(["nope"]) == [] and store.records(["commop"], limit=0) == []
    store.close()


def test_a_refused_record_is_returned_with_its_reason_and_the_rest_kept(tmp_path):
    store = DetailStore(str(tmp_path / "detail.db"))
    bad = [_op(1, bytes=-8), _op(2, members=[0, 1.5]), _op(3, comm_desc=None), _op(1 << 64)]
    refused = store.add_records("flightrec", [_op(0)] + bad + [_op(4)])
    assert [rec for rec, _ in refused] == bad and store.records_rejected == 4
    assert [why.split(":")[0] for _, why in refused] == ["bytes", "members", "comm_desc", "mono_ns"]
    assert "-8 is not a uint64" in refused[0][1]
    store.flush()
    assert [rec.mono_ns for _, rec in _back(store.records(["commop"]))] == [0, 4]
    store.close()


def test_the_bound_drops_the_oldest_rows_first_and_an_older_layout_is_still_read(tmp_path):
    """A store an older agent wrote (a row per encoded record in `records`) is read with the new rows, counted in
    the bound and dropped first; a row of another blob format is skipped; a row written with other fields is
    rebuilt by name."""
    import marshal
    import zlib

    from steplens.agent.transport.codec import encode_record
    path = str(tmp_path / "detail.db")
    store = DetailStore(path, max_records=1000)
    store._db.executemany("INSERT INTO records VALUES (?,?,?,?,?)",
                          [(i, "commop", 7, 0, encode_record("flightrec", _op(i))) for i in range(300)])
    names = tuple(n for n in _op(0).__slots__ if n != "comm_desc") + ("a_field_of_later",)
    rows = [tuple(getattr(_op(i), n, None) for n in names[:-1]) + ("x",) for i in range(300, 310)]
    store._db.execute("INSERT INTO record_batches VALUES (300, 309, 'flightrec', 'commop', 7, 0, 10, ?)",
                      (zlib.compress(marshal.dumps((1, names, rows))),))
    store._db.execute("INSERT INTO record_batches VALUES (310, 310, 'flightrec', 'commop', 7, 0, 1, ?)",
                      (zlib.compress(marshal.dumps((99, names, rows[:1]))),))
    store.close()
    store = DetailStore(path, max_records=1000)
    assert [rec.mono_ns for _, rec in _back(store.records(["commop"]))] == list(range(310))
    store.add_records("flightrec", [_op(400 + i) for i in range(800)])   # 1111 rows: 111 + 50 over
    store.flush()
    got = [rec.mono_ns for _, rec in _back(store.records(["commop"]))]
    assert got == list(range(161, 310)) + list(range(400, 1200)) and store.records_dropped == 161
    store.add_records("flightrec", [_op(1200 + i) for i in range(200)])
    store.flush()   # 1150 rows, 200 to drop: the older layout's last 139, then whole rows oldest first (10, 1, 800)
    assert store.records_dropped == 161 + 139 + 811
    assert [rec.mono_ns for _, rec in _back(store.records(["commop"], limit=2))] == [1200, 1201]
    store.close()
    again = DetailStore(path, max_records=1000)
    assert again.records_dropped == 1111 and again._record_rows == 200
    again.close()


def test_records_added_from_threads_while_flushing_are_all_kept(tmp_path):
    import threading
    store = DetailStore(str(tmp_path / "detail.db"))

    def add(pid: int) -> None:
        for i in range(200):
            store.add_records("flightrec", [_op(pid * 10_000 + i * 5 + j, pid=pid) for j in range(5)])
    threads = [threading.Thread(target=add, args=(p,)) for p in (1, 2, 3)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        store.flush()
    store.flush()
    assert len(store.records(["commop"], limit=10**6)) == 3000
    store.close()
