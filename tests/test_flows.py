"""Flows at the collector: agents' Flow/ConnStats records stored in cluster time and listed per
address pair or connection; switch-exported flows imported from CSV/JSON, all or nothing."""

import json
import subprocess
import time

from conftest import STEPLENS
from steplens.agent import records as r
from steplens.agent.transport.codec import decode_records, encode_records
from wire import RawAgent

T = time.monotonic_ns() - 10**9


def test_codec_round_trip():
    items = [("netflows", r.Flow(T + 5, T, "10.0.0.1", 40000, "10.0.0.2", 29500, 4_000_000, 2800, 77)),
             ("netflows", r.ConnStats(T + 9, T, "10.0.0.1", 40000, "10.0.0.2", 29500, 10, 20, 1, 2, 8, 16, 3, 150,
                                      77, "python"))]
    assert decode_records(encode_records(items)) == items


def _cli(collector, *args, check=True):
    out = subprocess.run([STEPLENS, "--collector", collector.address, "--insecure", *args], capture_output=True,
                         text=True, timeout=30)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def test_agent_flows_listed_per_pair_and_connection(collector):
    T = time.monotonic_ns() - 10**9  # now, not at collection time: the check below compares with the clock
    a = RawAgent(collector.address, "fl")
    a.hello()
    recs = [r.Flow(T + 1000 * i + 500, T + 1000 * i, "10.9.0.1", 40000 + i % 2, "10.9.0.2", 29500, 1_000_000, 700, 42)
            for i in range(6)]
    recs.append(r.Flow(T + 99, T + 1, "10.9.0.2", 29500, "10.9.0.1", 40000, 5000, 10, 0))
    recs.append(r.ConnStats(T + 100, T, "10.9.0.1", 40000, "10.9.0.2", 29500, 3_000_000, 5000, 2100, 10,
                            2_900_000, 4000, 1, 120, 42, "python"))
    a.batch(1, recs)
    assert a.wait_ack(1).rejected_records == 0
    a.close()
    pairs = json.loads(_cli(collector, "flows", "--json").stdout)
    by = {(p["src"], p["dst"]): p for p in pairs}
    fwd = by[("10.9.0.1", "10.9.0.2")]
    assert fwd["bytes"] == 6_000_000 and fwd["flows"] == 6 and fwd["origin"] == "ebpf"
    # times are cluster time (epoch ns), close to now, and ordered
    assert abs(fwd["last_ns"] - time.time_ns()) < 30 * 10**9 and fwd["first_ns"] < fwd["last_ns"]
    assert by[("10.9.0.2", "10.9.0.1")]["bytes"] == 5000
    conns = json.loads(_cli(collector, "flows", "--by", "connection", "--json").stdout)
    assert {(c["sport"], c["flows"]) for c in conns if c["src"] == "10.9.0.1"} == {(40000, 3), (40001, 3)}
    import sqlite3
    db = sqlite3.connect(f"file:{collector.db}?mode=ro", uri=True)
    assert db.execute("SELECT tx_payload_bytes, retransmits, pid FROM conn_stats").fetchone() == (2_900_000, 1, 42)


def test_import_csv_and_json(tmp_path, collector):
    csv = tmp_path / "erspan.csv"
    csv.write_text("start,src,dst,switches,bytes,duration,sport,dport\n"
                   "2025-11-21T10:00:00Z,10.1.0.1,10.1.1.1,leaf1;spine2;leaf3,8000000,0.004,51000,4791\n"
                   "1763719200.5,10.1.0.1,10.1.1.1,leaf1;spine1;leaf3,8000000,0.004,51000,4791\n"
                   "1763719201000000000,10.1.0.2,10.1.1.2,leaf1;spine1;leaf4,1000,0.0001,,\n")
    out = json.loads(_cli(collector, "import", "flows", str(csv), "--json").stdout)
    assert out == {"file": str(csv), "origin": "import:erspan.csv", "imported": 3}
    lines = tmp_path / "sflow.jsonl"
    lines.write_text(json.dumps({"start": 1763719300, "src": "10.2.0.1", "dst": "10.2.0.9",
                                 "switches": ["leaf9"], "bytes": 123, "duration": 1}) + "\n")
    assert "imported 1 flows" in _cli(collector, "import", "flows", str(lines)).stdout
    pairs = {(p["src"], p["dst"]): p for p in json.loads(_cli(collector, "flows", "--json").stdout)}
    assert pairs[("10.1.0.1", "10.1.1.1")]["bytes"] == 16_000_000 and pairs[("10.1.0.1", "10.1.1.1")]["flows"] == 2
    assert pairs[("10.1.0.1", "10.1.1.1")]["origin"] == "import:erspan.csv"
    import sqlite3
    db = sqlite3.connect(f"file:{collector.db}?mode=ro", uri=True)
    sw = db.execute("SELECT switches FROM flows WHERE src='10.1.0.1' ORDER BY start_ns").fetchall()
    assert [json.loads(x[0]) for x in sw] == [["leaf1", "spine2", "leaf3"], ["leaf1", "spine1", "leaf3"]]
    start, end = db.execute("SELECT start_ns, end_ns FROM flows WHERE src='10.1.0.1' ORDER BY start_ns").fetchone()
    assert start == 1763719200 * 10**9 and end - start == 4_000_000


def test_bad_import_imports_nothing(tmp_path, collector):
    bad = tmp_path / "bad.csv"
    bad.write_text("start,src,dst,switches,bytes,duration\n"
                   "1763719200,10.1.0.1,10.1.1.1,leaf1,100,0.1\n"
                   "1763719200,not-an-ip,10.1.1.1,leaf1,100,0.1\n"
                   "1763719200,10.1.0.1,10.1.1.1,leaf1,-5,0.1\n")
    out = _cli(collector, "import", "flows", str(bad), check=False)
    assert out.returncode == 2 and "bad.csv:3" in out.stderr and "bad.csv:4" in out.stderr
    assert json.loads(_cli(collector, "flows", "--json").stdout) == []
    missing = tmp_path / "missing.csv"
    missing.write_text("start,src,dst\n1,10.0.0.1,10.0.0.2\n")
    out = _cli(collector, "import", "flows", str(missing), check=False)
    assert out.returncode == 2 and "lacks" in out.stderr
