"""The line-table decoders against the running interpreter's own tables (and each pyenv version's
through a subprocess that dumps (offset, line) pairs from dis)."""

import glob
import json
import os
import subprocess

import pytest

from steplens.agent.pyframes.linetable import DECODERS

PROBE = r'''
import dis, json, sys
def sample(a, b):
    x = a + b
    if x > 3:
        for i in range(3):
            x += i * (
                2
            )
    y = [v for v in range(x)]
    return y
out = []
def pairs(code):
    """(byte offset, line) for every instruction, from the interpreter's own accessors."""
    if sys.version_info >= (3, 11):
        return [(2 * i, pos[0] if pos[0] is not None else -1) for i, pos in enumerate(code.co_positions())]
    if sys.version_info >= (3, 10):
        res = []
        for start, end, line in code.co_lines():
            res += [(off, line if line is not None else -1) for off in range(start, end, 2)]
        return res
    starts = dict(dis.findlinestarts(code))
    res, line = [], code.co_firstlineno
    for off in range(0, len(code.co_code), 2):
        line = starts.get(off, line)
        res.append((off, line))
    return res
def walk(code):
    out.append({"fl": code.co_firstlineno,
                "table": (code.co_lnotab if sys.version_info < (3, 10) else code.co_linetable).hex(),
                "pairs": pairs(code)})
    for c in code.co_consts:
        if hasattr(c, "co_code"):
            walk(c)
walk(sample.__code__)
print(json.dumps({"minor": sys.version_info[1], "codes": out}))
'''

INTERPRETERS = sorted(glob.glob("/root/.pyenv/versions/3.*/bin/python3.*[0-9]"))


def _fmt(minor):
    return "lnotab39" if minor == 9 else "linetable310" if minor == 10 else "locations311"


@pytest.mark.parametrize("python", [p for p in INTERPRETERS if any(f"/3.{m}." in p for m in (9, 10, 11, 12, 13, 14))]
                         or ["missing"])
def test_decoder_matches_dis(python):
    if python == "missing" or not os.access(python, os.X_OK):
        pytest.skip("no pyenv interpreters here")
    data = json.loads(subprocess.run([python, "-c", PROBE], capture_output=True, text=True, check=True).stdout)
    decode = DECODERS[_fmt(data["minor"])]
    checked = 0
    for code in data["codes"]:
        table = bytes.fromhex(code["table"])
        for offset, line in code["pairs"]:
            assert decode(table, code["fl"], offset) == line, (python, offset)
            checked += 1
    assert checked > 20
