"""procs source on real child Python processes: detection, environ, job keys, exits, maps-based torch."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from procutil import start_ticks as _start_ticks

from steplens.agent.records import Event, ProcessExit, ProcessInfo
from steplens.agent.sources.base import ConfigError, HostContext, build_config
from steplens.agent.sources.procs import ProcsConfig, ProcsSource, _container_id


class Clock:
    """CLOCK_MONOTONIC plus an offset the test can advance (the maps re-check waits >= 1 s)."""

    def __init__(self) -> None:
        self.offset_ns = 0

    def __call__(self) -> int:
        return time.monotonic_ns() + self.offset_ns

    def advance(self, seconds: float) -> None:
        self.offset_ns += int(seconds * 1e9)




def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                                                             "STEPLENS_JOB", "SLURM_PROCID")}
    env.update(extra)
    return env


def _wait_file(path: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.01)


def _wait_exec(pid: int, marker: str, timeout: float = 10.0) -> None:
    """Until the child has exec'd: its cmdline is its parent's interpreter's until then (a fresh, busy machine
    took long enough for a scan right after Popen to miss it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} never exec'd with {marker}")
        time.sleep(0.01)


@pytest.fixture
def children():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _infos(records) -> dict[int, ProcessInfo]:
    return {r.pid: r for r in records if isinstance(r, ProcessInfo)}


def test_detects_workloads_reads_environ_and_reports_exit(tmp_path, children):
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    marker = f"steplens-marker-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "train_megatron.py"
    script.write_text("import time\ntime.sleep(60)\n")
    # a fake package so that `python -m vllm.entrypoints.openai.api_server` really runs
    pkg = tmp_path / "pkgs" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg.parent.parent, pkg.parent, pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text("import time\ntime.sleep(60)\n")

    megatron = subprocess.Popen(
        [sys.executable, str(script), "--tensor-model-parallel-size", "2"],
        env=_env(RANK="1", LOCAL_RANK="1", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555",
                 TORCHELASTIC_RUN_ID=run_id, CUDA_VISIBLE_DEVICES="1", UNRELATED_SECRET="x"),
    )
    vllm = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--port", "0"],
        env=_env(PYTHONPATH=str(tmp_path / "pkgs"), MASTER_ADDR="10.0.0.1", MASTER_PORT="1234"),
    )
    patterned = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker], env=_env(SLURM_JOB_ID="777", SLURM_PROCID="3"))
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "not-a-workload"], env=_env(RANK="0"))
    children += [megatron, vllm, patterned, plain]

    ctx = HostContext(node_id="t")
    src = ProcsSource(ctx, build_config(ProcsConfig, {"patterns": [marker]}, "sources.procs"))
    assert ProcsSource.probe(ctx).ok
    src.start()
    infos = _infos(src.step())

    m = infos[megatron.pid]
    assert m.start_ticks == _start_ticks(megatron.pid)
    assert m.ppid == os.getpid()
    assert m.framework == "megatron"
    assert (m.rank, m.local_rank, m.world_size) == (1, 1, 4)
    assert (m.master_addr, m.master_port) == ("127.0.0.1", 29555)
    assert m.job_key == f"torchelastic:{run_id}"
    assert m.env["CUDA_VISIBLE_DEVICES"] == "1" and "UNRELATED_SECRET" not in m.env
    assert m.cmdline[1] == str(script)
    assert os.path.basename(m.exe).startswith("python")
    assert m.uid == os.getuid()

    v = infos[vllm.pid]
    assert v.framework == "vllm"
    assert v.job_key == "master:10.0.0.1:1234"
    assert v.rank == -1

    p = infos[patterned.pid]
    assert p.framework == f"pattern:{marker}"
    assert p.job_key == "slurm:777" and p.rank == 3

    assert plain.pid not in infos
    assert os.getpid() not in infos  # pytest itself is Python but runs nothing we look for

    snap = ctx.workloads.snapshot()
    for proc in (megatron, vllm, patterned):
        assert (proc.pid, _start_ticks(proc.pid)) in snap
    assert all(k[0] != plain.pid for k in snap)

    # steady state: nothing new, nothing gone
    assert src.step() == []

    key = (megatron.pid, m.start_ticks)
    megatron.kill()
    megatron.wait()
    out = src.step()
    exits = [r for r in out if isinstance(r, ProcessExit)]
    assert [(e.pid, e.start_ticks) for e in exits] == [key]
    assert key not in ctx.workloads.snapshot()
    assert (vllm.pid, v.start_ticks) in ctx.workloads.snapshot()
    src.stop()
    src.stop()  # idempotent


def test_unreaped_child_counts_as_exited(tmp_path, children):
    marker = f"steplens-zombie-{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    children.append(child)
    _wait_exec(child.pid, marker)
    src = ProcsSource(HostContext(node_id="t"), ProcsConfig(patterns=[marker]))
    src.start()
    assert child.pid in _infos(src.step())
    os.kill(child.pid, 9)
    deadline = time.monotonic() + 5
    while True:  # wait for the zombie state without reaping it
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        assert time.monotonic() < deadline
        time.sleep(0.01)
    exits = [r for r in src.step() if isinstance(r, ProcessExit)]
    assert [e.pid for e in exits] == [child.pid]


def test_torch_detected_from_maps_once_library_is_mapped(tmp_path, children):
    lib = tmp_path / "site-packages" / "torch" / "lib" / "libtorch_python.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\0" * 8192)
    go = tmp_path / "go"
    mapped = tmp_path / "mapped"
    code = textwrap.dedent(f"""
        import mmap, os, time
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        f = open({str(lib)!r}, "rb")
        # read only first (a symbolizer's view of the file: not loaded), then as the loader maps a library's text
        r = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        open({str(mapped)!r} + ".read", "w").close()
        while not os.path.exists({str(go)!r} + ".exec"):
            time.sleep(0.01)
        try:
            x = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_EXEC)
        except OSError as exc:  # a noexec mount
            open({str(mapped)!r} + ".noexec", "w").write(str(exc))
        open({str(mapped)!r}, "w").close()
        time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", code, "train.py"], env=_env(RANK="0", WORLD_SIZE="1"))
    children.append(child)
    clock = Clock()
    ctx = HostContext(node_id="t", mono_ns=clock)
    src = ProcsSource(ctx, ProcsConfig())
    src.start()
    assert child.pid not in _infos(src.step())  # plain python, nothing mapped yet
    go.touch()
    _wait_file(str(mapped) + ".read")
    clock.advance(1.1)
    assert child.pid not in _infos(src.step())  # libtorch mapped r--s: read, not loaded
    (tmp_path / "go.exec").touch()
    _wait_file(str(mapped))
    if (tmp_path / "mapped.noexec").exists():
        pytest.skip(f"{tmp_path} refuses PROT_EXEC mappings: {(tmp_path / 'mapped.noexec').read_text()}")
    clock.advance(1.1)
    assert child.pid not in _infos(src.step())  # re-check waits (back-off: 2 s now), maps not re-read yet
    clock.advance(1.1)
    infos = _infos(src.step())
    assert infos[child.pid].framework == "torch"
    assert infos[child.pid].rank == 0
    assert infos[child.pid].job_key == f"pid:{child.pid}"  # no job env: the process is its own job


def test_the_agent_itself_is_never_a_workload(children):
    """A pattern that matches the agent's own command line (here the test process's: it runs the source) names
    the child that matches it, never the agent."""
    with open("/proc/self/cmdline", "rb") as fh:
        own = fh.read().split(b"\0")[0].decode()
    marker = f"steplens-self-{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker, own])
    children.append(child)
    _wait_exec(child.pid, marker)
    src = ProcsSource(HostContext(node_id="t"), ProcsConfig(patterns=[re.escape(own)]))
    src.start()
    infos = _infos(src.step())
    assert child.pid in infos
    assert os.getpid() not in infos


def test_helpers_and_pid_job_key(tmp_path, children):
    marker = f"steplens-launch-{uuid.uuid4().hex[:8]}"
    ready = tmp_path / "ready"
    # launcher (no job env) forks a worker that is also a workload; the worker forks a helper with its rank
    worker_py = tmp_path / "worker.py"
    worker_py.write_text(textwrap.dedent(f"""
        import os, time
        if os.fork() == 0:
            time.sleep(60)
        open({str(ready)!r}, "w").close()
        time.sleep(60)
    """))
    code = textwrap.dedent(f"""
        import os, time
        if os.fork() == 0:
            os.environ["RANK"] = "5"
            os.execv({sys.executable!r}, [{sys.executable!r}, {str(worker_py)!r}, {marker!r}, "worker"])
        time.sleep(60)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", code, marker, "launcher"], env=_env(), start_new_session=True)
    children.append(launcher)
    _wait_file(str(ready))
    try:
        src = ProcsSource(HostContext(node_id="t"), ProcsConfig(patterns=[marker]))
        src.start()
        infos = _infos(src.step())
        assert infos[launcher.pid].rank == -1
        worker = [i for i in infos.values() if i.ppid == launcher.pid]
        assert len(worker) == 1 and worker[0].rank == 5
        assert worker[0].cmdline[-1] == "worker"
        # the worker's helper (same rank, parent a workload) is left out; both group under the launcher
        assert len(infos) == 2
        assert {i.job_key for i in infos.values()} == {f"pid:{launcher.pid}"}

        src2 = ProcsSource(HostContext(node_id="t"), ProcsConfig(patterns=[marker], include_helpers=True))
        src2.start()
        infos2 = _infos(src2.step())
        assert len(infos2) == 3
        helper = [i for i in infos2.values() if i.ppid == worker[0].pid]
        assert helper[0].rank == 5 and helper[0].job_key == f"pid:{launcher.pid}"
    finally:
        os.killpg(launcher.pid, 9)


TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

JOB_WORKER = textwrap.dedent("""
    import os, sys, time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    open(os.path.join(sys.argv[1], f"ready-{dist.get_rank()}-{os.getpid()}"), "w").close()
    parent = os.getppid()
    while not os.path.exists(os.path.join(sys.argv[1], "stop")) and os.getppid() == parent:
        time.sleep(0.1)
    dist.destroy_process_group()
""")


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="needs torch (torchrun) in the venv")
def test_torchrun_jobs_without_rdzv_id_get_distinct_keys(tmp_path, children):
    """Two real torchrun jobs at once, neither with --rdzv-id, so both run as TORCHELASTIC_RUN_ID=none: job A
    spans two launchers (two "hosts": --nnodes 2, one rank each, static rendezvous on --master-port), job B is
    one launcher with two ranks. Each job gets one key for all its ranks, and the two keys differ; A's key
    does not depend on either launcher (the other host could not know it), B's names its launcher."""
    port_a, port_b = _free_port(), _free_port()
    script = tmp_path / "job.py"
    script.write_text(JOB_WORKER)
    dirs = {"a": tmp_path / "a", "b": tmp_path / "b"}
    for d in dirs.values():
        d.mkdir()
    env = _env(OMP_NUM_THREADS="1")
    common = ["--master-addr", "127.0.0.1", "--max-restarts", "0", "--monitor-interval", "0.2"]
    launch = {
        "a0": [TORCHRUN, "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1", "--master-port", str(port_a)],
        "a1": [TORCHRUN, "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-port", str(port_a)],
        "b": [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--master-port", str(port_b)],
    }
    launchers = {}
    for name, argv in launch.items():
        d = dirs[name[0]]
        launchers[name] = subprocess.Popen(argv + common + [str(script), str(d)], env=env, cwd=str(tmp_path),
                                           stdout=open(tmp_path / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
                                           start_new_session=True)
        children.append(launchers[name])
    try:
        deadline = time.monotonic() + 120
        while sum(len(list(d.glob("ready-*"))) for d in dirs.values()) < 4:
            assert time.monotonic() < deadline, [(tmp_path / f"{n}.log").read_text()[-2000:] for n in launch]
            assert all(p.poll() is None for p in launchers.values()), \
                [(tmp_path / f"{n}.log").read_text()[-2000:] for n in launch]
            time.sleep(0.2)
        ranks = {job: {int(f.name.split("-")[2]): int(f.name.split("-")[1]) for f in d.glob("ready-*")}
                 for job, d in dirs.items()}  # pid -> rank
        src = ProcsSource(HostContext(node_id="host-x"), ProcsConfig())
        src.start()
        infos = _infos(src.step())
        keys = {}
        for job, pids in ranks.items():
            got = {pid: infos[pid] for pid in pids}
            assert all(i.env.get("TORCHELASTIC_RUN_ID") == "none" for i in got.values())  # what torchrun set
            assert {i.rank for i in got.values()} == {0, 1}
            job_keys = {i.job_key for i in got.values()}
            assert len(job_keys) == 1, (job, job_keys)
            keys[job] = job_keys.pop()
        assert keys["a"] != keys["b"] and "torchelastic:none" not in keys.values(), keys
        assert keys["a"] == f"torchrun:127.0.0.1:{port_a}", keys
        b_launcher = launchers["b"].pid
        assert keys["b"] == f"torchrun:127.0.0.1:{port_b}@host-x:{b_launcher}.{_start_ticks(b_launcher)}", keys
        # stable: a fresh scanner (an agent restart) derives the same keys
        src2 = ProcsSource(HostContext(node_id="host-x"), ProcsConfig())
        src2.start()
        infos2 = _infos(src2.step())
        assert all(infos2[pid].job_key == keys[job] for job, pids in ranks.items() for pid in pids)
        for d in dirs.values():
            (d / "stop").touch()
        for p in launchers.values():
            assert p.wait(60) == 0
    finally:  # torchrun puts each worker in a session of its own: a worker also ends when its launcher is gone
        for d in dirs.values():
            (d / "stop").touch()
        for p in launchers.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_key_from_the_launcher_command_line():
    """The c10d rendezvous endpoint as the launcher was given it (-style and _style options, = or a separate
    value; options after the script belong to the script); static rendezvous has none."""
    from steplens.agent.sources.procs import torchrun_endpoint
    py = sys.executable
    assert torchrun_endpoint([py, "/v/bin/torchrun", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400",
                              "train.py"]) == "head:29400"
    assert torchrun_endpoint([py, "-m", "torch.distributed.run", "--rdzv_backend=c10d", "--rdzv_endpoint=h:1",
                              "t.py"]) == "h:1"
    assert torchrun_endpoint([py, "/v/bin/torchrun", "--nnodes", "2", "--master-port", "1", "t.py"]) == ""
    assert torchrun_endpoint([py, "/v/bin/torchrun", "--rdzv-backend", "static", "--rdzv-endpoint", "h:1",
                              "t.py"]) == ""
    assert torchrun_endpoint([py, "/v/bin/torchrun", "t.py", "--rdzv-endpoint", "h:1"]) == ""
    assert torchrun_endpoint([py, "train.py", "--rdzv-endpoint", "h:1"]) is None  # not a launcher


def test_environ_unreadable_still_reports(tmp_path, children):
    """As a non-root scanner, a root-owned workload's environ is EACCES: report it without rank."""
    if os.geteuid() != 0:
        pytest.skip("needs root to start a scanner as another user")
    marker = f"steplens-noenv-{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker], env=_env(RANK="2"))
    children.append(child)
    scan = textwrap.dedent(f"""
        import json, os
        from steplens.agent.sources.base import HostContext
        from steplens.agent.sources.procs import ProcsConfig, ProcsSource
        os.setgid(65534); os.setuid(65534)  # after the imports: the interpreter's files may be root-only
        src = ProcsSource(HostContext(node_id="t"), ProcsConfig(patterns=[{marker!r}]))
        print(ProcsSource.probe(src.ctx).reason)
        src.start()
        for r in src.step():
            print(json.dumps([r.pid, r.rank, r.env, r.framework]))
    """)
    out = subprocess.run([sys.executable, "-c", scan], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "not root" in lines[0]
    import json

    rows = [json.loads(line) for line in lines[1:]]
    assert [child.pid, -1, {}, f"pattern:{marker}"] in rows


def test_container_id_from_cgroup(tmp_path):
    cid = "4f1c0e2a" * 8
    cases = {
        f"0::/system.slice/docker-{cid}.scope\n": cid,
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/cri-containerd-{cid}.scope\n": cid,
        f"12:memory:/kubepods/burstable/pod0f3e/{cid}\n11:cpu:/kubepods/burstable/pod0f3e/{cid}\n": cid,
        "0::/user.slice/user-0.slice/session-3.scope\n": "",
    }
    for text, want in cases.items():
        (tmp_path / "cgroup").write_text(text)
        assert _container_id(str(tmp_path)) == want


def test_config_validation():
    with pytest.raises(ConfigError, match="patterns"):
        build_config(ProcsConfig, {"patterns": ["("]}, "sources.procs")
    with pytest.raises(ConfigError, match="unknown key"):
        build_config(ProcsConfig, {"pattern": ["x"]}, "sources.procs")
    cfg = build_config(ProcsConfig, {}, "sources.procs")
    assert cfg.interval_seconds == 1.0 and cfg.patterns == []


def test_step_cost():
    """Steady-state CPU per scan on this host, clock advanced 1 s per step (as at 1 Hz)."""
    clock = Clock()
    src = ProcsSource(HostContext(node_id="t", mono_ns=clock), ProcsConfig())
    src.start()
    for _ in range(60):  # past the maps re-check ramp (1, 2, 4 ... 30 s) of unclassified Python processes
        clock.advance(1.0)
        src.step()
    n = 120
    t0 = time.process_time()
    for _ in range(n):
        clock.advance(1.0)
        src.step()
    per_step = (time.process_time() - t0) / n
    nprocs = sum(1 for d in os.listdir("/proc") if d.isdigit())
    print(f"procs step: {per_step * 1e6:.0f} us CPU for {nprocs} processes")
    assert per_step < 0.005


def _pattern_source(tag: str) -> tuple[Clock, str, ProcsSource]:
    """A started source on a test clock whose only pattern is a fresh marker (a child with it as an argument is a
    workload)."""
    clock = Clock()
    marker = f"{tag}-{uuid.uuid4().hex}"
    src = ProcsSource(HostContext(node_id="t", mono_ns=clock),
                      build_config(ProcsConfig, {"patterns": [marker]}, "sources.procs"))
    src.start()
    return clock, marker, src


def test_scans_without_a_fork_are_skipped_and_a_new_process_is_not_missed(children):
    """With no workload to follow, a scan is skipped while the last PID the kernel handed out (/proc/loadavg) is
    the one of the previous full scan and no re-read is due; a process started since is found at the next step
    (its fork moved the last PID), and the known processes are still re-read every recheck_seconds."""
    clock, marker, src = _pattern_source("skip")
    if not src._last_pid_path:
        with open("/proc/self/status") as f:
            assert len(next(ln for ln in f if ln.startswith("NSpid:")).split()) > 2
        pytest.skip("this process's PID namespace is not the one /proc shows: every scan is a full one")
    src.step()
    for _ in range(20):   # other processes of this machine may fork meanwhile: some steps at least are skipped
        clock.advance(0.1)
        src.step()
    assert src.scans_skipped >= 1
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    children.append(child)
    _wait_file(f"/proc/{child.pid}/cmdline")
    deadline = time.monotonic() + 10
    while True:   # the child's cmdline is its interpreter's until it has exec'd
        clock.advance(0.1)
        got = _infos(src.step())
        if child.pid in got or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert child.pid in got
    child.kill()
    child.wait()
    clock.advance(0.1)
    assert any(isinstance(r, ProcessExit) and r.pid == child.pid for r in src.step())
    # no workload again: skipped until the known processes' recheck is due, then a full scan
    skipped = src.scans_skipped
    clock.advance(0.1)
    src.step()
    clock.advance(0.1)
    src.step()
    due = src._due_ns
    clock.offset_ns += due - clock() + 1
    before = src.scans_skipped
    src.step()
    assert src.scans_skipped == before, "a re-read due is a full scan"
    assert src._due_ns > due
    print(f"skipped {src.scans_skipped} scans ({skipped} before the child's exit)")


def test_a_scan_without_a_fork_reads_only_the_workloads_and_still_sees_them_stop_and_exit(children):
    """With a workload to follow and no process created since the last full scan, a scan reads only the known
    processes' stat (no listing of /proc): the workload's stop (SIGSTOP) and its exit are still seen there. The
    no-fork answer is forced after the real first scans (another process of this machine may fork at any time);
    a fork or a re-read due makes the next scan a full one again."""
    clock, marker, src = _pattern_source("known")
    if not src._last_pid_path:
        pytest.skip("this process's PID namespace is not the one /proc shows: every scan is a full one")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    children.append(child)
    _wait_file(f"/proc/{child.pid}/cmdline")
    deadline = time.monotonic() + 10
    while child.pid not in _infos(src.step()) and time.monotonic() < deadline:
        clock.advance(0.1)
        time.sleep(0.05)
    assert any(k[0] == child.pid for k in src.ctx.workloads.snapshot())
    real = src._fork_free
    src._fork_free = lambda now: True    # no fork since: every scan below reads only the known processes
    listed = []
    real_listdir = os.listdir
    try:
        os.listdir = lambda path=".": listed.append(path) or real_listdir(path)
        clock.advance(0.5)
        assert not src.step()
        assert src.scans_known_only == 1 and not listed
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not _stat_state(child.pid) == "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        clock.advance(0.5)
        out = src.step()
        assert [e.kind for e in out if isinstance(e, Event)] == ["process_stopped"]
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        clock.advance(0.5)
        out = src.step()
        assert any(isinstance(r, ProcessExit) and r.pid == child.pid for r in out)
        assert not src.ctx.workloads.snapshot() and src.scans_known_only == 3 and not listed
    finally:
        os.listdir = real_listdir
        src._fork_free = real
    clock.advance(0.5)
    src.step()   # the real answer again: no workload left, so a scan is skipped or full, never known-only
    assert src.scans_known_only == 3


def _stat_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="unshare --pid needs root")
def test_no_scan_skipped_in_a_pid_namespace_below_the_one_proc_shows():
    """An agent in a PID namespace of its own that reads the host's /proc: /proc/loadavg's last PID is its own
    namespace's, not the host's, so no scan may be skipped on it."""
    code = ("import sys; from steplens.agent.sources.procs import _last_pid_source; "
            "print(repr(_last_pid_source('/proc')))")
    res = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=60)
    if res.returncode != 0 and "unshare" in res.stderr:
        pytest.skip(f"unshare --pid refused here: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "''"
    from steplens.agent.sources.procs import _last_pid_source
    with open("/proc/self/status") as f:
        ours = len(next(ln for ln in f if ln.startswith("NSpid:")).split()) == 2   # this test's own namespace
    assert _last_pid_source("/proc") == ("/proc/loadavg" if ours else "")
