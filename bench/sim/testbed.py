"""The simulator configured like the real CPU testbed (bench/testbed), and the side-by-side comparison.

`config_from_baseline(fixture)` derives every cost of the model from a recorded testbed baseline
(`bench/testbed/calibrate.py` writes the recording; `calibration/testbed-dp2pp2.json` is one):
  fwd_ms, bwd_ms     median per-rank forward / backward wall time per micro-batch (CPU contention included)
  fwd/bwd glue       the per-rank step time not in compute, pipeline wait or all-reduce (untimed glue: isend
                     posting, randn inputs, torch.cat, log line) spread over the forward/backward ops
  nic_gbps           the flat all-reduce's bytes over its pure cost, the pure cost being the all-reduce time
                     of the replica that arrives last (min over the DP group of the median), so a veth link is
                     as fast as the CPU-bound gloo transfer it carries
  jitter_cv          median per-rank coefficient of variation of compute time per step
  optimizer_ms       the optimizer step plus the per-step time the model lacks to match the recorded median
                     step (`fit_overhead_ms`: 4 ranks on 2 cores overlap less than the dependencies allow)
  send_rendezvous    a gloo send completes when the receiver takes it; the job waits for its sends
  schedule           GPipe (the testbed job's default), 4 micro-batches of 16 x 1024 floats
`sim_faults(name, record, fixture, cfg)` maps a testbed fault and its size to simulator faults:
  link   tbf RATE on host h      slow_link on rank h: NIC bandwidth / (RATE x TCP goodput 1448/1514)
  cpu    quota SHARE on rank r   rank r's CPU work per step (baseline `cpu_seconds`, all threads) at SHARE of a
                                 core: its ops and its link slowed by W / (SHARE x (the model's ops per step +
                                 pure all-reduce)), so the scaled work takes W / SHARE
  stop   SIGSTOP for S s         hang of S s on rank r (one long step)
  gc_storm on rank r             a stall at the start of every step on rank r as long as the storm's own cost
                                 (the target's `gc_seconds` in the fault phase, i.e. the injected work)
  extra_sync                     a world barrier after every forward micro-batch (model.ModelConfig.barrier_us),
                                 gloo's dissemination barrier: ceil(log2 world) messages of p2p_latency_us
  noisy  N burners on C cores    every rank's CPU work slowed by max(1, (U + N) / C) / max(1, U / C), U = the
                                 job's baseline CPU demand in cores (sum of cpu_seconds / step_seconds)
Nothing here reads a fault phase's step times; only the baseline and the fault's size (and, for the GC
storm, the injected work) go in. `compare()` then runs the simulator for the baseline and for each fault and
puts the per-rank figures next to the recorded ones; `table()` prints them.
"""

from __future__ import annotations

import json
import math
import os
import statistics

from .faults import parse_fault
from .model import Iteration, ModelConfig, simulate

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "calibration", "testbed-dp2pp2.json")
TCP_GOODPUT = 1448 / 1514      # TCP payload per Ethernet frame (MSS with timestamps) that tbf counts
COMPONENTS = ("busy", "pipe_wait", "allreduce", "sync")  # busy = compute + GC (+ time stopped)
TOLERANCE = 0.25


def load(path: str = FIXTURE) -> dict:
    with open(path) as fh:
        return json.load(fh)


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else 0.0


def pooled_baseline(fixture: dict) -> dict[int, dict]:
    """Per rank, the median over all baseline phases of each column."""
    world = fixture["shape"]["dp"] * fixture["shape"]["pp"]
    phases = [rec["baseline"] for rec in fixture["faults"].values()]
    out = {}
    for r in range(world):
        rows = [p[str(r)] for p in phases if p[str(r)].get("steps")]
        keys = set().union(*(row.keys() for row in rows)) - {"steps"}
        out[r] = {k: _med(row.get(k) for row in rows) for k in keys}
    return out


def _ar_pure(base: dict[int, dict], dp: int, stage: int) -> float:
    return min(base[stage * dp + d]["allreduce_seconds"] for d in range(dp))


def config_from_baseline(fixture: dict, **over) -> ModelConfig:
    sh = fixture["shape"]
    dp, pp, m, width, mbs = sh["dp"], sh["pp"], sh["micro_batches"], sh["width"], sh["micro_batch_size"]
    base = pooled_baseline(fixture)
    ranks = range(dp * pp)
    grad_bytes = 2 * (width * width + width) * 4
    ar = _med(_ar_pure(base, dp, s) for s in range(pp))
    # untimed glue (isend posting, randn inputs, requires_grad, bookkeeping) sits between the ops
    other = _med(base[r]["step_seconds"] - base[r]["compute_seconds"] - base[r]["pipe_wait_seconds"]
                 - base[r]["allreduce_seconds"] for r in ranks)
    fwd = _med(base[r]["fwd_seconds"] for r in ranks)
    bwd = _med(base[r]["bwd_seconds"] for r in ranks)
    glue = 1.0 + max(0.0, other) / (fwd + bwd)
    nic_gbps = 2 * (dp - 1) / dp * grad_bytes * 8 / ar / 1e9
    cfg = dict(dp=dp, pp=pp, tp=1, micro_batches=m, gpus_per_node=1, nodes_per_leaf=32, spines=1,
               schedule=sh.get("schedule", "gpipe"), send_rendezvous=True,
               fwd_ms=fwd * glue / m * 1e3, bwd_ms=bwd * glue / m * 1e3,
               optimizer_ms=_med(base[r].get("opt_seconds", 0.0) for r in ranks) * 1e3, tp_collective_ms=0.0,
               activation_bytes=mbs * width * 4, grad_bytes=grad_bytes,
               nic_gbps=nic_gbps, switch_gbps=nic_gbps, nvlink_gbps=nic_gbps,
               p2p_latency_us=0.0, hop_latency_us=0.0, iterations=40, seed=1,
               jitter_cv=_med(base[r].get("compute_cv") for r in ranks), collective_timeout_s=30.0)
    cfg["optimizer_ms"] += fit_overhead_ms(ModelConfig(**cfg), _med(base[r]["step_seconds"] for r in ranks))
    cfg.update(over)
    return ModelConfig(**cfg)


def _median_step(cfg: ModelConfig) -> float:
    rows = run_sim(cfg, [], cfg.iterations)[5:]
    return statistics.median(x["step_seconds"] for row in rows for x in row)


def fit_overhead_ms(cfg: ModelConfig, step_s: float) -> float:
    """Per-step serial time the model lacks to make its baseline step as long as the recorded one.

    On 4 ranks sharing 2 cores the pipeline and the all-reduce overlap less than the data dependencies
    allow (a rank is off-CPU when its message is due, the two stages' all-reduces contend): time the step
    log cannot place. It goes in as per-step overhead after the all-reduce (added to optimizer_ms), which
    no fault scales: a neutral place rather than a guess at where it comes from."""
    from dataclasses import replace
    have = _median_step(replace(cfg, jitter_cv=0.0))
    return max(0.0, step_s - have) * 1e3


def _rank_of(target: str) -> int:
    return int(target.lstrip("hrank"))


def _rate_bps(rate: str) -> float:
    s = rate.lower().rstrip("bit").rstrip("/s")
    mult = {"k": 1e3, "m": 1e6, "g": 1e9}.get(s[-1:], 1.0)
    return float(s[:-1] if s[-1:] in "kmg" else s) * mult


def sim_faults(name: str, rec: dict, fixture: dict, cfg: ModelConfig, n: int) -> tuple[list[str], dict, str]:
    """(fault specs over iterations [0, n), config overrides, how the size was mapped) for one testbed fault."""
    base = pooled_baseline(fixture)
    kind, p = rec["kind"], rec.get("params", {})
    world = cfg.dp * cfg.pp
    if kind == "link":
        r = _rank_of(rec["target"])
        div = cfg.nic_gbps * 1e9 / (_rate_bps(p.get("rate", "200mbit")) * TCP_GOODPUT)
        return [f"slow_link:{r}:0:{n}:{div:.4g}"], {}, f"link of rank {r} / {div:.3g}"
    if kind == "cpu":
        r = _rank_of(rec["target"])
        b = base[r]
        # the work f scales, as the model holds it: the rank's ops (glue included) and its pure all-reduce
        busy = cfg.micro_batches * (cfg.fwd_ms + cfg.bwd_ms) / 1e3 + _ar_pure(base, cfg.dp, r // cfg.dp)
        f = max(1.0, b["cpu_seconds"] / (p.get("cpu_share", 0.1) * busy))
        return [f"slow_gpu:{r}:0:{n}:{f:.4g}", f"slow_link:{r}:0:{n}:{f:.4g}"], {}, \
            f"rank {r} compute and link x{f:.3g}"
    if kind == "stop":
        r = _rank_of(rec["target"])
        return [f"hang:{r}:{n // 2}:{n // 2 + 1}:{p.get('duration_seconds', 2.0)}"], {}, \
            f"hang rank {r} {p.get('duration_seconds')} s"
    if kind == "gc_storm":
        r = _rank_of(rec["target"])
        gc_s = rec["fault"][str(r)].get("gc_seconds", 0.0)
        # the job runs the storm at the start of each step, before its first forward: a stall per step
        return [f"hang:{r}:{i}:{i + 1}:{gc_s:.6g}" for i in range(n)], {}, f"rank {r} stalls {gc_s * 1e3:.0f} ms/step"
    if kind == "extra_sync":
        # gloo's barrier is a dissemination barrier: ceil(log2 world) rounds of one message each; the
        # recording has no small-message latency (the P2P latency is 0), so this is the serialization only
        us = max(1.0, math.ceil(math.log2(max(2, world))) * cfg.p2p_latency_us)
        return [], {"barrier_us": us}, f"barrier per forward ({us / 1e3:.1f} ms: serialization only)"
    if kind == "noisy":
        cores = fixture["machine"]["cpus"]
        u = sum(base[r]["cpu_seconds"] / base[r]["step_seconds"] for r in range(world))
        f = max(1.0, (u + p.get("processes", 1)) / cores) / max(1.0, u / cores)
        specs = [f"slow_gpu:{r}:0:{n}:{f:.4g}" for r in range(world)]
        specs += [f"slow_link:{r}:0:{n}:{f:.4g}" for r in range(world)]
        return specs, {}, f"all ranks' CPU work x{f:.3g} (job uses {u:.2f} of {cores} cores)"
    raise ValueError(f"no simulator mapping for testbed fault kind {kind!r}")


def per_rank_components(cfg: ModelConfig, it: Iteration) -> list[dict]:
    """Seconds per rank in one simulated step, split like the testbed's step log."""
    D, P, T = cfg.dp, cfg.pp, cfg.tp
    if T != 1:
        raise ValueError("the testbed comparison has one rank per stage replica (tp=1)")
    opt = cfg.optimizer_ms * 1e6
    out = [None] * (D * P)
    for s in range(P):
        for d in range(D):
            r = s * D + d
            busy = sum(op[4][d] - op[3][d] for op in it.ops[s]) + opt + it.stall.get(r, 0.0)
            sw = it.send_wait_ns[s][d] if it.send_wait_ns else 0.0
            pipe = sum(op[3][d] - op[2][d] for op in it.ops[s]) + sw
            sync = it.sync_ns[s][d] if it.sync_ns else 0.0
            ar = it.last_b[s] + it.ar_ns[s][0] - it.ops[s][-1][4][d] - sw
            out[r] = {"step_seconds": (it.end[r] - it.start[r]) / 1e9, "busy": busy / 1e9,
                      "pipe_wait": pipe / 1e9, "allreduce": ar / 1e9, "sync": sync / 1e9}
    return out


def run_sim(cfg: ModelConfig, specs: list[str], iterations: int) -> list[list[dict]]:
    rows: list[list[dict]] = []
    faults = [parse_fault(s, cfg.topology()) for s in specs]
    simulate(cfg, faults, sink=lambda it: rows.append(per_rank_components(cfg, it)))
    return rows


def _summ(rows: list[list[dict]], r: int, longest: bool = False) -> dict:
    keys = ("step_seconds",) + COMPONENTS
    if longest:
        row = max((x[r] for x in rows), key=lambda x: x["step_seconds"])
        return {k: row[k] for k in keys}
    return {k: statistics.median(x[r][k] for x in rows) for k in keys}


def testbed_components(ph: dict) -> dict:
    return {"step_seconds": ph.get("step_seconds", 0.0),
            "busy": ph.get("compute_seconds", 0.0) + ph.get("gc_seconds", 0.0),
            "pipe_wait": ph.get("pipe_wait_seconds", 0.0), "allreduce": ph.get("allreduce_seconds", 0.0),
            "sync": ph.get("sync_seconds", 0.0)}


def grown(base: dict, fault: dict) -> str:
    """The component that grew most (seconds) from baseline to fault."""
    return max(COMPONENTS, key=lambda k: fault[k] - base[k])


def compare(fixture: dict, calib: dict | None = None, iterations: int = 40, seed: int = 1) -> list[dict]:
    """Per fault and rank: testbed vs simulator step-time ratio and fault-phase components.

    `fixture`: the recording to compare against; `calib`: the recording whose baselines configure the
    simulator (default: `fixture` itself)."""
    calib = calib or fixture
    cfg = config_from_baseline(calib, iterations=iterations, seed=seed)
    over0 = {"iterations": iterations, "seed": seed + 1, "p2p_latency_us": cfg.p2p_latency_us}
    world = cfg.dp * cfg.pp
    sim_base = run_sim(cfg, [], iterations)[5:]
    out = []
    for name, rec in fixture["faults"].items():
        specs, over, how = sim_faults(name, rec, calib, cfg, iterations)
        from dataclasses import replace
        fcfg = replace(cfg, **dict(over0, **over))
        rows = run_sim(fcfg, specs, iterations)
        stop = rec["kind"] == "stop"
        sim_fault = rows if stop else rows[5:]
        row = {"fault": name, "kind": rec["kind"], "target": rec["target"], "mapping": how, "ranks": []}
        for r in range(world):
            tb_b, tb_f = testbed_components(rec["baseline"][str(r)]), testbed_components(rec["fault"][str(r)])
            if stop:
                tb_f["step_seconds"] = rec["fault"][str(r)].get("max_step_seconds", 0.0)
            sb, sf = _summ(sim_base, r), _summ(sim_fault, r, longest=stop)
            tb_ratio = tb_f["step_seconds"] / max(tb_b["step_seconds"], 1e-6)
            sim_ratio = sf["step_seconds"] / max(sb["step_seconds"], 1e-6)
            row["ranks"].append({"rank": r, "testbed_ratio": tb_ratio, "sim_ratio": sim_ratio,
                                 "rel_err": sim_ratio / tb_ratio - 1.0,
                                 "testbed": tb_f, "sim": sf, "testbed_base": tb_b, "sim_base": sb,
                                 "testbed_grown": grown(tb_b, tb_f), "sim_grown": grown(sb, sf)})
        out.append(row)
    return out


def pattern_ranks(row: dict) -> list[int]:
    """Ranks whose grown component is compared. All, except: `stop` and `cpu` leave out the target rank (its
    stopped or CFS-throttled time lands in whatever op it was in, compute or all-reduce, by chance: a 10 %
    quota is 90 ms stops every 100 ms; live runs split it 0.10 s / 0.10 s or 0.19 s / 0.10 s); `extra_sync` keeps the first
    stage only (the later stage arrives last at each barrier, so its sync time is the barrier's own message
    latency, which the recording does not give the simulator: see sim_faults)."""
    ranks = [x["rank"] for x in row["ranks"]]
    if row["kind"] in ("stop", "cpu"):
        return [r for r in ranks if f"rank{r}" != row["target"]]
    if row["kind"] == "extra_sync":
        return ranks[:len(ranks) // 2]
    return ranks


def pattern_ok(row: dict) -> bool:
    """Same per-rank wait pattern: on every compared rank the component that grew most is the same on both
    sides. The noisy neighbour slows every rank alike and which wait grows most is chance there: its pattern
    is every rank's step at least 1.2x on both sides."""
    if row["kind"] == "noisy":
        return all(x["testbed_ratio"] > 1.2 and x["sim_ratio"] > 1.2 for x in row["ranks"])
    keep = set(pattern_ranks(row))
    return all(x["testbed_grown"] == x["sim_grown"] for x in row["ranks"] if x["rank"] in keep)


def ratio_ok(row: dict, tol: float = TOLERANCE) -> bool:
    return all(abs(x["rel_err"]) <= tol for x in row["ranks"])


def table(rows: list[dict]) -> str:
    short = {"busy": "busy", "pipe_wait": "pipe", "allreduce": "ar", "sync": "sync"}
    lines = [f"{'fault':<11}{'rank':>4} {'step x tb':>9} {'sim':>6} {'err':>6}  "
             f"{'testbed fault-phase s: busy/pipe/ar/sync':<41}{'sim':<33}{'grew tb/sim':<13}"]
    for row in rows:
        for x in row["ranks"]:
            tb = "/".join(f"{x['testbed'][k]:.3f}" for k in COMPONENTS)
            sm = "/".join(f"{x['sim'][k]:.3f}" for k in COMPONENTS)
            mark = "" if x["rank"] in pattern_ranks(row) and row["kind"] != "noisy" else " (not compared)"
            lines.append(f"{row['fault'] if x['rank'] == 0 else '':<11}{x['rank']:>4} {x['testbed_ratio']:>9.2f} "
                         f"{x['sim_ratio']:>6.2f} {x['rel_err'] * 100:>+5.0f}%  {tb:<41}{sm:<33}"
                         f"{short[x['testbed_grown']]}/{short[x['sim_grown']]}{mark}")
        lines.append(f"{'':<15}sim: {row['mapping']}; ratio within {TOLERANCE:.0%}: "
                     f"{'yes' if ratio_ok(row) else 'NO'}; pattern: {'same' if pattern_ok(row) else 'DIFFERENT'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="simulator vs recorded testbed, side by side")
    ap.add_argument("--fixture", default=FIXTURE)
    ap.add_argument("--calib", default=None, help="recording whose baseline configures the sim (default: --fixture)")
    a = ap.parse_args(argv)
    fx = load(a.fixture)
    rows = compare(fx, load(a.calib) if a.calib else None)
    print(f"testbed {fx['date']} on {fx['machine']['node']} ({fx['machine']['cpus']} CPUs): {fx.get('command', '')}")
    print(table(rows))
    return 0 if all(ratio_ok(r) and pattern_ok(r) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
