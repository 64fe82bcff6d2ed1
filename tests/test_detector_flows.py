"""The flows detector (collector/analysis/flows.py): a job seen only through its network flows, judged with the
k-σ rule across its steps, switches, links and DP groups. Flows from the simulator (a 64-GPU DP8 x PP4 x TP2 job
on 4 leaves with DDP buckets and 2 % transfer jitter), as switch mirroring would export them: the detector reads
the flows and the topology file, never the simulator's truth. Then the whole path through a real collector:
`steplens import topology/flows`, `jobs`, `timeline`, `diagnose`."""

from __future__ import annotations

import json
import subprocess

import numpy as np

from conftest import STEPLENS
from steplens.collector.analysis.flowjobs import FlowWindow, analyse, topology_maps
from steplens.collector.analysis.flows import FlowsConfig, diagnose, flag_steps, outliers
from steplens.collector.topology import from_dict
from steplens.sim.faults import parse_fault
from steplens.sim.model import ModelConfig, simulate
from steplens.sim.output import Rows


def sim_flows(specs=(), iterations=30, **over):
    """(flow rows as the store gives them, topology dict, cfg) of a simulated job with faults."""
    kw = dict(dp=8, pp=4, tp=2, iterations=iterations, nodes_per_leaf=2, spines=2, dp_bucket_bytes=25 << 20,
              net_jitter_cv=0.02, seed=3)
    kw.update(over)
    cfg = ModelConfig(**kw)
    topo = cfg.topology()
    gen = Rows(cfg)
    rows = []

    def sink(it):
        for st, a, b, nb, dur, path in gen.flows(it):
            rows.append((st, st + int(dur * 1e9), topo.ip(a), topo.ip(b), nb, json.dumps(list(path)), "import:sim"))
    simulate(cfg, [parse_fault(s, topo) for s in specs], sink=sink)
    rows.sort()
    return rows, topo.topology_file(), cfg


def run(specs=(), **over):
    rows, tdoc, cfg = sim_flows(specs, **over)
    server_of, nic_of = topology_maps(from_dict(tdoc))
    snap = analyse(FlowWindow.from_rows(rows), server_of)
    assert len(snap.jobs) == 1
    return diagnose(snap, snap.jobs[0], nic_of, server_of, FlowsConfig()), snap


def test_healthy_job_has_no_finding():
    found, snap = run()
    assert found == []
    assert snap.sources == ["switch"]


def test_slow_link_is_named_first():
    found, _ = run(["slow_link:n2.nic1:15:30:3"])
    assert len(found) == 1
    f = found[0]
    assert f.suspects[0].kind == "link" and f.suspects[0].id == "n2.nic1"
    assert f.suspects[0].cause == "network" and f.suspects[0].evidence["bandwidth_ratio"] < 0.5
    # its ring neighbours carry a healthy flow too: they are not suspects (no tie with the peer's link)
    assert [s.id for s in f.suspects if s.kind == "link"] == ["n2.nic1"]
    assert "sim-node-2" in [s.id for s in f.suspects if s.kind == "node"]


def test_congested_leaf_is_named_and_explains_its_endpoints():
    found, _ = run(["congested_switch:leaf1:15:30:4"])
    assert len(found) == 1
    f = found[0]
    assert f.kind == "slowdown" and f.severity > 1.05
    assert (f.suspects[0].kind, f.suspects[0].id) == ("switch", "leaf1")
    assert not [s for s in f.suspects if s.kind == "link"], "the leaf's endpoints are explained by it"
    # onset: the step the congestion began (15), within a step
    assert "since step" in f.summary and f.evidence["dp_groups"]


def test_a_slow_gpu_is_a_slowdown_without_a_network_suspect():
    found, _ = run(["slow_gpu:13:15:30:2"])
    assert len(found) == 1 and found[0].kind == "slowdown" and found[0].suspects == ()


def test_k_sigma_uses_the_standard_deviation():
    """The paper's σ = (1/n) Σ (l_i - mean) is identically 0 (erratum): with it every step above the mean
    would be flagged. With the standard deviation, noise stays unflagged and a 3σ step is flagged."""
    rng = np.random.default_rng(1)
    x = 1000 + rng.normal(0, 20, 40)
    cfg = FlowsConfig(min_sigma_fraction=0.001, min_step_ratio=1.0)
    flags, _ = flag_steps(x, cfg)
    assert sum(flags) <= 1
    y = np.concatenate([x, [1200.0]])
    assert flag_steps(y, cfg)[0][-1]
    # low-side outliers: robust with many peers, absolute with few
    assert [k for k, *_ in outliers({"a": 1.0, "b": 0.99, "c": 1.01, "d": 1.0, "e": 0.5}, cfg)] == ["e"]
    assert outliers({"a": 1.0, "b": 0.9}, cfg) == [] and outliers({"a": 0.6}, cfg)[0][0] == "a"


def _steplens(collector, *args):
    out = subprocess.run([STEPLENS, "--collector", collector.address, "--insecure", *args], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_whole_path_import_jobs_timeline_diagnose(tmp_path, collector):
    rows, tdoc, cfg = sim_flows(["slow_link:n2.nic1:15:30:3"])
    (tmp_path / "topology.json").write_text(json.dumps(tdoc))
    with open(tmp_path / "flows.jsonl", "w") as fh:
        for st, en, a, b, nb, sw, _ in rows:
            fh.write(json.dumps({"start": st, "src": a, "dst": b, "switches": json.loads(sw), "bytes": nb,
                                 "duration": (en - st) / 1e9}) + "\n")
    _steplens(collector, "import", "topology", str(tmp_path / "topology.json"))
    _steplens(collector, "import", "flows", str(tmp_path / "flows.jsonl"), "--format", "json")
    jobs = json.loads(_steplens(collector, "jobs", "--json"))
    assert len(jobs) == 1
    j = jobs[0]
    assert j["source"] == "flows" and j["job_key"].startswith("flows-") and j["flow_sources"] == ["switch"]
    assert sorted(j["endpoints"]) == sorted(cfg.topology().ip(r) for r in range(cfg.gpus))
    assert len(j["nodes"]) == 8 and j["steps"] >= 20 and j["step_seconds"] > 0
    types = {p["type"] for p in j["pairs"]}
    assert {"dp", "pp"} <= types and types <= {"dp", "pp", "ep", "tp"}
    assert all({"a", "b", "type"} <= set(p) for p in j["pairs"])
    tl = json.loads(_steplens(collector, "timeline", j["job_key"], "--json"))
    assert tl and all({"endpoint", "rank", "step", "start_ns", "end_ns"} <= set(s) for s in tl)
    assert all(s["end_ns"] > s["start_ns"] and s["rank"] is None for s in tl)
    found = json.loads(_steplens(collector, "diagnose", j["job_key"], "--json"))
    assert found and found[0]["detector"] == "flows"
    assert (found[0]["suspects"][0]["kind"], found[0]["suspects"][0]["id"]) == ("link", "n2.nic1")
    listed = json.loads(_steplens(collector, "findings", "--job", j["job_key"], "--json"))
    assert [f["id"] for f in listed] == [found[0]["id"]]
    out = subprocess.run([STEPLENS, "--collector", collector.address, "--insecure", "timeline", "flows-nonesuch"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no job 'flows-nonesuch'" in out.stderr


def test_the_analysis_loop_finds_flow_jobs_on_its_own(tmp_path):
    """The engine's pass: flows arrived, no job known from processes; the flow analysis recognizes the job and
    runs the flows detector on it, whose finding is stored under the flow job's key; a pass with no new flows
    analyses nothing again."""
    import threading

    from steplens.collector.analysis import load_spec
    from steplens.collector.analysis.engine import AnalysisEngine
    from steplens.collector.store.diagnosis import write_topology
    from steplens.collector.store.queries import Reader
    from steplens.collector.store.writer import StoreJob, StoreWriter
    rows, tdoc, _ = sim_flows(["slow_link:n2.nic1:15:30:3"])
    path = str(tmp_path / "s.db")
    writer = StoreWriter(path)
    writer.start()
    try:
        def put(conn):
            write_topology(conn, from_dict(tdoc), "test", 1)
            conn.executemany("INSERT INTO flows(agent_id, start_ns, end_ns, src, sport, dst, dport, bytes, packets,"
                             " pid, origin, switches) VALUES ('import',?,?,?,0,?,0,?,0,0,?,?)",
                             [(st, en, a, b, nb, origin, sw) for st, en, a, b, nb, sw, origin in rows])
            return len(rows)
        done = threading.Event()
        assert writer.submit(StoreJob(put, lambda *a: done.set())) and done.wait(60)
        eng = AnalysisEngine(Reader(path), writer, detectors={"flows": load_spec("flows")})
        assert eng.flowview is not None
        assert eng.run_pass() == 1 and eng.stats["flows"].runs == 1 and eng.flowview.analyses == 1
        (f,) = Reader(path).findings(open_only=True)
        assert f.job_key.startswith("flows-") and f.detector == "flows"
        assert (f.suspects[0].kind, f.suspects[0].id) == ("link", "n2.nic1")
        assert eng.run_pass() == 0 and eng.flowview.analyses == 1
        # flows keep arriving (here: a few late ones), and a job whose newest data is a second older than the
        # newest flow (its detectors' window) is served the kept analysis, not a new one: no flow analysis per
        # job and pass
        def late(conn):
            conn.executemany("INSERT INTO flows(agent_id, start_ns, end_ns, src, sport, dst, dport, bytes, packets,"
                             " pid, origin, switches) VALUES ('import',?,?,?,0,?,0,?,0,0,?,?)",
                             [(st, en, a, b, nb, origin, sw) for st, en, a, b, nb, sw, origin in rows[:3]])
            return 3
        done = threading.Event()
        assert writer.submit(StoreJob(late, lambda *a: done.set())) and done.wait(60)
        snap = eng.flowview.snapshot(Reader(path), eng.flowview._snap.until_ns - 10**9)
        assert snap is eng.flowview._snap and eng.flowview.analyses == 1
    finally:
        writer.stop()


def _recorded_testbed_flows():
    import gzip
    import os
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "testbed-flows")
    with gzip.open(os.path.join(here, "link-h1.jsonl.gz"), "rt") as fh:
        head = json.loads(fh.readline())
        rows = [tuple(json.loads(line)) for line in fh if line.strip()]
    with open(os.path.join(here, "topology.json")) as fh:
        tdoc = json.load(fh)
    return head["fault"], rows, tdoc


def test_recorded_testbed_link_fault_names_the_hosts_link():
    """Real eBPF flows of the testbed's DP2 x PP2 job with h1's link at 200 Mbit/s (fixtures/testbed-flows): from
    3 s into the fault on, the flows detector leads with h1's link. Two things make it so: each flow is judged
    against its own directed pair's history (the pipeline's forward bursts, which hold compute between messages,
    are ~3x slower as bytes / duration than its backward ones: a pooled baseline of every pipeline flow called
    h1's slowed backward flows normal), and an endpoint talking to two peers is also judged per direction."""
    fault, rows, tdoc = _recorded_testbed_flows()
    server_of, nic_of = topology_maps(from_dict(tdoc))
    t0 = fault["start_ns"]
    tops = []
    for sec in (4, 6, 8, 10):
        until = t0 + sec * 10**9
        window = [r for r in rows if until - 30 * 10**9 <= r[0] < until]
        snap = analyse(FlowWindow.from_rows(window, ignore_ports=(7707,)), server_of)
        job = max(snap.jobs, key=lambda j: len(j.timeline))
        assert sorted(job.endpoints) == ["10.77.0.10", "10.77.0.11", "10.77.0.12", "10.77.0.13"]
        found = diagnose(snap, job, nic_of, server_of, FlowsConfig())
        assert len(found) == 1 and found[0].kind == "slowdown" and found[0].severity > 3
        assert abs(found[0].onset_ns - t0) < 0.5e9
        tops.append(found[0].suspects[0].id if found[0].suspects else None)
    assert tops == ["h1.eth0"] * 4, tops
