"""Bad input, one test each: every case gets a clear gRPC status or is stored as a counted
rejection, nothing of a refused batch is half-written, and the collector keeps serving others."""

import math
import socket
import sqlite3
import time

import grpc
import pytest

from steplens.agent import records as r
from wire import RawAgent, metrics


def _count(db_path: str, sql: str, *args) -> int:
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return db.execute(sql, args).fetchone()[0]
    finally:
        db.close()


def _healthy(collector, agent_id="healthy"):
    """Another agent can still connect and store after whatever the test did."""
    a = RawAgent(collector.address, agent_id)
    assert a.hello() is not None
    a.batch(1, metrics(5))
    assert a.wait_ack(1).rejected_records == 0
    a.close()


def test_garbage_bytes_on_the_port(collector):
    for junk in (b"\x00" * 64, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 40):
        with socket.create_connection(("127.0.0.1", collector.port), timeout=5) as s:
            s.sendall(junk)
            s.settimeout(5)
            try:
                while s.recv(4096):
                    pass
            except (socket.timeout, ConnectionResetError):
                pass
    _healthy(collector)


def test_malformed_protobuf_in_a_valid_frame(collector):
    a = RawAgent(collector.address, "bad-frame")
    a.send(b"\xff\xff\xff\xff\x0f garbage")
    err = a.wait_error()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed AgentMessage" in err.details()
    _healthy(collector)


def test_malformed_payload_rejects_the_whole_batch(collector):
    a = RawAgent(collector.address, "bad-payload")
    a.hello()
    a.batch(1, [], n_records=3, payload=b"\x0a\xff\xff\xff\xff\xff not protobuf")
    ack = a.wait_ack(1)
    assert ack.rejected_records == 3 and "malformed records payload" in ack.note
    # header/payload disagreement: also refused whole, nothing written
    a.batch(2, metrics(4, "half"), n_records=5)
    ack = a.wait_ack(2)
    assert ack.rejected_records == 5 and "says 5 records, payload has 4" in ack.note
    a.close()
    assert _count(collector.db, "SELECT COUNT(*) FROM series WHERE agent_id='bad-payload'") == 0
    assert _count(collector.db, "SELECT SUM(count) FROM rejections WHERE agent_id='bad-payload'") == 8
    n = collector.node("bad-payload")
    assert n["records_rejected"] == 8 and n["records_stored"] == 0


def test_oversized_batch(collector):
    a = RawAgent(collector.address, "big")
    a.hello()
    a.batch(1, [], n_records=1, payload=b"\x00" * (9 * 1024 * 1024))
    err = a.wait_error()
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _count(collector.db, "SELECT COUNT(*) FROM batches WHERE agent_id='big'") == 0
    _healthy(collector)


def test_wrong_schema_version(collector):
    a = RawAgent(collector.address, "future", schema_version=2)
    assert a.hello(timeout=5, expect=False) is None
    err = a.wait_error()
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "schema version 2 is not supported" in err.details()
    _healthy(collector)


def test_first_message_must_be_hello(collector):
    a = RawAgent(collector.address, "nohello")
    a.batch(1, metrics(3))
    err = a.wait_error()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "Hello" in err.details()


def test_batch_for_another_agent_is_refused(collector):
    a = RawAgent(collector.address, "mallory")
    a.hello()
    a.agent_id = "victim"
    a.batch(1, metrics(3))
    err = a.wait_error()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _count(collector.db, "SELECT COUNT(*) FROM batches WHERE agent_id IN ('victim', 'mallory')") == 0


def test_replayed_batch_is_acked_but_stored_once(collector):
    a = RawAgent(collector.address, "replay")
    a.hello()
    recs = metrics(10)
    a.batch(1, recs)
    a.wait_ack(1)
    a.batch(1, recs)  # the same batch again on the same stream
    a.batch(2, metrics(3, "other"))
    a.wait_ack(2)
    a.close()
    # and again on a new stream, as an agent that missed the ack would
    b = RawAgent(collector.address, "replay", spool_id=a.spool_id)
    ack = b.hello()
    assert ack.last_seq == 2
    b.batch(1, recs)
    assert "duplicate" in b.wait_ack(1).note
    b.close()
    assert _count(collector.db, "SELECT COUNT(*) FROM metrics m JOIN series s ON s.id=m.series_id"
                                " WHERE s.agent_id='replay'") == 13
    n = collector.node("replay")
    assert n["batches_duplicate"] == 2 and n["batches_stored"] == 2 and n["records_stored"] == 13


def test_nan_and_non_monotonic_times_are_counted_rejections(collector):
    a = RawAgent(collector.address, "weird")
    a.hello()
    t = time.monotonic_ns() - 10**9
    good = [r.Metric(t + i, "ok", "e", 1.0) for i in range(5)]
    bad = [r.Metric(t + 10, "ok", "e", math.nan), r.Metric(t + 11, "ok", "e", math.inf),
           r.Metric(t + 2, "ok", "e", 2.0),                     # goes back in time within its series
           r.Metric(0, "ok", "x", 1.0),                          # no time at all
           r.Metric(t + 10**12, "ok", "y", 1.0)]                 # 1000 s ahead of the batch's send time
    a.batch(1, good + bad)
    ack = a.wait_ack(1)
    assert ack.rejected_records == 5
    # a later batch going back behind what is stored is caught across batches too
    a.batch(2, [r.Metric(t + 1, "ok", "e", 3.0), r.Metric(t + 100, "ok", "e", 4.0)])
    assert a.wait_ack(2).rejected_records == 1
    a.close()
    assert _count(collector.db, "SELECT COUNT(*) FROM metrics m JOIN series s ON s.id=m.series_id"
                                " WHERE s.agent_id='weird'") == 6
    reasons = dict(sqlite3.connect(collector.db).execute(
        "SELECT reason, SUM(count) FROM rejections WHERE agent_id='weird' GROUP BY reason").fetchall())
    assert reasons == {"non-finite metric value": 2, "non-monotonic time within a series": 2,
                       "missing time (mono_ns = 0)": 1, "time ahead of the batch's send time": 1}
    n = collector.node("weird")
    assert n["records_rejected"] == 6 and n["records_stored"] == 6


def test_agent_that_never_answers_probes_is_refused(tmp_path):
    from conftest import CollectorProc
    c = CollectorProc(tmp_path).start()
    try:
        ch = grpc.insecure_channel(c.address)
        from steplens.v1 import ingest_pb2 as ipb
        call = ch.stream_stream("/steplens.v1.Ingest/Stream", request_serializer=ipb.AgentMessage.SerializeToString,
                                response_deserializer=ipb.CollectorMessage.FromString)

        def reqs():
            yield ipb.AgentMessage(hello=ipb.Hello(schema_version=1, agent_id="mute", spool_id="ab" * 8))
            time.sleep(15)
        with pytest.raises(grpc.RpcError) as exc:
            for _ in call(reqs(), timeout=20):
                pass
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "did not answer clock probes" in exc.value.details()
        ch.close()
    finally:
        c.stop()
