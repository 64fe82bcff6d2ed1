"""Every command has --help and is in the README (the contract list stays true)."""

import os
import re
import subprocess

import pytest

from conftest import AGENT, COLLECTOR, REPO, STEPLENS

COMMANDS = [
    (AGENT, ["run"]), (AGENT, ["check"]), (AGENT, ["print-config"]), (AGENT, ["stack"]), (AGENT, ["record"]), (AGENT, ["env"]), (AGENT, ["parse"]),
    (COLLECTOR, ["serve"]), (COLLECTOR, ["allinone"]),
    (STEPLENS, ["nodes"]), (STEPLENS, ["gpus"]), (STEPLENS, ["procs"]), (STEPLENS, ["gaps"]), (STEPLENS, ["stacks"]),
    (STEPLENS, ["flows"]), (STEPLENS, ["import"]), (STEPLENS, ["detail"]), (STEPLENS, ["commops"]), (STEPLENS, ["comms"]),
    (STEPLENS, ["deep"]), (STEPLENS, ["jobs"]), (STEPLENS, ["findings"]), (STEPLENS, ["diagnose"]),
    (STEPLENS, ["topology"]), (STEPLENS, ["timeline"]), (STEPLENS, ["trace"]), (STEPLENS, ["completion"]),
]


def _readme():
    with open(os.path.join(REPO, "README.md")) as fh:
        return fh.read()


@pytest.mark.parametrize("binary, sub", COMMANDS, ids=[f"{os.path.basename(b)} {' '.join(s)}" for b, s in COMMANDS])
def test_command_has_help_and_is_documented(binary, sub):
    out = subprocess.run([binary, *sub, "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "usage:" in out.stdout
    name = os.path.basename(binary)
    assert re.search(rf"`{re.escape(name)}( --collector HOST:PORT)? {sub[0]}", _readme()), \
        f"README.md does not document `{name} {sub[0]}`"


def test_every_subcommand_is_listed_here():
    """A new subcommand must be added to COMMANDS (and so to the README)."""
    for binary in (AGENT, COLLECTOR, STEPLENS):
        out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30).stdout
        subs = set(re.search(r"\{([a-z,-]+)\}", out).group(1).split(","))
        assert subs == {s[0] for b, s in COMMANDS if b == binary}, binary


def test_readme_starts_with_the_two_commands():
    head = _readme()[:1500]
    assert "make run" in head and "make test" in head
