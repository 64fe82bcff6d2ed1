"""sources.base.glob_dirs: the runtime-directory patterns the flightrec and iters sources poll every second are
listed again only when their parent directory changed, and what they find is what glob finds."""

from __future__ import annotations

import glob
import os
import time

from steplens.agent.sources import base
from steplens.agent.sources.base import glob_dirs, runtime_files


def _counting(monkeypatch) -> list:
    calls = []
    real = glob.glob

    def counted(pattern, *a, **k):
        calls.append(pattern)
        return real(pattern, *a, **k)
    monkeypatch.setattr(base.glob, "glob", counted)
    return calls


def _age(path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_a_settled_parent_is_not_listed_again_until_it_changes(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    (tmp_path / "fr-a").mkdir()
    (tmp_path / "other").mkdir()
    _age(tmp_path, 3600)
    pattern = str(tmp_path / "fr-*")
    assert glob_dirs(pattern) == [str(tmp_path / "fr-a")] and len(calls) == 1
    for _ in range(5):
        assert glob_dirs(pattern) == [str(tmp_path / "fr-a")]
    assert len(calls) == 1                                   # unchanged parent: the listing is reused
    (tmp_path / "fr-b").mkdir()                              # a new job's runtime directory: the parent changes
    assert glob_dirs(pattern) == [str(tmp_path / "fr-a"), str(tmp_path / "fr-b")] and len(calls) == 2
    _age(tmp_path, 3600)
    assert glob_dirs(pattern) == sorted(glob.glob(pattern))
    os.rmdir(tmp_path / "fr-a")                              # and one that went away
    assert glob_dirs(pattern) == [str(tmp_path / "fr-b")]


def test_a_parent_changed_within_the_last_seconds_is_listed_every_time(tmp_path, monkeypatch):
    """Its mtime may not move for an entry added within the same timestamp tick: nothing is remembered yet."""
    calls = _counting(monkeypatch)
    (tmp_path / "fr-a").mkdir()
    pattern = str(tmp_path / "fr-*")
    for _ in range(3):
        assert glob_dirs(pattern) == [str(tmp_path / "fr-a")]
    assert len(calls) == 3


def test_literal_missing_and_deeper_patterns(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    assert glob_dirs(str(tmp_path)) == [str(tmp_path)] and not calls          # no wildcard: itself
    assert glob_dirs(str(tmp_path / "nope" / "fr-*")) == []                   # a parent that is not there
    (tmp_path / "j1").mkdir()
    (tmp_path / "j1" / "fr").mkdir()
    _age(tmp_path, 3600)
    deep = str(tmp_path / "j*" / "fr")
    assert glob_dirs(deep) == [str(tmp_path / "j1" / "fr")] and glob_dirs(deep) == [str(tmp_path / "j1" / "fr")]
    assert calls.count(deep) == 2                                             # wildcards above the last part


def test_runtime_files_through_a_settled_parent(tmp_path):
    d = tmp_path / "steplens-fr-1"
    d.mkdir()
    (d / "12.sock").touch()
    _age(tmp_path, 3600)
    assert runtime_files([str(tmp_path / "steplens-fr-*")], ("sock", "gc")) == {"sock": {12: str(d / "12.sock")},
                                                                               "gc": {}}
    (d / "12.gc").touch()   # a file added inside an existing directory: that directory changed, listed again
    assert runtime_files([str(tmp_path / "steplens-fr-*")], ("sock", "gc"))["gc"] == {12: str(d / "12.gc")}


def test_a_settled_runtime_directory_is_not_listed_again_until_it_changes(tmp_path, monkeypatch):
    """runtime_files lists each directory again only when it changed (a process's file created or removed); a
    directory changed within the last 2 s is listed at every call; the first directory still wins for a pid."""
    first, second = tmp_path / "steplens-fr-a", tmp_path / "steplens-fr-b"
    for d in (first, second):
        d.mkdir()
    (first / "12.sock").touch()
    (second / "12.sock").touch()
    (second / "13.gc").touch()
    (second / "x.sock").touch()          # not a pid: left out
    for d in (first, second, tmp_path):
        _age(d, 3600)
    listed = []
    real = os.listdir
    monkeypatch.setattr(base.os, "listdir", lambda d: listed.append(d) or real(d))
    pattern = [str(tmp_path / "steplens-fr-*")]
    want = {"sock": {12: str(first / "12.sock")}, "gc": {13: str(second / "13.gc")}}
    assert runtime_files(pattern, ("sock", "gc")) == want and len(listed) == 2
    for _ in range(3):
        assert runtime_files(pattern, ("sock", "gc")) == want
    assert len(listed) == 2                                    # settled: the listings are reused
    assert runtime_files(pattern, ("sock",)) == {"sock": want["sock"]} and len(listed) == 4   # other extensions
    (first / "14.sock").touch()                                # a new process's socket: its directory changed
    got = runtime_files(pattern, ("sock", "gc"))
    assert got["sock"] == {12: str(first / "12.sock"), 14: str(first / "14.sock")} and len(listed) == 5
    runtime_files(pattern, ("sock", "gc"))
    assert len(listed) == 6                                    # changed within 2 s: listed again
    os.unlink(first / "14.sock")
    _age(first, 3600)
    assert runtime_files(pattern, ("sock", "gc")) == want      # its exit: gone at the next call
