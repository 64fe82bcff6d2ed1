"""The collector's Prometheus /metrics: findings open per job and kind, the analysis engine's health, the ingest
rate, and per agent its stream, last report, clock uncertainty, spool backlog and sources (deploy/prometheus has
alert rules over them, deploy/grafana a dashboard).

Rendered at scrape time (nothing runs between scrapes): open findings are counted in the store through a
read-only connection; the rest are the engine's counters. Per detector, like node_exporter's collectors:
`steplens_collector_detector_duration_seconds` (histogram), `..._last_duration_seconds`, `..._success` and
`..._runs_total` / `..._errors_total`. Analysis latency: `steplens_collector_analysis_seconds` (one job, all
detectors, merge and commit) and `steplens_collector_analysis_lag_seconds` (newest data of a job to its
findings stored). Cost: one GROUP BY over the open findings and one read of the agents table per scrape.
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
                                   labels=["job_key", "kind"])
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
        own = getattr(e, "ownership", None)
        if own is not None:   # several collectors on one store: each job's analysis on one of them
            yield GaugeMetricFamily("steplens_collector_collectors_live", "Collectors with a fresh heartbeat in "
                                    "this store (this one included).", value=max(1, len(own.live)))
            yield CounterMetricFamily("steplens_collector_analysis_jobs_elsewhere", "Jobs with new data left to the "
                                      "collector that owns them.", value=e.jobs_elsewhere)
            yield CounterMetricFamily("steplens_collector_heartbeat_errors", "Heartbeats or live-set reads that "
                                      "failed.", value=own.errors)
        fs = getattr(e.fetch, "stats", None)
        if fs is not None:   # node-local detail the detectors fetched (control/fetch.py thread_fetcher)
            yield CounterMetricFamily("steplens_collector_detail_fetch_asks", "FetchDetail asks the detectors' "
                                      "fetches sent to agents.", value=fs["asks"])
            rows = CounterMetricFamily("steplens_collector_detail_fetch_rows", "Rows the detectors' fetches got, "
                                       "from the agents or from what the collector kept ([analysis] "
                                       "fetch_cache_rows).", labels=["source"])
            rows.add_metric(["agents"], fs["rows_agents"])
            rows.add_metric(["kept"], fs["rows_kept"])
            yield rows
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
            yield CounterMetricFamily("steplens_collector_streams_refused", "Agent streams refused (bad hello, "
                                      "schema version, identity).", value=self.ingest.streams_refused)
            w = self.ingest.writer
            yield CounterMetricFamily("steplens_collector_ingest_batches", "Agent batches stored (acked).",
                                      value=getattr(w, "batches_written", 0))
            yield CounterMetricFamily("steplens_collector_ingest_records", "Records stored from agent batches (the "
                                      "ingest rate: rate() of this).", value=getattr(w, "records_written", 0))
        yield from self._agents()

    def _agents(self):
        """Per agent known to the store (connected or not): what an alert on an agent that stops reporting, a
        clock that is not trustworthy or a spool that backs up needs. Ages and uncertainties are the collector's
        own figures (its cluster clock), so they do not depend on the Prometheus server's clock."""
        fams = {
            "connected": GaugeMetricFamily("steplens_collector_agent_connected", "1 while the agent's stream is "
                                           "live.", labels=["node"]),
            "age": GaugeMetricFamily("steplens_collector_agent_last_seen_age_seconds", "Seconds since the agent "
                                     "last sent anything (batch, status, clock probe answer).", labels=["node"]),
            "unc": GaugeMetricFamily("steplens_collector_agent_clock_uncertainty_seconds", "Stated uncertainty of "
                                     "the agent's clock mapping to cluster time.", labels=["node"]),
            "backlog": GaugeMetricFamily("steplens_collector_agent_spool_backlog_batches", "Batches in the agent's "
                                         "spool not yet acknowledged.", labels=["node"]),
            "cpu": GaugeMetricFamily("steplens_collector_agent_cpu_cores", "The agent's own CPU use, in cores.",
                                     labels=["node"]),
            "stored": CounterMetricFamily("steplens_collector_agent_records_stored", "Records of this agent "
                                          "stored.", labels=["node"]),
            "dropped": CounterMetricFamily("steplens_collector_agent_records_dropped", "Records the agent dropped "
                                           "(spool full, ...), as it reports.", labels=["node"]),
            "gaps": CounterMetricFamily("steplens_collector_agent_gaps", "Gaps in the agent's data it reported.",
                                        labels=["node"]),
            "src": GaugeMetricFamily("steplens_collector_agent_source_up", "1 if the agent's source is running.",
                                     labels=["node", "source"]),
        }
        try:
            nodes = self.reader.nodes()
        except Exception:  # the store is busy or gone for a moment: counted with the other scrape errors
            self.scrape_errors += 1
            nodes = []
        now = self.ingest.clock.now_ns() if self.ingest is not None else None
        for n in nodes:
            node = n["node_id"]
            fams["connected"].add_metric([node], 1.0 if n["connected"] else 0.0)
            if now is not None and n["last_seen_ns"]:
                fams["age"].add_metric([node], max(0.0, (now - n["last_seen_ns"]) / 1e9))
            if n["clock_samples"]:
                fams["unc"].add_metric([node], n["clock_uncertainty_ns"] / 1e9)
            fams["backlog"].add_metric([node], n["spool_backlog"] or 0)
            fams["cpu"].add_metric([node], n["agent_cpu_cores"])
            fams["stored"].add_metric([node], n["records_stored"] or 0)
            fams["dropped"].add_metric([node], n["records_dropped"] or 0)
            fams["gaps"].add_metric([node], n["gaps"] or 0)
            for src, st in n["sources"].items():
                fams["src"].add_metric([node, src], 1.0 if st["up"] else 0.0)
        yield from fams.values()


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
