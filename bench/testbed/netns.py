"""Emulated hosts: network namespaces on a bridge, a throw-away PKI, a collector and one steplens agent per host.

Layout (root namespace untouched): namespace `sltb-br` holds bridge `br0`; each host `sltb-h<i>` has `eth0`
(10.77.0.(10+i)/24) on a veth pair whose other end `vh<i>` sits on the bridge; the collector runs in
`sltb-c` (10.77.0.2, port 7707) with mutual TLS, because a namespace cannot reach another one's loopback and
the collector refuses plaintext off loopback. Every process started here is recorded (PID and start time)
in `<state>/pids.jsonl`, so `down` kills exactly those, also after a crash of the caller; namespaces are
found by the `sltb-` prefix and removed with everything inside them (veths, tc qdiscs).
Each agent watches its own host's ranks only: all namespaces share the root PID namespace and file system, so
the agent of `h<i>` gets a config (`agents/h<i>.toml`) whose procs source classifies workloads by the
`--host h<i>` the job carries on its command line (not by libtorch in their maps, which every rank has), and
whose flightrec source reads the sockets in `<state>/fr/h<i>`, where that host's ranks run the steplens
bootstrap (`start_job` with agents up: PYTHONPATH + STEPLENS_BOOTSTRAP=1, Flight Recorder worker server and
the optimizer-step anchors). The collector reads `<state>/collector.toml` (COLLECTOR_TOML: the analysis
loop and detector windows for a ~0.1 s step, and the irregularity gate set to this bed's jitter).
Needs root and `ip` (iproute2). Costs: the collector and four agents take a few % of a core together.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

PREFIX = "sltb-"
BRIDGE_NS = PREFIX + "br"
COLLECTOR_NS = PREFIX + "c"
SUBNET = "10.77.0"
COLLECTOR_IP = f"{SUBNET}.2"
COLLECTOR_PORT = 7707
DEFAULT_STATE_DIR = "/tmp/steplens-testbed"
OPERATOR_CN = "steplens-operator"
CGROUP_PREFIX = PREFIX  # cgroups made by faults.py are named sltb-*

# agent settings for the testbed: quick batches, eBPF sources off (compiling them costs ~1 core-minute
# per agent on this 2-core machine and would drown the job's own timing)
AGENT_TOML = """
[agent]
batch_max_delay_seconds = 0.5
status_interval_seconds = 1.0
reconnect_min_seconds = 0.2
reconnect_max_seconds = 2.0

[sources.host]
interval_seconds = 1.0

[sources.sched]
enabled = false

[sources.gpuprobes]
enabled = false

[sources.netflows]
enabled = false
"""

# `up --flows-node h<i>`: that host's agent runs the eBPF netflows source (one is enough: the probes see every
# namespace's packets, so the whole job's flows); the others keep eBPF off
NETFLOWS_OFF = "[sources.netflows]\nenabled = false\n"
NETFLOWS_ON = """[sources.netflows]
enabled = true
interval_seconds = 1.0
"""

# per host, appended to AGENT_TOML: only this host's ranks (see the module docstring); Flight Recorder and
# anchors every second, so a step reaches the collector ~1-2 s after it ended
AGENT_HOST_TOML = """
[sources.procs]
interval_seconds = 1.0
detect_by_maps = false
patterns = ['job\\.py .*--host {node}( |$)']

[sources.flightrec]
interval_seconds = 1.0
max_interval_seconds = 0   # every ring read every second, as the testbed's figures were measured (default: when due)
socket_dirs = ['{fr_dir}']

[sources.iters]
interval_seconds = 1.0
ring_dirs = ['{fr_dir}']
"""

# the collector's analysis for the testbed's job (~0.07-0.1 s steps quiet, ~0.3-0.5 s under the slower faults): a
# pass every second over the last 40 s of steps (~400 steps: the 100-step baseline plus a fault), and a finding
# resolves 6 s of data time after its last confirmation, so faults ~20 s apart are told apart.
# The irregularity gate is set to this bed's own jitter: 4 CPU-bound ranks, 4 agents and the collector share 2
# cores, so the quiet job step (max over ranks) is 1.25x its trailing median in 25 % of the steps, 1.55x at the
# 90th percentile, 2.3x at the 99th (measured 2026-11-24, 3,100 quiet steps). With the defaults (delta 1.1,
# spike 1.25x, fluctuation at 5 % flagged) that quiet job gave 163 findings in 4.3 min (replayed through
# irregularity.detect on the stored steps); with delta 1.8, spikes from 3x and fluctuations from 30 % flagged,
# none. The faults that matter here are 2.8-25x; `noisy` (1.7-1.85x) sits inside the quiet jitter.
# Every other detector setting keeps its default (systemd/collector.toml.example).
COLLECTOR_TOML = """
[analysis]
interval_seconds = 1.0
flows_interval_seconds = 5.0
flows_window_seconds = 30.0

[detectors.irregularity]
window_seconds = 40.0
resolve_after_seconds = 6.0
delta = 1.8
spike_ratio = 3.0
fluctuation_fraction = 0.3

[detectors.commtime]
window_seconds = 40.0
resolve_after_seconds = 6.0

[detectors.flows]
window_seconds = 30.0
resolve_after_seconds = 10.0

[detectors.sentinel]
window_seconds = 40.0
resolve_after_seconds = 6.0

# a ~0.1 s step: no progress for 4 s (40 steps) is a hang here (the production floor is 15 s)
[detectors.hang]
floor_seconds = 4.0

# a finding starts a 6 s deep dive on the job's hosts (analysis/deepdive.py); the bed injects a fault every
# minute or so, hence a short cool-down and a loose budget (production defaults: 10 s, 10 min, 5 % of the hour)
[deep_dive]
duration_seconds = 6.0
reference_seconds = 8.0
cooldown_seconds = 20.0
max_per_hour = 120
max_deep_fraction = 0.5
"""


@dataclass
class Layout:
    """Where things are: the state directory and the number of emulated hosts."""
    state_dir: str = DEFAULT_STATE_DIR
    hosts: int = 4

    def validate(self) -> None:
        if not 1 <= self.hosts <= 200:
            raise ValueError(f"hosts must be 1..200, got {self.hosts}")

    def path(self, *parts: str) -> str:
        return os.path.join(self.state_dir, *parts)

    @property
    def collector_address(self) -> str:
        return f"{COLLECTOR_IP}:{COLLECTOR_PORT}"


def host_ns(i: int) -> str:
    return f"{PREFIX}h{i}"


def host_ip(i: int) -> str:
    return f"{SUBNET}.{10 + i}"


def node_id(i: int) -> str:
    return f"h{i}"


def topology_file(layout: Layout) -> dict:
    """The testbed in the collector's topology file format (collector/topology.py, README "Topology file"):
    hosts `h<i>` (the agents' node ids) with one NIC each, `h<i>.eth0` (its veth; the id of its link too),
    all under one leaf, the bridge `br0`. No GPUs: the job runs on CPUs."""
    return {"format": "steplens-topology", "version": 1, "name": f"steplens-testbed {layout.hosts} hosts",
            "switches": [{"id": "br0", "tier": "leaf"}], "links": [],
            "nodes": [{"id": node_id(i), "hostname": host_ns(i),
                       "nics": [{"id": f"{node_id(i)}.eth0", "switch": "br0", "ip": host_ip(i)}], "gpus": []}
                      for i in range(layout.hosts)]}


def fr_dir(layout: Layout, i: int) -> str:
    """Where host i's ranks put their bootstrap sockets (<pid>.sock), read by host i's agent only. A Unix socket
    path holds 107 bytes: a state dir too deep for that gets a short directory under /tmp instead."""
    d = layout.path("fr", node_id(i))
    if len(d) + len("/4194304.sock") > 107:
        import hashlib
        d = os.path.join("/tmp", "sltb-fr-" + hashlib.sha1(layout.state_dir.encode()).hexdigest()[:10], node_id(i))
    return d


def bin_path(name: str) -> str:
    """A console script next to the running interpreter (the venv's bin), else on PATH."""
    cand = os.path.join(os.path.dirname(sys.executable), name)
    return cand if os.path.exists(cand) else (shutil.which(name) or name)


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def list_namespaces() -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip() and line.split()[0].startswith(PREFIX)]


# ---------------------------------------------------------------- process records

def _start_time(pid: int) -> str | None:
    """Start time (clock ticks since boot) of a live process; None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):
        try:
            os.waitpid(pid, os.WNOHANG)  # reap it when it is our child
        except ChildProcessError:
            pass
        return None
    return fields[19]


def record_pid(layout: Layout, name: str, pid: int) -> None:
    with open(layout.path("pids.jsonl"), "a") as fh:
        fh.write(json.dumps({"name": name, "pid": pid, "start_time": _start_time(pid)}) + "\n")


def recorded(layout: Layout) -> list[dict]:
    try:
        with open(layout.path("pids.jsonl")) as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except OSError:
        return []


def alive(entry: dict) -> bool:
    """True while the recorded process still runs (same PID and same start time, so no recycled PID)."""
    st = _start_time(entry["pid"])
    return st is not None and st == entry.get("start_time")


def spawn(layout: Layout, name: str, cmd: list[str], ns: str | None = None,
          env: dict | None = None, host_sys: bool = False) -> subprocess.Popen:
    """Start a detached process (own session, survives the caller), output to logs/<name>.log, and record it.
    host_sys: enter the namespace with nsenter, keeping the host's /sys (`ip netns exec` mounts a fresh sysfs
    without /sys/fs/cgroup, where the agents' host source reads each rank's cgroup CPU throttling)."""
    os.makedirs(layout.path("logs"), exist_ok=True)
    enter = ["nsenter", f"--net=/run/netns/{ns}"] if host_sys else ["ip", "netns", "exec", ns]
    full = (enter if ns else []) + cmd
    log = open(layout.path("logs", f"{name}.log"), "ab")
    p = subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         env=env, start_new_session=True)
    log.close()
    record_pid(layout, name, p.pid)  # `ip netns exec` execs, so this is the command's own PID
    return p


def kill_recorded(layout: Layout, names: set[str] | None = None, timeout: float = 10.0) -> int:
    """SIGCONT+SIGTERM the recorded processes (all, or those named), SIGKILL what is left after `timeout`."""
    entries = [e for e in recorded(layout) if (names is None or e["name"] in names) and alive(e)]
    for e in entries:
        for sig in (signal.SIGCONT, signal.SIGTERM):  # a stopped rank would never see SIGTERM
            try:
                os.kill(e["pid"], sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(e) for e in entries):
        time.sleep(0.1)
    for e in entries:
        if alive(e):
            try:
                os.kill(e["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    return len(entries)


# ---------------------------------------------------------------- PKI

def make_pki(layout: Layout, node_ids: list[str]) -> dict[str, tuple[str, str]]:
    """A throw-away CA in <state>/pki, a server certificate for the collector's IP, one client cert per node id
    (CN = node id, as the collector requires) and an operator certificate for the CLI."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = layout.path("pki")
    os.makedirs(d, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def write(name: str, data: bytes) -> str:
        p = os.path.join(d, name)
        with open(p, "wb") as fh:
            fh.write(data)
        os.chmod(p, 0o600)
        return p

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "steplens testbed CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=7))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    out = {"ca": (write("ca.pem", ca.public_bytes(serialization.Encoding.PEM)), "")}

    def issue(cn: str, server: bool) -> tuple[str, str]:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
             .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=7)))
        if server:
            b = b.add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address(COLLECTOR_IP)), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.DNSName("localhost")]), critical=False)
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        else:
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        return (write(f"{cn}.crt", cert.public_bytes(serialization.Encoding.PEM)),
                write(f"{cn}.key", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption())))

    out["collector"] = issue("collector", True)
    out[OPERATOR_CN] = issue(OPERATOR_CN, False)
    for n in node_ids:
        out[n] = issue(n, False)
    return out


def operator_args(layout: Layout) -> list[str]:
    """`steplens` CLI options that reach the testbed's collector (run the CLI inside a host namespace)."""
    d = layout.path("pki")
    return ["--collector", layout.collector_address, "--tls-ca", os.path.join(d, "ca.pem"),
            "--tls-cert", os.path.join(d, f"{OPERATOR_CN}.crt"), "--tls-key", os.path.join(d, f"{OPERATOR_CN}.key")]


def steplens_cli(layout: Layout, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run the operator CLI from inside the collector's namespace against the testbed's collector."""
    return subprocess.run(["ip", "netns", "exec", COLLECTOR_NS, bin_path("steplens"), *operator_args(layout), *args],
                          capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- up / down

def _network_up(layout: Layout) -> None:
    sh("ip", "netns", "add", BRIDGE_NS)
    sh("ip", "-n", BRIDGE_NS, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", BRIDGE_NS, "link", "set", "br0", "up")
    for key in ("iptables", "ip6tables", "arptables"):
        # only present when br_netfilter is loaded; then bridged frames must skip the host's netfilter
        sh("ip", "netns", "exec", BRIDGE_NS, "sysctl", "-qw", f"net.bridge.bridge-nf-call-{key}=0", check=False)
    members = [(host_ns(i), f"vh{i}", host_ip(i)) for i in range(layout.hosts)] + [(COLLECTOR_NS, "vc", COLLECTOR_IP)]
    for ns, peer, ip in members:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", peer, "netns", BRIDGE_NS)
        sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", BRIDGE_NS, "link", "set", peer, "master", "br0")
        sh("ip", "-n", BRIDGE_NS, "link", "set", peer, "up")


def _wait_log(path: str, needle: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(path, errors="replace") as fh:
                if needle in fh.read():
                    return
        except OSError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"{os.path.basename(path)}: no {needle!r} within {timeout}s; see {path}")


def up(layout: Layout, agents: bool = True, flows_node: str = "") -> dict:
    """Create namespaces and bridge, PKI, collector and agents; write <state>/state.json. Fails if already up.
    flows_node: the host whose agent also runs the eBPF netflows source (see NETFLOWS_ON)."""
    layout.validate()
    if flows_node and flows_node not in [node_id(i) for i in range(layout.hosts)]:
        raise ValueError(f"flows_node {flows_node!r} is not one of the hosts h0..h{layout.hosts - 1}")
    if os.geteuid() != 0:
        raise PermissionError("the testbed needs root (network namespaces, tc, cgroups)")
    if list_namespaces():
        raise RuntimeError(f"testbed namespaces exist already ({', '.join(list_namespaces())}); run `down` first")
    for sub in ("logs", "steps", "faults", "agents"):
        os.makedirs(layout.path(sub), exist_ok=True)
    try:
        _network_up(layout)
        nodes = [node_id(i) for i in range(layout.hosts)]
        pki = make_pki(layout, nodes)
        ca = pki["ca"][0]
        with open(layout.path("collector.toml"), "w") as fh:
            fh.write(COLLECTOR_TOML)
        c = spawn(layout, "collector", [bin_path("steplens-collector"), "serve", "--config",
                                        layout.path("collector.toml"), "--db", layout.path("collector.db"),
                                        "--listen", layout.collector_address, "--tls-ca", ca,
                                        "--tls-cert", pki["collector"][0], "--tls-key", pki["collector"][1]],
                  ns=COLLECTOR_NS)
        _wait_log(layout.path("logs", "collector.log"), "listening", 30, c)
        if agents:
            for i, n in enumerate(nodes):
                sd = layout.path("agents", n)
                os.makedirs(sd, exist_ok=True)
                os.makedirs(fr_dir(layout, i), exist_ok=True)
                with open(layout.path("agents", f"{n}.toml"), "w") as fh:
                    base = AGENT_TOML.replace(NETFLOWS_OFF, NETFLOWS_ON) if n == flows_node else AGENT_TOML
                    fh.write(base + AGENT_HOST_TOML.format(node=n, fr_dir=fr_dir(layout, i)))
                spawn(layout, f"agent-{n}", [bin_path("steplens-agent"), "run", "--config",
                                             layout.path("agents", f"{n}.toml"), "--collector",
                                             layout.collector_address, "--node-id", n, "--state-dir", sd,
                                             "--metrics-listen", "", "--tls-ca", ca, "--tls-cert", pki[n][0],
                                             "--tls-key", pki[n][1]], ns=host_ns(i), host_sys=True)
    except BaseException:
        down(layout)
        raise
    with open(layout.path("topology.json"), "w") as fh:  # `steplens import topology` reads it
        json.dump(topology_file(layout), fh, indent=1)
    state = {"hosts": layout.hosts, "collector": layout.collector_address, "agents": agents, "flows_node": flows_node,
             "namespaces": {node_id(i): host_ns(i) for i in range(layout.hosts)},
             "ips": {node_id(i): host_ip(i) for i in range(layout.hosts)}, "up_ns": time.time_ns()}
    with open(layout.path("state.json"), "w") as fh:
        json.dump(state, fh, indent=1)
    return state


def load_state(layout: Layout) -> dict:
    try:
        with open(layout.path("state.json")) as fh:
            return json.load(fh)
    except OSError as e:
        raise RuntimeError(f"no testbed state in {layout.state_dir}; run `up` first") from e


def cgroups_left() -> list[str]:
    left = []
    for root in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup"):
        try:
            left += [os.path.join(root, n) for n in os.listdir(root) if n.startswith(CGROUP_PREFIX)]
        except OSError:
            pass
    return sorted(set(left))


def _remove_cgroup(path: str) -> None:
    parent = os.path.dirname(path)
    try:
        with open(os.path.join(path, "cgroup.procs")) as fh:
            pids = [p for p in fh.read().split() if p]
        for pid in pids:  # move survivors back to the parent, else rmdir fails with EBUSY
            try:
                with open(os.path.join(parent, "cgroup.procs"), "w") as fh:
                    fh.write(pid)
            except OSError:
                pass
        os.rmdir(path)
    except OSError:
        pass


def down(layout: Layout) -> dict:
    """Remove everything: recorded processes, anything left in sltb-* namespaces, the namespaces (veths and
    qdiscs go with them) and sltb-* cgroups. Idempotent; needs no state but the PID records."""
    killed = kill_recorded(layout)
    namespaces = list_namespaces()
    for ns in namespaces:  # processes not recorded (a crash between spawn and record, a user's shell)
        for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for path in cgroups_left():
        _remove_cgroup(path)
    for ns in namespaces:
        sh("ip", "netns", "del", ns, check=False)
    try:
        os.remove(layout.path("pids.jsonl"))
    except OSError:
        pass
    try:
        os.remove(layout.path("state.json"))
    except OSError:
        pass
    return {"killed": killed, "namespaces_removed": namespaces, "namespaces_left": list_namespaces(),
            "cgroups_left": cgroups_left()}


# ---------------------------------------------------------------- the job

def placement(dp: int, pp: int, tp: int = 1) -> list[dict]:
    """Rank -> coordinates and host: rank r = (stage * dp + replica) * tp + tp_index, host r // tp.

    The tp ranks of a TP group share one host (namespace), as TP shares a node's NVLink domain on GPUs;
    DP peers and pipeline neighbours sit on different hosts. With tp = 1: rank r on host r, stage r // dp,
    replica r % dp (the original layout)."""
    if min(dp, pp, tp) < 1:
        raise ValueError(f"dp, pp, tp must be >= 1, got {dp}, {pp}, {tp}")
    out = []
    for r in range(dp * pp * tp):
        g, k = divmod(r, tp)
        stage, replica = divmod(g, dp)
        out.append({"rank": r, "stage": stage, "replica": replica, "tp_index": k, "host_index": g})
    return out


def start_job(layout: Layout, dp: int = 2, pp: int = 2, steps: int = 100, schedule: str = "gpipe",
              timeout_seconds: float = 30.0, extra_args: list[str] | None = None,
              env_faults: dict[int, dict[str, str]] | None = None, port: int = 29577, tp: int = 1) -> list[dict]:
    """Launch the `job.py` ranks: tp ranks per host (one TP group per host namespace), dp x pp hosts, which
    must equal the testbed's host count. Returns and writes <state>/job.json: rank, host, ip, pid and the
    rank's stage / replica / tp_index. Step logs go to <state>/steps/rank<r>.jsonl."""
    state = load_state(layout)
    world = dp * pp * tp
    if dp * pp != state["hosts"]:
        raise ValueError(f"dp x pp = {dp * pp} but the testbed has {state['hosts']} hosts "
                         f"(one host per stage replica, its {tp} TP rank(s) inside it)")
    prev = []
    try:
        prev = [r["rank"] for r in load_job(layout)["ranks"]]
    except RuntimeError:
        pass
    kill_recorded(layout, {f"rank{r}" for r in set(range(world)) | set(prev)})
    for r in set(range(world)) | set(prev):  # a fresh run starts fresh logs and no leftover run-time faults
        for p in (layout.path("steps", f"rank{r}.jsonl"), layout.path("faults", f"rank{r}.json")):
            if os.path.exists(p):
                os.remove(p)
    if os.path.exists(layout.path("faults", "all.json")):
        os.remove(layout.path("faults", "all.json"))
    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "job.py")
    boot = {}
    if state.get("agents"):  # the agents read Flight Recorder and the anchors through the bootstrap
        from steplens.agent.bootstrap import site_dir
        boot = dict(PYTHONPATH=site_dir(), STEPLENS_BOOTSTRAP="1")
    ranks = []
    for pl in placement(dp, pp, tp):
        r, h = pl["rank"], pl["host_index"]
        # GLOO_SOCKET_IFNAME=eth0 for every group: TP peers reach each other at their host's eth0 address,
        # which the kernel delivers over `lo` (a local address never leaves through the veth), so TP traffic
        # stays inside the host and a link fault (tbf on eth0) does not touch it, like NVLink vs the NIC.
        env = dict(os.environ, MASTER_ADDR=host_ip(0), MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0",
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", WORLD_SIZE=str(world),
                   RANK=str(r), **(env_faults or {}).get(r, {}))
        if boot:
            os.makedirs(fr_dir(layout, h), exist_ok=True)
            env.update(boot, STEPLENS_RUNTIME_DIR=fr_dir(layout, h))
        p = spawn(layout, f"rank{r}", [sys.executable, job, "--rank", str(r), "--host", node_id(h),
                                       "--dp", str(dp), "--pp", str(pp),
                                       "--tp", str(tp), "--steps", str(steps), "--schedule", schedule,
                                       "--timeout-seconds", str(timeout_seconds), "--state-dir", layout.state_dir,
                                       *(extra_args or [])],
                  ns=host_ns(h), env=env)
        ranks.append({"rank": r, "host": node_id(h), "ip": host_ip(h), "pid": p.pid, "stage": pl["stage"],
                      "replica": pl["replica"], "tp_index": pl["tp_index"]})
    with open(layout.path("job.json"), "w") as fh:
        json.dump({"dp": dp, "pp": pp, "tp": tp, "steps": steps, "schedule": schedule, "ranks": ranks,
                   "start_ns": time.time_ns()}, fh, indent=1)
    return ranks


def load_job(layout: Layout) -> dict:
    try:
        with open(layout.path("job.json")) as fh:
            return json.load(fh)
    except OSError as e:
        raise RuntimeError(f"no job in {layout.state_dir}; run `run` first") from e


def job_alive(layout: Layout) -> dict[int, bool]:
    by_name = {e["name"]: e for e in recorded(layout)}
    return {r["rank"]: bool(by_name.get(f"rank{r['rank']}") and alive(by_name[f"rank{r['rank']}"]))
            for r in load_job(layout)["ranks"]}
