"""`make run`'s first-run demo (collector/demo.py through `steplens-collector allinone`): where torch is installed a
small gloo job runs under the bootstrap, one of its ranks turns into a straggler, and the all-in-one prints the
finding that names it with the commands that show it (its merged trace among them); without torch it says why the
demo is skipped. Real processes: collector, agent, job ranks, the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(REPO, ".venv", "bin")
COLLECTOR = os.path.join(VENV, "steplens-collector")


def _torch() -> bool:
    from steplens.collector.demo import torch_missing
    return not torch_missing(os.path.join(VENV, "python"))


class AllInOne:
    def __init__(self, tmp_path, *args: str) -> None:
        self.addr = f"127.0.0.1:{free_port()}"
        self.lines: list[str] = []
        self.p = subprocess.Popen([COLLECTOR, "allinone", "--state-dir", str(tmp_path / "run"), "--listen", self.addr,
                                   "--metrics-listen", "", *args], stdout=subprocess.PIPE,
                                  stderr=open(tmp_path / "allinone.err", "wb"), text=True, cwd=str(tmp_path))
        self.t = threading.Thread(target=lambda: [self.lines.append(x) for x in self.p.stdout], daemon=True)
        self.t.start()

    def wait_for(self, pred, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = "".join(self.lines)
            if pred(text):
                return text
            if self.p.poll() is not None:
                break
            time.sleep(0.5)
        raise AssertionError(f"no {what} within {timeout} s; output:\n{''.join(self.lines)}")

    def stop(self) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
        try:
            return self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.p.wait()


def test_without_torch_the_demo_says_why(tmp_path):
    from steplens.collector.demo import torch_missing
    # an interpreter without torch (the system's, where it has none; else one whose import of torch fails)
    fake = tmp_path / "py"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -S -I -c 'import sys; sys.exit(1)'\n")
    fake.chmod(0o755)
    why = torch_missing(str(fake))
    assert "torch is not installed" in why and str(fake) in why
    run = AllInOne(tmp_path, "--demo", "off")
    try:
        out = run.wait_for(lambda t: "demo job skipped" in t, 60, what="banner")
        assert "demo job skipped: --demo off" in out and "Ctrl-C stops everything" in out
    finally:
        assert run.stop() == 0


@pytest.mark.skipif(not _torch(), reason="torch is not installed in .venv")
def test_the_demo_job_gets_a_finding_naming_its_straggler_and_a_trace(tmp_path):
    run = AllInOne(tmp_path, "--demo", "on", "--demo-fault-after", "25")
    try:
        run.wait_for(lambda t: "4-rank gloo training job `demo`" in t, 60, what="demo start")
        # the straggler named, cause compute: late into its gradients' first all-reduce of every slow step (at the
        # next ones the ranks arrive together, so its share of last arrivals is near chance; it was "waiting" in 4
        # of 8 runs before irregularity.late_every_step)
        # (a spike the loaded machine makes before the fault may name any rank: not the finding looked for; the
        # fault's first slow step is no spike, a spike being over: irregularity.classify)
        def named(t: str) -> list[str]:
            return [ln for ln in t.splitlines() if ln.startswith("demo: finding ") and "(top suspect: rank 1, " in ln
                    and any(k in ln for k in ("slowdown by", "degradation by"))]
        out = run.wait_for(lambda t: named(t), 240, what="slowdown finding naming rank 1")
        first = named(out)[0]
        assert "(top suspect: rank 1, compute)" in first, out
        assert " opened: " in first or " updated: " in first
        fid = first.split()[2]
        assert "hang by" not in out, out                   # a straggler is no hang
        cli = [os.path.join(VENV, "steplens"), "--collector", run.addr, "--insecure"]
        trace = tmp_path / "demo.pftrace"
        res = subprocess.run(cli + ["trace", "demo", "--finding", fid, "-o", str(trace)], capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert trace.stat().st_size > 1000
    finally:
        assert run.stop() == 0
    # the ranks are gone with it
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "run" / "demo" / "job.py")], capture_output=True, text=True)
    assert left.stdout.strip() == ""
