"""The physical topology file (node -> GPUs -> NIC -> leaf -> spine): its format, validation and a lookup model.

One JSON document, read whole, validated whole (every problem listed with its JSON path, nothing accepted
from a file with a problem), then kept by the collector as the current topology (`steplens import topology`).
The same `parse()` runs in the CLI before anything is sent and in the collector before anything is stored.
Format (version 1), documented for operators in README.md ("Topology file"):

    {"format": "steplens-topology", "version": 1, "name": "optional label",
     "switches": [{"id": "leaf0", "tier": "leaf"}, {"id": "spine0", "tier": "spine"}],
     "links": [{"a": "leaf0", "b": "spine0"}],              # switch to switch; "id" defaults to "a-b"
     "nodes": [{"id": "node-0",                             # the agent's node id (`steplens nodes`)
                "hostname": "gpu-host-0",                   # optional
                "nics": [{"id": "n0.nic0", "switch": "leaf0", "ip": "10.0.0.10", "speed_gbps": 400,
                          "port": "mlx5_0/1"}],                     # its InfiniBand device/port on the node
                "gpus": [{"index": 0, "nic": "n0.nic0"}]}]}  # "id" defaults to "<node>.gpu<index>"

Ids share one namespace (a node, NIC, GPU, switch and link may not have the same id) so that a suspect id
names one thing. A NIC is also the id of its link to the switch it hangs from (`n0.nic0`); a switch-to-switch
link has its own id. Optional per object: `uuid`, `pci_bus_id` (GPU), `ip`, `speed_gbps` (NIC, link), `port` (NIC:
its RDMA device and port as /sys/class/infiniband names them, `<device>/<port>`, the entity of the agent's ib_port_*
metrics: how the NIC's port counters are found, collector/analysis/ports.py).
Cost: linear in the size of the file; the model's path search is a BFS over switches only.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections import deque
from dataclasses import dataclass, field

FORMAT = "steplens-topology"
VERSION = 1
TIERS = ("leaf", "spine", "core")
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,127}$")
MAX_PROBLEMS = 20
PORT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}/[0-9]{1,3}$")
_TOP_KEYS = {"format", "version", "name", "switches", "links", "nodes"}
_KEYS = {"switches": {"id", "tier"}, "links": {"id", "a", "b", "speed_gbps"},
         "nodes": {"id", "hostname", "nics", "gpus"}, "nics": {"id", "switch", "ip", "speed_gbps", "port"},
         "gpus": {"id", "index", "nic", "uuid", "pci_bus_id"}}


class TopologyError(ValueError):
    """The document is not a valid topology; .problems lists each problem with its JSON path."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        more = f"\n  (and {len(problems) - MAX_PROBLEMS} more)" if len(problems) > MAX_PROBLEMS else ""
        super().__init__("invalid topology, nothing imported:\n  " + "\n  ".join(problems[:MAX_PROBLEMS]) + more)


@dataclass(frozen=True)
class Switch:
    id: str
    tier: str


@dataclass(frozen=True)
class Link:
    id: str
    a: str
    b: str
    speed_gbps: float = 0.0


@dataclass(frozen=True)
class Nic:
    id: str
    node: str
    switch: str
    ip: str = ""
    speed_gbps: float = 0.0
    port: str = ""     # "<rdma device>/<port>" on its node (the agent's ib_port_* entity), "" unknown


@dataclass(frozen=True)
class Gpu:
    id: str
    node: str
    index: int
    nic: str
    uuid: str = ""
    pci_bus_id: str = ""


@dataclass(frozen=True)
class Node:
    id: str
    hostname: str
    nics: tuple[str, ...]
    gpus: tuple[str, ...]


@dataclass
class Topology:
    """A validated topology with lookups; build it with parse() or from_dict()."""

    name: str = ""
    nodes: dict[str, Node] = field(default_factory=dict)
    nics: dict[str, Nic] = field(default_factory=dict)
    gpus: dict[str, Gpu] = field(default_factory=dict)
    switches: dict[str, Switch] = field(default_factory=dict)
    links: dict[str, Link] = field(default_factory=dict)

    # -- lookups ---------------------------------------------------------------------------
    def gpu_at(self, node: str, index: int) -> Gpu | None:
        for gid in self.nodes[node].gpus if node in self.nodes else ():
            if self.gpus[gid].index == index:
                return self.gpus[gid]
        return None

    def nic_by_ip(self, ip: str) -> Nic | None:
        for n in self.nics.values():
            if n.ip and n.ip == ip:
                return n
        return None

    def neighbours(self, switch: str) -> list[tuple[str, str]]:
        """(other switch, link id) for every switch-to-switch link of a switch."""
        return self._adjacency().get(switch, [])

    def _adjacency(self) -> dict[str, list[tuple[str, str]]]:
        adj = getattr(self, "_adj", None)
        if adj is None:
            adj = {}
            for ln in self.links.values():
                adj.setdefault(ln.a, []).append((ln.b, ln.id))
                adj.setdefault(ln.b, []).append((ln.a, ln.id))
            self._adj = adj
        return adj

    def paths(self, src_nic: str, dst_nic: str, limit: int = 64) -> list[tuple[str, ...]]:
        """Every shortest device path between two NICs (equal-cost paths, ECMP), each as
        (src_nic, switch, link, switch, ..., dst_nic); at most `limit` of them. The NIC ids stand for their
        links to their switches. Same switch: (src_nic, switch, dst_nic). No route: []. Cached per pair (the
        topology does not change once parsed)."""
        cache = self.__dict__.setdefault("_paths", {})
        key = (src_nic, dst_nic, limit)
        got = cache.get(key)
        if got is None:
            if len(cache) > 1_000_000:
                cache.clear()
            got = cache[key] = self._paths_uncached(src_nic, dst_nic, limit)
        return list(got)

    def _paths_uncached(self, src_nic: str, dst_nic: str, limit: int) -> list[tuple[str, ...]]:
        a, b = self.nics[src_nic].switch, self.nics[dst_nic].switch
        if src_nic == dst_nic:
            return [(src_nic,)]
        # BFS from a over switches, keeping every predecessor on a shortest path
        dist, preds = {a: 0}, {a: []}
        q = deque([a])
        while q:
            s = q.popleft()
            if b in dist and dist[s] >= dist[b]:
                continue
            for t, link in self.neighbours(s):
                if t not in dist:
                    dist[t] = dist[s] + 1
                    preds[t] = [(s, link)]
                    q.append(t)
                elif dist[t] == dist[s] + 1:
                    preds[t].append((s, link))
        if b not in dist:
            return []
        out: list[tuple[str, ...]] = []

        def walk(s: str, tail: tuple[str, ...]) -> None:
            if len(out) >= limit:
                return
            if s == a:
                out.append((src_nic, a) + tail + (dst_nic,))
                return
            for p, link in preds[s]:
                walk(p, (link, s) + tail)
        walk(b, ())
        return out

    def downstream_nics(self, switch: str) -> int:
        """NICs below a switch: those it serves directly, or, for a switch above leaves, every NIC reachable
        through switches of a lower tier (used for Holmes' topology decay H(d)). Cached per switch."""
        cache = self.__dict__.setdefault("_downstream", {})
        got = cache.get(switch)
        if got is None:
            got = cache[switch] = self._downstream_uncached(switch)
        return got

    def _downstream_uncached(self, switch: str) -> int:
        direct = [n for n in self.nics.values() if n.switch == switch]
        if direct:
            return len(direct)
        rank = {t: i for i, t in enumerate(TIERS)}
        mine = rank.get(self.switches[switch].tier, 0)
        seen, stack, count = {switch}, [switch], 0
        while stack:
            s = stack.pop()
            for t, _ in self.neighbours(s):
                if t not in seen and rank.get(self.switches[t].tier, 0) < mine:
                    seen.add(t)
                    stack.append(t)
                    count += sum(1 for n in self.nics.values() if n.switch == t)
        return count

    def counts(self) -> dict[str, int]:
        return {"nodes": len(self.nodes), "gpus": len(self.gpus), "nics": len(self.nics),
                "switches": len(self.switches), "links": len(self.links)}

    def to_dict(self) -> dict:
        """The document in canonical form (every default filled in, sorted by id)."""
        def nic(n: Nic) -> dict:
            d = {"id": n.id, "switch": n.switch}
            if n.ip:
                d["ip"] = n.ip
            if n.speed_gbps:
                d["speed_gbps"] = n.speed_gbps
            if n.port:
                d["port"] = n.port
            return d

        def gpu(g: Gpu) -> dict:
            d = {"id": g.id, "index": g.index, "nic": g.nic}
            if g.uuid:
                d["uuid"] = g.uuid
            if g.pci_bus_id:
                d["pci_bus_id"] = g.pci_bus_id
            return d

        def link(ln: Link) -> dict:
            d = {"id": ln.id, "a": ln.a, "b": ln.b}
            if ln.speed_gbps:
                d["speed_gbps"] = ln.speed_gbps
            return d
        doc = {"format": FORMAT, "version": VERSION}
        if self.name:
            doc["name"] = self.name
        doc["switches"] = [{"id": s.id, "tier": s.tier} for s in sorted(self.switches.values(), key=lambda s: s.id)]
        doc["links"] = [link(ln) for ln in sorted(self.links.values(), key=lambda ln: ln.id)]
        doc["nodes"] = [{"id": n.id, **({"hostname": n.hostname} if n.hostname else {}),
                         "nics": [nic(self.nics[x]) for x in n.nics],
                         "gpus": [gpu(self.gpus[x]) for x in n.gpus]}
                        for n in sorted(self.nodes.values(), key=lambda n: n.id)]
        return doc

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def parse(text: str | bytes) -> Topology:
    """Parse and validate a topology document; raise TopologyError listing every problem."""
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TopologyError([f"not JSON: {exc}"]) from None
    return from_dict(doc)


def from_dict(doc) -> Topology:
    problems: list[str] = []
    bad = problems.append
    if not isinstance(doc, dict):
        raise TopologyError(["the document must be a JSON object with switches, links and nodes"])
    if doc.get("format", FORMAT) != FORMAT:
        bad(f"format: expected {FORMAT!r}, got {doc.get('format')!r}")
    if doc.get("version") != VERSION:
        bad(f"version: expected {VERSION}, got {doc.get('version')!r} (this collector reads version {VERSION})")
    for k in sorted(set(doc) - _TOP_KEYS):
        bad(f"{k}: unknown key (known: {', '.join(sorted(_TOP_KEYS))})")
    name = doc.get("name", "")
    if not isinstance(name, str):
        bad("name: must be a string")
        name = ""
    topo = Topology(name=name)
    owner: dict[str, str] = {}  # id -> JSON path of its definition (one namespace for every kind)

    def items(value, path: str, kind: str) -> list[tuple[str, dict]]:
        if value is None:
            return []
        if not isinstance(value, list):
            bad(f"{path}: must be a list")
            return []
        out = []
        for i, it in enumerate(value):
            p = f"{path}[{i}]"
            if not isinstance(it, dict):
                bad(f"{p}: must be an object")
                continue
            for k in sorted(set(it) - _KEYS[kind]):
                bad(f"{p}.{k}: unknown key (known: {', '.join(sorted(_KEYS[kind]))})")
            out.append((p, it))
        return out

    def new_id(value, path: str) -> str | None:
        if not isinstance(value, str) or not ID_RE.match(value):
            bad(f"{path}: id must be 1-128 characters [A-Za-z0-9._:@/+-] starting with a letter or digit, "
                f"got {value!r}")
            return None
        if value in owner:
            bad(f"{path}: duplicate id {value!r} (first defined at {owner[value]})")
            return None
        owner[value] = path
        return value

    def speed(it: dict, path: str) -> float:
        v = it.get("speed_gbps", 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            bad(f"{path}.speed_gbps: must be a number >= 0, got {v!r}")
            return 0.0
        return float(v)

    def text(it: dict, key: str, path: str) -> str:
        v = it.get(key, "")
        if not isinstance(v, str):
            bad(f"{path}.{key}: must be a string, got {v!r}")
            return ""
        return v

    if "switches" not in doc or "nodes" not in doc:
        bad("switches and nodes are required (lists; links may be left out)")
    for p, it in items(doc.get("switches"), "switches", "switches"):
        sid = new_id(it.get("id"), f"{p}.id")
        tier = it.get("tier")
        if tier not in TIERS:
            bad(f"{p}.tier: must be one of {', '.join(TIERS)}, got {tier!r}")
        if sid:
            topo.switches[sid] = Switch(sid, tier if tier in TIERS else "leaf")
    pairs: dict[frozenset, str] = {}
    for p, it in items(doc.get("links"), "links", "links"):
        a, b = it.get("a"), it.get("b")
        ok = True
        for end, v in (("a", a), ("b", b)):
            if v not in topo.switches:
                bad(f"{p}.{end}: unknown switch {v!r}")
                ok = False
        if ok and a == b:
            bad(f"{p}: a link joins two different switches, got {a!r} twice")
            ok = False
        if ok and frozenset((a, b)) in pairs:
            bad(f"{p}: duplicate link {a!r}-{b!r} (first at {pairs[frozenset((a, b))]})")
            ok = False
        lid = new_id(it.get("id", f"{a}-{b}"), f"{p}.id")
        sp = speed(it, p)
        if ok and lid:
            pairs[frozenset((a, b))] = p
            topo.links[lid] = Link(lid, a, b, sp)
    for p, it in items(doc.get("nodes"), "nodes", "nodes"):
        nid = new_id(it.get("id"), f"{p}.id")
        hostname = text(it, "hostname", p)
        nics, gpus = [], []
        for q, n in items(it.get("nics", []), f"{p}.nics", "nics"):
            cid = new_id(n.get("id"), f"{q}.id")
            sw = n.get("switch")
            if sw not in topo.switches:
                bad(f"{q}.switch: unknown switch {sw!r}")
            ip = text(n, "ip", q)
            if ip:
                try:
                    ip = str(ipaddress.ip_address(ip))
                except ValueError:
                    bad(f"{q}.ip: not an IP address: {ip!r}")
            sp = speed(n, q)
            port = text(n, "port", q)
            if port and not PORT_RE.match(port):
                bad(f"{q}.port: must be `<rdma device>/<port number>` as /sys/class/infiniband names them "
                    f"(e.g. mlx5_0/1), got {port!r}")
                port = ""
            if cid and nid and sw in topo.switches:
                topo.nics[cid] = Nic(cid, nid, sw, ip, sp, port)
                nics.append(cid)
        indexes: dict[int, str] = {}
        for q, g in items(it.get("gpus", []), f"{p}.gpus", "gpus"):
            idx = g.get("index")
            if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0:
                bad(f"{q}.index: must be an integer >= 0, got {idx!r}")
                continue
            if idx in indexes:
                bad(f"{q}.index: duplicate GPU index {idx} on node {nid!r} (first at {indexes[idx]})")
                continue
            indexes[idx] = q
            gid = new_id(g.get("id", f"{nid}.gpu{idx}"), f"{q}.id")
            nic = g.get("nic")
            if nic not in nics:
                bad(f"{q}.nic: {nic!r} is not a NIC of node {nid!r}" +
                    (f" (its NICs: {', '.join(nics)})" if nics else " (it has none)"))
                continue
            if gid and nid:
                topo.gpus[gid] = Gpu(gid, nid, idx, nic, text(g, "uuid", q), text(g, "pci_bus_id", q))
                gpus.append(gid)
        if nid:
            topo.nodes[nid] = Node(nid, hostname, tuple(nics), tuple(gpus))
    if not problems and not topo.nodes:
        bad("nodes: the topology has no node")
    if problems:
        raise TopologyError(problems)
    return topo
