"""Prometheus exporter: scraped over real HTTP on loopback and parsed with prometheus_client's parser."""

from __future__ import annotations

import socket
import time
import urllib.request

import psutil
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from steplens.agent.exporter import AgentExporter, LatestValues, parse_listen, serve_metrics
from steplens.agent.records import GpuInfo, Metric, ProcessExit
from steplens.agent.sources.base import HostContext
from steplens.agent.sources.host import HostConfig, HostSource

HEALTH = {
    "sources": {
        "host": {"up": True, "reason": "", "last_duration_seconds": 0.0004, "steps": 12, "errors": 0, "records": 500},
        "gpu": {"up": False, "reason": "NVML unavailable: NVML Shared Library Not Found", "last_duration_seconds": 0.0,
                "steps": 0, "errors": 3, "records": 0},
    },
    "records_produced": 500, "records_acked": 480, "records_dropped": 7, "queue_dropped": 2,
    "spool_backlog_batches": 3, "spool_backlog_bytes": 4096, "connected": True, "mode": "deep",
}


@pytest.fixture(autouse=True)
def _restore_procfs_path():
    saved = psutil.PROCFS_PATH
    yield
    psutil.PROCFS_PATH = saved


@pytest.fixture
def served():
    servers = []

    def start(latest: LatestValues, health=lambda: HEALTH):
        exporter = AgentExporter(latest, health, hostname="node-a")
        server = serve_metrics(exporter, "127.0.0.1:0")
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.close()


def scrape(server) -> dict[str, list]:
    """{sample name: [(labels, value), ...]} from a real HTTP GET of /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    samples: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def one(samples, name, **labels):
    hits = [v for lbl, v in samples.get(name, []) if all(lbl.get(k) == v2 for k, v2 in labels.items())]
    assert len(hits) == 1, (name, labels, samples.get(name))
    return hits[0]


def test_host_metrics_from_a_real_step(served):
    src = HostSource(HostContext(node_id="t"), HostConfig())
    src.start()
    latest = LatestValues()
    latest.observe(src.step())
    time.sleep(0.1)  # a few clock ticks, so every core has a /proc/stat difference
    records = src.step()
    latest.observe(records)
    server = served(latest)
    s = scrape(server)
    mem = next(m.value for m in records if m.name == "memory_total_bytes")
    assert one(s, "steplens_host_memory_total_bytes") == mem == psutil.virtual_memory().total
    lo_rx = next(m.value for m in records if m.name == "network_receive_bytes_total" and m.entity == "lo")
    assert one(s, "steplens_host_network_receive_bytes_total", device="lo") == lo_rx
    for i in range(psutil.cpu_count()):
        assert 0 <= one(s, "steplens_host_cpu_utilization_percent", cpu=f"cpu{i}") <= 100
    assert {"load1", "load5", "load15"} <= {n.removeprefix("steplens_host_") for n in s}
    # no GPU records were observed: no DCGM families at all
    assert not [n for n in s if n.startswith("DCGM_")]


def test_health_dict(served):
    s = scrape(served(LatestValues()))
    assert one(s, "steplens_agent_source_up", source="host") == 1.0
    assert one(s, "steplens_agent_source_up", source="gpu") == 0.0
    assert one(s, "steplens_agent_source_duration_seconds", source="host") == 0.0004
    assert one(s, "steplens_agent_source_errors_total", source="gpu") == 3
    assert one(s, "steplens_agent_source_records_total", source="host") == 500
    assert one(s, "steplens_agent_records_produced_total") == 500
    assert one(s, "steplens_agent_records_acked_total") == 480
    assert one(s, "steplens_agent_records_dropped_total") == 7
    assert one(s, "steplens_agent_queue_dropped_total") == 2
    assert one(s, "steplens_agent_spool_backlog_batches") == 3
    assert one(s, "steplens_agent_spool_backlog_bytes") == 4096
    assert one(s, "steplens_agent_connected") == 1
    assert one(s, "steplens_agent_mode", mode="deep") == 1
    assert one(s, "steplens_agent_mode", mode="sentinel") == 0


def test_gpu_records_map_to_dcgm_names_and_labels(served):
    latest = LatestValues()
    uuid0 = "GPU-1c4d3a7e-0000-1111-2222-333344445555"
    latest.observe([
        GpuInfo(1, 0, uuid0, name="NVIDIA H100 80GB HBM3", pci_bus_id="00000000:18:00.0", memory_total_bytes=85520809984),
        GpuInfo(1, 1, "GPU-other", name="NVIDIA H100 80GB HBM3", pci_bus_id="00000000:2A:00.0"),
        Metric(2, "gpu_utilization_percent", "gpu0", 87.0),
        Metric(2, "gpu_utilization_percent", "gpu1", 3.0),
        Metric(2, "gpu_memory_utilization_percent", "gpu0", 41.0),
        Metric(2, "gpu_memory_used_bytes", "gpu0", 1024 * (1 << 20)),
        Metric(2, "gpu_memory_free_bytes", "gpu0", 80000 * (1 << 20)),
        Metric(2, "gpu_sm_clock_mhz", "gpu0", 1980.0),
        Metric(2, "gpu_memory_clock_mhz", "gpu0", 2619.0),
        Metric(2, "gpu_temperature_celsius", "gpu0", 45.0),
        Metric(2, "gpu_memory_temperature_celsius", "gpu0", 52.0),
        Metric(2, "gpu_power_watts", "gpu0", 312.5),
        Metric(2, "gpu_energy_millijoules_total", "gpu0", 123456789.0),
        Metric(2, "gpu_xid_last", "gpu0", 79.0),
        Metric(2, "gpu_pcie_replay_total", "gpu0", 4.0),
        Metric(2, "gpu_nvlink_bytes_per_second", "gpu0", 1024 * 1000 * 250.0),
        Metric(2, "gpu_ecc_uncorrected_errors_total", "gpu0", 1.0),
        Metric(2, "gpu_nvlink_transmit_bytes_total", "gpu0:nvlink3", 2048.0),
        Metric(2, "gpu_process_memory_used_bytes", "gpu0:pid:4242", 512.0),
        Metric(2, "process_threads", "pid:4242:999", 17.0),
    ])
    s = scrape(served(latest))
    labels = {"gpu": "0", "UUID": uuid0, "pci_bus_id": "00000000:18:00.0", "device": "nvidia0",
              "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "node-a"}
    assert one(s, "DCGM_FI_DEV_GPU_UTIL", **labels) == 87.0
    assert one(s, "DCGM_FI_DEV_GPU_UTIL", gpu="1", device="nvidia1", UUID="GPU-other") == 3.0
    assert one(s, "DCGM_FI_DEV_MEM_COPY_UTIL", **labels) == 41.0
    assert one(s, "DCGM_FI_DEV_FB_USED", **labels) == 1024.0  # MiB
    assert one(s, "DCGM_FI_DEV_FB_FREE", **labels) == 80000.0
    assert one(s, "DCGM_FI_DEV_SM_CLOCK", **labels) == 1980.0
    assert one(s, "DCGM_FI_DEV_MEM_CLOCK", **labels) == 2619.0
    assert one(s, "DCGM_FI_DEV_GPU_TEMP", **labels) == 45.0
    assert one(s, "DCGM_FI_DEV_MEMORY_TEMP", **labels) == 52.0
    assert one(s, "DCGM_FI_DEV_POWER_USAGE", **labels) == 312.5
    assert one(s, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", **labels) == 123456789.0  # mJ, no _total suffix
    assert one(s, "DCGM_FI_DEV_XID_ERRORS", **labels) == 79.0
    assert one(s, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", **labels) == 4.0
    assert one(s, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", **labels) == 250.0
    assert one(s, "steplens_gpu_ecc_uncorrected_errors_total", **labels) == 1.0
    assert one(s, "steplens_gpu_nvlink_transmit_bytes_total", link="3", **labels) == 2048.0
    assert one(s, "steplens_gpu_process_memory_used_bytes", pid="4242", **labels) == 512.0
    assert one(s, "steplens_host_process_threads", pid="4242", start_ticks="999") == 17.0
    # the per-process and per-link series never leak into DCGM families
    assert all("pid" not in lbl and "link" not in lbl for n, v in s.items() if n.startswith("DCGM_") for lbl, _ in v)

    latest.observe([ProcessExit(3, 4242, 999)])
    metrics, gpus = latest.snapshot()
    assert ("process_threads", "pid:4242:999") not in metrics
    assert ("gpu_process_memory_used_bytes", "gpu0:pid:4242") not in metrics
    assert gpus[0].uuid == uuid0


def test_latest_values_keeps_newest_and_expires_stale():
    now = [0]
    latest = LatestValues(stale_after_seconds=10, clock=lambda: now[0])
    latest.observe([Metric(1, "load1", "", 1.0), Metric(1, "network_receive_bytes_total", "eth9", 5.0)])
    now[0] = 5_000_000_000
    latest.observe([Metric(2, "load1", "", 2.0)])
    metrics, _ = latest.snapshot()
    assert metrics == {("load1", ""): 2.0, ("network_receive_bytes_total", "eth9"): 5.0}
    metrics[("load1", "")] = 99.0  # a copy: the store is untouched
    now[0] = 12_000_000_000
    metrics, _ = latest.snapshot()
    assert metrics == {("load1", ""): 2.0}


def test_own_registry_port_zero_and_clean_close(served):
    latest = LatestValues()
    latest.observe([Metric(1, "load1", "", 0.5)])
    server = served(latest)
    assert server.port > 0
    assert one(scrape(server), "steplens_host_load1") == 0.5
    # nothing registered on the global registry
    assert not [n for n in REGISTRY._names_to_collectors if n.startswith(("steplens_", "DCGM_"))]
    server.close()
    server.close()
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", server.port)) != 0  # port released


def test_parse_listen():
    assert parse_listen("127.0.0.1:9400") == ("127.0.0.1", 9400)
    assert parse_listen("[::1]:0") == ("::1", 0)
    with pytest.raises(ValueError):
        parse_listen("9400")
