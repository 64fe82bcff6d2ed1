"""The committed CPython layout tables equal what genoffsets computes from each interpreter's own
headers (where that interpreter is installed), and the 3.13+ _Py_DebugOffsets reader accepts the
real thing and refuses a wrong field list."""

import glob
import importlib
import os
import shutil
import subprocess
import sys

import pytest

from steplens.agent.pyframes import genoffsets, layouts

PREFIXES = {tuple(map(int, os.path.basename(p).split(".")[:2])): p
            for p in glob.glob("/root/.pyenv/versions/3.*") if os.path.isdir(os.path.join(p, "include"))}


@pytest.mark.parametrize("version", sorted(genoffsets.PER_MINOR))
def test_committed_table_matches_headers(version):
    prefix = PREFIXES.get(version)
    if prefix is None or not shutil.which("cc"):
        pytest.skip(f"no CPython {version[0]}.{version[1]} headers or no C compiler here")
    got_version, table = genoffsets.generate(prefix)
    assert got_version == version
    committed = importlib.import_module(f"steplens.agent.pyframes.layouts.py{version[0]}{version[1]}").OFFSETS
    assert table == committed, "regenerate with `python -m steplens.agent.pyframes.genoffsets PREFIX`"


def test_every_table_builds_a_layout():
    for version in genoffsets.PER_MINOR:
        lay = layouts.for_table(version)
        assert lay.frame_kind == ("interp" if version >= (3, 11) else "object")


def test_debug_offsets_of_a_real_313():
    prefix = PREFIXES.get((3, 13))
    if prefix is None:
        pytest.skip("no CPython 3.13 here")
    proc = subprocess.Popen([os.path.join(prefix, "bin", "python3"), "-c", "import time; time.sleep(30)"])
    try:
        from steplens.agent.pyframes.reader import attach
        import time
        time.sleep(0.3)
        p = attach(proc.pid)
        blob = p.mem.read(p.runtime, layouts.debug_offsets_size((3, 13)))
        d = layouts.parse_debug_offsets(blob, (3, 13))
        assert d["thread_state.current_frame"] == 72  # offsetof(PyThreadState, current_frame) in 3.13
        # a wrong field list (3.14's, applied to a 3.13 runtime) is refused, not misread
        with pytest.raises(layouts.LayoutError):
            layouts.for_debug_offsets(layouts.parse_debug_offsets(blob + b"\0" * 512, (3, 14)), (3, 13))
        p.close()
    finally:
        proc.kill()
        proc.wait()


def test_field_positions_match_the_checked_figures():
    """FACTS.md: thread_state.current_frame sits at byte 184 of _Py_DebugOffsets in 3.13, 208 in 3.14."""
    assert layouts.field_position((3, 13), "thread_state.current_frame") == 184
    assert layouts.field_position((3, 14), "thread_state.current_frame") == 208


def test_unsupported_versions_say_so():
    with pytest.raises(layouts.LayoutError, match="not supported"):
        layouts.for_table((3, 8))
