"""Torn reads are never reported: a target whose stacks change all the time (random recursion
through a known set of functions, threads starting and exiting) is sampled thousands of times
without a pause; every reported frame must be one the target can have, at a line inside it."""

import ast
import glob
import os
import subprocess
import sys
import time

import pytest

from steplens.agent.pyframes.reader import attach

TARGET = '''
import random, threading, time
def a(n):
    return b(n - 1) if n > 0 else spin()
def b(n):
    return c(n - 1) if n > 0 else spin()
def c(n):
    return a(n - 1) if n > 0 else spin()
def spin():
    x = 0
    for _ in range(200):
        x += 1
    return x
def churn():
    while True:
        a(random.randint(0, 60))
def short_lived():
    while True:
        t = threading.Thread(target=lambda: a(random.randint(0, 30)))
        t.start()
        t.join()
threading.Thread(target=churn, daemon=True).start()
threading.Thread(target=short_lived, daemon=True).start()
print("ready", flush=True)
churn()
'''

PYTHONS = sorted(glob.glob("/root/.pyenv/versions/3.1[1-3]*/bin/python3")) or [sys.executable]


_SPANS: dict[str, dict[str, list[tuple[int, int]]]] = {}


def _spans(path: str) -> dict[str, list[tuple[int, int]]]:
    """Every function name in a source file -> the line spans of its definitions."""
    if path not in _SPANS:
        tree = ast.parse(open(path, encoding="utf-8").read())
        spans: dict[str, list[tuple[int, int]]] = {"<module>": [(1, 10**6)]}
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                spans.setdefault(n.name, []).append((n.lineno, n.end_lineno))
            elif isinstance(n, ast.Lambda):
                spans.setdefault("<lambda>", []).append((n.lineno, n.end_lineno))
        _SPANS[path] = spans
    return _SPANS[path]


def _plausible(frame) -> bool:
    """The frame names a function that exists in its file, at a line inside that function."""
    if not os.path.exists(frame.file):
        return False
    return any(lo <= frame.line <= hi for lo, hi in _spans(frame.file).get(frame.function, []))


@pytest.mark.parametrize("python", PYTHONS[-2:] + glob.glob("/root/.pyenv/versions/3.9*/bin/python3"))
def test_no_torn_stack_is_reported(tmp_path, python):
    path = tmp_path / "churn.py"
    path.write_text(TARGET)
    proc = subprocess.Popen([python, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        p = attach(proc.pid)
        ok = failed = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                sample = p.sample()
            except Exception as exc:  # a sample may be refused after its retries, never invented
                assert type(exc).__name__ == "TornRead", exc
                failed += 1
                continue
            ok += 1
            for th in sample.threads:
                for f in th.frames:
                    assert _plausible(f), f
        p.close()
        # refusing a sample is right when it cannot be read consistently; it must stay the exception (a loaded
        # 2-core CI run refused 410 against 1,481 read with python 3.9, whose churn this target maximizes)
        assert ok > 200 and failed <= ok // 2, (ok, failed)
        print(f"{python}: {ok} samples, {failed} refused after retries, {p.torn} torn reads retried")
    finally:
        proc.kill()
        proc.wait()
