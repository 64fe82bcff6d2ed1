"""Helpers shared by the tests of sources that watch processes and load BPF programs."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess

import pytest


def start_ticks(pid: int) -> int:
    """Start time in clock ticks (/proc/PID/stat field 22): with the PID, names one process."""
    with open(f"/proc/{pid}/stat") as fh:
        stat = fh.read()
    return int(stat[stat.rindex(")") + 2:].split()[19])


@functools.lru_cache(maxsize=1)
def ebpf_reason() -> str:
    """"" when BPF programs can be loaded here, else why not."""
    from steplens.agent.ebpf import unavailable_reason
    return unavailable_reason()


needs_ebpf = pytest.mark.skipif(ebpf_reason() != "", reason=f"eBPF unavailable: {ebpf_reason()}")


def bpftool_progs() -> list[dict]:
    out = subprocess.run(["bpftool", "prog", "show", "--json"], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def prog_ids_of(pid: int, prefix: str = "steplens_") -> set[int]:
    """IDs of the BPF programs (named with `prefix`) a process holds, from /proc/PID/fdinfo
    (this bpftool cannot list the processes holding a program)."""
    ids = set()
    base = f"/proc/{pid}/fdinfo"
    for fd in os.listdir(base):
        try:
            with open(os.path.join(base, fd)) as fh:
                m = re.search(r"^prog_id:\s+(\d+)", fh.read(), re.M)
        except OSError:
            continue
        if m:
            ids.add(int(m.group(1)))
    return {p["id"] for p in bpftool_progs() if p["id"] in ids and p.get("name", "").startswith(prefix)}


def progs_alive(ids: set[int]) -> set[int]:
    return {p["id"] for p in bpftool_progs()} & ids


@pytest.fixture
def started():
    """start(source) -> source, stopped at teardown whatever the test did (an assertion before its own
    try/finally, an exception in start() after some programs were attached): no BPF program outlives its test."""
    sources = []

    def start(src):
        sources.append(src)
        src.start()
        return src
    yield start
    for src in reversed(sources):
        src.stop()


def own_prog_ids(baseline: set[int], names) -> set[int]:
    """Programs this process holds now that it did not hold at `baseline` (prog_ids_of(os.getpid(), "")), named
    as in `names`: what one test loaded, whatever other tests left behind."""
    names = set(names)
    ids = prog_ids_of(os.getpid(), prefix="") - baseline
    return {p["id"] for p in bpftool_progs() if p["id"] in ids and p.get("name", "") in names}


def bootstrapped_env(run_dir, port: int, rank: int, world: int, job_key: str, **extra) -> dict:
    """The environment of one rank of a torch.distributed job under the steplens bootstrap (Flight Recorder
    worker server in run_dir), rendezvous on 127.0.0.1:port."""
    from steplens.agent.bootstrap import site_dir
    return dict(os.environ, PYTHONPATH=site_dir(), STEPLENS_BOOTSTRAP="1", STEPLENS_RUNTIME_DIR=str(run_dir),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                STEPLENS_BOOTSTRAP_POLL_S="0.05", STEPLENS_JOB=job_key, OMP_NUM_THREADS="1", **extra)


def capture_commlog(src) -> tuple[list, list]:
    """Keep every CommOp and KernelRec a comm-op source hands its CommLog (the full stream, which stays
    node-local): returns the (ops, kernels) lists that fill as the source steps."""
    ops: list = []
    kernels: list = []
    real_add = src.log.add

    def add(o, k=(), steps=(), final=False, checked=False):
        ops.extend(o)
        kernels.extend(k)
        return real_add(o, k, steps, final, checked)
    src.log.add = add
    return ops, kernels


@functools.lru_cache(maxsize=1)
def child_memory_readable() -> bool:
    """Whether this process may read a child's memory through /proc/PID/mem (root, or Yama's ptrace_scope <= 1):
    what the flightrec source's memory reads (agent/sources/frmemory.py) and the frame sampler need."""
    import sys
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        fd = os.open(f"/proc/{child.pid}/mem", os.O_RDONLY)
        os.close(fd)
        return True
    except OSError:
        return False
    finally:
        child.kill()
        child.wait()


def reap(procs, timeout: float = 20.0) -> None:
    """Wait for each process to exit (a job released to end), killing one that takes longer than `timeout`."""
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
