"""flightrec catches a short job's last ops: a real 2-rank gloo job under the bootstrap runs N all-reduces in a
few seconds while the procs and flightrec sources step as an agent would; the ops after the last periodic
read reach the source through the dump the bootstrap writes at interpreter exit. Every all-reduce of the job
arrives exactly once per rank (no duplicates between the periodic reads and the exit dump)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from conftest import REPO, free_port
from procutil import bootstrapped_env, capture_commlog
from steplens.agent.records import Event
from steplens.agent.sources.base import HostContext
from steplens.agent.sources.flightrec import FlightrecConfig, FlightrecSource
from steplens.agent.sources.procs import ProcsConfig, ProcsSource

VENV_PY = os.path.join(REPO, ".venv", "bin", "python")
N_STEPS = 600

JOB = r'''
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
while not os.path.exists(sys.argv[1]):   # until the test has seen the worker-server sockets
    time.sleep(0.02)
t = torch.ones(1024)
for _ in range(int(sys.argv[2])):
    dist.all_reduce(t)
    time.sleep(0.004)
dist.destroy_process_group()
'''

pytestmark = pytest.mark.skipif(
    not os.path.exists(VENV_PY) or subprocess.run(
        [VENV_PY, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"]
    ).returncode != 0, reason="torch is not installed in .venv")


def _start_job(tmp_path, n: int, job_key: str):
    run, go = tmp_path / "run", tmp_path / "go"
    run.mkdir()
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = free_port()
    procs = []
    for rank in range(2):
        env = bootstrapped_env(run, port, rank, 2, job_key)
        procs.append(subprocess.Popen([VENV_PY, str(script), str(go), str(n)], env=env, stdout=subprocess.DEVNULL,
                                      stderr=open(tmp_path / f"rank{rank}.err", "wb")))
    return procs, run, go


def test_every_allreduce_of_a_short_job_arrives_once(tmp_path):
    procs, run, go = _start_job(tmp_path, N_STEPS, "short-job")
    ctx = HostContext(node_id="t", state_dir=str(tmp_path))
    finder = ProcsSource(ctx, ProcsConfig())
    src = FlightrecSource(ctx, FlightrecConfig(socket_dirs=[str(run)], without_bootstrap=False))  # this job only
    finder.start()
    src.start()
    captured, _ = capture_commlog(src)
    events: list = []
    try:
        deadline = time.monotonic() + 120
        while not all((run / f"{p.pid}.sock").exists() for p in procs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                (tmp_path / "rank0.err").read_text()[-2000:]
            time.sleep(0.05)
        go.touch()
        periodic = 0
        while any(p.poll() is None for p in procs):  # an agent's steps: procs, then flightrec
            finder.step()
            events += [e for e in src.step() if isinstance(e, Event)]
            periodic = periodic or len(captured)
            time.sleep(0.5)
            assert time.monotonic() < deadline, "the job did not end"
        assert all(p.returncode == 0 for p in procs), (tmp_path / "rank0.err").read_text()[-2000:]
        for _ in range(2):  # after the exit: procs reports it gone, flightrec reads the exit dumps
            finder.step()
            events += [e for e in src.step() if isinstance(e, Event)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        src.stop()
        finder.stop()
    assert 0 < periodic < 2 * N_STEPS, f"the periodic reads saw {periodic} ops: the test needs both kinds of read"
    for rank, p in enumerate(procs):
        ops = [o for o in captured if o.pid == p.pid]
        assert all(o.op == "all_reduce" and o.comm_id == "pg:0" and o.rank == rank for o in ops)
        assert all(o.job_key == "short-job" and o.bytes == 4096 for o in ops)
        seqs = sorted(o.seq for o in ops)
        assert len(ops) == N_STEPS and seqs == list(range(seqs[0], seqs[0] + N_STEPS)), \
            (rank, len(ops), len(set(seqs)))
    assert not events, events
    assert not list(run.glob("*.fr-exit*")), "the exit dumps are consumed"
