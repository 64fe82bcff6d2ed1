"""flightrec CommProgress on a real 2-rank gloo job (torch CPU, child processes, the steplens bootstrap): rank 1
blocks on a sync file before its 4th all_reduce while rank 0 enters it. The source shows rank 0 pending in that
seq (N) and rank 1 with last_enqueued N-1, re-emits rank 0 every poll while it waits and rank 1 not at all until
something changes; once rank 1 is let go both report last_completed >= N, then nothing until the periodic
refresh; a process gone from the workloads has its state forgotten."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time

import pytest

from conftest import free_port, wait_for
from procutil import reap
from steplens.agent.bootstrap import site_dir
from steplens.agent.records import CommProgress, Event
from test_source_flightrec import VENV_PY, _source, _torch_available

N_BEFORE = 3   # all_reduces both ranks finish before rank 1 blocks

JOB = r'''
import os, sys, time
import torch, torch.distributed as dist
sync, rank = sys.argv[1], int(os.environ["RANK"])
def wait(name):
    while not os.path.exists(os.path.join(sync, name)):
        time.sleep(0.02)
def mark(name):
    open(os.path.join(sync, f"{name}.{rank}"), "w").close()
dist.init_process_group("gloo")
t = torch.ones(16)
for _ in range(N_BEFORE): dist.all_reduce(t)
mark("entered")
if rank == 1:
    wait("go")
dist.all_reduce(t)
mark("done"); wait("exit")
'''

pytestmark = pytest.mark.skipif(not _torch_available(), reason="torch is not installed in .venv")


@pytest.fixture
def job(tmp_path):
    run, sync = tmp_path / "run", tmp_path / "sync"
    run.mkdir()
    sync.mkdir()
    script = tmp_path / "job.py"
    script.write_text(JOB.replace("N_BEFORE", str(N_BEFORE)))
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, PYTHONPATH=site_dir(), STEPLENS_BOOTSTRAP="1", STEPLENS_RUNTIME_DIR=str(run),
                   TORCH_FR_BUFFER_SIZE="64", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE="2", STEPLENS_BOOTSTRAP_POLL_S="0.05", STEPLENS_JOB="frtest")
        procs.append(subprocess.Popen([VENV_PY, str(script), str(sync)], env=env, stdout=subprocess.DEVNULL,
                                      stderr=open(tmp_path / f"rank{rank}.err", "wb")))
    try:
        wait_for(lambda: all((sync / f"entered.{r}").exists() for r in range(2)) or
                 any(p.poll() is not None for p in procs), 120, what="both ranks before the 4th all_reduce")
        assert all(p.poll() is None for p in procs), (tmp_path / "rank0.err").read_text()[-2000:]
        wait_for(lambda: all((run / f"{p.pid}.sock").exists() for p in procs), 30, what="worker-server sockets")
        yield {"procs": procs, "run": run, "sync": sync}
    finally:
        (sync / "go").touch()
        (sync / "exit").touch()
        reap(procs)


def _progress(src) -> dict[int, CommProgress]:
    out = src.step()
    assert not [e for e in out if isinstance(e, Event)], out
    recs = [x for x in out if isinstance(x, CommProgress)]
    assert len({x.rank for x in recs}) == len(recs), recs  # one group: at most one record per rank
    return {x.rank: x for x in recs}


def test_blocked_rank_and_waiting_rank(tmp_path, job):
    procs = job["procs"]
    t0 = time.monotonic_ns()
    src = _source(tmp_path, job, progress_every_seconds=2.0)
    try:
        # rank 0 is in the all_reduce rank 1 has not entered: pending in seq N
        seen: dict[int, CommProgress] = {}

        def rank0_pending():
            seen.update(_progress(src))
            return 0 in seen and seen[0].pending_op
        wait_for(rank0_pending, 30, what="rank 0 pending")
        p0, p1 = seen[0], seen[1]  # rank 1: emitted by the first poll that saw it
        n = p0.pending_seq
        assert n == N_BEFORE + 1 and p0.last_enqueued == n and p0.last_completed == n - 1
        assert (p0.comm_id, p0.pending_op, p0.pending_p2p, p0.pending_peer, p0.nranks, p0.job_key) == \
            ("pg:0", "all_reduce", False, -1, 2, "frtest")
        assert p0.pid == procs[0].pid and t0 - 120e9 < p0.pending_since_mono_ns <= p0.mono_ns
        assert (p1.comm_id, p1.pid, p1.last_enqueued, p1.last_completed, p1.pending_op, p1.pending_seq,
                p1.pending_since_mono_ns) == ("pg:0", procs[1].pid, n - 1, n - 1, "", -1, 0)

        # still waiting: rank 0 every poll ("still pending as of T"), rank 1 unchanged and idle: not re-sent, but
        # for the periodic one (progress_every_seconds after it was last sent: rank 0 may have taken that long to
        # block, a slow machine's timing)
        again = _progress(src)
        assert 0 in again and again[0].pending_seq == n and again[0].mono_ns > p0.mono_ns
        if 1 in again:
            assert again[1].mono_ns - p1.mono_ns >= 2e9 and \
                dataclasses.replace(again[1], mono_ns=0) == dataclasses.replace(p1, mono_ns=0), (again[1], p1)
        assert again[0].pending_since_mono_ns == p0.pending_since_mono_ns

        # let rank 1 go: both complete seq N
        (job["sync"] / "go").touch()
        wait_for(lambda: all((job["sync"] / f"done.{r}").exists() for r in range(2)), 60, what="the 4th all_reduce")
        seen.clear()

        def both_done():
            seen.update(_progress(src))
            return all(r in seen and seen[r].last_completed >= n and not seen[r].pending_op for r in (0, 1))
        wait_for(both_done, 30, what="both ranks past seq N")
        assert all(seen[r].last_enqueued >= n for r in (0, 1))

        # nothing changes, nothing pending: quiet until progress_every_seconds, then both again
        assert _progress(src) == {}
        time.sleep(2.1)
        assert set(_progress(src)) == {0, 1}

        # a process that left the workloads: its state is forgotten
        assert {k[0] for k in src.progress} == {p.pid for p in procs}
        src.ctx.workloads.replace({})
        src.step()
        assert src.progress == {}
    finally:
        src.stop()
