"""Map overflow is counted, never silent: more connections (netflows) or threads (sched) than the
BPF maps hold produce an Event with the number of failed inserts."""

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from procutil import start_ticks, started
from steplens.agent.ebpf import unavailable_reason
from steplens.agent.records import Event, ProcessInfo
from steplens.agent.sources.base import HostContext

pytestmark = [pytest.mark.privileged,
              pytest.mark.skipif(os.geteuid() != 0 or unavailable_reason() != "", reason="needs root and eBPF")]


def test_netflows_map_full_is_an_event(tmp_path, started):
    from steplens.agent.sources.netflows import NetflowsConfig, NetflowsSource
    src = started(NetflowsSource(HostContext("t", state_dir=str(tmp_path)),
                                 NetflowsConfig(max_connections=16, include_loopback=True)))
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(128)
    conns = []
    try:
        def accept():
            for _ in range(40):
                c, _ = server.accept()
                conns.append(c)
        t = threading.Thread(target=accept)
        t.start()
        clients = [socket.create_connection(server.getsockname()) for _ in range(40)]
        t.join(10)
        for c in clients:
            c.sendall(b"x" * 2000)
        time.sleep(0.3)
        events = [r for r in src.step() + src.step() if isinstance(r, Event) and r.kind == "netflows_map_full"]
        assert events and sum(e.value for e in events) > 0, events
        for c in clients + conns:
            c.close()
    finally:
        server.close()
        src.stop()


def test_sched_map_overflow_is_an_event(tmp_path):
    from steplens.agent.sources.sched import SchedConfig, SchedSource
    code = ("import threading, time\n"
            "def w():\n    while True: time.sleep(0.001)\n"
            "for _ in range(40): threading.Thread(target=w, daemon=True).start()\n"
            "print('ready', flush=True); time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        ticks = start_ticks(child.pid)
        ctx = HostContext("t", state_dir=str(tmp_path))
        ctx.workloads.replace({(child.pid, ticks): ProcessInfo(0, child.pid, ticks)})
        src = SchedSource(ctx, SchedConfig(max_threads=16))
        src.start()
        try:
            src.step()
            time.sleep(0.5)
            events = [r for r in src.step() if isinstance(r, Event) and r.kind == "sched_map_overflow"]
            assert events and events[0].value > 0, events
        finally:
            src.stop()
    finally:
        child.kill()
        child.wait()
