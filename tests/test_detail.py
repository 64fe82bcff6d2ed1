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
