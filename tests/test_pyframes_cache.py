"""The sampler's caches do not outlive the code objects they name.

Decoded frames are memoized by their bytes, a thread's last walk is reused below the first frame found
unchanged, and an unchanged stack is reused whole; all of these trust the code objects named in the
frames, as the code-object cache does, for at most `revalidate_seconds`. Here a target parks a thread in
`alpha`, frees it, and compiles `beta` until its code object lands at the very address alpha's had (and
parks the thread in it): after revalidate_seconds, samples must name beta, never alpha.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

import pytest

from steplens.agent.pyframes.reader import attach

FAKE = "/nonexistent/steplens_swap_target_code.py"
TARGET = f'''
import gc, sys, threading
SRC = "def {{name}}(ev):\\n    x = 1\\n    ev.wait()\\n    return x\\n"

def make(name):
    ns = {{}}
    exec(compile(SRC.format(name=name), {FAKE!r}, "exec"), ns)
    return ns[name]

holder = {{"f": make("alpha")}}
ev1, ev2, back, go = (threading.Event() for _ in range(4))

def worker():
    holder["f"](ev1)
    back.set()
    go.wait()
    holder["f"](ev2)

threading.Thread(target=worker, daemon=True).start()
old = id(holder["f"].__code__)
print("alpha", flush=True)
sys.stdin.readline()
ev1.set()
back.wait()
del holder["f"]
gc.collect()
keep = []
for _ in range(5000):
    f = make("beta")
    if id(f.__code__) == old:
        break
    keep.append(f)
holder["f"] = f
go.set()
print("beta", id(f.__code__) == old, flush=True)
sys.stdin.readline()
'''

PYTHONS = sorted(glob.glob("/root/.pyenv/versions/3.1[1-4]*/bin/python3")) or [sys.executable]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (/proc/PID/mem of another process)")


def _names(proc) -> list[str]:
    """The function names of FAKE frames, over every thread of one sample."""
    return [f.function for t in proc.sample().threads for f in t.frames if f.file == FAKE]


@needs_root
@pytest.mark.parametrize("python", PYTHONS[-3:])
def test_code_object_at_a_reused_address_is_not_named_stale(tmp_path, python):
    path = tmp_path / "swap.py"
    path.write_text(TARGET)
    t = subprocess.Popen([python, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert t.stdout.readline().split() == ["alpha"]
        p = attach(t.pid, revalidate_seconds=0.3)
        try:
            deadline = time.monotonic() + 5
            while _names(p) != ["alpha"]:
                assert time.monotonic() < deadline, "the worker never showed up parked in alpha"
                time.sleep(0.01)
            for _ in range(50):   # fill every cache with alpha: memo, chains, unchanged-stack reuse
                assert _names(p) == ["alpha"]
            t.stdin.write("\n")
            t.stdin.flush()
            word, reused = t.stdout.readline().split()
            assert word == "beta"
            if reused != "True":
                pytest.skip("beta's code object did not land at alpha's address in this run")
            time.sleep(0.5)   # past revalidate_seconds
            seen = [_names(p) for _ in range(20)]
        finally:
            p.close()
        assert all(names == ["beta"] for names in seen), seen
    finally:
        t.kill()
        t.wait()
