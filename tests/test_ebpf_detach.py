"""A whole agent never leaves BPF programs behind: whether it stops normally (SIGINT, SIGTERM) or
is killed (SIGKILL), every program it loaded is gone from the kernel shortly after (nothing is
pinned; the kernel frees a program when its last fd closes)."""

import os
import signal
import subprocess

import pytest

from conftest import AgentProc, wait_for
from procutil import prog_ids_of, progs_alive
from steplens.agent.ebpf import unavailable_reason

pytestmark = [pytest.mark.privileged,
              pytest.mark.skipif(os.geteuid() != 0 or unavailable_reason() != "", reason="needs root and eBPF")]

TOML = """
[agent]
batch_max_delay_seconds = 0.2
status_interval_seconds = 0.5
flush_timeout_seconds = 3.0
reconnect_min_seconds = 0.2
reconnect_max_seconds = 0.5

[sources.pystacks]
enabled = false
"""


def _prog_ids(pid: int) -> set[int]:
    return prog_ids_of(pid, prefix="")  # every program the agent holds


def _alive(prog_id: int) -> bool:
    return bool(progs_alive({prog_id}))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["sigint", "sigterm", "sigkill"])
def test_agent_exit_detaches_every_program(tmp_path, collector, agents, sig):
    a = AgentProc(tmp_path, f"bpf-{sig.name.lower()}", collector.address, toml=TOML).start()
    agents.append(a)

    def loaded():
        n = collector.node(a.node_id) or {}
        s = n.get("sources", {})
        return all(s.get(k, {}).get("up") for k in ("netflows", "sched", "gpuprobes")) and n
    wait_for(loaded, 60, what="eBPF sources up")
    ids = _prog_ids(a.proc.pid)
    assert len(ids) >= 7, f"expected the netflows and sched programs, got {ids}"
    names = subprocess.run(["bpftool", "prog", "show", "id", str(min(ids))], capture_output=True, text=True).stdout
    assert "steplens_" in names
    os.kill(a.proc.pid, sig)
    a.proc.wait(30)
    wait_for(lambda: not any(_alive(i) for i in ids), 15, what="programs freed")
