"""An agent given several collectors of one cluster (`--collector A,B`): it streams to one at a time, chosen by its
node id, and moves to the next when that one goes away (issue "Scale-out", item 2: agents connect to any
collector). Real collectors and a real agent on loopback; each collector has its own SQLite file here, so a batch
the killed collector stored but had not acked is stored again by the other (on a shared ClickHouse store the
writer reads the spool's committed seq at the agent's Hello and drops it as a duplicate: clickhouse.py)."""

import sqlite3
import zlib

import pytest

from conftest import AgentProc, CollectorProc, free_port, wait_for
from steplens import conn


def _seqs(db: str, node: str) -> set[int]:
    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return {r[0] for r in c.execute("SELECT seq FROM batches WHERE agent_id = ?", (node,))}
    finally:
        c.close()


def _node_starting_at(index: int, n: int) -> str:
    """A node id whose first collector is the index-th of n (the agent starts at crc32(node id) % n)."""
    return next(f"fo-{k}" for k in range(1000) if zlib.crc32(f"fo-{k}".encode()) % n == index)


def test_address_lists_are_checked():
    assert conn.split_addresses("127.0.0.1:1") == ["127.0.0.1:1"]
    assert conn.split_addresses("a:1, b:2,[::1]:3") == ["a:1", "b:2", "[::1]:3"]
    for bad, why in [("", "address list"), ("a:1,", "address list"), ("a:1,a:1", "named twice"),
                     ("a:1,b", "bad address 'b'")]:
        with pytest.raises(conn.SecurityError, match=why):
            conn.split_addresses(bad)
    with pytest.raises(conn.SecurityError, match="10.0.0.9:7707"):
        conn.require_insecure_allowed(*conn.split_addresses("127.0.0.1:7707,10.0.0.9:7707"))


def test_the_agent_moves_to_the_other_collector_when_its_own_is_killed(tmp_path):
    a = CollectorProc(tmp_path, db=str(tmp_path / "a.db")).start()
    b = CollectorProc(tmp_path, db=str(tmp_path / "b.db")).start()
    node = _node_starting_at(0, 2)
    agent = AgentProc(tmp_path, node, f"{a.address},{b.address}").start()
    try:
        wait_for(lambda: (a.node(node) or {}).get("records_stored", 0) > 0, 60, interval=0.5,
                 what="the agent streaming to its first collector")
        assert b.node(node) is None   # one stream at a time
        a.kill9()
        got = wait_for(lambda: (b.node(node) or {}).get("records_stored", 0) > 0 and b.node(node), 60, interval=0.5,
                       what="the agent streaming to the other collector after the first was killed")
        assert got["connected"]
        assert agent.stop() == 0   # drains its spool into b
    finally:
        agent.stop() if agent.proc.poll() is None else None
        a.stop()
        b.stop()
    log = agent.read_log()
    assert f"trying collector {b.address}" in log, log[-3000:]
    # nothing lost: every batch the agent produced is in one store or the other; only what was in flight when
    # `a` died (at most the agent's window of 8 batches) is in both
    sa, sb = _seqs(a.db, node), _seqs(b.db, node)
    assert sa and sb and sa | sb == set(range(1, max(sa | sb) + 1))
    assert len(sa & sb) <= 8


def test_a_collector_that_is_down_is_passed_over(tmp_path):
    live = CollectorProc(tmp_path, db=str(tmp_path / "live.db")).start()
    dead = f"127.0.0.1:{free_port()}"   # nothing listens there
    node = _node_starting_at(0, 2)      # the dead one is this node's first
    agent = AgentProc(tmp_path, node, f"{dead},{live.address}").start()
    try:
        wait_for(lambda: (live.node(node) or {}).get("records_stored", 0) > 0, 60, interval=0.5,
                 what="the agent streaming to the collector that answers")
    finally:
        agent.stop()
        live.stop()
    assert f"trying collector {live.address}" in agent.read_log()
