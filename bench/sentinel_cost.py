"""The sentinel's cost to the job it watches, with and without, side by side in one run (issue "Sentinel").

What the sentinel adds inside a job is the bootstrap's iteration anchors (agent/bootstrap/site/steplens_iters.py):
per iteration two clock reads and a ring slot write, per serving batch the workload reader, per training step the
optimizer hook and its frame-local reads. The rest (the agent's ring reads, the collector's model) runs outside
the job. Each part below runs one job under the steplens bootstrap and switches the anchors off and on in turn
inside that one process (steplens_iters.set_enabled), so both halves share the host's state of the moment:
  training   bench/testbed/job.py, DP=2 gloo on loopback (2 ranks, PP=1, 4 micro-batches, width 1024), the
             anchors off and on every --toggle-steps steps (all ranks switch on the same step);
             STEPLENS_STEP_FEATURES set (the frame-local reads are part of the cost). Per state: the median step
             time of rank 0, the first step after each switch left out.
  inference  bench/inference/record.py (vLLM's CPU build, dummy-weight Llama --hidden x --layers, Poisson load
             at a constant --rate), the anchors off and on every --toggle-seconds. Per state and decode batch
             size (with >= 20 batches in both): median batch time; the cost is their ratio averaged over sizes,
             weighted by the smaller count.
Cost = on / off - 1. Beside it the same statistic between the two halves of the "off" segments (A/A): what this
machine's noise alone gives, i.e. the resolution of the figure. And in place: the anchors time themselves
(STEPLENS_ITERS_SELFTIME=1: each wrapper's time minus the wrapped call's, the optimizer hook's whole time, the
timer's own clock reads included) over the iterations run with them on, per iteration and as % of the median
step / batch: the figure that resolves what the A/B cannot on a shared 2-core VM. Goal: <= 0.1 % of the step /
batch time (LatencyPrism: 0.5 %). Last line: one JSON object.

    .venv/bin/python bench/sentinel_cost.py [--steps 600] [--seconds 120] [--skip-inference]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
VLLM_PY = os.path.join(REPO, ".venv-vllm", "bin", "python")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _boot_env(rings: str, **extra) -> dict:
    from steplens.agent.bootstrap import site_dir
    return dict(os.environ, PYTHONPATH=site_dir(), STEPLENS_BOOTSTRAP="1", STEPLENS_RUNTIME_DIR=rings,
                OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", STEPLENS_ITERS_SELFTIME="1", **extra)


def in_place(status: dict, iterations_on: int, median_ms: float) -> dict:
    """The anchors' own time as they measured it (STEPLENS_ITERS_SELFTIME: each wrapper's time minus the
    wrapped call's, the optimizer hook's whole time), per iteration judged with them on."""
    per = status["self_ns"] / max(1, iterations_on)
    cpu = status.get("self_cpu_ns", 0) / max(1, iterations_on)
    step_ns = median_ms * 1e6
    return {"self_us_per_iteration": round(per / 1e3, 2), "self_calls": status["self_calls"],
            "in_place_cost_pct": round(100 * per / step_ns, 4),
            # the thread's CPU time in them: wall time less the preemptions a loaded host puts inside them
            "self_cpu_us_per_iteration": round(cpu / 1e3, 2), "in_place_cpu_cost_pct": round(100 * cpu / step_ns, 4),
            "self_median_us_per_call": round(status.get("self_median_ns", 0) / 1e3, 2)}


def ratio(on: list[float], off: list[float]) -> float | None:
    return statistics.median(on) / statistics.median(off) - 1 if on and off else None


def training(a, tmp: str) -> dict:
    rings = os.path.join(tmp, "train-rings")
    os.makedirs(rings, exist_ok=True)
    port = _port()
    procs = []
    for r in range(2):
        env = _boot_env(rings, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(r),
                        GLOO_SOCKET_IFNAME="lo", STEPLENS_STEP_FEATURES="micro_batches=micro_batches,tokens=tokens")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(REPO, "bench", "testbed", "job.py"), "--rank", str(r), "--dp", "2",
             "--pp", "1", "--steps", str(a.steps), "--toggle-iters", str(a.toggle_steps), "--state-dir", tmp],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=3600)[1] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"training job failed: {errs[0][-2000:]}")
    with open(os.path.join(tmp, "steps", "rank0.jsonl")) as fh:
        steps = [json.loads(line) for line in fh]
    k = a.toggle_steps
    usable = [s for s in steps[2 * k:] if s["step"] % k != 0 and s["iters_on"] is not None]
    on = [s["step_seconds"] for s in usable if s["iters_on"]]
    off = [s["step_seconds"] for s in usable if not s["iters_on"]]
    seg = [(s["step"] // k) % 4 for s in usable if not s["iters_on"]]
    off_a = [x for x, g in zip(off, seg) if g == 1]
    off_b = [x for x, g in zip(off, seg) if g == 3]
    rings_written = sorted(f for f in os.listdir(rings) if f.endswith(".iters"))
    with open(os.path.join(tmp, "steps", "iters-status-rank0.json")) as fh:
        status = json.load(fh)
    med = 1e3 * statistics.median(s["step_seconds"] for s in usable)
    return {"steps": len(steps), "steps_on": len(on), "steps_off": len(off), "step_ms_median": round(med, 2),
            **in_place(status, sum(1 for s in steps if s["iters_on"]), med),
            "cost_pct": round(100 * ratio(on, off), 3), "aa_noise_pct": round(100 * ratio(off_a, off_b), 3),
            "rings": len(rings_written)}


def inference(a, tmp: str) -> dict:
    if not os.path.exists(VLLM_PY):
        return {"skipped": ".venv-vllm is missing (make inference-env)"}
    rings = os.path.join(tmp, "infer-rings")
    os.makedirs(rings, exist_ok=True)
    out = os.path.join(tmp, "infer.jsonl")
    res = subprocess.run([VLLM_PY, os.path.join(REPO, "bench", "inference", "record.py"), "--seconds",
                          str(a.seconds), "--rate", str(a.rate), "--hidden", str(a.hidden), "--layers", str(a.layers),
                          "--toggle-seconds", str(a.toggle_seconds), "--out", out],
                         env=_boot_env(rings), capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"engine failed: {res.stderr[-2000:]}")
    with open(out) as fh:
        fh.readline()
        rows = [json.loads(line) for line in fh]
    rows = [r for r in rows if r["mode"] == 2 and r["iters_on"] is not None and r["t_s"] >= 2 * a.toggle_seconds]

    def weighted(sel_on, sel_off) -> float | None:
        by: dict[int, tuple[list, list]] = {}
        for r in rows:
            if sel_on(r):
                by.setdefault(r["batch_size"], ([], []))[0].append(r["dur_ns"])
            elif sel_off(r):
                by.setdefault(r["batch_size"], ([], []))[1].append(r["dur_ns"])
        num = den = 0.0
        for on, off in by.values():
            w = min(len(on), len(off))
            if w >= 20:
                num += w * ratio(on, off)
                den += w
        return num / den if den else None

    def seg(r) -> int:
        return int(r["t_s"] // a.toggle_seconds) % 4
    cost = weighted(lambda r: r["iters_on"], lambda r: not r["iters_on"])
    aa = weighted(lambda r: seg(r) == 1, lambda r: seg(r) == 3)
    with open(out + ".iters-status.json") as fh:
        status = json.load(fh)
    med = statistics.median(r["dur_ns"] for r in rows) / 1e6
    with open(out) as fh:
        fh.readline()
        batches_on = sum(1 for line in fh if json.loads(line)["iters_on"])
    return {"decode_batches": len(rows), "batch_ms_median": round(med, 3), **in_place(status, batches_on, med),
            "cost_pct": round(100 * cost, 3) if cost is not None else None,
            "aa_noise_pct": round(100 * aa, 3) if aa is not None else None,
            "rings": len([f for f in os.listdir(rings) if f.endswith(".iters")])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--toggle-steps", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--toggle-seconds", type=float, default=4.0)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--skip-inference", action="store_true")
    ap.add_argument("--skip-training", action="store_true")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="steplens-scost-") as tmp:
        res = {}
        if not a.skip_training:
            res["training"] = training(a, tmp)
            print(f"training: {res['training']}", flush=True)
        if not a.skip_inference:
            res["inference"] = inference(a, tmp)
            print(f"inference: {res['inference']}", flush=True)
    print(json.dumps({"training_in_place_cost_pct": res.get("training", {}).get("in_place_cost_pct"),
                      "inference_in_place_cost_pct": res.get("inference", {}).get("in_place_cost_pct"),
                      "training_in_place_cpu_cost_pct": res.get("training", {}).get("in_place_cpu_cost_pct"),
                      "inference_in_place_cpu_cost_pct": res.get("inference", {}).get("in_place_cpu_cost_pct"),
                      "training_cost_pct": res.get("training", {}).get("cost_pct"),
                      "training_aa_noise_pct": res.get("training", {}).get("aa_noise_pct"),
                      "inference_cost_pct": res.get("inference", {}).get("cost_pct"),
                      "inference_aa_noise_pct": res.get("inference", {}).get("aa_noise_pct"), **res}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
