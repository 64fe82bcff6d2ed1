"""A real agent serves /metrics with its own health and host telemetry (scraped over HTTP)."""

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from conftest import AgentProc, free_port, wait_for


def test_agent_serves_metrics(tmp_path, collector, agents):
    port = free_port()
    a = AgentProc(tmp_path, "prom", collector.address, extra=["--metrics-listen", f"127.0.0.1:{port}"]).start()
    agents.append(a)

    def scrape():
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            return None
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        up = {s.labels["source"]: s.value for s in fams.get("steplens_agent_source_up", type("x", (), {"samples": []})).samples}
        return fams if up.get("host") == 1 and "steplens_host_cpu_utilization_percent" in fams else None
    fams = wait_for(scrape, 20, what="/metrics with host up")
    up = {s.labels["source"]: s.value for s in fams["steplens_agent_source_up"].samples}
    assert {k: up[k] for k in ("host", "procs", "gpu", "pystacks")} == {"host": 1.0, "procs": 1.0, "gpu": 0.0,
                                                                          "pystacks": 1.0}
    from steplens.agent.sources import SOURCE_PATHS
    assert set(up) == set(SOURCE_PATHS)
    produced = [s.value for s in fams["steplens_agent_records_produced"].samples if s.name.endswith("_total")]
    assert produced and produced[0] > 0
    assert a.stop() == 0
