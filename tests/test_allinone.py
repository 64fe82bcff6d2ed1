"""`make run`'s mode: collector + local agent in one command; Ctrl-C (SIGINT) stops both cleanly."""

import os
import signal
import subprocess
import time

from conftest import COLLECTOR, STEPLENS, free_port, wait_for


def test_allinone_starts_reports_and_stops_on_ctrl_c(tmp_path):
    port = free_port()
    addr = f"127.0.0.1:{port}"
    proc = subprocess.Popen([COLLECTOR, "allinone", "--state-dir", str(tmp_path / "run"), "--listen", addr,
                             "--metrics-listen", ""], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        import json

        def node():
            out = subprocess.run([STEPLENS, "--collector", addr, "--insecure", "nodes", "--json"],
                                 capture_output=True, text=True, timeout=30)
            nodes = json.loads(out.stdout) if out.returncode == 0 else []
            return nodes[0] if nodes and nodes[0]["records_stored"] > 0 and nodes[0]["connected"] else None
        n = wait_for(node, 30, what="the local agent's records")
        assert n["sources"]["host"]["up"]
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "steplens --collector" in out and "nodes" in out
        # the agent flushed before the collector stopped: everything it produced is stored
        import sqlite3
        db = sqlite3.connect(str(tmp_path / "run" / "steplens.db"))
        produced, stored = db.execute("SELECT records_produced, records_stored FROM agents").fetchone()
        assert produced == stored > 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
