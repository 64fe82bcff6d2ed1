"""deploy/: the Prometheus alert rules (checked and unit-tested by promtool, Debian's `prometheus` package, which
`make test` installs), the example Prometheus configuration, and the Grafana dashboard (the generator's output, and
every metric its queries or the rules name is one a real collector or agent exports)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import subprocess
import threading
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROM = os.path.join(REPO, "deploy", "prometheus")
GRAFANA = os.path.join(REPO, "deploy", "grafana")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus; "
                                                             "`make test` installs it as root)")
# PromQL words that look like metric names but are functions, keywords or labels of ours
_NOT_METRICS = {"sum", "by", "max", "min", "avg", "count", "rate", "increase", "histogram_quantile", "and", "or",
                "on", "vector", "label_values", "without", "bool", "le"}


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=PROM)


@needs_promtool
def test_alert_rules_pass_promtool_check_and_their_unit_tests():
    out = _promtool("check", "rules", "steplens-rules.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"SUCCESS: \d+ rules found", out.stdout + out.stderr)
    out = _promtool("test", "rules", "steplens-rules.test.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


@needs_promtool
def test_a_broken_rule_is_caught(tmp_path):
    """The check can fail: a rule whose expression does not parse, and a unit test whose expectation is wrong."""
    bad = tmp_path / "bad.yml"
    bad.write_text(open(os.path.join(PROM, "steplens-rules.yml")).read().replace(
        "steplens_collector_agent_last_seen_age_seconds > 120", "steplens_collector_agent_last_seen_age_seconds >"))
    out = subprocess.run([PROMTOOL, "check", "rules", str(bad)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    shutil.copy(os.path.join(PROM, "steplens-rules.yml"), tmp_path / "steplens-rules.yml")
    wrong = tmp_path / "wrong.test.yml"
    wrong.write_text(open(os.path.join(PROM, "steplens-rules.test.yml")).read().replace(
        "summary: \"steplens collector c1:9500 is down\"", "summary: \"steplens collector c2:9500 is down\""))
    out = subprocess.run([PROMTOOL, "test", "rules", str(wrong)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "SteplensCollectorDown" in out.stdout + out.stderr


@needs_promtool
def test_example_prometheus_config_is_valid():
    out = _promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def _dashboard_module():
    spec = importlib.util.spec_from_file_location("make_dashboard", os.path.join(GRAFANA, "make_dashboard.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _exprs() -> list[str]:
    with open(os.path.join(GRAFANA, "dashboards", "steplens.json")) as fh:
        d = json.load(fh)
    out = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in d["templating"]["list"] if v.get("definition")]
    return out


def _metric_names(expr: str) -> set[str]:
    expr = re.sub(r"label_values\(([^,]+),[^)]*\)", r"\1", expr)   # a variable's query: its label is not a metric
    expr = re.sub(r'"[^"]*"', '""', expr)              # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)              # matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)             # ranges
    expr = re.sub(r"\bby\s*\([^)]*\)|\bon\s*\([^)]*\)|\bwithout\s*\([^)]*\)", "", expr)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return {w for w in words if w not in _NOT_METRICS and not w.startswith("__")}


def test_dashboard_is_the_generators_output_and_valid():
    mod = _dashboard_module()
    with open(mod.OUT) as fh:
        assert fh.read() == mod.render(), "run python3 deploy/grafana/make_dashboard.py"
    d = json.loads(mod.render())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and d["uid"] and d["schemaVersion"] >= 30
    assert {v["name"] for v in d["templating"]["list"]} >= {"datasource", "job_key", "host"}
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}" and t["expr"]


class _Collector:
    """A real collector (in-process, its own event loop thread) with /metrics, and an empty store."""

    def __init__(self, tmp_path) -> None:
        from steplens.collector.server import Collector, CollectorSettings
        self.metrics_port = free_port()
        self.c = Collector(CollectorSettings(db=str(tmp_path / "c.db"), listen=f"127.0.0.1:{free_port()}",
                                             insecure=True, metrics_listen=f"127.0.0.1:{self.metrics_port}"))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.c.start(), self.loop).result(30)

    def text(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.c.stop(0.5), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _agent_text() -> str:
    """An agent's /metrics with a GPU's worth of gpu-source metrics and a host metric fed in."""
    from steplens.agent.exporter import AgentExporter, LatestValues
    from steplens.agent.records import GpuInfo, Metric
    from steplens.agent.sources.gpu import DCGM_NAMES
    latest = LatestValues()
    now = __import__("time").monotonic_ns()
    recs = [GpuInfo(now, 0, "GPU-0", "NVIDIA H100 80GB HBM3", "00000000:19:00.0", 80 << 30, "550.54")]
    recs += [Metric(now, name, "gpu0", 1.0) for name in DCGM_NAMES]
    recs += [Metric(now, "gpu_clocks_event_reasons", "gpu0", 4.0), Metric(now, "cpu_utilization_percent", "", 5.0)]
    latest.observe(recs)
    return generate_latest(AgentExporter(latest, lambda: {}, "gpu-node-001").registry).decode()


def _exported(*texts: str) -> set[str]:
    names = set()
    for text in texts:
        for f in text_string_to_metric_families(text):
            names.add(f.name)
            if f.type == "counter":
                names.add(f.name + "_total")
            if f.type == "histogram":
                names |= {f.name + s for s in ("_bucket", "_sum", "_count")}
            names |= {s.name for s in f.samples}
    return names


def test_every_metric_the_dashboard_and_rules_name_is_exported(tmp_path):
    col = _Collector(tmp_path)
    try:
        collector_text = col.text()
    finally:
        col.stop()
    exported = _exported(collector_text, _agent_text()) | {"up"}
    assert "steplens_collector_agent_last_seen_age_seconds" in exported and "DCGM_FI_DEV_GPU_UTIL" in exported
    with open(os.path.join(PROM, "steplens-rules.yml")) as fh:
        rule_exprs = re.findall(r"^\s*expr:\s*(.+)$", fh.read(), flags=re.M)
    assert len(rule_exprs) >= 10
    used = set()
    for expr in _exprs() + rule_exprs:
        names = _metric_names(expr)
        assert names, expr
        used |= names
    missing = sorted(used - exported)
    assert not missing, f"named but not exported: {missing}"
    # and the check can fail: a name no exporter has
    assert _metric_names("sum(rate(steplens_collector_no_such_thing_total[5m]))") - exported
