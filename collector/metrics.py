"""The collector's Prometheus /metrics: findings open per job and kind, and the analysis engine's health.

Rendered at scrape time (nothing runs between scrapes): open findings are counted in the store through a
read-only connection; the rest are the engine's counters. Per detector, like node_exporter's collectors:
`steplens_collector_detector_duration_seconds` (histogram), `..._last_duration_seconds`, `..._success` and
`..._runs_total` / `..._errors_total`. Analysis latency: `steplens_collector_analysis_seconds` (one job, all
detectors, merge and commit) and `steplens_collector_analysis_lag_seconds` (newest data of a job to its
findings stored). Cost: one GROUP BY over the open findings per scrape.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


def _hist(name: str, doc: str, h, labels: list[str] | None = None, values: list[str] | None = None,
          fam: HistogramMetricFamily | None = None) -> HistogramMetricFamily:
    fam = fam or HistogramMetricFamily(name, doc, labels=labels)
    fam.add_metric(values or [], h.cumulative(), h.sum)
    return fam


class CollectorExporter:
    def __init__(self, reader, engine, ingest=None, deepdives=None) -> None:
        self.reader = reader
        self.engine = engine
        self.ingest = ingest
        self.deepdives = deepdives
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.scrape_errors = 0

    def collect(self):
        e = self.engine
        opened = GaugeMetricFamily("steplens_collector_findings_open", "Findings open now, per job and kind.",
                                   labels=["job", "kind"])
        try:
            for job, kind, n in self.reader.open_finding_counts():
                opened.add_metric([job, kind], n)
        except Exception:  # the store is busy or gone for a moment: say so, keep the rest
            self.scrape_errors += 1
        yield opened
        yield CounterMetricFamily("steplens_collector_scrape_errors", "Scrapes that could not read the store.",
                                  value=self.scrape_errors)
        changes = CounterMetricFamily("steplens_collector_finding_changes", "Findings opened, updated, resolved "
                                      "(and pending, dropped under `for`).", labels=["action"])
        for action in ("opened", "updated", "resolved", "pending", "dropped"):
            changes.add_metric([action], e.changes.get(action, 0))
        yield changes
        yield GaugeMetricFamily("steplens_collector_detectors", "Registered detectors.", value=len(e.detectors))
        runs = CounterMetricFamily("steplens_collector_detector_runs", "Detector runs.", labels=["detector"])
        errs = CounterMetricFamily("steplens_collector_detector_errors", "Detector runs that raised.",
                                   labels=["detector"])
        last = GaugeMetricFamily("steplens_collector_detector_last_duration_seconds", "Duration of the last run.",
                                 labels=["detector"])
        ok = GaugeMetricFamily("steplens_collector_detector_success", "1 if the last run succeeded.",
                               labels=["detector"])
        dur = HistogramMetricFamily("steplens_collector_detector_duration_seconds", "Detector run time.",
                                    labels=["detector"])
        for name, st in sorted(e.stats.items()):
            runs.add_metric([name], st.runs)
            errs.add_metric([name], st.errors)
            last.add_metric([name], st.last_duration_seconds)
            ok.add_metric([name], 1.0 if st.last_success else 0.0)
            _hist("", "", st.duration, values=[name], fam=dur)
        yield from (runs, errs, last, ok, dur)
        yield _hist("steplens_collector_analysis_seconds", "One job's analysis: every detector, the merge and the "
                    "commit of its findings.", e.cycle)
        yield _hist("steplens_collector_analysis_lag_seconds", "From a job's newest data to its findings stored "
                    "(the loop).", e.lag)
        yield CounterMetricFamily("steplens_collector_analysis_cpu_seconds", "CPU time of the analysis loop.",
                                  value=e.cpu_seconds)
        yield CounterMetricFamily("steplens_collector_analysis_jobs", "Jobs analysed by the loop.",
                                  value=e.jobs_analysed)
        yield CounterMetricFamily("steplens_collector_analysis_passes", "Passes of the loop.", value=e.passes)
        yield GaugeMetricFamily("steplens_collector_analysis_jobs_waiting", "Jobs with new data left for the next "
                                "pass (max_jobs_per_cycle reached).", value=e.jobs_waiting)
        yield CounterMetricFamily("steplens_collector_analysis_store_failures", "Findings merges not committed.",
                                  value=e.store_failures)
        if self.deepdives is not None:
            dd = CounterMetricFamily("steplens_collector_deep_dives", "Deep dives by how they ended up (scheduled: "
                                     "started; done, failed: analysed).", labels=["status"])
            for status, n in sorted(self.deepdives.counts.items()):
                dd.add_metric([status], n)
            yield dd
            sk = CounterMetricFamily("steplens_collector_deep_dives_skipped", "Findings that started no deep dive, "
                                     "by reason (kind, detector, severity, cooldown, rate limit, overhead budget).",
                                     labels=["reason"])
            for why, n in sorted(self.deepdives.skipped.items()):
                sk.add_metric([why], n)
            yield sk
        yield CounterMetricFamily("steplens_collector_analysis_cause_errors", "Passes whose causes step failed "
                                  "(the findings kept the detectors' causes).", value=e.cause_errors)
        yield CounterMetricFamily("steplens_collector_analysis_cause_seconds", "Time spent attaching causes.",
                                  value=e.cause_seconds)
        yield GaugeMetricFamily("steplens_collector_findings_watchers", "WatchFindings streams open.",
                                value=e.hub.watchers)
        if self.ingest is not None:
            yield GaugeMetricFamily("steplens_collector_agents_connected", "Agents with a live stream.",
                                    value=len(self.ingest.sessions))


class MetricsServer:
    """/metrics over HTTP in a daemon thread; close() frees the port."""

    def __init__(self, registry: CollectorRegistry, listen: str) -> None:
        from prometheus_client import start_http_server
        host, sep, port = listen.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"metrics listen address must be HOST:PORT, got {listen!r}")
        self._httpd, self._thread = start_http_server(int(port), addr=host.strip("[]") or "127.0.0.1",
                                                      registry=registry)
        self.port: int = self._httpd.server_address[1]
        self._closed = threading.Event()

    def close(self, timeout_seconds: float = 5.0) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout_seconds)
