"""Step boundaries of a real job against its own: a 2-rank gloo data-parallel job under the bootstrap logs
time.monotonic_ns() around each iteration (forward, backward, two gradient all-reduce buckets, optimizer, a
loss all-reduce), while the procs and flightrec sources step as an agent would; the Step records CommLog
emits (evidence comm_pattern: the job steps no profiler, and its optimizer step comes before the loss
all-reduce, so the bootstrap's anchors leave the boundaries alone) are matched to the job's iterations.

Figures (printed): the median boundary error |segmenter end - job end| as a fraction of the median step time,
the same after removing the constant phase (the segmenter's boundary is the issue of the last collective:
gloo's Flight Recorder entries have no end time, so what follows that issue, the loss all-reduce itself, is a
fixed offset), and the median error of step durations. Measured 2026-11-24 (24 ms steps): 1.3-1.4 %, 0.3-0.4 %
after the phase (-0.3 ms), durations 0.5-0.6 %. That offset varies with the wait inside the last collective: on a
loaded machine (two busy loops on 2 cores, 2026-12-05, ~29 ms steps) 1.7-2.1 %, durations 1.5-7.3 %, as much as
that collective's own step-to-step variation (1.4-7.2 %), while against the job's clock read at the issue of its
last collective (what the boundary is) the error is 0.11 % (a +0.03 ms phase) and durations 0.02 %.
The second test runs the testbed's DP2 x PP2 job the same way."""

from __future__ import annotations

import json
import os
import subprocess
import time
from statistics import median

import pytest

from conftest import REPO, free_port
from procutil import bootstrapped_env
from steplens.agent.records import Step
from steplens.agent.sources.base import HostContext
from steplens.agent.sources.flightrec import FlightrecConfig, FlightrecSource
from steplens.agent.sources.procs import ProcsConfig, ProcsSource

VENV_PY = os.path.join(REPO, ".venv", "bin", "python")
N_STEPS = 120

JOB = r'''
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
while not os.path.exists(sys.argv[1]):   # until the test has seen the worker-server sockets
    time.sleep(0.02)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
params = list(model.parameters())
log = open(sys.argv[3], "w", buffering=1)
for step in range(int(sys.argv[2])):
    t0 = time.monotonic_ns()
    time.sleep(0.02)                                   # the data loader
    x = torch.randn(64, 256)
    loss = model(x).pow(2).mean()
    loss.backward()
    for bucket in (params[:2], params[2:]):            # DDP-style gradient buckets
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat)
        off = 0
        for p in bucket:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p) / 2)
            off += p.numel()
    opt.step()
    opt.zero_grad()
    ti = time.monotonic_ns()                           # the issue of the step's last collective
    dist.all_reduce(loss.detach().reshape(1))          # the logged loss
    t1 = time.monotonic_ns()
    log.write(json.dumps({"step": step, "rank": rank, "pid": os.getpid(), "start_mono_ns": t0,
                          "last_issue_mono_ns": ti, "end_mono_ns": t1}) + "\n")
dist.destroy_process_group()
'''

pytestmark = pytest.mark.skipif(
    not os.path.exists(VENV_PY) or subprocess.run(
        [VENV_PY, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"]
    ).returncode != 0, reason="torch is not installed in .venv")


def boundary_errors(steps: list[Step], log: list[dict], key: str = "end_mono_ns") -> dict:
    """Match each Step to the job iteration whose end (`key`: its end, or where the job logs it, the issue of its
    last collective) is nearest; errors in ns and as fractions of step time."""
    ends = sorted(x[key] for x in log)
    step_ns = median(b - a for a, b in zip(ends, ends[1:]))
    signed, dur_err = [], []
    by_end = {}
    for st in steps:
        j = min(range(len(ends)), key=lambda i: abs(ends[i] - st.end_mono_ns))
        signed.append(st.end_mono_ns - ends[j])
        by_end[j] = st
    for j, st in by_end.items():
        prev = by_end.get(j - 1)
        if prev is not None:
            dur_err.append(abs((st.end_mono_ns - prev.end_mono_ns) - (ends[j] - ends[j - 1])))
    phase = median(signed)
    return {"steps": len(steps), "iterations": len(ends), "step_ms": step_ns / 1e6,
            "median_abs_error": median(abs(e) for e in signed) / step_ns,
            "phase_ms": phase / 1e6,
            "median_error_after_phase": median(abs(e - phase) for e in signed) / step_ns,
            "median_duration_error": median(dur_err) / step_ns if dur_err else None}


def test_steps_of_a_real_gloo_job_match_its_own_boundaries(tmp_path):
    run, go = tmp_path / "run", tmp_path / "go"
    run.mkdir()
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = free_port()
    procs = []
    for rank in range(2):
        env = bootstrapped_env(run, port, rank, 2, "steps-job")
        procs.append(subprocess.Popen([VENV_PY, str(script), str(go), str(N_STEPS), str(tmp_path / f"steps{rank}.jsonl")],
                                      env=env, stdout=subprocess.DEVNULL,
                                      stderr=open(tmp_path / f"rank{rank}.err", "wb")))
    ctx = HostContext(node_id="t", state_dir=str(tmp_path))
    finder = ProcsSource(ctx, ProcsConfig())
    src = FlightrecSource(ctx, FlightrecConfig(socket_dirs=[str(run)], without_bootstrap=False))  # this job only
    finder.start()
    src.start()
    seg = src.log.segmenter
    steps: list[Step] = []
    try:
        deadline = time.monotonic() + 180
        while not all((run / f"{p.pid}.sock").exists() for p in procs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                (tmp_path / "rank0.err").read_text()[-2000:]
            time.sleep(0.05)
        go.touch()
        while any(p.poll() is None for p in procs):  # an agent's steps: procs, then flightrec
            finder.step()
            steps += [s for s in src.step() if isinstance(s, Step)]
            time.sleep(0.5)
            assert time.monotonic() < deadline, "the job did not end"
        assert all(p.returncode == 0 for p in procs), (tmp_path / "rank0.err").read_text()[-2000:]
        for _ in range(2):  # after the exit: the exit dumps
            finder.step()
            steps += [s for s in src.step() if isinstance(s, Step)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        src.stop()
        finder.stop()
    figures = {}
    for rank, p in enumerate(procs):
        log = [json.loads(x) for x in (tmp_path / f"steps{rank}.jsonl").read_text().splitlines()]
        mine = [s for s in steps if s.pid == p.pid]
        assert all(s.evidence == "comm_pattern" and s.rank == rank and s.job_key == "steps-job" for s in mine)
        assert all(s.period_ops == 3 and [c.calls for c in s.comms] == [3] for s in mine), mine[:2]
        numbers = [s.step for s in mine]
        assert numbers == sorted(set(numbers))
        figures[rank] = f = boundary_errors(mine, log)
        f.update(segments_dropped=seg.segments_dropped, ops_dropped=seg.ops_dropped, relearned=seg.relearned,
                 first=numbers[:3], last=numbers[-3:])
        # what the boundary is: the issue of the step's last collective, against the job's own clock read there
        f["vs_last_issue"] = at = boundary_errors(mine, log, "last_issue_mono_ns")
        # what separates it from the iteration's end: that collective's own time (the wait for the other rank
        # included), which gloo's Flight Recorder does not record; its step-to-step variation is what durations
        # measured against the iteration ends cannot be better than
        w = [x["end_mono_ns"] - x["last_issue_mono_ns"] for x in log]
        f["last_op_ms_median"] = median(w) / 1e6
        f["last_op_variation"] = median(abs(b - a) for a, b in zip(w, w[1:])) / (f["step_ms"] * 1e6)
        print(f"rank {rank}: {json.dumps(f)}")
        # all but the first few iterations (the pattern is learnt from 3 cycles) and at most a trailing one
        assert f["steps"] >= N_STEPS - 6, f
        assert at["median_abs_error"] <= 0.01 and at["median_duration_error"] <= 0.01, f
        # against the iteration's end the error is the last collective's own time: on a loaded 2-core CI machine a
        # median of 1.2 % of the step, durations 5.5 % (more than the 5 % this asserted then), all of it that
        # collective's variation
        assert f["median_abs_error"] <= 0.05 and f["median_error_after_phase"] <= 0.05, f
        assert f["median_duration_error"] <= f["last_op_variation"] + 0.01, f
    # the ranks number the steps alike (from the collective sequence numbers)
    common = {s.step for s in steps if s.pid == procs[0].pid} & {s.step for s in steps if s.pid == procs[1].pid}
    assert len(common) >= N_STEPS - 6


TESTBED_JOB = os.path.join(REPO, "bench", "testbed", "job.py")
TB_STEPS = 40


def test_steps_of_the_testbed_job_dp2_pp2_on_loopback(tmp_path):
    """The testbed's own job (bench/testbed/job.py: DP2 x PP2, GPipe, isend/recv between stages, a flat DP
    all-reduce, SGD; it writes steps/rank<r>.jsonl) on loopback, without namespaces, under the bootstrap: the
    segmenter's boundaries against the job's step logs, per rank (the testbed acceptance, minus the netns).

    What Flight Recorder gives here (torch 2.13, gloo): only the DP all-reduce (the isend/recv between stages
    are not recorded), with its issue time only. From the comm ops alone each step is one all-reduce and its
    boundary the all-reduce's issue, which precedes the job's step end by the all-reduce (including the wait
    for the other replica) and the optimizer step: measured 2026-11-24, median |error| 25-29 % of the step
    time, 4.6-6.9 % after the constant phase (-16..-20 ms), durations 6-12 %. The bootstrap's anchors (the
    end of each optimizer step, steplens_anchors) end each step where the iteration ends, evidence `anchor`:
    measured 2026-11-24 (4 ranks on 2 cores, ~68 ms steps) with the optimizer-step ends alone: median |error|
    1.05-1.17 % of the step time, a constant phase of -0.74..-0.81 ms (what follows opt.step(): zero_grad of
    2.1 M floats), 0.10-0.17 % after it, durations 0.25-2.0 %. The job's loop is `opt.step(); opt.zero_grad()`,
    so the anchors now also hold the zero_grad's end and the step ends there: measured 2026-11-24 (~112 ms steps,
    loaded machine) median |error| 0.026-0.028 %, phase -0.03 ms, 0.003 % after it, durations 0.005 %."""
    run = tmp_path / "run"
    run.mkdir()
    port = free_port()
    procs = []
    for rank in range(4):
        env = bootstrapped_env(run, port, rank, 4, "tb-job", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen([VENV_PY, TESTBED_JOB, "--rank", str(rank), "--dp", "2", "--pp", "2",
                                       "--steps", str(TB_STEPS), "--state-dir", str(tmp_path)],
                                      env=env, stdout=subprocess.DEVNULL,
                                      stderr=open(tmp_path / f"rank{rank}.err", "wb")))
    ctx = HostContext(node_id="t", state_dir=str(tmp_path))
    finder = ProcsSource(ctx, ProcsConfig())
    src = FlightrecSource(ctx, FlightrecConfig(socket_dirs=[str(run)], without_bootstrap=False))  # this job only
    finder.start()
    src.start()
    seg = src.log.segmenter
    steps: list[Step] = []
    try:
        deadline = time.monotonic() + 240
        while any(p.poll() is None for p in procs):
            finder.step()
            steps += [s for s in src.step() if isinstance(s, Step)]
            time.sleep(0.5)
            assert time.monotonic() < deadline, "the job did not end"
        assert all(p.returncode == 0 for p in procs), (tmp_path / "rank0.err").read_text()[-2000:]
        for _ in range(2):
            finder.step()
            steps += [s for s in src.step() if isinstance(s, Step)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        src.stop()
        finder.stop()
    figures = []
    assert {s.evidence for s in steps} <= {"anchor", "comm_pattern"}
    for rank, p in enumerate(procs):
        log = [json.loads(x) for x in (tmp_path / "steps" / f"rank{rank}.jsonl").read_text().splitlines()]
        log = log[3:]  # the first steps connect the pairs (up to ~1 s): not the job's rhythm
        mine = [s for s in steps if s.pid == p.pid and s.end_mono_ns > log[0]["start_mono_ns"]]
        f = boundary_errors(mine, log)
        f.update(rank=rank, period_ops=sorted({s.period_ops for s in mine}),
                 anchored=sum(s.evidence == "anchor" for s in mine),
                 comms=sorted({c.comm_id for s in mine for c in s.comms}), segments_dropped=seg.segments_dropped,
                 relearned=seg.relearned)
        print(f"testbed job rank {rank}: {json.dumps(f)}")
        figures.append(f)
    for f in figures:
        assert f["steps"] >= f["iterations"] - 4 and f["anchored"] >= f["steps"] - 1, f
        # anchored at zero_grad's end, the job's own end but for a clock read: no phase left (it was -0.75 ms at
        # the optimizer step's end, 1.05-1.17 %, and 2.2 % in a loaded CI run; without anchors ~25 % and ~7 %);
        # what is left is jitter, of which a loaded machine has more: hence the margin on the error
        assert f["median_abs_error"] <= 0.03 and -0.3 < f["phase_ms"] <= 0.05, f
        assert f["median_error_after_phase"] <= 0.03 and f["median_duration_error"] <= 0.05, f
