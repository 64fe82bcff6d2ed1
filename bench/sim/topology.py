"""Cluster topology of the simulator: rank -> GPU -> NIC (one per GPU, a rail) -> leaf -> spine.

Rank r runs on GPU r (node r // gpus_per_node, local index r % gpus_per_node). Link ids name a GPU's
NIC (`n12.nic3`), switch ids are `leaf<k>` and `spine<k>`. A flow between GPUs of one node goes over
NVLink and touches no switch; between nodes under one leaf its path is [leaf]; otherwise
[leaf(src), spine(hash), leaf(dst)] with a deterministic spine choice (ECMP-like, no Python hash()).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    gpus: int
    gpus_per_node: int = 8
    nodes_per_leaf: int = 32
    spines: int = 8

    @property
    def nodes(self) -> int:
        return (self.gpus + self.gpus_per_node - 1) // self.gpus_per_node

    @property
    def leaves(self) -> int:
        return (self.nodes + self.nodes_per_leaf - 1) // self.nodes_per_leaf

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def device_of(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def link_of(self, rank: int) -> str:
        return f"n{rank // self.gpus_per_node}.nic{rank % self.gpus_per_node}"

    def rank_of_link(self, link: str) -> int:
        node, nic = link.split(".")
        if not node.startswith("n") or not nic.startswith("nic"):
            raise ValueError(f"bad link id {link!r} (want n<node>.nic<k>)")
        n, k = int(node[1:]), int(nic[3:])
        if k >= self.gpus_per_node or n >= self.nodes:
            raise ValueError(f"link {link!r} is not in a cluster of {self.nodes} nodes x {self.gpus_per_node} GPUs")
        return n * self.gpus_per_node + k

    def leaf_of_node(self, node: int) -> str:
        return f"leaf{node // self.nodes_per_leaf}"

    def ip(self, rank: int) -> str:
        n = rank // self.gpus_per_node
        return f"10.{(n >> 8) & 255}.{n & 255}.{10 + rank % self.gpus_per_node}"

    def path(self, src: int, dst: int) -> tuple[str, ...]:
        """Switches a flow src -> dst crosses; () when both GPUs share a node (NVLink)."""
        na, nb = src // self.gpus_per_node, dst // self.gpus_per_node
        if na == nb:
            return ()
        la, lb = na // self.nodes_per_leaf, nb // self.nodes_per_leaf
        if la == lb:
            return (f"leaf{la}",)
        spine = (na * 7 + nb * 13 + src % self.gpus_per_node) % self.spines
        return (f"leaf{la}", f"spine{spine}", f"leaf{lb}")

    def switches(self) -> list[str]:
        return [f"leaf{i}" for i in range(self.leaves)] + ([f"spine{i}" for i in range(self.spines)]
                                                           if self.leaves > 1 else [])

    def port_of(self, rank: int) -> str:
        """The RDMA device/port of rank's NIC on its node, as /sys/class/infiniband names it (`mlx5_<k>/1`, one
        single-port HCA per GPU): the entity of the agent's ib_port_* metrics and the topology file's NIC `port`."""
        return f"mlx5_{self.device_of(rank)}/1"

    def topology_file(self, node_id=None) -> dict:
        """This cluster in the collector's topology file format (collector/topology.py, README "Topology file"):
        node ids are the emulated agents' (`sim-node-<n>`, one agent per node: `stream`'s default), one NIC per
        GPU (`n<n>.nic<k>`, its link id as in faults and flows, port `mlx5_<k>/1`) under the node's leaf, every
        leaf linked to every spine."""
        node_id = node_id or (lambda n: f"sim-node-{n}")
        spines = [f"spine{i}" for i in range(self.spines)] if self.leaves > 1 else []
        nodes = []
        for n in range(self.nodes):
            ranks = range(n * self.gpus_per_node, min(self.gpus, (n + 1) * self.gpus_per_node))
            nodes.append({"id": node_id(n), "hostname": f"n{n}",
                          "nics": [{"id": self.link_of(r), "switch": self.leaf_of_node(n), "ip": self.ip(r),
                                    "port": self.port_of(r)} for r in ranks],
                          "gpus": [{"index": self.device_of(r), "nic": self.link_of(r)} for r in ranks]})
        return {"format": "steplens-topology", "version": 1,
                "name": f"steplens-sim {self.gpus} GPUs",
                "switches": [{"id": f"leaf{i}", "tier": "leaf"} for i in range(self.leaves)] +
                            [{"id": s, "tier": "spine"} for s in spines],
                "links": [{"a": f"leaf{i}", "b": s} for i in range(self.leaves) for s in spines],
                "nodes": nodes}

    def write_topology_file(self, path: str, node_id=None) -> str:
        import json
        with open(path, "w") as fh:
            json.dump(self.topology_file(node_id), fh)
        return path

    def to_json(self) -> dict:
        return {"gpus": self.gpus, "gpus_per_node": self.gpus_per_node, "nodes_per_leaf": self.nodes_per_leaf,
                "spines": self.spines, "nodes": self.nodes, "leaves": self.leaves}
