"""`steplens-agent check --json` on this machine: gpu unavailable with the NVML reason, host and procs up."""

import json
import subprocess

import pytest

from conftest import AGENT


def _check(*extra):
    out = subprocess.run([AGENT, "check", "--json", *extra], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _has_nvml() -> bool:
    try:
        import pynvml
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


@pytest.mark.skipif(_has_nvml(), reason="this host has a working NVML; the gpu-marked tests cover it")
def test_check_reports_gpu_unavailable_with_the_nvml_reason():
    report = _check()
    src = report["sources"]
    assert src["host"]["available"] and src["procs"]["available"]
    assert not src["gpu"]["available"]
    assert src["gpu"]["reason"].startswith("NVML unavailable: ")
    import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        assert str(exc) in src["gpu"]["reason"]  # the library's own words, not a paraphrase


def test_check_needs_no_collector_or_tls_settings(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[agent]\ncollector = "10.9.9.9:7707"\n')  # would need TLS to run; check never connects
    report = _check("--config", str(cfg))
    from steplens.agent.sources import SOURCE_PATHS
    assert set(report["sources"]) == set(SOURCE_PATHS)


def test_check_reports_disabled_sources():
    report = _check("--disable", "procs")
    assert report["sources"]["procs"] == {**report["sources"]["procs"], "available": False, "enabled": False,
                                          "reason": "disabled in config"}


def test_check_human_output():
    out = subprocess.run([AGENT, "check"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    lines = {line.split()[0]: line for line in out.stdout.splitlines()}
    assert lines["host"].split()[1] == "up"
    assert lines["gpu"].split()[1] == ("up" if _has_nvml() else "unavailable")


def test_check_says_which_mode_each_ebpf_source_runs_in_and_why():
    """netflows, sched and gpuprobes carry `mode` and `mode_reason` (text output: a `mode` line under the
    source); netflows' mode follows what the kernel accepts, and a refused BTF program type (as
    STEPLENS_EBPF_REFUSE makes this process see it) turns it to the classic build, with the reason."""
    import os
    from steplens.agent.ebpf import REFUSE_ENV, unavailable_reason
    report = _check()["sources"]
    assert all(set(r) >= {"mode", "mode_reason"} for r in report.values())
    assert report["host"]["mode"] == ""
    if unavailable_reason():
        for name in ("netflows", "sched", "gpuprobes"):
            assert report[name]["mode"] == "none" and report[name]["mode_reason"] == report[name]["reason"]
        return
    assert report["netflows"]["mode"] in ("socket-storage", "raw-tracepoints") and report["netflows"]["mode_reason"]
    assert report["sched"]["mode"] == "raw-tracepoints" and report["gpuprobes"]["mode"] == "uprobes"
    out = subprocess.run([AGENT, "check", "--json"], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, **{REFUSE_ENV: "iter"}))
    refused = json.loads(out.stdout)["sources"]["netflows"]
    assert refused["mode"] == "raw-tracepoints" and "iter" in refused["mode_reason"], refused
    out = subprocess.run([AGENT, "check", "--disable", "netflows"], capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    sched = lines.index(next(line for line in lines if line.startswith("sched ")))
    assert lines[sched + 1].split()[:2] == ["mode", "raw-tracepoints:"], lines
    assert not any(line.split()[:1] == ["mode"] and "socket" in line for line in lines)  # disabled: no mode line
