"""The topology file: validation (every problem listed, nothing imported), import through the real CLI into a
real collector, GetTopology, the files the simulator and the testbed write, and the model's lookups."""

import json
import os
import sqlite3
import subprocess

import grpc
import pytest

from conftest import BIN, STEPLENS
from steplens.collector.topology import TopologyError, from_dict, parse
from steplens.sim.topology import Topology as SimTopology
from steplens.testbed import netns
from steplens.v1 import control_pb2 as cpb
from steplens.v1 import control_pb2_grpc as cgrpc

GOOD = {"format": "steplens-topology", "version": 1, "name": "two leaves",
        "switches": [{"id": "leaf0", "tier": "leaf"}, {"id": "leaf1", "tier": "leaf"},
                     {"id": "spine0", "tier": "spine"}, {"id": "spine1", "tier": "spine"}],
        "links": [{"a": "leaf0", "b": "spine0"}, {"a": "leaf0", "b": "spine1"},
                  {"id": "l1s0", "a": "leaf1", "b": "spine0", "speed_gbps": 800}, {"a": "leaf1", "b": "spine1"}],
        "nodes": [{"id": "node-a", "hostname": "gpu-a",
                   "nics": [{"id": "a.nic0", "switch": "leaf0", "ip": "10.0.0.1", "speed_gbps": 400, "port": "mlx5_0/1"},
                            {"id": "a.nic1", "switch": "leaf0", "ip": "10.0.0.2"}],
                   "gpus": [{"index": 0, "nic": "a.nic0", "uuid": "GPU-1"}, {"index": 1, "nic": "a.nic1"}]},
                  {"id": "node-b", "nics": [{"id": "b.nic0", "switch": "leaf1"}],
                   "gpus": [{"index": 0, "id": "b-gpu0", "nic": "b.nic0"}]}]}


def _cli(collector, *args, check=True):
    out = subprocess.run([STEPLENS, "--collector", collector.address, "--insecure", *args], capture_output=True,
                         text=True, timeout=60)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def _bad(doc) -> list[str]:
    with pytest.raises(TopologyError) as exc:
        from_dict(doc)
    return exc.value.problems


def _with(**changes) -> dict:
    doc = json.loads(json.dumps(GOOD))
    doc.update(changes)
    return doc


def test_good_document_and_lookups():
    t = from_dict(GOOD)
    assert t.counts() == {"nodes": 2, "gpus": 3, "nics": 3, "switches": 4, "links": 4}
    assert t.gpus["node-a.gpu0"].nic == "a.nic0" and t.gpus["b-gpu0"].node == "node-b"
    assert t.gpu_at("node-a", 1).id == "node-a.gpu1" and t.gpu_at("node-b", 5) is None
    assert t.nic_by_ip("10.0.0.2").id == "a.nic1"
    assert t.links["l1s0"].speed_gbps == 800 and "leaf0-spine0" in t.links
    assert t.nics["a.nic0"].port == "mlx5_0/1" and t.nics["a.nic1"].port == ""
    # ECMP: both spines, each path NIC, leaf, link, spine, link, leaf, NIC
    assert sorted(t.paths("a.nic0", "b.nic0")) == [
        ("a.nic0", "leaf0", "leaf0-spine0", "spine0", "l1s0", "leaf1", "b.nic0"),
        ("a.nic0", "leaf0", "leaf0-spine1", "spine1", "leaf1-spine1", "leaf1", "b.nic0")]
    assert t.paths("a.nic0", "a.nic1") == [("a.nic0", "leaf0", "a.nic1")]
    assert t.downstream_nics("leaf0") == 2 and t.downstream_nics("spine0") == 3
    # canonical form round-trips, and its digest does not depend on key order
    again = from_dict(json.loads(json.dumps(t.to_dict())))
    assert again.to_dict() == t.to_dict() and again.digest() == t.digest()


@pytest.mark.parametrize("doc, expect", [
    (_with(version=2), "version: expected 1"),
    (_with(colour="red"), "colour: unknown key"),
    (_with(switches=[{"id": "leaf0", "tier": "leaf"}, {"id": "leaf0", "tier": "spine"}]),
     "switches[1].id: duplicate id 'leaf0' (first defined at switches[0].id)"),
    (_with(switches=[{"id": "leaf0", "tier": "tor"}]), "switches[0].tier: must be one of leaf, spine, core"),
    (_with(links=[{"a": "leaf0", "b": "nowhere"}]), "links[0].b: unknown switch 'nowhere'"),
    (_with(links=[{"a": "leaf0", "b": "spine0"}, {"a": "spine0", "b": "leaf0"}]), "links[1]: duplicate link"),
    (_with(links=[{"a": "leaf0", "b": "leaf0"}]), "two different switches"),
    (_with(nodes=[{"id": "n", "nics": [{"id": "n.nic0", "switch": "leaf9"}], "gpus": []}]),
     "nodes[0].nics[0].switch: unknown switch 'leaf9'"),
    (_with(nodes=[{"id": "n", "nics": [{"id": "n.nic0", "switch": "leaf0"}],
                   "gpus": [{"index": 0, "nic": "b.nic0"}]}]), "nodes[0].gpus[0].nic: 'b.nic0' is not a NIC of node 'n'"),
    (_with(nodes=[{"id": "n", "nics": [{"id": "n.nic0", "switch": "leaf0"}],
                   "gpus": [{"index": 0, "nic": "n.nic0"}, {"index": 0, "nic": "n.nic0"}]}]), "duplicate GPU index 0"),
    (_with(nodes=[{"id": "leaf0", "nics": [], "gpus": []}]), "nodes[0].id: duplicate id 'leaf0'"),
    (_with(nodes=[{"id": "n", "nics": [{"id": "n.nic0", "switch": "leaf0", "ip": "10.0.0.300"}]}]), "not an IP"),
    (_with(nodes=[{"id": "bad id", "nics": []}]), "nodes[0].id: id must be"),
    (_with(nodes=[{"id": "n", "nics": [{"id": "n.nic0", "switch": "leaf0", "port": "mlx5_0"}]}]),
     "nodes[0].nics[0].port: must be `<rdma device>/<port number>`"),
    (_with(nodes=[{"id": "n", "nics": [{"id": "n.nic0", "switch": "leaf0", "port": 1}]}]),
     "nodes[0].nics[0].port: must be a string"),
    (_with(nodes=[{"id": "n", "gpus": [{"index": -1, "nic": "x"}]}]), "index: must be an integer >= 0"),
    (_with(nodes=[]), "the topology has no node"),
    (_with(nodes={"id": "n"}), "nodes: must be a list"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_documents_say_where(doc, expect):
    problems = _bad(doc)
    assert any(expect in p for p in problems), problems


def test_every_problem_is_listed():
    doc = _with(links=[{"a": "leaf0", "b": "x"}], nodes=[{"id": "n", "nics": [{"id": "n.nic0", "switch": "y"}],
                                                          "gpus": [{"index": 0, "nic": "z"}]}])
    assert len(_bad(doc)) >= 3
    with pytest.raises(TopologyError, match="not JSON"):
        parse("{nope")


def test_import_and_get_through_the_cli(tmp_path, collector):
    path = tmp_path / "fabric.json"
    path.write_text(json.dumps(GOOD))
    out = json.loads(_cli(collector, "import", "topology", str(path), "--json").stdout)
    assert out["version"] == 1 and out["origin"] == "fabric.json"
    assert {k: out[k] for k in ("nodes", "gpus", "nics", "switches", "links")} == from_dict(GOOD).counts()
    got = collector.cli("topology")
    assert got["version"] == 1 and got["digest"] == from_dict(GOOD).digest() and got["name"] == "two leaves"
    assert from_dict(got["topology"]).to_dict() == from_dict(GOOD).to_dict()
    # a second import is the new current version; the first stays in the store
    path.write_text(json.dumps(_with(name="v2")))
    assert "imported topology v2" in _cli(collector, "import", "topology", str(path)).stdout
    assert collector.cli("topology")["name"] == "v2"
    db = sqlite3.connect(f"file:{collector.db}?mode=ro", uri=True)
    assert [r[0] for r in db.execute("SELECT version FROM topologies ORDER BY version")] == [1, 2]


def test_bad_file_imports_nothing(tmp_path, collector):
    assert collector.cli("topology") is None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_with(nodes=[{"id": "n", "nics": [{"id": "n.nic0", "switch": "leaf9"}],
                                            "gpus": [{"index": 0, "nic": "n.nic0"}]}, {"id": "n", "nics": []}])))
    out = _cli(collector, "import", "topology", str(bad), check=False)
    assert out.returncode == 2 and "nothing imported" in out.stderr
    assert "nodes[0].nics[0].switch: unknown switch 'leaf9'" in out.stderr and "duplicate id 'n'" in out.stderr
    (tmp_path / "broken.json").write_text('{"version": 1, "switches": [')
    out = _cli(collector, "import", "topology", str(tmp_path / "broken.json"), check=False)
    assert out.returncode == 2 and "not JSON" in out.stderr
    # the collector validates too: a client that skips the CLI's check gets INVALID_ARGUMENT, nothing stored
    with grpc.insecure_channel(collector.address) as ch:
        stub = cgrpc.ControlStub(ch)
        with pytest.raises(grpc.RpcError) as exc:
            stub.ImportTopology(cpb.ImportTopologyRequest(origin="raw", topology_json=bad.read_text()), timeout=10)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "leaf9" in exc.value.details()
        assert stub.GetTopology(cpb.TopologyRequest(), timeout=10).version == 0
    assert collector.cli("topology") is None


def test_simulator_writes_an_importable_file(tmp_path, collector):
    out = tmp_path / "sim"
    run = subprocess.run([os.path.join(BIN, "steplens-sim"), "run", "--gpus", "512", "--dp", "64", "--pp",
                          "8", "--iterations", "2", "--emit", "none", "--out", str(out)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(_cli(collector, "import", "topology", str(out / "topology.json"), "--json").stdout)
    assert (got["nodes"], got["gpus"], got["nics"], got["switches"], got["links"]) == (64, 512, 512, 10, 16)
    t = from_dict(collector.cli("topology")["topology"])
    sim = SimTopology(512)
    # the file agrees with the simulator's own model: NIC per rank, its leaf, and the switches on every path
    for rank in (0, 9, 300, 511):
        node = sim.node_of(rank)
        g = t.gpu_at(f"sim-node-{node}", sim.device_of(rank))
        assert g.nic == sim.link_of(rank) and t.nics[g.nic].switch == sim.leaf_of_node(node)
        assert t.nics[g.nic].ip == sim.ip(rank)
    sim_path = sim.path(0, 300)
    switches = {tuple(x for x in p if x in t.switches) for p in t.paths(sim.link_of(0), sim.link_of(300))}
    assert tuple(sim_path) in switches and len(switches) == sim.spines


def test_testbed_writes_an_importable_file(tmp_path, collector):
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(netns.topology_file(netns.Layout(state_dir=str(tmp_path), hosts=4))))
    got = json.loads(_cli(collector, "import", "topology", str(path), "--json").stdout)
    assert (got["nodes"], got["nics"], got["switches"], got["gpus"]) == (4, 4, 1, 0)
    t = from_dict(collector.cli("topology")["topology"])
    assert sorted(t.nodes) == ["h0", "h1", "h2", "h3"] and t.nic_by_ip("10.77.0.12").node == "h2"
