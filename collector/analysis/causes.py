"""Why a suspect is slow: a cause for the leading suspects of every slowdown-type finding, from evidence the
agents already send, each cause judged on the suspect's own figures during the episode against the same figures
before it (its own baseline), and the GPU's against its peers'. Not a detector: the engine calls `attach` on the
detectors' output of each pass, before the findings are merged, so the cause is part of what is stored and shown.

A share of the episode's time (throttled, GC, run-queue wait, memory pressure) is its busiest `stretch_seconds`
(15 s) where the episode is longer (worst_rate): a fault is rarely all of its episode, which can begin with a false
alarm before it and run on through its slower tail after it (the inference bed's memory hog: run-queue wait 0.33
of its own 15 s against 0.19 before; under the rule's floor over its finding, which ran on 11 s after it). The
baseline stays a mean.

Causes, in the order they win (the first whose rule holds is the suspect's cause; all that hold are evidence):
  stopped          a process_stopped Event (procs: state T/t) of the rank's process in or around the episode
  cpu-throttled    the process's cgroup throttled it (host: process_cpu_throttled_seconds_total) for at least
                   `throttled_fraction` of the episode, up by as much and `rise` x on its baseline (_rise)
  gc               Python GC (bootstrap gc.callbacks: python_gc_seconds_total) took `gc_fraction` of the episode
                   and `rise` x its baseline
  gpu-error        an XID Event of the rank's GPU in the episode
  gpu-throttled    the rank's GPU ran at < `gpu_clock_ratio` x its peers' SM clock (median over the episode) with a
                   slowdown reason active (HW slowdown 0x8, SW thermal 0x20, HW thermal 0x40, HW power brake
                   0x80, applications clocks 0x2). SW power cap (0x4) alone is not one: a real H100 under full load
                   holds it with its clock ~30 % under the maximum (tests/fixtures/gpu-recorded/nvml-h100-load.jsonl),
                   like every busy GPU of the job
  gpu-slow         the same clock deficit with no reason reported; or its identical compute kernels take
                   >= `kernel_ratio` x its peers' mean time (weighted by its time in each: XPUTimer's comparison
                   of identical kernels, on kernel records fetched from the agents of the rank and 3 peers)
  memory-pressure  the node's memory PSI (pressure_memory_some) at `pressure_fraction` of the episode, `rise` x
                   baseline, or swapping in at >= `swap_in_bytes_per_s`
  cpu-affinity     the process may run on fewer CPUs than before (host: process_cpus_allowed, its main thread's
                   affinity mask; the lowest it kept for `affinity_hold_seconds` in the episode below the baseline's
                   median): a pin to fewer cores makes its own
                   threads queue for them, which the run-queue rule below would call contention
  cpu-contention   the process waited on a run queue (process_runqueue_seconds_total, /proc/PID/schedstat) for
                   `runqueue_fraction` of the episode and `rise` x its baseline (with no throttling: a quota makes
                   run-queue waits too, and is the cause then)
  host-bound       its GPU waits for its CPU: the share of its kernels that start < 50 µs after their launch is
                   >= 0.5 and `issue_shift` over its peers' (XPUTimer's issue latency; a real H100 job: 12 %
                   queued, 92 % CPU-bound, tests/fixtures/gpu-recorded/cupti-phases); a specific CPU-side cause
                   above wins
  network          the node's TCP connections (netflows ConnStats) retransmitted (>= `retransmits_per_s`, `rise`
                   x baseline) or their smoothed RTT rose `srtt_rise` x and by >= `srtt_min_increase_us` over their
                   own baseline while the sender was held back by the network (tcpinfo's net_limited_us, TCP's
                   chrono "busy" time: >= `net_limited_fraction` of the time and up by half that; on the testbed
                   an RTT rise alone came with every CPU fault too: delayed ACKs of a slowed peer); the evidence
                   names the remote addresses most of the degraded connections share. Loopback connections
                   (both ends 127.0.0.0/8 or ::1: ranks of one host talking over lo) cross no link: their RTT is
                   the CPU scheduling of both ends, never network evidence (the make-run demo on a loaded host
                   blamed "connections degraded (towards 127.0.0.1)")
  data-loading     the share of the process's Python samples inside torch.utils.data rose by >= `frames_rise`
A process suspect ("node:pid", a process of no rank: a serving engine the sentinel names) gets the same rules on its
own process and node, without the GPU and kernel comparisons (they compare a rank with its job's other ranks).
Other suspects keep the detector's cause (a link or NIC is "network" by what it is).

A rank whose process was stopped during the episode but that no detector named (a stop landing while it is inside
a collective makes no arrival late) is added as the first suspect.
Re-ranking: where the leading rank has no cause of its own (none, or only network: waiting is not a cause) and
another of the examined rank suspects, scored >= `rerank_within` x the leader, has one in its own process (stopped,
cpu-throttled, gc, gpu-*, memory-pressure, cpu-contention), that one leads: the detectors see who arrives late,
and a rank that waits for a stopped peer arrives as late as the peer (tests/test_testbed_diagnosis.py). Where the
leader has no cause at all, a rank with `network` (its connections degraded) leads likewise: on the testbed a link
fault's waiting rank came first with nothing measured against it, the rank behind the shaped link second.

Kernel records are fetched once per (rank, episode onset) and kept in the job's memo across passes (an agent
round trip; CommOps-only fetchers and agents without kernel records leave it out). Where they were, the rank's
other XPUTimer metrics go into its evidence ("xpu", beside "kernels"; no cause rests on them): V_inter of its
steps, its throughput against its baseline and its peers, its communicators' single-member bandwidth
(xpu_evidence); the cross-member bus bandwidth needs the CommOps of every member, a fetch not made here.
Reads per finding, for each examined rank: its process (Reader.job_processes, once per pass), its node's metrics over
the episode and baseline (Reader.metric_points, one indexed read per node), its node's connections
(Reader.conn_stats_of), its process events and stack summaries. A reader without these reads (a simulator's
in-memory reader) leaves the causes as the detectors set them. Cost: O(examined suspects x samples in
baseline + episode); at 1 Hz metrics and a 60 s baseline, a few hundred rows per suspect.
"""

from __future__ import annotations

import bisect
import functools
import ipaddress
import statistics
from dataclasses import dataclass, replace

from steplens.collector.analysis.base import nic_addresses, nics_of
from steplens.collector.analysis.findings import Finding, Suspect

EXAMINED_KINDS = ("slowdown", "degradation", "spike", "fluctuation", "network")
LOCAL = ("stopped", "cpu-throttled", "gc", "gpu-error", "gpu-throttled", "gpu-slow", "memory-pressure",
         "cpu-affinity", "cpu-contention", "host-bound", "data-loading")
SLOWDOWN_REASONS = {0x2: "applications_clocks", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
                    0x80: "hw_power_brake"}
REASON_NAMES = {0x1: "idle", 0x4: "sw_power_cap", 0x10: "sync_boost", 0x100: "display_clock", **SLOWDOWN_REASONS}

PROC_METRICS = ("process_cpu_throttled_seconds_total", "process_cpu_quota_cores", "python_gc_seconds_total",
                "python_gc_collections_total", "process_runqueue_seconds_total", "process_cpu_seconds_total",
                "process_cpus_allowed")
HOST_METRICS = ("pressure_memory_some_seconds_total", "pressure_cpu_some_seconds_total", "swap_in_bytes_total")
GPU_METRICS = ("gpu_sm_clock_mhz", "gpu_clocks_event_reasons")
GPU_PEERS = 8      # other GPUs of the job a suspect's GPU is compared with at most (its node's first)


@dataclass
class CausesConfig:
    suspects: int = 3                     # leading suspects examined per finding
    baseline_seconds: float = 60.0        # the suspect's own "before" ends at the onset
    margin_seconds: float = 2.0           # around the episode: events, and samples that cover it
    stretch_seconds: float = 15.0         # a longer episode is judged on its worst stretch this long as well
    affinity_hold_seconds: float = 5.0    # a pin to fewer CPUs counts where it lasted this long in the episode
    throttled_fraction: float = 0.05
    gc_fraction: float = 0.05
    runqueue_fraction: float = 0.10
    pressure_fraction: float = 0.10
    swap_in_bytes_per_s: float = 8 << 20
    rise: float = 1.25                    # x the suspect's own baseline, and up by the fraction's floor
    gpu_clock_ratio: float = 0.9
    retransmits_per_s: float = 1.0
    retransmits_min: int = 5              # ... and at least this many in the episode
    retransmit_share: float = 0.01        # ... and this share of the segments sent (where the source counts them)
    srtt_rise: float = 2.0
    srtt_min_increase_us: float = 1000.0
    net_limited_fraction: float = 0.2     # ... while its sender was held back by the network this share of the time
    frames_rise: float = 0.3
    rerank_within: float = 0.5
    kernel_ratio: float = 1.15            # identical kernels this much slower than the peers': gpu-slow
    issue_shift: float = 0.3              # share of kernels issued < 50 µs before start, over the peers'


# -- counters and series -----------------------------------------------------------------------------------------

def counter_rate(points: list[tuple[int, float]], a: int, b: int) -> float | None:
    """Increase per second of a counter over the samples that cover [a, b] (counter_rise). None: fewer than two
    samples."""
    got = counter_rise(points, a, b)
    return got[0] / got[1] if got else None


def counter_rise(points: list[tuple[int, float]], a: int, b: int) -> tuple[float, float] | None:
    """(increase, seconds) of a counter over the samples that cover [a, b]: the last sample at or before a (else
    the first) to the first at or after b (else the last); a decrease is a reset: the new value counts from 0.
    None: fewer than two samples, or no time between them."""
    if not points:
        return None
    lo = 0
    for i, (t, _) in enumerate(points):
        if t <= a:
            lo = i
        else:
            break
    hi = len(points) - 1
    for i in range(lo, len(points)):
        if points[i][0] >= b:
            hi = i
            break
    if hi <= lo:
        return None
    inc = 0.0
    for (_, v1), (_, v2) in zip(points[lo:hi], points[lo + 1:hi + 1]):
        inc += v2 - v1 if v2 >= v1 else v2
    dt = (points[hi][0] - points[lo][0]) / 1e9
    return (inc, dt) if dt > 0 else None


def worst_rate(points: list[tuple[int, float]], a: int, b: int, width: int) -> tuple[float, int] | None:
    """(rate, start) of the counter's busiest stretch `width` long inside [a, b] (counter_rate over each stretch
    that starts at a sample, from running sums: one pass, an episode of an hour at 1 Hz as cheap as a minute's);
    the whole of [a, b] where it is no longer than width. A fault is rarely the whole of the episode that holds
    it (a false alarm before it that the episode began with, the slow tail after it): its share of the whole is
    diluted by the rest. None: fewer than two samples."""
    whole = counter_rate(points, a, b)
    if whole is None or b - a <= width:
        return None if whole is None else (whole, a)
    times = [t for t, _ in points]
    cum = [0.0]
    for (_, v1), (_, v2) in zip(points, points[1:]):
        cum.append(cum[-1] + (v2 - v1 if v2 >= v1 else v2))   # a decrease is a reset (counter_rise)
    best = (whole, a)
    for i in range(bisect.bisect_left(times, a), len(times)):
        t = times[i]
        if t + width > b:
            break
        j = min(bisect.bisect_left(times, t + width, i), len(times) - 1)   # the first sample at or after its end
        if j > i and times[j] > t and (cum[j] - cum[i]) / ((times[j] - t) / 1e9) > best[0]:
            best = ((cum[j] - cum[i]) / ((times[j] - t) / 1e9), t)
    return best


def gauge_median(points: list[tuple[int, float]], a: int, b: int) -> float | None:
    vals = [v for t, v in points if a <= t <= b]
    return statistics.median(vals) if vals else None


def lowest_held(points: list[tuple[int, float]], a: int, b: int, hold: int) -> float | None:
    """The lowest value the gauge kept for `hold` inside [a, b] (the least of the highest values of each span of
    consecutive samples `hold` long), its median where no span is that long. A pin to fewer CPUs for 15 s of a
    45 s episode (the inference bed's: a false alarm opened it 11 s before) is not the episode's median."""
    pts = [(t, v) for t, v in points if a <= t <= b]
    best = None
    j = 0
    for i, (t, _) in enumerate(pts):
        j = max(j, i)
        while j + 1 < len(pts) and pts[j][0] - t < hold:   # the first sample `hold` or more after this one
            j += 1
        if pts[j][0] - t < hold:
            break
        top = max(v for _, v in pts[i:j + 1])
        best = top if best is None else min(best, top)
    if best is None:
        return statistics.median(v for _, v in pts) if pts else None
    return best


def reasons_seen(points: list[tuple[int, float]], a: int, b: int) -> int:
    mask = 0
    for t, v in points:
        if a <= t <= b:
            mask |= int(v)
    return mask


def reason_names(mask: int) -> list[str]:
    return [name for bit, name in sorted(REASON_NAMES.items()) if mask & bit]


# -- per-pass context --------------------------------------------------------------------------------------------

class _Pass:
    """What one pass has read already: processes of the job, and per node the metric samples it needed."""

    def __init__(self, reader, job_key: str, cfg: CausesConfig) -> None:
        self.reader, self.job_key, self.cfg = reader, job_key, cfg
        self._procs: dict[int, dict] | None = None
        self._metrics: dict[tuple[str, int, int], dict] = {}
        self._conns: dict[tuple[str, int, int], list[dict]] = {}

    def procs(self) -> dict[int, dict]:
        if self._procs is None:
            self._procs = {}
            for p in self.reader.job_processes(self.job_key):
                if p["rank"] >= 0:
                    self._procs[p["rank"]] = p   # newest process of a rank last
        return self._procs

    def process(self, node: str, pid: str) -> dict | None:
        """The job's newest process with this pid on this node (any rank), None when there is none."""
        if not pid.isdigit():
            return None
        got = None
        for p in self.reader.job_processes(self.job_key):
            if p["node_id"] == node and p["pid"] == int(pid):
                got = p
        return got

    def metrics(self, node: str, a: int, b: int, names, entities) -> dict:
        key = (node, a, b, tuple(names), tuple(entities) if entities is not None else None)
        got = self._metrics.get(key)
        if got is None:
            got = self._metrics[key] = self.reader.metric_points(node, list(names), entities, a, b)
        return got

    def conns(self, node: str, a: int, b: int) -> list[dict]:
        key = (node, a, b)
        if key not in self._conns:
            self._conns[key] = self.reader.conn_stats_of(node, a, b)
        return self._conns[key]


def _rise(during: float | None, before: float | None, floor: float, rise: float) -> bool:
    """A fraction of the episode's time at least `floor`, up by at least `floor` (absolute) and `rise` x (relative)
    on the baseline: on a saturated host a rank waits for a CPU half the time already, and a noisy neighbour
    takes it from 0.5 to 0.7, not to 2 x."""
    if during is None or during < floor:
        return False
    return before is None or (during - before >= floor and during >= rise * before)


# -- the rules ---------------------------------------------------------------------------------------------------

def explain_rank(ps: _Pass, rank: int, onset: int, last: int) -> tuple[str, dict]:
    """(cause, evidence) for one rank over the episode [onset, last]; ("", {...}) when no rule holds."""
    proc = ps.procs().get(rank)
    if proc is None:
        return "", {"why": "no process of this rank reported"}
    return explain_process(ps, proc, rank, onset, last)


def explain_process(ps: _Pass, proc: dict, rank: int, onset: int, last: int) -> tuple[str, dict]:
    """(cause, evidence) for one process (a rank's, or a process suspect's: a serving engine, rank -1) over the
    episode; the GPU and kernel rules, which compare with the job's other ranks, only for ranks."""
    cfg = ps.cfg
    node, pid, ticks = proc["node_id"], proc["pid"], proc["start_ticks"]
    m = int(cfg.margin_seconds * 1e9)
    b0 = max(0, onset - int(cfg.baseline_seconds * 1e9))
    a, b = onset, max(last, onset + 1)
    ev: dict = {"node": node, "pid": pid}
    found: list[str] = []

    # stopped
    events = ps.reader.process_events(a - m, b + m, [node], ("process_stopped", "process_running"))
    stops = [e for e in events if e["pid"] == pid and e["start_ticks"] == ticks]
    if any(e["kind"] == "process_stopped" for e in stops) or \
            any(e["kind"] == "process_running" and "stopped" in e["message"] for e in stops):
        found.append("stopped")
        ev["stopped"] = [e["message"] for e in stops][:4]

    entity = f"pid:{pid}:{ticks}"
    pm = ps.metrics(node, b0, b + m, PROC_METRICS, [entity])

    width = int(cfg.stretch_seconds * 1e9)

    def share(points: list) -> tuple[float | None, float | None, dict]:
        """(during, before, where) of a counter of seconds per second: during the episode's busiest stretch
        (worst_rate), before over the baseline; where: that stretch, for the evidence ({} for a short episode)."""
        worst, before = worst_rate(points, a, b, width), counter_rate(points, b0, a - m)
        if worst is None:
            return None, before, {}
        where = {"stretch": {"offset_s": round((worst[1] - a) / 1e9, 1), "seconds": round(width / 1e9, 1)}} \
            if b - a > width else {}
        return worst[0], before, where

    for name, cause, floor in (("process_cpu_throttled_seconds_total", "cpu-throttled", cfg.throttled_fraction),
                               ("python_gc_seconds_total", "gc", cfg.gc_fraction),
                               ("process_runqueue_seconds_total", "cpu-contention", cfg.runqueue_fraction)):
        during, before, where = share(pm.get((name, entity), []))
        if during is None:
            continue
        ev[name.removesuffix("_seconds_total") + "_fraction"] = {
            "during": round(during, 4), "before": None if before is None else round(before, 4), **where}
        if _rise(during, before, floor, cfg.rise):
            found.append(cause)
    quota = gauge_median(pm.get(("process_cpu_quota_cores", entity), []), a, b + m)
    if quota is not None:
        ev["cpu_quota_cores"] = quota
    cpus = pm.get(("process_cpus_allowed", entity), [])
    cpus_now, cpus_before = lowest_held(cpus, a, b + m, int(cfg.affinity_hold_seconds * 1e9)), \
        gauge_median(cpus, b0, a - m)
    if cpus_now is not None and cpus_before is not None and cpus_now < cpus_before:
        found.append("cpu-affinity")
        ev["cpus_allowed"] = {"during": cpus_now, "before": cpus_before}

    # the GPU
    if rank >= 0 and proc["local_rank"] >= 0:
        cause, gev = _gpu(ps, rank, proc, a, b, m)
        if gev:
            ev["gpu"] = gev
        if cause:
            found.append(cause)

    # its kernels against its peers' (XPUTimer's metrics), where the agents keep kernel records: GPU jobs only (its
    # node reports its GPU), the fetch being an agent round trip
    kcause, kev, xev = _kernels(ps, rank, a, b) if "gpu" in ev and rank >= 0 else ("", {}, {})
    if kev:
        ev["kernels"] = kev
    if xev:
        ev["xpu"] = xev
    if kcause:
        found.append(kcause)

    # the node: memory pressure, the network
    hm = ps.metrics(node, b0, b + m, HOST_METRICS, [""])
    mem, mem0, where = share(hm.get(("pressure_memory_some_seconds_total", ""), []))
    swap = counter_rate(hm.get(("swap_in_bytes_total", ""), []), a, b)
    if mem is not None or swap is not None:
        ev["memory"] = {"pressure_some_fraction": mem, "before": mem0, "swap_in_bytes_per_s": swap, **where}
    if _rise(mem, mem0, cfg.pressure_fraction, cfg.rise) or (swap or 0) >= cfg.swap_in_bytes_per_s:
        found.append("memory-pressure")
    cpu_psi = counter_rate(hm.get(("pressure_cpu_some_seconds_total", ""), []), a, b)
    if cpu_psi is not None:
        ev["node_cpu_pressure_fraction"] = round(cpu_psi, 4)

    net = _network(ps, node, b0, a, b, m)
    if net:
        ev["network"] = net
        if net.get("degraded"):
            found.append("network")

    frames = _frames(ps, node, pid, b0, a, b, m)
    if frames:
        ev["frames"] = frames
        if any("torch/utils/data" in f["file"] for f in frames if f["rise"] >= cfg.frames_rise):
            found.append("data-loading")

    order = ("stopped", "cpu-throttled", "gc", "gpu-error", "gpu-throttled", "gpu-slow", "memory-pressure",
             "cpu-affinity", "cpu-contention", "host-bound", "network", "data-loading")
    # a quota or a pin to fewer cores makes run-queue waits too: they explain them
    found = list(dict.fromkeys(found))
    if ("cpu-throttled" in found or "cpu-affinity" in found) and "cpu-contention" in found:
        found.remove("cpu-contention")
    found.sort(key=order.index)
    ev["causes"] = found
    return (found[0] if found else ""), ev


def _gpu(ps: _Pass, rank: int, proc: dict, a: int, b: int, m: int) -> tuple[str, dict]:
    cfg = ps.cfg
    node, gpu = proc["node_id"], f"gpu{proc['local_rank']}"
    gm = ps.metrics(node, a - m, b + m, GPU_METRICS, None)
    own = gm.get(("gpu_sm_clock_mhz", gpu))
    xids = [f"{e['message']}" for e in ps.reader.node_events(node, ("xid",), a - m, b + m) if e["entity"] == gpu]
    if xids:
        return "gpu-error", {"gpu": gpu, "xid": xids[:8]}
    if not own:
        return "", {}
    clock = gauge_median(own, a, b)
    if clock is None:
        return "", {}
    mask = reasons_seen(gm.get(("gpu_clocks_event_reasons", gpu), []), a, b)
    peers = [gauge_median(pts, a, b) for (name, ent), pts in gm.items() if name == "gpu_sm_clock_mhz" and ent != gpu]
    seen_nodes = {node}
    for r, p in sorted(ps.procs().items()):
        if len(peers) >= GPU_PEERS:
            break
        if r == rank or p["node_id"] in seen_nodes or p["local_rank"] < 0:
            continue
        seen_nodes.add(p["node_id"])
        pm = ps.metrics(p["node_id"], a - m, b + m, GPU_METRICS, None)
        pts = pm.get(("gpu_sm_clock_mhz", f"gpu{p['local_rank']}"))
        if pts:
            peers.append(gauge_median(pts, a, b))
    peers = [x for x in peers if x]
    ev = {"gpu": gpu, "sm_clock_mhz": clock, "reasons": reason_names(mask)}
    if not peers:
        return "", ev
    ref = statistics.median(peers)
    ev["peers_sm_clock_mhz"] = ref
    ev["peers"] = len(peers)
    if clock < cfg.gpu_clock_ratio * ref:
        return ("gpu-throttled" if mask & sum(SLOWDOWN_REASONS) else "gpu-slow"), ev
    return "", ev


KERNEL_PEERS = 3          # ranks a suspect's kernels are compared with
KERNEL_LIMIT = 20_000     # kernel records fetched per rank at most
MEMO_KEY = ("causes", "kernels")   # in the engine's per-job memo, beside irregularity's (name, step) keys


def _kernel_rows(rows: list[dict]) -> dict[int, list[dict]]:
    by: dict[int, list[dict]] = {}
    for r in rows:
        if r.get("kind") != "kernel" or not r.get("start_ns") or not r.get("end_ns"):
            continue
        by.setdefault(r.get("rank", -1), []).append(
            {"name": r.get("name", ""), "start_mono_ns": r["start_ns"], "end_mono_ns": r["end_ns"],
             "launch_start_mono_ns": r.get("launch_start_ns") or 0, "launch_end_mono_ns": r.get("launch_end_ns") or 0,
             "stream": r.get("stream", 0), "device": r.get("device", 0)})
    return by


def compare_kernels(own: list, peers: list[list], cfg: CausesConfig) -> tuple[str, dict]:
    """XPUTimer's cross-rank comparison for one rank: identical kernels' mean duration against the peers' (compute
    kernels, NCCL ones left out: they wait for the others), weighted by the rank's time in each; and the share of
    its kernels issued < 50 µs before they started against the peers' (the GPU waiting for its CPU).
    ("gpu-slow" | "host-bound" | "", evidence)."""
    from steplens.collector.analysis import kernels as km

    mine = km.per_name([k for k in own if not km.is_comm(k["name"])])
    theirs: dict[str, list[float]] = {}
    for ks in peers:
        for name, d in km.per_name([k for k in ks if not km.is_comm(k["name"])]).items():
            if d["count"] >= 5:
                theirs.setdefault(name, []).append(d["mean_ns"])
    ratios, weights = [], []
    names = {}
    for name, d in mine.items():
        if d["count"] < 5 or name not in theirs:
            continue
        ref = statistics.median(theirs[name])
        if ref <= 0:
            continue
        ratios.append(d["mean_ns"] / ref)
        weights.append(d["total_ns"])
        names[name] = round(d["mean_ns"] / ref, 3)
    ev: dict = {"kernels": len(own), "peer_kernels": sum(len(p) for p in peers)}
    ratio = None
    if ratios:
        pairs = sorted(zip(ratios, weights))
        half, acc = sum(weights) / 2, 0.0
        for r, w in pairs:   # weighted median
            acc += w
            if acc >= half:
                ratio = r
                break
        ev["identical_kernel_ratio"] = round(ratio, 3)
        ev["names"] = dict(sorted(names.items(), key=lambda kv: -mine[kv[0]]["total_ns"])[:5])
    own_il = km.distribution(km.issue_latencies(own, comm=False))
    peer_il = km.distribution([x for ks in peers for x in km.issue_latencies(ks, comm=False)])
    if own_il["count"] and peer_il["count"]:
        ev["issue_below_50us"] = {"own": own_il["below_50us_fraction"], "peers": peer_il["below_50us_fraction"]}
        ev["issue_p50_ns"] = {"own": own_il["p50_ns"], "peers": peer_il["p50_ns"]}
    if ratio is not None and ratio >= cfg.kernel_ratio:
        return "gpu-slow", ev
    il = ev.get("issue_below_50us")
    if il and il["own"] >= 0.5 and il["own"] - il["peers"] >= cfg.issue_shift:
        return "host-bound", ev
    return "", ev


def _kernels(ps: _Pass, rank: int, a: int, b: int) -> tuple[str, dict, dict]:
    """(cause, kernel evidence, XPUTimer evidence) of a rank from its and its peers' kernel records."""
    fetch = getattr(ps.reader, "fetch_kernels", None)
    procs = ps.procs()
    if fetch is None or procs.get(rank, {}).get("local_rank", -1) < 0:
        return "", {}, {}
    memo = getattr(ps.reader, "step_memo", None)
    cache = memo.setdefault(MEMO_KEY, {}) if isinstance(memo, dict) else {}
    key = (rank, a)
    if key in cache:
        return cache[key]
    others = [r for r in sorted(procs) if r != rank]
    step = max(1, len(others) // KERNEL_PEERS)
    peers = others[::step][:KERNEL_PEERS]
    try:
        rows = fetch(ps.job_key, [rank] + peers, a, b, KERNEL_LIMIT)
        by = _kernel_rows(rows)
        got = compare_kernels(by.get(rank, []), [by[p] for p in peers if by.get(p)], ps.cfg) \
            if by.get(rank) and any(by.get(p) for p in peers) else ("", {})
    except Exception as exc:  # no agent connection, a fetcher of CommOps only, an agent that did not answer
        got, by = ("", {"unavailable": f"{type(exc).__name__}: {exc}"[:200]}), {}
    got = (*got, xpu_evidence(ps, rank, peers, by, a, b) if by.get(rank) else {})
    if len(cache) > 256:
        cache.clear()
    cache[key] = got
    return got


XPU_ROWS = 50_000          # Step / Iteration rows read for the XPUTimer evidence at most


def xpu_evidence(ps: _Pass, rank: int, peers: list[int], by: dict[int, list[dict]], a: int, b: int) -> dict:
    """XPUTimer's other metrics of a rank whose kernels were fetched, against its peers', as evidence only (no
    cause rests on them yet): V_inter over its Step records in the episode (kernels.inter_step_void), its
    throughput in the episode against its own baseline (robust z) and against its peers (xpumetrics: the
    Iterations' tokens or samples where its anchor counts them, else steps), and the single-member bandwidth of its
    communicators from its Steps' comms (bytes / busy time; it includes waiting for the other members). Reads the
    ranks' Step rows (one indexed read) and the job's Iterations over the baseline and episode; {} without them."""
    from steplens.collector.analysis import kernels as km
    from steplens.collector.analysis import xpumetrics as xm

    steps_of = getattr(ps.reader, "steps", None)
    if not callable(steps_of):
        return {}
    b0 = max(0, a - int(ps.cfg.baseline_seconds * 1e9))
    ranks = [rank] + peers
    try:
        steps = [s for s in steps_of(ps.job_key, ranks, since_ns=b0, limit=XPU_ROWS, with_comms=True)
                 if s["end_ns"] <= b]
        out: dict = {}
        vi = {}
        for r in ranks:
            mine = [s for s in steps if s["rank"] == r and a <= s["start_ns"] <= b]
            if by.get(r) and mine:
                got = km.inter_step_void(by[r], mine)
                if got["count"]:
                    vi[r] = got
        if rank in vi:
            peer_v = [vi[p]["median"] for p in peers if p in vi]
            out["v_inter"] = {"own": vi[rank]["median"], "own_p90": vi[rank]["p90"], "steps": vi[rank]["count"],
                              "peers": round(statistics.median(peer_v), 6) if peer_v else None}
        iters_of = getattr(ps.reader, "iterations", None)
        rows = []
        if callable(iters_of):
            rows = [x for x in iters_of(ps.job_key, since_ns=b0, until_ns=b, limit=XPU_ROWS) if x["rank"] in ranks]
            if not any((x.get("tokens") or 0) > 0 or (x.get("batch_size") or 0) > 0 for x in rows):
                rows = []
        tp = xm.window_throughput(rows or steps, a, b)
        if rank in tp:
            own = tp[rank]
            peer_t = [tp[p]["during"] for p in peers if p in tp and tp[p]["unit"] == own["unit"]]
            ref = statistics.median(peer_t) if peer_t else None
            out["throughput"] = {**own, "source": "iterations" if rows else "steps",
                                 "peers": None if ref is None else round(ref, 4),
                                 "vs_peers": round(own["during"] / ref, 4) if ref else None}
        bw = xm.step_comm_algbw([s for s in steps if s["start_ns"] >= a])
        if rank in bw:
            out["comm_algbw_gb_per_s"] = {
                comm: {"own": v, "peers": round(statistics.median(pv), 4) if (pv := [bw[p][comm] for p in peers
                                                                                       if comm in bw.get(p, {})])
                       else None} for comm, v in bw[rank].items()}
            out["comm_algbw_method"] = "single_member"
        return out
    except Exception as exc:  # a store without these reads: evidence only, never the cause
        return {"unavailable": f"{type(exc).__name__}: {exc}"[:200]}


@functools.lru_cache(maxsize=4096)
def _loopback(addr) -> bool:
    """A loopback address (IPv4-mapped too); anything unparsable is not."""
    try:
        ip = ipaddress.ip_address(str(addr).split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _network(ps: _Pass, node: str, b0: int, a: int, b: int, m: int) -> dict:
    cfg = ps.cfg
    rows = ps.conns(node, b0, b + m)
    if not rows:
        return {}
    before: dict[tuple, list[dict]] = {}
    during: dict[tuple, list[dict]] = {}
    for r in rows:
        if _loopback(r["src"]) and _loopback(r["dst"]):
            continue
        key = (r["src"], r["sport"], r["dst"], r["dport"])
        if r["end_ns"] < a - m:
            before.setdefault(key, []).append(r)
        elif r["end_ns"] >= a:
            during.setdefault(key, []).append(r)
    if not during:
        return {}
    span_d = max(1e-3, (b + m - a) / 1e9)
    span_b = max(1e-3, (a - m - b0) / 1e9)
    retx_n = sum(r["retransmits"] or 0 for rs in during.values() for r in rs)
    sent = sum(r.get("tx_packets") or 0 for rs in during.values() for r in rs)
    retx_d = retx_n / span_d
    retx_b = sum(r["retransmits"] or 0 for rs in before.values() for r in rs) / span_b if before else None
    slow, remotes, held, healthy = [], {}, 0, set()
    chrono = any(r["source"] == "tcpinfo" for r in rows)   # net_limited_us known (tcpinfo on Linux 4.10+)
    for key, rs in during.items():
        base = [r["srtt_us"] for r in before.get(key, []) if r["srtt_us"]]
        now = [r["srtt_us"] for r in rs if r["srtt_us"]]
        if not base or not now:
            continue
        s0, s1 = statistics.median(base), max(now)
        if s1 < cfg.srtt_rise * s0 or s1 - s0 < cfg.srtt_min_increase_us:
            # its RTT held while it pushed as much as the network let it: its path is not the slow one (a
            # connection that sent little tests nothing: a short message passes a shaper from its token bucket)
            if chrono and _held_fraction(rs) >= cfg.net_limited_fraction:
                healthy.add(key[2])
        else:
            item = {"conn": f"{key[0]}:{key[1]}->{key[2]}:{key[3]}", "srtt_us": s1, "before_us": s0}
            if chrono:
                # an RTT that rose while the sender was not held back by the network is a slow peer or
                # application (delayed ACKs, a starved receiver), not the link
                nl1, nl0 = _held_fraction(rs), _held_fraction(before.get(key, []))
                item["net_limited_fraction"] = {"during": round(nl1, 3), "before": round(nl0, 3)}
                if not (nl1 >= cfg.net_limited_fraction and nl1 - nl0 >= cfg.net_limited_fraction / 2):
                    held += 1
                    continue
            slow.append(item)
            remotes[key[2]] = remotes.get(key[2], 0) + 1
        if sum(r["retransmits"] or 0 for r in rs):
            remotes[key[2]] = remotes.get(key[2], 0) + 1
    out = {"connections": len(during), "retransmits_per_s": round(retx_d, 3), "srtt_up_not_network_limited": held,
           "retransmits_per_s_before": None if retx_b is None else round(retx_b, 3),
           "srtt_degraded": sorted(slow, key=lambda x: -x["srtt_us"] / x["before_us"])[:8]}
    if remotes:
        out["remotes"] = sorted(remotes, key=lambda k: -remotes[k])[:4]
    out["healthy_remotes"] = sorted(healthy - {x["conn"].rpartition("->")[2].rpartition(":")[0] for x in slow})[:8]
    # retransmits: a loss rate, not a few tail-loss probes (a loaded host's low-RTT links retransmit a little)
    lossy = retx_n >= cfg.retransmits_min and (not sent or retx_n >= cfg.retransmit_share * sent)
    out["retransmitted_share"] = round(retx_n / sent, 4) if sent else None
    out["degraded"] = bool(slow) or (lossy and _rise(retx_d, retx_b, cfg.retransmits_per_s, cfg.rise))
    return out


def _held_fraction(rows: list[dict]) -> float:
    """Share of the rows' intervals the sender spent held back by the network (net_limited_us)."""
    span = sum(max(0, r["end_ns"] - r["start_ns"]) for r in rows)
    return min(1.0, sum(r.get("net_limited_us") or 0 for r in rows) * 1000 / span) if span else 0.0


def _frames(ps: _Pass, node: str, pid: int, b0: int, a: int, b: int, m: int) -> list[dict]:
    """Python functions whose share of the process's samples rose most from the baseline to the episode."""
    rows = ps.reader.stacks(node, pid, b0, 2000)
    if not rows:
        return []
    share: dict[str, dict] = {"before": {}, "during": {}}
    totals = {"before": 0, "during": 0}
    where: dict = {}
    for r in rows:
        if r["end_ns"] < a - m and r["start_ns"] >= b0:
            part = "before"
        elif r["start_ns"] <= b and r["end_ns"] >= a:
            part = "during"
        else:
            continue
        for st in r["stacks"] or ():   # [{"count", "frames": [[fn, qualname, file, line], ...]}]
            count = st.get("count") or 0
            totals[part] += count
            names = set()
            for fr in st.get("frames") or ():
                name = fr[1] or fr[0]
                names.add(name)
                where.setdefault(name, fr[2])
            for n in names:
                share[part][n] = share[part].get(n, 0) + count
    if not totals["during"]:
        return []
    out = []
    for n, c in share["during"].items():
        d = c / totals["during"]
        p = share["before"].get(n, 0) / totals["before"] if totals["before"] else 0.0
        if d - p >= 0.1:
            out.append({"function": n, "file": where.get(n, ""), "during": round(d, 3), "before": round(p, 3),
                        "rise": round(d - p, 3)})
    return sorted(out, key=lambda x: -x["rise"])[:5]


# -- attaching ---------------------------------------------------------------------------------------------------

def _supported(reader) -> bool:
    return all(callable(getattr(reader, n, None)) for n in
               ("job_processes", "metric_points", "conn_stats_of", "process_events", "node_events", "stacks"))


def stopped_ranks(ps: _Pass, a: int, b: int) -> dict[int, list[str]]:
    """Ranks of the job whose process was stopped (procs: state T/t) in [a, b]: rank -> the Events' messages."""
    by_proc = {(p["node_id"], p["pid"], p["start_ticks"]): r for r, p in ps.procs().items()}
    if not by_proc:
        return {}
    out: dict[int, list[str]] = {}
    for e in ps.reader.process_events(a, b, None, ("process_stopped", "process_running")):
        r = by_proc.get((e["node_id"], e["pid"], e["start_ticks"]))
        if r is not None and (e["kind"] == "process_stopped" or "stopped" in e["message"]):
            out.setdefault(r, []).append(e["message"])
    return out


def explain_finding(ps: _Pass, f: Finding) -> Finding:
    cfg = ps.cfg
    sus = list(f.suspects)
    changed = False
    # a rank stopped during the episode explains it even where no arrival of it was late (a stop that lands
    # while it is inside a collective holds the others there with it): it is added, first
    m = int(cfg.margin_seconds * 1e9)
    named = {s.id for s in sus if s.kind == "rank"}
    for r, msgs in sorted(stopped_ranks(ps, f.onset_ns - m, f.last_ns + m).items()):
        if str(r) not in named:
            node = ps.procs()[r]["node_id"]
            sus.insert(0, Suspect("rank", str(r), max((s.score for s in sus), default=1.0), "stopped",
                                  {"node": node, "added_by": "causes: its process was stopped in the episode"}))
            changed = True
    for i, s in enumerate(sus[:cfg.suspects]):
        if s.kind == "rank" and s.id.lstrip("-").isdigit():
            cause, ev = explain_rank(ps, int(s.id), f.onset_ns, f.last_ns)
        elif s.kind == "process" and ":" in s.id:   # "node:pid", a process outside any rank (a serving engine)
            proc = ps.process(*s.id.rsplit(":", 1))
            if proc is None:
                continue
            cause, ev = explain_process(ps, proc, -1, f.onset_ns, f.last_ns)
        else:
            continue
        if not cause and set(ev) <= {"node", "pid", "causes", "why"}:
            continue   # nothing measured for this rank: the detector's word stands, unannotated
        evidence = {**s.evidence, "why": ev}
        if cause:
            evidence["detector_cause"] = s.cause
        sus[i] = replace(s, cause=cause or s.cause, evidence=evidence)
        changed = True
    if not changed:
        return f
    lead = sus[0]
    if lead.kind == "rank" and lead.cause not in LOCAL:
        # a rank with a cause of its own goes ahead of one without; where the leader has no cause at all (it
        # only waits), a rank whose connections are degraded (network) does too
        bare = lead.cause not in LOCAL + ("network",)
        for j in range(1, min(cfg.suspects, len(sus))):
            s = sus[j]
            if s.kind == "rank" and (s.cause in LOCAL or bare and s.cause == "network") and \
                    s.score >= cfg.rerank_within * lead.score:
                sus.insert(0, sus.pop(j))
                break
    if sus[0].cause == "network":
        sus = _network_lead(ps, sus, f.onset_ns, f.last_ns)
    return _explained(f, tuple(sus))


def _explained(f: Finding, sus: tuple) -> Finding:
    """The finding with its explained suspects, its leader's cause said in the summary."""
    summary = f.summary
    top = sus[0]
    if top.kind == "node" and top.cause == "network":
        summary = f"{summary.rstrip('.')}; node {top.id}: {top.evidence.get('why', '')}."
    elif top.kind in ("rank", "process") and top.cause in LOCAL + ("network",):
        summary = f"{summary.rstrip('.')}; {top.kind} {top.id}: {_say(top)}."
    return replace(f, suspects=sus, summary=summary)


def _network_lead(ps: _Pass, sus: list[Suspect], onset: int, last: int) -> list[Suspect]:
    """Where the leading suspect's cause is the network: the host at one end of every degraded connection of the
    network suspects, if one is (its node, then its NICs: the link to its switch), goes first. A connection has
    two ends; an end whose node also kept healthy connections towards other hosts over the episode is not the
    slow one (a slow link slows every connection through it), so with one degraded peer the remote is told apart.
    Addresses are a node's by the topology's NIC addresses, or by the node's own side of its connections (the job's
    other nodes' connections are read for an address neither names, 64 nodes at most)."""
    conns, healthy_of = [], {}
    owner: dict[str, str] = {}
    for s in sus[:ps.cfg.suspects]:
        if s.cause != "network" or s.kind != "rank":
            continue
        why = s.evidence.get("why", {})
        node, net = why.get("node") or s.evidence.get("node"), why.get("network", {})
        if not node:
            continue
        healthy_of[node] = set(net.get("healthy_remotes", []))
        for item in net.get("srtt_degraded", []):
            src, _, dst = item["conn"].partition("->")
            src_a, dst_a = src.rpartition(":")[0], dst.rpartition(":")[0]
            owner.setdefault(src_a, node)
            conns.append((node, dst_a))
    if not conns:
        return sus
    for ip, node in nic_addresses(ps.reader).items():
        owner.setdefault(ip, node)
    nodes = {p["node_id"] for p in ps.procs().values()}
    unknown = {d for _, d in conns if d not in owner}
    if unknown:
        m = int(ps.cfg.margin_seconds * 1e9)
        b0 = max(0, onset - int(ps.cfg.baseline_seconds * 1e9))
        for node in sorted(nodes - set(healthy_of))[:64]:
            for r in ps.conns(node, b0, max(last, onset + 1) + m):
                owner.setdefault(r["src"], node)
            if all(d in owner for d in unknown):
                break
    counts: dict[str, int] = {}
    for node, dst in conns:
        for end in {node, owner.get(dst, "")} - {""}:
            counts[end] = counts.get(end, 0) + 1
    # an end that kept healthy connections to hosts other than the degraded ones' far ends is cleared
    cleared = {n for n, ok in healthy_of.items()
               if {owner.get(a, a) for a in ok} - {owner.get(d, d) for n2, d in conns if n2 == n}}
    ends = sorted(e for e, c in counts.items() if c == len(conns) and e not in cleared)
    if len(ends) != 1 or ends[0] not in nodes:
        return sus
    lead = ends[0]
    why = (f"every one of the {len(conns)} degraded TCP connection(s) has {lead} at one end"
           + (f"; {', '.join(sorted(cleared))} kept healthy connections to other hosts" if cleared else ""))
    score = max(x.score for x in sus)
    added = [Suspect("node", lead, score, "network", {"why": why, "connections": len(conns), "added_by": "causes"})]
    added += [Suspect("nic", nic, score, "network", {"node": lead, "why": "its link to its switch"})
              for nic in nics_of(ps.reader, lead)[:2]]
    keep = [x for x in sus if not (x.kind in ("node", "nic") and x.id in {a.id for a in added})]
    return added + keep


def _say(s: Suspect) -> str:
    why = s.evidence.get("why", {})
    c = s.cause
    if c == "stopped":
        return "its process was stopped (" + "; ".join(why.get("stopped", [])[:1]) + ")"
    if c == "cpu-throttled":
        fr = why.get("process_cpu_throttled_fraction", {}).get("during")
        q = why.get("cpu_quota_cores")
        return f"CPU-throttled by its cgroup for {fr:.0%} of the time" + (f" (quota {q:g} cores)" if q else "")
    if c == "gc":
        fr = why.get("python_gc_fraction", {}).get("during")
        return f"Python GC took {fr:.0%} of the time"
    if c == "cpu-affinity":
        n = why.get("cpus_allowed", {})
        return f"may run on {n.get('during'):g} CPU(s), {n.get('before'):g} before (its affinity was narrowed)"
    if c == "cpu-contention":
        fr = why.get("process_runqueue_fraction", {}).get("during")
        return f"waited for a CPU {fr:.0%} of the time (run queue)"
    if c == "gpu-slow" and "identical_kernel_ratio" in why.get("kernels", {}):
        k = why["kernels"]
        return f"its identical kernels run {k['identical_kernel_ratio']:.2f}x its peers' time"
    if c in ("gpu-throttled", "gpu-slow"):
        g = why.get("gpu", {})
        return (f"{g.get('gpu')} at {g.get('sm_clock_mhz'):.0f} MHz vs its peers' {g.get('peers_sm_clock_mhz'):.0f}"
                + (f" ({', '.join(g.get('reasons'))})" if g.get("reasons") else ""))
    if c == "gpu-error":
        g = why.get("gpu", {})
        return f"{g.get('gpu')} reported {', '.join(g.get('xid', []))}"
    if c == "host-bound":
        k = why.get("kernels", {}).get("issue_below_50us", {})
        return (f"its GPU waits for its CPU ({k.get('own', 0):.0%} of its kernels start < 50 µs after their "
                f"launch, its peers' {k.get('peers', 0):.0%})")
    if c == "memory-pressure":
        return "its node is under memory pressure"
    if c == "network":
        n = why.get("network", {})
        rem = n.get("remotes")
        return "its node's connections degraded" + (f" (towards {', '.join(rem)})" if rem else "")
    if c == "data-loading":
        return "its Python time moved into data loading"
    return c


EXPLAINED_KEY = ("causes", "explained")   # in the engine's per-job memo: suspects of findings explained before
EXPLAINED_MAX = 256
SETTLE_NS = 3 * 10**9   # a finding over this long before the pass's data time (past the margin) has all its data


def attach(reader, job_key: str, outputs: dict[str, list[Finding]], cfg: CausesConfig | None = None,
           until_ns: int = 0, open_onsets: dict | None = None) -> dict[str, list[Finding]]:
    """The detectors' output with a cause on the leading suspects of every examined finding (see the module
    docstring). A reader without the reads needed returns the output as it is.

    until_ns: the pass's data time. A detector reports an episode that is over again at every pass while it lies in
    its window (the sentinel's 60 s): one that ended margin + SETTLE_NS before until_ns, unchanged since (span,
    suspects), gets the suspects it got then, from the engine's per-job memo (reader.step_memo), instead of its
    reads again (a serving engine's findings took ~0.3-0.9 s of the collector's CPU a pass, mostly its stack
    summaries re-read for every over episode, and the loop's duty cycle sleeps 3x that).

    open_onsets: {finding key: onset} of the job's open findings. An output that continues one (same identity) is
    explained over the finding's whole span, from its onset: a fault's milder tail (a memory hog's aftermath) is the
    same incident, and explained alone it had no cause of its own (its finding showed none once the tail was the
    newest output)."""
    if not _supported(reader):
        return outputs
    cfg = cfg or CausesConfig()
    ps = _Pass(reader, job_key, cfg)
    memo = getattr(reader, "step_memo", None)
    done = memo.setdefault(EXPLAINED_KEY, {}) if isinstance(memo, dict) and until_ns else None
    settled = until_ns - int(cfg.margin_seconds * 1e9) - SETTLE_NS

    def explain(f: Finding) -> Finding:
        onset = (open_onsets or {}).get(f.key, f.onset_ns)
        if onset < f.onset_ns:
            return replace(explain(replace(f, onset_ns=onset)), onset_ns=f.onset_ns)
        if done is None or f.last_ns > settled:
            return explain_finding(ps, f)
        key = (f.key, f.onset_ns, f.last_ns, tuple((s.kind, s.id, s.score, s.cause) for s in f.suspects))
        sus = done.get(key)
        if sus is None:
            out = explain_finding(ps, f)
            if len(done) >= EXPLAINED_MAX:
                del done[next(iter(done))]   # the oldest
            done[key] = out.suspects
            return out
        return _explained(f, sus) if sus != f.suspects else f
    return {name: [explain(f) if f.kind in EXAMINED_KINDS and f.suspects else f for f in fs]
            for name, fs in outputs.items()}
