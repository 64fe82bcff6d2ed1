"""Deep mode: `steplens deep start` reaches every agent with one cluster-time instant, each agent
switches, reports it in its status, records it, and returns to sentinel when the window ends."""

import sqlite3
import subprocess
import time

from conftest import STEPLENS, AgentProc, wait_for


def test_deep_mode_window_on_all_agents(tmp_path, collector, agents):
    for i in range(2):
        agents.append(AgentProc(tmp_path, f"deep{i}", collector.address).start())
    wait_for(lambda: sum(1 for n in collector.cli("nodes") if n["connected"]) == 2, 30, what="agents")
    out = subprocess.run([STEPLENS, "--collector", collector.address, "--insecure", "deep", "start",
                          "--duration", "4s", "--lead-ms", "300", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import json
    reply = json.loads(out.stdout)
    assert sorted(reply["delivered"]) == ["deep0", "deep1"] and not reply["offline"]
    assert all("deep mode from +" in m for m in reply["messages"].values())
    # each agent reports the window in its status (polled one at a time: a CLI call can take a second)
    seen = set()
    wait_for(lambda: seen.update(n["node_id"] for n in collector.cli("nodes") if n["mode"] == "deep")
             or seen == {"deep0", "deep1"}, 10, what="deep mode reported by both agents")
    wait_for(lambda: all(n["mode"] == "sentinel" for n in collector.cli("nodes")), 15, what="back to sentinel")
    for a in agents:
        assert a.stop() == 0
    db = sqlite3.connect(f"file:{collector.db}?mode=ro", uri=True)
    rows = db.execute("SELECT agent_id, ts_ns, entity FROM events WHERE kind='mode' ORDER BY ts_ns").fetchall()
    starts = {a: ts for a, ts, e in rows if e == "deep"}
    ends = {a: ts for a, ts, e in rows if e == "sentinel"}
    assert set(starts) == set(ends) == {"deep0", "deep1"}
    # both agents switched at the requested instant, within a few ms of each other in cluster time
    assert abs(starts["deep0"] - reply["start_ns"]) < 20_000_000
    assert abs(starts["deep0"] - starts["deep1"]) < 10_000_000, starts
    for a in starts:
        assert abs((ends[a] - starts[a]) / 1e9 - 4.0) < 0.1


def test_deep_stop_and_offline_nodes(tmp_path, collector, agents):
    agents.append(AgentProc(tmp_path, "d", collector.address).start())
    wait_for(lambda: (collector.node("d") or {}).get("connected"), 30, what="agent")
    base = [STEPLENS, "--collector", collector.address, "--insecure", "deep"]
    assert subprocess.run(base + ["start", "--duration", "60s", "--lead-ms", "0"], capture_output=True,
                          timeout=60).returncode == 0
    wait_for(lambda: collector.node("d")["mode"] == "deep", 10, what="deep")
    assert subprocess.run(base + ["stop"], capture_output=True, timeout=60).returncode == 0
    wait_for(lambda: collector.node("d")["mode"] == "sentinel", 10, what="stopped")
    out = subprocess.run(base + ["start", "--nodes", "ghost", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and '"ghost"' in out.stdout and "not connected" in out.stdout
