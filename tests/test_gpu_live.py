"""GPU only (marker `gpu`, run on the device machine): the comm-op sources against a live CUDA + NCCL job.

One GPU, so the job is a 1-rank NCCL process group (NCCL refuses two ranks on one device); it still goes
through ProcessGroupNCCL, its CUDA-event timing, its Flight Recorder and Kineto's CUPTI path. torch runs
only in the child process. The job writes how many all-reduces it issued, which the sources must match.

Status: both pass on an H100 (driver 580.159.04, torch 2.11.0+cu130, NCCL 2.28.9) run with
`bash bench/gpu_device.sh live` (2026-11-24, the second session with a GPU). The first run there found that
ops were emitted before the watchdog retired them, without their CUDA-event duration (228 of 256 timed);
tests/test_gpu_recorded.py holds the recorded dumps that show it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from conftest import REPO, free_port, wait_for
from procutil import capture_commlog, start_ticks
from steplens.agent.bootstrap import site_dir
from steplens.agent.records import Event, Mode, ProcessInfo
from steplens.agent.sources.base import HostContext, WorkloadRegistry
from steplens.agent.sources.flightrec import FlightrecConfig, FlightrecSource
from steplens.agent.sources.kineto import KinetoConfig, KinetoSource

VENV_PY = os.path.join(REPO, ".venv", "bin", "python")

JOB = r'''
import json, os, sys, time
import torch, torch.distributed as dist
out, seconds = sys.argv[1], float(sys.argv[2])
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
a = torch.randn(2048, 2048, device=dev)
flat = torch.zeros(1 << 20, device=dev)
n, end = 0, time.time() + seconds
open(os.path.join(out, "ready"), "w").close()
while time.time() < end and not os.path.exists(os.path.join(out, "stop")):
    for _ in range(4):
        a = (a @ a) / a.norm()
    dist.all_reduce(flat)
    n += 1
    torch.cuda.synchronize()
    time.sleep(0.01)
with open(os.path.join(out, "count.tmp"), "w") as fh:
    json.dump({"all_reduce": n}, fh)
os.rename(os.path.join(out, "count.tmp"), os.path.join(out, "count"))
dist.destroy_process_group()
'''

pytestmark = pytest.mark.gpu


def _cuda() -> bool:
    return os.path.exists(VENV_PY) and subprocess.run(
        [VENV_PY, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"]).returncode == 0


needs_cuda = pytest.mark.skipif(not _cuda(), reason="needs torch with CUDA and a GPU in .venv")


def _start(tmp_path, seconds: float, env: dict) -> subprocess.Popen:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **env)
    return subprocess.Popen([VENV_PY, str(script), str(tmp_path), str(seconds)], env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "job.err", "wb"))


def _finish(tmp_path, proc) -> int:
    (tmp_path / "stop").touch()
    proc.wait(timeout=60)
    assert proc.returncode == 0, (tmp_path / "job.err").read_text()[-3000:]
    return json.loads((tmp_path / "count").read_text())["all_reduce"]


def _register(ctx, proc, job_key="gpujob"):
    ticks = start_ticks(proc.pid)
    ctx.workloads.replace({(proc.pid, ticks): ProcessInfo(0, proc.pid, ticks, rank=0, world_size=1, job_key=job_key)})


@needs_cuda
def test_flightrec_reads_a_live_nccl_job_with_cuda_event_durations(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    proc = _start(tmp_path, 60, {"PYTHONPATH": site_dir(), "STEPLENS_BOOTSTRAP": "1", "STEPLENS_RUNTIME_DIR": str(run),
                                 "STEPLENS_BOOTSTRAP_POLL_S": "0.05", "TORCH_FR_BUFFER_SIZE": "4000"})
    ctx = HostContext(node_id="g", state_dir=str(tmp_path / "state"))
    os.makedirs(ctx.state_dir)
    src = None
    try:
        wait_for(lambda: (tmp_path / "ready").exists() and (run / f"{proc.pid}.sock").exists()
                 or proc.poll() is not None, 120, what="the NCCL job and its worker-server socket")
        assert proc.poll() is None, (tmp_path / "job.err").read_text()[-3000:]
        _register(ctx, proc)
        src = FlightrecSource(ctx, FlightrecConfig(socket_dirs=[str(run)]))
        src.start()
        captured, _ = capture_commlog(src)
        out = []
        for _ in range(6):
            time.sleep(0.5)
            out += src.step()
        n = _finish(tmp_path, proc)
        for _ in range(3):   # the ops after the last poll: whatever the source catches at exit
            out += src.step()
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        if src is not None:
            src.stop()
    ar = [o for o in captured if o.op == "all_reduce"]
    errors = [e for e in out if isinstance(e, Event) and "refused" not in e.message]
    assert ar, f"no all_reduce from the NCCL job; events {errors}"
    seqs = [o.seq for o in ar]
    assert len(set(seqs)) == len(seqs) and sorted(seqs) == list(range(min(seqs), min(seqs) + len(seqs)))
    assert len(ar) <= n
    assert all(o.bytes == 4 << 20 and o.comm_id == "pg:0" and o.nranks == 1 for o in ar)
    timed = [o for o in ar if o.timing == "cuda_event"]
    assert len(timed) >= len(ar) - 2, [o.timing for o in ar]   # the last may not have completed when read
    # CUDA-event durations of a 4 MiB 1-rank all-reduce on one GPU: positive and well under a second
    assert all(0 < o.end_mono_ns - o.start_mono_ns < 1e9 for o in timed)
    assert all(o.issue_mono_ns <= o.start_mono_ns for o in timed)
    now = time.monotonic_ns()
    assert all(now - 600e9 < o.issue_mono_ns <= now for o in ar)


@needs_cuda
def test_kineto_on_demand_traces_gpu_kernels_and_nccl_ops(tmp_path):
    sockdir = f"/tmp/ktg{os.getpid()}"
    os.makedirs(sockdir, exist_ok=True)
    reg = WorkloadRegistry()
    ctx = HostContext("g", state_dir=str(tmp_path / "state"), workloads=reg, mode=lambda: Mode.DEEP)
    os.makedirs(ctx.state_dir)
    cfg = KinetoConfig(socket_dir=sockdir, deep_window_ms=1500, warmup_seconds=1)
    cfg.validate()
    src = KinetoSource(ctx, cfg)
    src.start()
    proc = _start(tmp_path, 90, {"KINETO_USE_DAEMON": "1", "KINETO_IPC_SOCKET_DIR": sockdir})
    captured_ops, captured_kernels = capture_commlog(src)
    out = []
    try:
        wait_for(lambda: (tmp_path / "ready").exists() or proc.poll() is not None, 120, what="the NCCL job")
        assert proc.poll() is None, (tmp_path / "job.err").read_text()[-3000:]
        reg.replace({(proc.pid, start_ticks(proc.pid)): ProcessInfo(0, proc.pid, start_ticks(proc.pid), rank=0,
                                                                    world_size=1, job_key="gpujob")})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and src.traces_total < 1:
            out += src.step()
            time.sleep(0.2)
        assert src.traces_total >= 1, f"no trace: {out}; {(tmp_path / 'job.err').read_text()[-2000:]}"
        # let the window close before the job exits (libkineto's teardown hazard, see the source docstring)
        time.sleep(1.0)
        _finish(tmp_path, proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        src.stop()
    assert not [e for e in out if isinstance(e, Event) and e.kind != "kineto_trace_events_skipped"], out
    names = {k.name for k in captured_kernels}
    assert len(names) >= 3, names                               # gemm, norm/div, ... : real kernel names
    assert any("gemm" in n.lower() or "sm90" in n.lower() or "cutlass" in n.lower() for n in names), names
    launched = [k for k in captured_kernels if k.launch_start_mono_ns]
    assert len(launched) >= len(captured_kernels) * 0.9
    assert all(k.start_mono_ns >= k.launch_start_mono_ns for k in launched)   # issue latency >= 0
    assert all(k.device == 0 and k.grid and k.block for k in captured_kernels if "memcpy" not in k.name.lower())
    ar = [o for o in captured_ops if o.op == "all_reduce"]
    assert ar and all(o.bytes == 4 << 20 for o in ar), [(o.op, o.bytes) for o in captured_ops][:20]
    seqs = sorted(o.seq for o in ar)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] >= 0, seqs
