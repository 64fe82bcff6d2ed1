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
