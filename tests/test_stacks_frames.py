"""No nameless frames in printed stacks: a real Python process that calls back into Python from C (sorted
with a key, map, reduce, a ctypes qsort callback), raises and catches in a loop (instructions without a
line) and starts short-lived threads (thread states without a Python frame), on every CPython 3.9-3.13 that
pyenv has here. The reader gives every frame a name, a file and a line; `steplens-agent stack` and
`steplens stacks` print a thread without Python frames as <no Python frame> and never `(:-1)`."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import AGENT, FAST_AGENT_TOML, STEPLENS, AgentProc, wait_for
from pytarget import Target
from steplens.agent.pyframes import memory, reader
from steplens.stackfmt import NO_PYTHON_FRAME

HERE = os.path.dirname(os.path.abspath(__file__))
CCALLS = os.path.join(HERE, "pytargets", "ccalls.py")
PYTHONS = {v: p for v in ("3.9", "3.10", "3.11", "3.12", "3.13")
           for p in sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{v}.*/bin/python{v}")))[-1:]}
# a printed frame without a name, a file or a line: "(:-1)", "(:12)", "(file:-1)", a line that is only "(...)"
NAMELESS = re.compile(r"\(:|:-1\)|^\s+\(")


def _bad(frames) -> list:
    return [f for f in frames if not (f.function and f.qualname and f.file and f.line >= 1)]


@pytest.mark.parametrize("version", sorted(PYTHONS))
def test_every_frame_has_a_name_file_and_line(version):
    t = Target([PYTHONS[version], CCALLS, "60"])
    try:
        t.wait_ready()
        proc = reader.attach(t.pid)
        bad, frameless, threads, samples = [], 0, set(), 0
        try:
            start = time.monotonic()
            want = {"key", "compare", "raising", "<lambda>"}
            # until every wanted function was seen (a loaded machine gives the target's five threads little CPU:
            # once, 6 s of back-to-back samples never caught the qsort callback), pausing between samples so
            # the sampler does not take the core from the target
            while time.monotonic() < start + 30.0 and not (want <= threads and time.monotonic() > start + 1.5):
                time.sleep(0.0005)
                try:
                    sample = proc.sample()
                except memory.PyFramesError:
                    continue
                samples += 1
                for th in sample.threads:
                    bad += _bad(th.frames)
                    frameless += not th.frames
                    threads.update(f.function for f in th.frames)
        finally:
            proc.close()
        assert samples > 50 and want <= threads, (samples, threads)
        assert not bad, f"python {version}: {len(bad)} frames without name/file/line, e.g. {bad[:3]}"
        # the CLI: a thread without Python frames is named, no frame prints without name or location
        seen_frameless = False
        for _ in range(40):
            out = subprocess.run([AGENT, "stack", str(t.pid)], capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            assert not [ln for ln in out.stdout.splitlines() if NAMELESS.search(ln)], out.stdout
            seen_frameless |= NO_PYTHON_FRAME in out.stdout
            if seen_frameless:
                break
        assert seen_frameless or frameless == 0, f"python {version}: no frameless thread printed in 40 dumps"
    finally:
        t.close()


def test_steplens_stacks_prints_no_nameless_frames(tmp_path, collector, agents):
    """Through the agent's pystacks summaries and the collector: frameless threads and the "other stacks"
    bucket (max_stacks_per_summary = 2 forces it) print without an empty location."""
    t = Target([sys.executable, CCALLS, "120"])
    try:
        t.wait_ready()
        toml = FAST_AGENT_TOML.replace("[sources.procs]\ninterval_seconds = 0.5\n", textwrap.dedent(r'''
            [sources.procs]
            interval_seconds = 0.3
            patterns = ['ccalls\.py']

            [sources.pystacks]
            interval_seconds = 0.02
            summary_seconds = 1.0
            max_stacks_per_summary = 2
        '''))
        assert "ccalls" in toml
        agents.append(AgentProc(tmp_path, "stk", collector.address, toml=toml).start())

        def printed():
            rows = collector.cli("stacks", "--pid", str(t.pid), "--limit", "500")
            if not rows or not any(not s["frames"] for r in rows for s in r["stacks"]) \
                    or not any(s["frames"] and s["frames"][0][0] == "<other stacks>" for r in rows for s in r["stacks"]):
                return None
            return subprocess.run([STEPLENS, "--collector", collector.address, "--insecure", "stacks", "--pid",
                                   str(t.pid), "--limit", "500"], capture_output=True, text=True, timeout=30).stdout
        human = wait_for(printed, 60, interval=0.5, what="summaries with frameless threads and other stacks")
        assert NO_PYTHON_FRAME in human and "<other stacks>" in human
        assert not [ln for ln in human.splitlines() if NAMELESS.search(ln)], human
    finally:
        t.close()


def test_one_shot_dump_spreads_its_tries_over_time():
    """`steplens-agent stack` retries a torn read after pauses (a descheduled target stays torn while retried
    back to back), gives up after its time, and never retries a process that exited."""
    from steplens.agent import cli
    from steplens.agent.pyframes.reader import TornRead

    class Torn:
        def __init__(self, fails):
            self.fails, self.calls = fails, []

        def sample(self, stop_threads=False):
            self.calls.append(time.monotonic())
            if len(self.calls) <= self.fails:
                raise TornRead("torn")
            return "sample"

    p = Torn(8)
    assert cli._patient_sample(p, False) == "sample" and len(p.calls) == 9
    assert p.calls[-1] - p.calls[0] >= 0.1     # 1+2+4+...+50 ms of pauses between the 9 tries
    p = Torn(10**9)
    t0 = time.monotonic()
    with pytest.raises(TornRead):
        cli._patient_sample(p, False, seconds=0.3)
    assert 0.2 <= time.monotonic() - t0 < 1.0

    class Gone:
        calls = 0

        def sample(self, stop_threads=False):
            Gone.calls += 1
            raise memory.ProcessGone("exited")

    with pytest.raises(memory.ProcessGone):
        cli._patient_sample(Gone(), False)
    assert Gone.calls == 1
