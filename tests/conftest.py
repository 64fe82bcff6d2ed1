"""Shared harness: real collector and agent processes on loopback, a free port each, JSON from the CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

BIN = os.path.dirname(sys.executable)
STEPLENS = os.path.join(BIN, "steplens")
AGENT = os.path.join(BIN, "steplens-agent")
COLLECTOR = os.path.join(BIN, "steplens-collector")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# fast settings for tests: small batches, frequent status, quick reconnects
FAST_AGENT_TOML = """
[agent]
batch_max_delay_seconds = 0.2
status_interval_seconds = 0.5
flush_timeout_seconds = 10.0
reconnect_min_seconds = 0.2
reconnect_max_seconds = 1.0
log_level = "info"

[sources.host]
interval_seconds = 0.2

[sources.procs]
interval_seconds = 0.5

# eBPF sources have their own tests; agents in other tests skip compiling them
[sources.sched]
enabled = false

[sources.gpuprobes]
enabled = false

[sources.netflows]
enabled = false

# comm-op sources have their own tests
[sources.flightrec]
enabled = false

[sources.kineto]
enabled = false
"""


def skip_module_unless_testbed() -> None:
    """Skip the calling test module unless the netns testbed can run here: root, torch installed (checked
    without importing it: the test process must not map libtorch), and `ip netns`."""
    import importlib.util
    if os.geteuid() != 0:
        pytest.skip("the testbed needs root", allow_module_level=True)
    if importlib.util.find_spec("torch") is None:
        pytest.skip("the testbed needs torch (pip install '.[testbed]')", allow_module_level=True)
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        pytest.skip("no `ip netns`", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class CollectorProc:
    def __init__(self, tmp_path, port: int | None = None, extra: list[str] | None = None, db: str | None = None):
        self.port = port or free_port()
        self._auto_port = port is None   # only a port chosen here may be replaced (start: taken meanwhile)
        self.db = db or str(tmp_path / "collector.db")
        self.extra = extra or []
        self.log = open(tmp_path / f"collector-{self.port}.log", "ab")
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, insecure: bool = True) -> "CollectorProc":
        for attempt in range(3):
            cmd = [COLLECTOR, "serve", "--db", self.db, "--listen", self.address] + (["--insecure"] if insecure else [])
            mark = self.log.tell()
            self.proc = subprocess.Popen(cmd + self.extra, stdout=subprocess.PIPE, stderr=self.log)
            line = self.proc.stdout.readline().decode()
            if "listening" in line:
                return self
            self.proc.wait(10)
            # free_port() cannot reserve a port: another process (an outgoing connection's ephemeral port) may take
            # it before the collector binds (seen once in CI). Such a port is taken again, a fresh one each time.
            self.log.flush()
            with open(self.log.name, "rb") as fh:
                fh.seek(mark)
                taken = re.search(rb"Failed to bind to address 127\.0\.0\.1:(\d+)", fh.read())
            if taken is None or attempt == 2:
                break
            old = f"127.0.0.1:{taken.group(1).decode()}"
            if old == self.address:
                if not self._auto_port:
                    break    # the test asked for this port (a restart on the same address): no other will do
                self.port = free_port()
            else:
                new = f"127.0.0.1:{free_port()}"
                self.extra = [new if x == old else x for x in self.extra]
                if getattr(self, "control_address", None) == old:
                    self.control_address = new
        raise RuntimeError(f"collector did not start: {line!r}; see {self.log.name}")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def cli(self, *args: str, check: bool = True) -> object:
        out = subprocess.run([STEPLENS, "--collector", self.address, "--insecure", *args, "--json"],
                             capture_output=True, text=True, timeout=30)
        if check and out.returncode != 0:
            raise AssertionError(f"steplens {' '.join(args)} failed: {out.stderr}")
        return json.loads(out.stdout) if out.stdout.strip() else None

    def node(self, node_id: str) -> dict | None:
        for n in self.cli("nodes"):
            if n["node_id"] == node_id:
                return n
        return None


class AgentProc:
    def __init__(self, tmp_path, node_id: str, collector: str, prefix: list[str] | None = None,
                 extra: list[str] | None = None, toml: str = FAST_AGENT_TOML):
        self.node_id = node_id
        self.collector = collector
        self.state_dir = str(tmp_path / f"agent-{node_id}")
        os.makedirs(self.state_dir, exist_ok=True)
        self.config = os.path.join(self.state_dir, "agent.toml")
        with open(self.config, "w") as fh:
            fh.write(toml)
        self.prefix = prefix or []
        self.extra = extra or []
        self.log_path = os.path.join(self.state_dir, "agent.log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> "AgentProc":
        cmd = self.prefix + [AGENT, "run", "--config", self.config, "--collector", self.collector, "--insecure",
                             "--node-id", self.node_id, "--state-dir", self.state_dir, "--metrics-listen", "",
                             *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT)
        return self

    def agent_pid(self) -> int:
        """The agent's own PID (below `unshare --fork` when the agent runs in a time namespace)."""
        import psutil
        p = psutil.Process(self.proc.pid)
        for child in [p] + p.children(recursive=True):
            try:
                if any("steplens-agent" in part for part in child.cmdline()) and child.name() != "unshare":
                    return child.pid
            except psutil.NoSuchProcess:
                continue
        return self.proc.pid

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            os.kill(self.agent_pid(), signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                raise AssertionError(f"agent {self.node_id} did not stop on SIGTERM; log: {self.read_log()[-2000:]}")
        return self.proc.returncode

    def read_log(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()


@pytest.fixture
def collector(tmp_path):
    c = CollectorProc(tmp_path).start()
    yield c
    c.stop()


@pytest.fixture
def agents():
    started: list[AgentProc] = []
    yield started
    for a in started:
        if a.proc and a.proc.poll() is None:
            try:
                os.kill(a.agent_pid(), signal.SIGKILL)  # the agent itself, also below `unshare --fork`
            except (ProcessLookupError, Exception):
                pass
            a.proc.kill()
            a.proc.wait(5)


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory):
    """chDB's one engine directory for this test process (chDB runs one engine per process: every test that opens
    a chdb:// store uses this directory, each with a database of its own)."""
    return str(tmp_path_factory.mktemp("chdb"))
