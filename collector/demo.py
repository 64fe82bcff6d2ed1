"""The first-run demo of `make run` (steplens-collector allinone): a small training job on gloo under the steplens
bootstrap, a fault injected into it after about a minute, and what to run to see the job, its steps, the finding
and its merged trace.

The job (DEMO_JOB, run once per rank with this interpreter): a two-layer MLP, data-parallel over `ranks` ranks
(gloo on loopback), its gradients all-reduced each step, ~0.3 s per step. The fault: from `fault_after` seconds on,
rank `slow_rank` computes `slow_fraction` longer each step (busy on its CPU after its backward pass, as a slower
GPU would): every rank then waits for it in the all-reduce, the job's steps take longer, and steplens should open a
finding naming that rank. The job is started with `steplens-agent env`'s variables (bootstrap: Flight Recorder and
step anchors for the flightrec source, Kineto's daemon mode for deep dives), so it is watched like any job.

Needs torch in the interpreter running the collector (`make test` installs it into .venv); without it the demo is
skipped with the reason, and the collector and agent run as before.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time

DEMO_JOB = r'''
import ctypes, os, signal, sys, time
try:   # PR_SET_PDEATHSIG: end with the all-in-one, even where it is killed without a chance to stop the ranks
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
except (OSError, AttributeError):
    pass
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
fault_at = float(sys.argv[1])
slow_rank, slow_fraction = int(sys.argv[2]), float(sys.argv[3])
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randn(64, 16)
compute = 0.0
while True:
    t0 = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    time.sleep(0.25)                          # the rest of a step's compute, without taking the CPU
    own = time.perf_counter() - t0
    compute = own if not compute else 0.9 * compute + 0.1 * own
    if rank == slow_rank and time.time() >= fault_at:
        end = time.perf_counter() + slow_fraction * compute
        while time.perf_counter() < end:      # a slower device: busy, not asleep
            pass
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
'''


def torch_missing(python: str = sys.executable) -> str:
    """'' where `python` can import torch; else why the demo cannot run."""
    if python == sys.executable:
        if importlib.util.find_spec("torch") is not None:
            return ""
    else:
        out = subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') "
                              "is None)"], capture_output=True)
        if out.returncode == 0:
            return ""
    return (f"torch is not installed for {python} (`make test` installs it, or `{python} -m pip install "
            "torch==2.13.0`); the collector and agent run without the demo job")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Demo:
    """The demo job's ranks; start() after the agent, stop() before it."""

    def __init__(self, state_dir: str, agent_cmd: list[str], agent_config: str, ranks: int = 4,
                 fault_after: float = 60.0, slow_rank: int = 1, slow_fraction: float = 0.5,
                 python: str = sys.executable, job: str = "demo") -> None:
        if not 0 <= slow_rank < ranks:
            raise ValueError(f"slow rank {slow_rank} is not one of the job's {ranks} ranks")
        self.dir = os.path.join(state_dir, "demo")
        self.agent_cmd, self.agent_config = agent_cmd, agent_config
        self.ranks, self.fault_after, self.slow_rank, self.slow_fraction = ranks, fault_after, slow_rank, slow_fraction
        self.python, self.job = python, job
        self.procs: list[subprocess.Popen] = []
        self.fault_at = 0.0

    def start(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        script = os.path.join(self.dir, "job.py")
        with open(script, "w") as fh:
            fh.write(DEMO_JOB)
        out = subprocess.run(self.agent_cmd + ["env", "--format", "json", "--config", self.agent_config],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"steplens-agent env failed: {out.stderr.strip()}")
        launch = json.loads(out.stdout)
        port = _free_port()
        self.fault_at = time.time() + self.fault_after
        for rank in range(self.ranks):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(self.ranks), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", STEPLENS_JOB=self.job,
                       **launch)
            with open(os.path.join(self.dir, f"rank{rank}.log"), "ab") as log:
                self.procs.append(subprocess.Popen(
                    [self.python, script, f"{self.fault_at:.3f}", str(self.slow_rank), str(self.slow_fraction)],
                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def failed(self) -> str:
        """'' while every rank runs; else which exited and the end of its log."""
        for rank, p in enumerate(self.procs):
            if p.poll() is not None:
                try:
                    with open(os.path.join(self.dir, f"rank{rank}.log"), "rb") as fh:
                        tail = fh.read()[-600:].decode(errors="replace").strip()
                except OSError:
                    tail = ""
                return f"demo rank {rank} exited with {p.returncode}: {tail}"
        return ""

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def intro(self, cli: str) -> str:
        return (f"demo: a {self.ranks}-rank gloo training job `{self.job}` (logs in {self.dir}); in "
                f"{self.fault_after:.0f} s rank {self.slow_rank} starts computing {self.slow_fraction:.0%} longer "
                f"each step (a slower GPU), and the others wait for it. Meanwhile:\n"
                f"  {cli} jobs                      # the job, its ranks, step time and baseline\n"
                f"  {cli} findings --job {self.job} --watch   # findings as they open\n")

    def finding_text(self, cli: str, f, updated: bool = False) -> str:
        top = f.suspects[0] if f.suspects else None
        who = f" (top suspect: {top.kind} {top.id}, {top.cause})" if top is not None else ""
        return (f"demo: finding {f.id} {'updated' if updated else 'opened'}: {f.kind} by {f.detector}{who}: "
                f"{f.summary}\n"
                f"  {cli} findings --job {self.job} --open --json   # suspects and evidence\n"
                f"  {cli} trace {self.job} --finding {f.id} -o demo.pftrace   # one merged Perfetto trace "
                "of every rank (ui.perfetto.dev)\n")
