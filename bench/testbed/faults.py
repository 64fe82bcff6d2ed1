"""Real faults on the testbed, a ground-truth log of each, and per-rank step-log windows to check them against.

Kinds (`inject(layout, kind, target, duration_seconds, ...)`; each call blocks for the duration, reverts, and
appends one JSON line {kind, target, params, start_ns, end_ns} (wall clock) to <state>/ground_truth.jsonl):
Targets: a rank (`rank3` or `3`) for cpu / stop / gc_storm / hold / slow; a host (`h1`, `1`, or `rank3` = the host
of rank 3) for link / drop / noisy. With TP (several ranks per host) a host's link fault slows its DP and PP traffic,
not TP, which stays on the host's loopback path.
- `link`: tbf (default 200 Mbit, bucket 64 KiB) on the target host's eth0 egress and on its bridge port's egress (both
  directions of its link); the qdiscs also vanish with the namespaces on `down`.
- `drop`: netem loss 100 % on the same two egresses (without sch_netem: a tc redirect of every packet into a
  veth leading nowhere): the host's link drops everything, both ways (its agent's
  connection to the collector too: the agent spools and sends when the link is back); TCP backs off while it
  lasts, so the job resumes up to a minute or so after the link is back (the retransmission timer's backoff).
- `cpu`: CPU quota (default 10 % of a core) for the target rank's process, cgroup v1 `cpu` controller
  (`cpu.cfs_quota_us`) or v2 (`cpu.max`); the cgroup is named sltb-rank<r> and removed afterwards.
- `stop`: SIGSTOP then SIGCONT of the target rank; longer than the job's gloo timeout (30 s) kills the job.
- `gc_storm`: control file <state>/faults/rank<r>.json read by the job each step.
- `hold`: the target rank is stuck in Python (job.py `hold_in_python`, a sleep loop at the start of its next
  step) while its control file says hold; the others hang in their collectives. Longer than the job's gloo
  timeout (start_job timeout_seconds) kills the job, as `stop` does.
- `extra_sync`: a world barrier per micro-batch on every rank (target `all`), through <state>/faults/all.json
  with a step range a few steps ahead so all ranks switch on the same step; start/end come from the step logs.
- `noisy`: N CPU-burning processes inside the target host's namespace. The namespaces share the VM's CPUs, so
  for the fault's duration the burners and the host's ranks go into one cgroup sltb-host<i> weighing as one
  process (cpu.shares default): the host's CPU, which the burners take from its ranks only (run-queue waits),
  as a noisy neighbour on a host of its own would, instead of slowing every emulated host alike.
- `slow`: the target rank computes `slow_fraction` (default 5 %) of its step time longer each step (job.py: busy on
  its CPU after its micro-batches, as a slower device would), through its control file; the job's steps take about
  that much longer (the others wait for it at the all-reduce and the pipeline); target `all`: every rank.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time

from . import netns

RANK_KINDS = ("cpu", "stop", "gc_storm", "hold", "slow")
KINDS = ("link", "drop", "cpu", "stop", "gc_storm", "hold", "extra_sync", "noisy", "slow")


# ---------------------------------------------------------------- step logs

def read_steps(layout: netns.Layout, rank: int) -> list[dict]:
    try:
        with open(layout.path("steps", f"rank{rank}.jsonl")) as fh:
            return [json.loads(line) for line in fh if line.endswith("\n")]
    except OSError:
        return []


def last_step(layout: netns.Layout) -> int:
    """The highest step every rank has finished (-1 before the first)."""
    world = len(netns.load_job(layout)["ranks"])
    done = [read_steps(layout, r) for r in range(world)]
    return min((s[-1]["step"] if s else -1) for s in done)


def wait_steps(layout: netns.Layout, n: int, timeout: float = 120.0) -> int:
    """Block until every rank has finished `n` more steps; returns the new last step."""
    target = last_step(layout) + n
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cur = last_step(layout)
        if cur >= target:
            return cur
        if not all(netns.job_alive(layout).values()):
            raise RuntimeError("a rank of the job exited; see <state>/logs/rank*.log")
        time.sleep(0.05)
    raise TimeoutError(f"ranks did not reach step {target} within {timeout}s")


def window(layout: netns.Layout, start_ns: int, end_ns: int, rank: int) -> list[dict]:
    """Steps of one rank that overlap [start_ns, end_ns] (wall clock)."""
    return [s for s in read_steps(layout, rank) if s["end_ns"] > start_ns and s["start_ns"] < end_ns]


def summarize(steps: list[dict]) -> dict:
    """Medians of each timing column, step count, and the longest step."""
    if not steps:
        return {"steps": 0}
    out = {"steps": len(steps), "max_step_seconds": max(s["step_seconds"] for s in steps)}
    for k in ("step_seconds", "compute_seconds", "pipe_wait_seconds", "allreduce_seconds",
              "tp_allreduce_seconds", "gc_seconds", "sync_seconds"):
        out[k] = statistics.median(s.get(k, 0.0) for s in steps)  # logs from before TP lack tp_allreduce
    return out


def ground_truth(layout: netns.Layout) -> list[dict]:
    try:
        with open(layout.path("ground_truth.jsonl")) as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except OSError:
        return []


def _log(layout: netns.Layout, entry: dict) -> dict:
    with open(layout.path("ground_truth.jsonl"), "a") as fh:
        fh.write(json.dumps(entry) + "\n")
    return entry


# ---------------------------------------------------------------- the faults

def _rank_pid(layout: netns.Layout, rank: int) -> int:
    for r in netns.load_job(layout)["ranks"]:
        if r["rank"] == rank:
            return r["pid"]
    raise ValueError(f"no rank {rank} in the job")


def _number(target: str, prefix: str) -> int | None:
    t = target.strip()
    if t.startswith(prefix):
        t = t[len(prefix):]
    return int(t) if t.isdigit() else None


def resolve_target(layout: netns.Layout, kind: str, target: str) -> int:
    """The rank (cpu, stop, gc_storm, hold) or host index (link, drop, noisy) a target names.

    Ranks: 'rank3' or '3'; a host 'h1' only while it holds one rank (tp = 1). Hosts: 'h1' or '1', or
    'rank3' for the host that rank 3 runs on (with tp > 1 that is rank 3 // tp)."""
    try:
        ranks = netns.load_job(layout)["ranks"]
    except RuntimeError:
        ranks = []
    host_of = {r["rank"]: int(r["host"].lstrip("h")) for r in ranks}
    if kind in RANK_KINDS:
        if target.strip().startswith("h"):
            i = _number(target, "h")
            on = [r for r, h in host_of.items() if h == i]
            if i is None or len(on) != 1:
                raise ValueError(f"{kind} targets a rank; host {target!r} holds ranks {on}: name one as rank<r>")
            return on[0]
        r = _number(target, "rank")
        if r is None or (host_of and r not in host_of):
            raise ValueError(f"no rank {target!r} in the job (ranks {sorted(host_of)})")
        return r
    if target.strip().startswith("rank"):
        r = _number(target, "rank")
        if r not in host_of:
            raise ValueError(f"no rank {target!r} in the job (ranks {sorted(host_of)})")
        return host_of[r]
    i = _number(target, "h")
    if i is None:
        raise ValueError(f"bad host target {target!r}: h<i>, <i> or rank<r>")
    return i


def _tbf(dev_ns: list[tuple[str, str]], rate: str, on: bool, burst: str = "64kb") -> None:
    for ns, dev in dev_ns:
        if on:
            netns.sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", burst, "latency", "100ms")
        else:
            netns.sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)


def _drop_all(dev_ns: list[tuple[str, str]], on: bool) -> str:
    """Every packet leaving these devices dropped past the TCP stack, as a broken link drops it: netem loss 100 %
    where the kernel has sch_netem, else a clsact egress filter redirecting every packet into a veth that leads
    nowhere (a kernel without netem, like this VM's). Returns how."""
    how = ""
    for k, (ns, dev) in enumerate(dev_ns):
        ip = ("ip", "netns", "exec", ns)
        hole = f"sltbhole{k}"
        if on:
            r = netns.sh(*ip, "tc", "qdisc", "replace", "dev", dev, "root", "netem", "loss", "100%", check=False)
            if r.returncode == 0:
                how = "netem"
                continue
            netns.sh(*ip, "ip", "link", "add", hole, "type", "veth", "peer", "name", hole + "p", check=False)
            netns.sh(*ip, "ip", "link", "set", hole, "up")
            netns.sh(*ip, "tc", "qdisc", "add", "dev", dev, "clsact")
            netns.sh(*ip, "tc", "filter", "add", "dev", dev, "egress", "protocol", "all", "u32", "match", "u32", "0",
                     "0", "action", "mirred", "egress", "redirect", "dev", hole)
            how = "mirred"
        else:
            netns.sh(*ip, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            netns.sh(*ip, "tc", "qdisc", "del", "dev", dev, "clsact", check=False)
            netns.sh(*ip, "ip", "link", "del", hole, check=False)
    return how


def _cgroup_v1_cpu() -> str | None:
    p = "/sys/fs/cgroup/cpu"
    return p if os.path.exists(os.path.join(p, "cpu.cfs_quota_us")) else None


def _cgroup_v2() -> str | None:
    p = "/sys/fs/cgroup"
    try:
        with open(os.path.join(p, "cgroup.controllers")) as fh:
            return p if "cpu" in fh.read().split() else None
    except OSError:
        return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _original_cgroup(pid: int, v1: bool) -> str:
    with open(f"/proc/{pid}/cgroup") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (v1 and "cpu" in controllers.split(",")) or (not v1 and controllers == ""):
                return path
    return "/"


def _cgroup(name: str, pids: list[int], share: float | None = None):
    """Put the processes `pids` (every thread of each) into cgroup sltb-<name> of the cpu controller (v1, else v2):
    with `share`, limited to that share of one core (CFS quota); without, the group weighs as one process does
    (cpu.shares / cpu.weight at their defaults), so what runs in it shares one process's part of the CPUs.
    Returns an undo function: each process back where it was, the cgroup removed."""
    period = 100_000
    root = _cgroup_v1_cpu()
    v1 = root is not None
    if not v1:
        root = _cgroup_v2()
        if root is None:
            raise RuntimeError("no cgroup cpu controller (v1 /sys/fs/cgroup/cpu or v2 with cpu)")
        _write(os.path.join(root, "cgroup.subtree_control"), "+cpu")
    originals = {pid: os.path.join(root, _original_cgroup(pid, v1).lstrip("/")) for pid in pids}
    cg = os.path.join(root, f"{netns.CGROUP_PREFIX}{name}")
    os.makedirs(cg, exist_ok=True)
    if share is not None:
        quota = max(1000, int(period * share))
        if v1:
            _write(os.path.join(cg, "cpu.cfs_period_us"), str(period))
            _write(os.path.join(cg, "cpu.cfs_quota_us"), str(quota))
        else:
            _write(os.path.join(cg, "cpu.max"), f"{quota} {period}")
    for pid in pids:
        _write(os.path.join(cg, "cgroup.procs"), str(pid))  # moves every thread of the process

    def undo():
        for pid, original in originals.items():
            try:
                _write(os.path.join(original if os.path.isdir(original) else root, "cgroup.procs"), str(pid))
            except OSError:
                pass  # the process is gone
        try:
            os.rmdir(cg)
        except OSError:
            pass
    return undo


def _control(layout: netns.Layout, name: str, content: dict | None) -> None:
    path = layout.path("faults", name)
    if content is None:
        if os.path.exists(path):
            os.remove(path)
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(content, fh)
    os.replace(tmp, path)  # the job never reads half a file


def inject(layout: netns.Layout, kind: str, target: str, duration_seconds: float, rate: str = "200mbit",
           cpu_share: float = 0.1, processes: int = 1, lead_steps: int = 4, slow_fraction: float = 0.05,
           burst: str = "64kb") -> dict:
    """Apply one fault for `duration_seconds`, revert it, log and return the ground-truth entry."""
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; one of {', '.join(KINDS)}")
    if duration_seconds <= 0:
        raise ValueError("duration must be > 0 seconds")
    params: dict = {"duration_seconds": duration_seconds}
    entry = {"kind": kind, "target": target}

    if kind == "extra_sync":
        step_s = statistics.median(s["step_seconds"] for s in read_steps(layout, 0)[-10:] or [{"step_seconds": .15}])
        start = last_step(layout) + lead_steps
        n = max(1, round(duration_seconds / max(step_s, 0.01)))
        _control(layout, "all.json", {"extra_sync": {"start_step": start, "end_step": start + n}})
        wait_steps(layout, lead_steps + n, timeout=duration_seconds * 20 + 60)
        _control(layout, "all.json", None)
        world = len(netns.load_job(layout)["ranks"])
        marked = [s for r in range(world) for s in read_steps(layout, r) if start <= s["step"] < start + n]
        params.update(start_step=start, end_step=start + n)
        entry.update(target="all", start_ns=min(s["start_ns"] for s in marked),
                     end_ns=max(s["end_ns"] for s in marked), params=params)
        return _log(layout, entry)

    if kind == "slow" and target == "all":   # every rank slower alike: the job's steps, not one rank's
        params["slow_fraction"] = slow_fraction
        _control(layout, "all.json", {"slow": slow_fraction})
        entry.update(target="all", start_ns=time.time_ns())
        try:
            time.sleep(duration_seconds)
        finally:
            _control(layout, "all.json", None)
            entry["end_ns"] = time.time_ns()
            entry["params"] = params
            _log(layout, entry)
        return entry

    i = resolve_target(layout, kind, target)
    entry["target"] = f"rank{i}" if kind in RANK_KINDS else netns.node_id(i)
    if kind == "link":
        devs = [(netns.host_ns(i), "eth0"), (netns.BRIDGE_NS, f"vh{i}")]
        params["rate"], params["burst"] = rate, burst
        _tbf(devs, rate, True, burst)
        undo = lambda: _tbf(devs, rate, False)  # noqa: E731
    elif kind == "drop":
        devs = [(netns.host_ns(i), "eth0"), (netns.BRIDGE_NS, f"vh{i}")]
        params["loss"] = "100%"
        params["how"] = _drop_all(devs, True)
        undo = lambda: _drop_all(devs, False)  # noqa: E731
    elif kind == "cpu":
        params["cpu_share"] = cpu_share
        undo = _cgroup(f"rank{i}", [_rank_pid(layout, i)], cpu_share)
    elif kind == "stop":
        pid = _rank_pid(layout, i)
        os.kill(pid, signal.SIGSTOP)
        undo = lambda: os.kill(pid, signal.SIGCONT)  # noqa: E731
    elif kind in ("gc_storm", "hold"):
        _control(layout, f"rank{i}.json", {kind: True})
        undo = lambda: _control(layout, f"rank{i}.json", None)  # noqa: E731
    elif kind == "slow":
        params["slow_fraction"] = slow_fraction
        _control(layout, f"rank{i}.json", {"slow": slow_fraction})
        undo = lambda: _control(layout, f"rank{i}.json", None)  # noqa: E731
    else:  # noisy
        params["processes"] = processes
        names, burners = set(), []
        for k in range(processes):
            name = f"noisy-h{i}-{k}"
            burners.append(netns.spawn(layout, name, [sys.executable, "-c", "while True: pass"],
                                       ns=netns.host_ns(i)).pid)
            names.add(name)
        # the namespaces share the VM's CPUs: the burners and the host's ranks share one cgroup, the CPU that
        # host has, so they take it from that host's ranks only, as on a host of its own
        ranks = [r["pid"] for r in netns.load_job(layout)["ranks"] if r["host"] == netns.node_id(i)]
        params["host_cgroup"] = bool(ranks)
        ungroup = _cgroup(f"host{i}", ranks + burners) if ranks else (lambda: None)

        def undo():
            netns.kill_recorded(layout, names, timeout=2)
            ungroup()
    entry["start_ns"] = time.time_ns()
    try:
        time.sleep(duration_seconds)
    finally:
        undo()
        entry["end_ns"] = time.time_ns()
        entry["params"] = params
        _log(layout, entry)
    return entry
