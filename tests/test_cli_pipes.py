"""Both CLIs (`steplens`, `steplens-agent`) end quietly when the reader of their output goes away
(`steplens stacks | head`): no traceback, no "[Errno 32] Broken pipe", the status a shell reports for other
tools stopped by a closed pipe (141)."""

from __future__ import annotations

import os
import subprocess

from conftest import AGENT, STEPLENS

CLOSED_PIPE_STATUS = 141


def _run_into_closed_pipe(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run `cmd` with stdout on a pipe whose read end is closed before the command writes anything."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(cmd, stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)


def test_agent_cli_quiet_on_a_closed_pipe():
    for cmd in ([AGENT, "env"], [AGENT, "env", "--format", "json"], [AGENT, "print-config"],
                [AGENT, "stack", str(os.getpid())]):
        out = _run_into_closed_pipe(cmd)
        assert out.returncode == CLOSED_PIPE_STATUS and out.stderr == "", (cmd, out.returncode, out.stderr)


def test_operator_cli_quiet_on_a_closed_pipe(collector):
    out = _run_into_closed_pipe([STEPLENS, "--collector", collector.address, "--insecure", "nodes"])
    assert out.returncode == CLOSED_PIPE_STATUS and out.stderr == "", (out.returncode, out.stderr)


def test_operator_cli_quiet_when_head_stops_reading_mid_listing(collector, tmp_path):
    """`steplens flows | head -n 3` over a listing far larger than the pipe buffer: head exits while
    steplens is still writing."""
    rows = ["start,src,dst,switches,bytes,duration"]
    rows += [f"{1_700_000_000 + i},10.0.{i // 250}.{i % 250 + 1},10.1.{i // 250}.{i % 250 + 1},leaf1;spine2,"
             f"{1000 + i},0.5" for i in range(4000)]
    (tmp_path / "flows.csv").write_text("\n".join(rows) + "\n")
    base = [STEPLENS, "--collector", collector.address, "--insecure"]
    imp = subprocess.run(base + ["import", "flows", str(tmp_path / "flows.csv")], capture_output=True, text=True,
                         timeout=60)
    assert imp.returncode == 0, imp.stderr
    script = 'set -o pipefail; "$@" flows --limit 4000 | head -n 3; echo "status ${PIPESTATUS[0]}" >&2'
    out = subprocess.run(["bash", "-c", script, "bash", *base], capture_output=True, text=True, timeout=60)
    assert len(out.stdout.splitlines()) == 3, out.stdout
    assert out.stderr.strip() == f"status {CLOSED_PIPE_STATUS}", out.stderr
    # and with the whole listing read, the same command succeeds
    full = subprocess.run(base + ["flows", "--limit", "4000"], capture_output=True, text=True, timeout=60)
    assert full.returncode == 0 and len(full.stdout.splitlines()) == 4001 and len(full.stdout) > 1 << 17
