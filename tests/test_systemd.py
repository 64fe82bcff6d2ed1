"""Checks the systemd units, the no-ebpf drop-in, install.sh and systemd/README.md against each other.

`systemd-analyze verify` loads each unit as systemd would (drop-ins included, through
SYSTEMD_UNIT_PATH) and checks every directive and that ExecStart= is executable. It exits 0 even on
unknown keys or bad values (those are warnings on stderr), so the test fails on any output that
mentions our units. It does not need systemd as PID 1; in the Debian 12 container this was written in
(systemd 252) it prints nothing at all for these units.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SYSTEMD = REPO / "systemd"
INSTALL = SYSTEMD / "install.sh"
README = SYSTEMD / "README.md"
AGENT = "steplens-agent.service"
COLLECTOR = "steplens-collector.service"
NO_EBPF = SYSTEMD / "steplens-agent.service.d" / "no-ebpf.conf"

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed on this host"
)

# Lines verify may print that are about this host, not about our units: warnings from the host's
# own unit files that verify loads as dependencies (network-online.target pulls some in). Anything
# else is a failure. None of these were printed on the host the test was written on.
ENVIRONMENTAL = [
    re.compile(r"^/(usr/)?lib/systemd/system/(?!steplens-)\S+:\d+: "),
    re.compile(r"^/etc/systemd/system/(?!steplens-)\S+:\d+: "),
]


def parse_unit(*paths: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment, in order, across a unit and its drop-ins."""
    entries = []
    for path in paths:
        section = ""
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("["):
                section = line.strip("[]")
                continue
            key, _, value = line.partition("=")
            entries.append((section, key.strip(), value.strip()))
    return entries


def capability_set(entries, key: str) -> set[str]:
    """The set systemd ends up with: empty value resets, "~" lines AND the complement, others OR."""
    caps: set[str] = set()
    for section, k, value in entries:
        if section != "Service" or k != key:
            continue
        if not value:
            caps = set()
        elif value.startswith("~"):
            caps -= set(value[1:].split())
        else:
            caps |= set(value.split())
    return caps


def values(entries, key: str) -> list[str]:
    return [v for s, k, v in entries if s == "Service" and k == key]


def venv_script(name: str) -> str:
    """The console script installed next to the interpreter (the venv's bin/)."""
    script = Path(sys.executable).parent / name
    if script.exists():
        return str(script)
    # Package not installed in this environment yet: any executable lets verify check the rest.
    return sys.executable


def staged_unit_dir(tmp_path: Path, with_no_ebpf: bool) -> Path:
    """Copies of both units with ExecStart= pointed at the venv (verify needs an executable)."""
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    for unit in (AGENT, COLLECTOR):
        text = (SYSTEMD / unit).read_text()
        new, n = re.subn(
            r"^ExecStart=/opt/steplens/bin/(\S+)",
            lambda m: "ExecStart=" + venv_script(m.group(1)),
            text,
            flags=re.M,
        )
        assert n == 1, f"{unit}: expected one ExecStart=/opt/steplens/bin/..."
        (unit_dir / unit).write_text(new)
    if with_no_ebpf:
        dropin = unit_dir / f"{AGENT}.d"
        dropin.mkdir()
        shutil.copy(NO_EBPF, dropin / NO_EBPF.name)
    return unit_dir


def run_verify(unit_dir: Path, *units: str) -> subprocess.CompletedProcess:
    # Trailing ":" keeps the default search path after ours, so targets like
    # network-online.target resolve as on a real host.
    env = dict(os.environ, SYSTEMD_UNIT_PATH=f"{unit_dir}:", SYSTEMD_LOG_COLOR="0")
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", *units],
        capture_output=True,
        text=True,
        env=env,
        # verify loads a bare unit name from the current directory before the search path.
        cwd=unit_dir.parent,
        timeout=60,
    )


def problems(proc: subprocess.CompletedProcess) -> list[str]:
    lines = (proc.stdout + proc.stderr).splitlines()
    return [l for l in lines if l.strip() and not any(p.search(l) for p in ENVIRONMENTAL)]


@needs_systemd_analyze
@pytest.mark.parametrize(
    "units,with_no_ebpf",
    [((AGENT,), False), ((COLLECTOR,), False), ((AGENT,), True)],
    ids=["agent", "collector", "agent+no-ebpf"],
)
def test_systemd_analyze_verify_is_clean(tmp_path, units, with_no_ebpf):
    unit_dir = staged_unit_dir(tmp_path, with_no_ebpf)
    proc = run_verify(unit_dir, *units)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert problems(proc) == []


@needs_systemd_analyze
def test_verify_would_catch_a_bad_directive(tmp_path):
    """Guards the test itself: a bad drop-in line must show up as a problem."""
    unit_dir = staged_unit_dir(tmp_path, with_no_ebpf=True)
    (unit_dir / f"{AGENT}.d" / "zz-bad.conf").write_text("[Service]\nProtectSystem=stric\n")
    proc = run_verify(unit_dir, AGENT)
    assert any("ProtectSystem" in l or "protect system" in l for l in problems(proc))


def test_units_run_the_documented_commands():
    agent = parse_unit(SYSTEMD / AGENT)
    collector = parse_unit(SYSTEMD / COLLECTOR)
    assert values(agent, "ExecStart") == [
        "/opt/steplens/bin/steplens-agent run --config /etc/steplens/agent.toml"
    ]
    assert values(collector, "ExecStart") == [
        "/opt/steplens/bin/steplens-collector serve --config /etc/steplens/collector.toml"
    ]
    assert values(agent, "StateDirectory") == ["steplens-agent"]
    assert values(collector, "StateDirectory") == ["steplens-collector"]
    for unit in (agent, collector):
        assert values(unit, "Restart") == ["on-failure"]
        assert values(unit, "ConfigurationDirectory") == ["steplens"]
        assert values(unit, "NoNewPrivileges") == ["yes"]
        assert values(unit, "ProtectSystem") == ["strict"]
    # The agent flushes its spool for up to 5 s on SIGTERM.
    stop = values(agent, "TimeoutStopSec")
    assert len(stop) == 1 and int(stop[0].rstrip("s")) > 5


def readme_agent_capabilities() -> set[str]:
    text = README.read_text()
    section = text.split("## Agent privileges", 1)[1].split("\n## ", 1)[0]
    # Capability rows of the first table: "| `CAP_X` | why | what breaks |".
    return set(re.findall(r"^\| `(CAP_[A-Z_]+)` \|", section, flags=re.M))


def readme_no_ebpf_capabilities() -> set[str]:
    m = re.search(r"^no-ebpf capabilities: (.*)$", README.read_text(), flags=re.M)
    assert m, "README.md must state the capabilities left by no-ebpf.conf"
    return set(re.findall(r"`(CAP_[A-Z_]+)`", m.group(1)))


def test_readme_capabilities_match_agent_unit():
    agent = parse_unit(SYSTEMD / AGENT)
    bounding = capability_set(agent, "CapabilityBoundingSet")
    ambient = capability_set(agent, "AmbientCapabilities")
    assert bounding, "the agent must limit its bounding set"
    assert ambient <= bounding
    # uid 0: what the agent holds is the bounding set (plus nothing ambient).
    assert readme_agent_capabilities() == bounding | ambient


def test_readme_capabilities_match_agent_with_no_ebpf():
    entries = parse_unit(SYSTEMD / AGENT, NO_EBPF)
    left = capability_set(entries, "CapabilityBoundingSet") | capability_set(
        entries, "AmbientCapabilities"
    )
    assert left == readme_no_ebpf_capabilities()
    assert not left & {"CAP_SYS_ADMIN", "CAP_BPF", "CAP_PERFMON"}


def test_collector_has_no_capabilities():
    collector = parse_unit(SYSTEMD / COLLECTOR)
    assert values(collector, "CapabilityBoundingSet") == [""]
    assert capability_set(collector, "CapabilityBoundingSet") == set()
    assert capability_set(collector, "AmbientCapabilities") == set()
    assert values(collector, "DynamicUser") == ["yes"]
    assert "CapabilityBoundingSet=` (empty)" in README.read_text()


def test_install_sh_parses():
    subprocess.run(["bash", "-n", str(INSTALL)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_install_sh_is_shellcheck_clean():
    proc = subprocess.run(["shellcheck", str(INSTALL)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_install_dry_run_mentions_every_step_and_changes_nothing(tmp_path):
    prefix = tmp_path / "opt" / "steplens"
    units = tmp_path / "units"
    conf = tmp_path / "conf"
    env = dict(os.environ, STEPLENS_UNIT_DIR=str(units), STEPLENS_CONF_DIR=str(conf))
    proc = subprocess.run(
        ["bash", str(INSTALL), "--agent", "--collector", "--no-ebpf", "--dry-run",
         "--prefix", str(prefix)],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for step in ("venv", "pip", "units", "config", "users", "systemd"):
        assert f"==> [{step}]" in out
    expected = [
        f"python3 -m venv --system-site-packages {prefix}",
        f"{prefix}/bin/pip install",
        str(REPO),  # default --from: the checkout the script lives in
        f"{units}/{AGENT}",
        f"{units}/{COLLECTOR}",
        f"{units}/{AGENT}.d/no-ebpf.conf",
        "agent.toml.example",
        f"{conf}/agent.toml",
        "collector.toml.example",
        f"{conf}/collector.toml",
        "daemon-reload",
        f"enable --now {AGENT}",
        f"enable --now {COLLECTOR}",
    ]
    for needle in expected:
        assert needle in out, needle
    assert not prefix.exists() and not units.exists() and not conf.exists()


def test_install_keeps_an_existing_config(tmp_path):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "agent.toml").write_text("# mine\n")
    env = dict(os.environ, STEPLENS_UNIT_DIR=str(tmp_path / "u"), STEPLENS_CONF_DIR=str(conf))
    proc = subprocess.run(
        ["bash", str(INSTALL), "--agent", "--dry-run", "--prefix", str(tmp_path / "p")],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"keep {conf}/agent.toml (exists)" in proc.stdout
    copies = [l for l in proc.stdout.splitlines() if l.startswith("+ install") and "agent.toml" in l]
    assert copies == []


@pytest.mark.parametrize(
    "args", [[], ["--collector", "--no-ebpf"], ["--agent", "--prefix", "relative"], ["--bogus"]]
)
def test_install_rejects_bad_arguments(tmp_path, args):
    proc = subprocess.run(
        ["bash", str(INSTALL), "--dry-run", *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "install.sh: error:" in proc.stderr
