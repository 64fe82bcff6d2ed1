"""Writes deploy/grafana/dashboards/steplens.json, the steplens Grafana dashboard (provisioning-ready: the data
source is a template variable, no ids bound to one Grafana). Run after changing a panel:

    python3 deploy/grafana/make_dashboard.py

tests/test_deploy.py checks the file is this script's output and that every metric its queries name is one the
collector or the agents export. Rows: findings (what is wrong, where), agents (who reports, how well), the
collector's analysis, and GPUs and hosts from the agents under dcgm-exporter's names (so an existing DCGM panel and
this one read the same series).
"""

from __future__ import annotations

import json
import os

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dashboards", "steplens.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
GPU = 'Hostname=~"$host"'


class Layout:
    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.y = 0
        self.x = 0
        self.row_h = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        self.newline()
        self.panels.append({"type": "row", "title": title, "id": self._id(), "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def newline(self) -> None:
        if self.x:
            self.y += self.row_h
            self.x, self.row_h = 0, 0

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def add(self, kind: str, title: str, targets: list[tuple[str, str]], w: int = 8, h: int = 8, unit: str = "",
            description: str = "", instant: bool = False, **options) -> None:
        if self.x + w > 24:
            self.newline()
        panel = {
            "type": kind, "title": title, "id": self._id(), "datasource": DS, "description": description,
            "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
            "targets": [{"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i),
                         **({"instant": True, "range": False, "format": "table"} if instant else {})}
                        for i, (expr, legend) in enumerate(targets)],
            "fieldConfig": {"defaults": {"unit": unit} if unit else {}, "overrides": []},
            "options": options,
        }
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def dashboard() -> dict:
    d = Layout()
    d.row("Findings: what is wrong, where")
    d.add("stat", "Open findings", [("sum(steplens_collector_findings_open{job_key=~\"$job_key\"}) or vector(0)", "")],
          w=4, h=5, description="Findings open now (steplens findings --open).")
    d.add("stat", "Hangs", [("sum(steplens_collector_findings_open{kind=\"hang\", job_key=~\"$job_key\"}) or vector(0)",
                             "")], w=4, h=5, description="Jobs hung now: every GPU of the job idles until the "
                                                         "collective times out.")
    d.add("table", "Open findings by job and kind",
          [("sum by (job_key, kind) (steplens_collector_findings_open{job_key=~\"$job_key\"})", "")], w=16, h=10,
          instant=True, description="`steplens findings --job JOB --open` gives each one's suspects, cause and "
                                    "evidence; `steplens trace JOB --finding ID` its merged trace.")
    d.add("timeseries", "Findings open by kind", [("sum by (kind) (steplens_collector_findings_open{job_key=~\"$job_key\"})",
                                                   "{{kind}}")], w=8, h=8)
    d.add("timeseries", "Finding changes", [("sum by (action) (rate(steplens_collector_finding_changes_total[5m]))",
                                             "{{action}}")], w=12, h=8, unit="ops")
    d.add("timeseries", "Deep dives", [("sum by (status) (rate(steplens_collector_deep_dives_total[15m]))", "{{status}}")],
          w=12, h=8, unit="ops", description="Synchronized deep dives the collector started on findings, by outcome.")

    d.row("Agents: who reports, how well")
    d.add("stat", "Agents connected", [("sum(steplens_collector_agents_connected)", "")], w=4, h=5)
    d.add("stat", "Agents silent > 2 min", [("count(steplens_collector_agent_last_seen_age_seconds > 120) or vector(0)",
                                             "")], w=4, h=5, description="Nodes whose jobs are not watched now.")
    d.add("timeseries", "Ingest rate", [("sum(rate(steplens_collector_ingest_records_total[5m]))", "records/s")],
          w=8, h=8, unit="short")
    d.add("timeseries", "Last report age", [("steplens_collector_agent_last_seen_age_seconds", "{{node}}")], w=8, h=8,
          unit="s")
    d.add("timeseries", "Clock uncertainty", [("steplens_collector_agent_clock_uncertainty_seconds", "{{node}}")],
          w=8, h=8, unit="s", description="How well each node's clock maps to cluster time (cross-node order).")
    d.add("timeseries", "Spool backlog", [("steplens_collector_agent_spool_backlog_batches", "{{node}}")], w=8, h=8,
          unit="short")
    d.add("timeseries", "Agent CPU", [("steplens_collector_agent_cpu_cores", "{{node}}")], w=8, h=8, unit="short",
          description="The agent's own CPU, in cores.")
    d.add("table", "Sources down", [("steplens_collector_agent_source_up == 0", "")], w=8, h=8, instant=True,
          description="`steplens nodes` gives each one's reason.")

    d.row("Analysis")
    d.add("timeseries", "Findings lag their data (p50, p90)",
          [("histogram_quantile(0.5, sum by (le) (rate(steplens_collector_analysis_lag_seconds_bucket[5m])))", "p50"),
           ("histogram_quantile(0.9, sum by (le) (rate(steplens_collector_analysis_lag_seconds_bucket[5m])))", "p90")],
          w=8, h=8, unit="s")
    d.add("timeseries", "Detector run time (p90)",
          [("histogram_quantile(0.9, sum by (le, detector) (rate(steplens_collector_detector_duration_seconds_bucket[5m])))",
            "{{detector}}")], w=8, h=8, unit="s")
    d.add("stat", "Detectors failing", [("count(steplens_collector_detector_success == 0) or vector(0)", "")], w=8, h=8)

    d.row("GPUs (dcgm-exporter names, from the agents)")
    for title, metric, unit in (("GPU utilization", "DCGM_FI_DEV_GPU_UTIL", "percent"),
                                ("SM clock", "DCGM_FI_DEV_SM_CLOCK", "rotmhz"),
                                ("Power", "DCGM_FI_DEV_POWER_USAGE", "watt"),
                                ("Temperature", "DCGM_FI_DEV_GPU_TEMP", "celsius"),
                                ("Framebuffer used", "DCGM_FI_DEV_FB_USED", "mbytes"),
                                ("NVLink bandwidth", "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "short")):
        d.add("timeseries", title, [(f"{metric}{{{GPU}}}", "{{Hostname}} gpu{{gpu}}")], w=8, h=8, unit=unit)
    d.add("timeseries", "Clock throttle reasons (bitmask)", [(f"steplens_gpu_clocks_event_reasons{{{GPU}}}",
                                                              "{{Hostname}} gpu{{gpu}}")], w=8, h=8,
          description="NVML clocks event reasons: 0x4 SW power cap, 0x8 HW slowdown, 0x20 SW thermal, 0x40 HW thermal.")
    d.add("table", "Last XID per GPU", [(f"DCGM_FI_DEV_XID_ERRORS{{{GPU}}} > 0", "")], w=8, h=8, instant=True)
    d.add("timeseries", "Host CPU busy", [("avg by (instance) (steplens_host_cpu_utilization_percent)", "{{instance}}")],
          w=8, h=8, unit="percent", description="From the agents' host source (steplens_host_*).")
    d.newline()
    return {
        "title": "steplens", "uid": "steplens-overview", "tags": ["steplens", "gpu", "training"],
        "description": "steplens findings (hangs, slowdowns, network), its agents and the GPUs they watch.",
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "30s", "timezone": "",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            {"name": "job_key", "label": "Job", "type": "query", "datasource": DS, "refresh": 2, "includeAll": True,
             "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
             "query": {"query": "label_values(steplens_collector_findings_open, job_key)", "refId": "job_key"},
             "definition": "label_values(steplens_collector_findings_open, job_key)"},
            {"name": "host", "label": "GPU host", "type": "query", "datasource": DS, "refresh": 2, "includeAll": True,
             "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
             "query": {"query": "label_values(DCGM_FI_DEV_GPU_UTIL, Hostname)", "refId": "host"},
             "definition": "label_values(DCGM_FI_DEV_GPU_UTIL, Hostname)"},
        ]},
        "annotations": {"list": []},
        "panels": d.panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as fh:
        fh.write(render())
    print(OUT)
