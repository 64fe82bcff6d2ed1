"""The agent's spool: seq numbers, acks, bounded size with exact loss accounting, persistence."""

import pytest

from steplens.agent.main import _gap_payload
from steplens.agent.spool import Spool, SpoolError
from steplens.agent.transport.codec import decode_records


def test_append_ack_and_counters_survive_reopen(tmp_path):
    path = str(tmp_path / "spool.db")
    s = Spool(path, 1 << 20, _gap_payload)
    assert [s.append(b"x" * 10, 3, 1) for _ in range(4)] == [1, 2, 3, 4]
    assert [row[0] for row in s.take_for_send(0, 2)] == [1, 2]
    assert s.ack(2) == 6
    spool_id = s.spool_id
    s.close()
    s = Spool(path, 1 << 20, _gap_payload)
    st = s.stats()
    assert (st.spool_id, st.records_produced, st.records_acked, st.backlog_batches, st.last_acked_seq) == \
        (spool_id, 12, 6, 2, 2)
    assert s.append(b"y", 1, 2) == 5  # seq continues after a restart


def test_overflow_drops_oldest_with_one_exact_gap(tmp_path):
    s = Spool(str(tmp_path / "spool.db"), 64 * 1024, _gap_payload)
    for i in range(200):
        s.append(b"z" * 1000, 10, i + 1)
    st = s.stats()
    assert st.backlog_bytes <= 64 * 1024 + 2000
    assert st.records_produced == st.records_acked + st.records_dropped + st.backlog_records
    rows = s.take_for_send(0, 1000)
    gaps = [decode_records(p)[0][1] for _, n, p in rows if n == 1]
    assert len(gaps) == 1, "one waiting gap batch absorbs every later loss"
    assert gaps[0].dropped_records == st.records_dropped and gaps[0].dropped_batches == st.batches_dropped
    # seqs the transport will send: no holes but the dropped batches
    seqs = [row[0] for row in rows]
    assert len(seqs) + st.batches_dropped == seqs[-1]


def test_in_flight_batches_are_never_dropped(tmp_path):
    s = Spool(str(tmp_path / "spool.db"), 64 * 1024, _gap_payload)
    for i in range(10):
        s.append(b"a" * 1000, 1, i)
    sent = [row[0] for row in s.take_for_send(0, 3)]
    for i in range(300):
        s.append(b"b" * 1000, 1, i)
    remaining = {row[0] for row in s.take_for_send(0, 10000)}
    assert set(sent) <= remaining


def test_count_lost_keeps_the_books(tmp_path):
    s = Spool(str(tmp_path / "spool.db"), 1 << 20, _gap_payload)
    s.count_lost(7)
    st = s.stats()
    assert st.records_produced == 7 and st.records_dropped == 7


def test_bad_bound_and_bad_path(tmp_path):
    with pytest.raises(SpoolError):
        Spool(str(tmp_path / "s.db"), 1000)
    (tmp_path / "file").write_text("x")
    with pytest.raises((SpoolError, OSError)):
        Spool(str(tmp_path / "file" / "spool.db"))
