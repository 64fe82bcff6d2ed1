"""exporter: the agent's Prometheus /metrics, built from the latest records the sources produced.

LatestValues keeps the newest value per (metric name, entity) and the newest GpuInfo per GPU index, fed by
the runner with every step's records. AgentExporter is a custom collector on its own CollectorRegistry that
renders, at scrape time:
  * GPU metrics under dcgm-exporter names and labels (gpu, UUID, pci_bus_id, device, modelName, Hostname),
    using gpu.DCGM_NAMES for names and unit factors, so existing DCGM dashboards work unchanged; other
    gpu_* metrics as steplens_gpu_<name> with the same labels (+ pid / link where the entity has one);
  * everything else as steplens_host_<name>, labelled by what the entity is (cpu, device, pid);
  * the agent's own health as steplens_agent_* from the runner's health() dict.
dcgm-exporter declares ENERGY and PCIE_REPLAY as counters without a `_total` suffix, which prometheus_client
cannot emit under their exact names; they are exported untyped so the names stay identical.
Cost: proportional to the number of series held; no work happens between scrapes.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric as PromMetric

from steplens.agent.records import GpuInfo, Metric, ProcessExit
from steplens.agent.sources.gpu import DCGM_NAMES

_DCGM_LABELS = ["gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname"]
_DCGM_UNTYPED = {"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"}
_DCGM_HELP = {
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %).",
    "DCGM_FI_DEV_MEM_COPY_UTIL": "Memory utilization (in %).",
    "DCGM_FI_DEV_SM_CLOCK": "SM clock frequency (in MHz).",
    "DCGM_FI_DEV_MEM_CLOCK": "Memory clock frequency (in MHz).",
    "DCGM_FI_DEV_GPU_TEMP": "GPU temperature (in C).",
    "DCGM_FI_DEV_MEMORY_TEMP": "Memory temperature (in C).",
    "DCGM_FI_DEV_POWER_USAGE": "Power draw (in W).",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "Total energy consumption since boot (in mJ).",
    "DCGM_FI_DEV_FB_FREE": "Framebuffer memory free (in MiB).",
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB).",
    "DCGM_FI_DEV_XID_ERRORS": "Value of the last XID error encountered.",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "Total number of PCIe retries.",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": "Total NVLink bandwidth, all links, TX+RX (as DCGM: KiB/s / 1000).",
}
# host metric name prefix -> label the entity goes into
_HOST_LABEL = (("cpu_", "cpu"), ("network_", "device"), ("disk_", "device"))


@dataclass
class _Sample:
    value: float
    mono_ns: int
    seen_ns: int


class LatestValues:
    """Thread-safe latest value per (metric name, entity) and latest GpuInfo per index.

    Series of an exited process are dropped on its ProcessExit; any series not refreshed for
    stale_after_seconds is dropped at the next snapshot, so a vanished NIC or GPU process does not linger.
    """

    def __init__(self, stale_after_seconds: float = 300.0, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[tuple[str, str], _Sample] = {}
        self._gpus: dict[int, GpuInfo] = {}
        self._stale_ns = int(stale_after_seconds * 1e9)
        self._clock = clock

    def observe(self, records: list) -> None:
        now = self._clock()
        with self._lock:
            for r in records:
                if isinstance(r, Metric):
                    self._metrics[(r.name, r.entity)] = _Sample(r.value, r.mono_ns, now)
                elif isinstance(r, GpuInfo):
                    self._gpus[r.index] = copy.copy(r)
                elif isinstance(r, ProcessExit):
                    gone = f"pid:{r.pid}:{r.start_ticks}"
                    gpu_suffix = f":pid:{r.pid}"
                    for key in [k for k in self._metrics if k[1] == gone or (k[1].startswith("gpu") and k[1].endswith(gpu_suffix))]:
                        del self._metrics[key]

    def snapshot(self) -> tuple[dict[tuple[str, str], float], dict[int, GpuInfo]]:
        """(metrics {(name, entity): value}, gpus {index: GpuInfo}), both copies."""
        now = self._clock()
        with self._lock:
            for key in [k for k, s in self._metrics.items() if now - s.seen_ns > self._stale_ns]:
                del self._metrics[key]
            return ({k: s.value for k, s in self._metrics.items()}, {i: copy.copy(g) for i, g in self._gpus.items()})


def _family(name: str, doc: str, labels: list[str], counter: bool):
    if counter:
        return CounterMetricFamily(name.removesuffix("_total"), doc, labels=labels)
    return GaugeMetricFamily(name, doc, labels=labels)


class AgentExporter:
    """prometheus_client custom collector; `registry` holds only this collector."""

    def __init__(self, latest: LatestValues, health: Callable[[], dict], hostname: str) -> None:
        self.latest = latest
        self.health = health
        self.hostname = hostname
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def describe(self):
        return []  # families depend on what the sources have seen; rendered at scrape time

    def collect(self):
        metrics, gpus = self.latest.snapshot()
        yield from self._gpu_families(metrics, gpus)
        yield from self._host_families(metrics)
        yield from self._health_families(self.health())

    # -- GPU -------------------------------------------------------------------------------------

    def _gpu_labels(self, index: int, gpus: dict[int, GpuInfo]) -> list[str]:
        info = gpus.get(index)
        return [str(index), info.uuid if info else "", info.pci_bus_id if info else "", f"nvidia{index}",
                info.name if info else "", self.hostname]

    def _gpu_families(self, metrics: dict, gpus: dict):
        families: dict[str, PromMetric] = {}
        for (name, entity), value in sorted(metrics.items()):
            if not name.startswith("gpu_") or not entity.startswith("gpu"):
                continue
            head, _, rest = entity.partition(":")
            try:
                index = int(head[3:])
            except ValueError:
                continue
            labels = self._gpu_labels(index, gpus)
            extra_names: list[str] = []
            if rest.startswith("pid:"):
                extra_names, labels = ["pid"], labels + [rest[4:]]
            elif rest.startswith("nvlink"):
                extra_names, labels = ["link"], labels + [rest[6:]]
            dcgm = DCGM_NAMES.get(name)
            if dcgm is not None and not extra_names:
                prom_name, factor = dcgm
                fam = families.get(prom_name)
                if fam is None:
                    doc = _DCGM_HELP.get(prom_name, prom_name)
                    fam = (PromMetric(prom_name, doc, "unknown") if prom_name in _DCGM_UNTYPED
                           else GaugeMetricFamily(prom_name, doc, labels=_DCGM_LABELS))
                    families[prom_name] = fam
                if isinstance(fam, GaugeMetricFamily):
                    fam.add_metric(labels, value * factor)
                else:
                    fam.add_sample(prom_name, dict(zip(_DCGM_LABELS, labels)), value * factor)
                continue
            prom_name = f"steplens_{name}"
            key = f"{prom_name}|{','.join(extra_names)}"
            fam = families.get(key)
            if fam is None:
                fam = _family(prom_name, f"steplens gpu source: {name}", _DCGM_LABELS + extra_names, name.endswith("_total"))
                families[key] = fam
            fam.add_metric(labels, value)
        return list(families.values())

    # -- host ------------------------------------------------------------------------------------

    def _host_families(self, metrics: dict):
        families: dict[str, PromMetric] = {}
        for (name, entity), value in sorted(metrics.items()):
            if name.startswith("gpu_"):
                continue
            if entity.startswith("pid:"):
                parts = entity.split(":")
                label_names, label_values = ["pid", "start_ticks"], parts[1:3]
            elif entity == "":
                label_names, label_values = [], []
            else:
                label = next((lbl for prefix, lbl in _HOST_LABEL if name.startswith(prefix)), "entity")
                label_names, label_values = [label], [entity]
            prom_name = f"steplens_host_{name}"
            key = f"{prom_name}|{','.join(label_names)}"
            fam = families.get(key)
            if fam is None:
                fam = _family(prom_name, f"steplens host source: {name}", label_names, name.endswith("_total"))
                families[key] = fam
            fam.add_metric(label_values, value)
        return list(families.values())

    # -- agent health ----------------------------------------------------------------------------

    def _health_families(self, h: dict):
        sources = h.get("sources", {})
        up = GaugeMetricFamily("steplens_agent_source_up", "1 if the source is running, 0 if down.", labels=["source"])
        dur = GaugeMetricFamily("steplens_agent_source_duration_seconds", "Duration of the source's last step.", labels=["source"])
        steps = CounterMetricFamily("steplens_agent_source_steps", "Steps run by the source.", labels=["source"])
        errs = CounterMetricFamily("steplens_agent_source_errors", "Errors counted for the source.", labels=["source"])
        recs = CounterMetricFamily("steplens_agent_source_records", "Records produced by the source.", labels=["source"])
        for name, s in sorted(sources.items()):
            up.add_metric([name], 1.0 if s.get("up") else 0.0)
            dur.add_metric([name], float(s.get("last_duration_seconds", 0.0)))
            steps.add_metric([name], float(s.get("steps", 0)))
            errs.add_metric([name], float(s.get("errors", 0)))
            recs.add_metric([name], float(s.get("records", 0)))
        yield from (up, dur, steps, errs, recs)
        for key, doc in (("records_produced", "Records produced by all sources."),
                         ("records_acked", "Records the collector acknowledged."),
                         ("records_dropped", "Records dropped by the spool (reported as gaps)."),
                         ("queue_dropped", "Records dropped from the runner's queue.")):
            c = CounterMetricFamily(f"steplens_agent_{key}", doc)
            c.add_metric([], float(h.get(key, 0)))
            yield c
        for key, doc in (("spool_backlog_batches", "Batches waiting in the spool."),
                         ("spool_backlog_bytes", "Bytes waiting in the spool."),
                         ("connected", "1 if the stream to the collector is up.")):
            g = GaugeMetricFamily(f"steplens_agent_{key}", doc)
            g.add_metric([], float(h.get(key, 0)))
            yield g
        mode = GaugeMetricFamily("steplens_agent_mode", "1 for the agent's current mode.", labels=["mode"])
        current = h.get("mode", "sentinel")
        for m in ("sentinel", "deep"):
            mode.add_metric([m], 1.0 if m == current else 0.0)
        yield mode


class MetricsServer:
    """A running /metrics HTTP server; close() stops it and frees the port."""

    def __init__(self, httpd, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self.host = httpd.server_address[0]
        self.port: int = httpd.server_address[1]
        self._closed = False

    def close(self, timeout_seconds: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout_seconds)


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"listen address must be HOST:PORT, got {listen!r}")
    host = host.strip("[]") or "0.0.0.0"
    p = int(port)
    if not 0 <= p <= 65535:
        raise ValueError(f"port out of range in {listen!r}")
    return host, p


def serve_metrics(exporter: AgentExporter, listen: str) -> MetricsServer:
    """Serve exporter.registry over HTTP on HOST:PORT (port 0: any free port) in a daemon thread."""
    from prometheus_client import start_http_server

    host, port = parse_listen(listen)
    httpd, thread = start_http_server(port, addr=host, registry=exporter.registry)
    return MetricsServer(httpd, thread)
