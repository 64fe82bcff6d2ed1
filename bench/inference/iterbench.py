"""How exactly the bootstrap's iteration anchors see a real vLLM engine's batches, and what they cost
(issue "Sentinel", item 1): record.py under the steplens bootstrap, its iteration ring against its own rows.

Runs bench/inference/record.py (vLLM 0.32.0 CPU in .venv-vllm, engine in-process, one LLMEngine.step per batch)
twice, interleaved: under the bootstrap with iterations on, and under the bootstrap with STEPLENS_ITERS=0 (so
the difference is the anchors and the reader, not the GC timer or the watcher thread). After the first run the
ring <runtime dir>/<pid>.iters (kept at exit) is read with steplens_iters.read and each of record.py's rows
(t0_real_ns / t1_real_ns, CLOCK_REALTIME read just outside engine.step) is matched to the LLMEngine.step
iteration inside it. Prints:
  matched: rows with exactly one iteration inside [t0, t1], of rows and of iterations;
  boundary error: (start - t0) and (t1 - end) as % of the batch (median, p95): what separates the wrapper's
    clock reads from record.py's, i.e. the outer wrapper's own cost plus two clock reads;
  features: agreement of the reader's counts with record.py's bookkeeping (exact-match share, mean difference);
  outside the bounds: median (t1 - t0) - (end - start), the outer anchor's work outside its own clock reads, in
    us and % of the batch. Not its whole cost: the slot write lies inside [start, end] (the end is read once the
    slot's body is stored), as do the nested EngineCore.step wrapper and the reader; the anchors' own time in place
    is bench/sentinel_cost.py's (STEPLENS_ITERS_SELFTIME). The reader alone on vLLM's own SchedulerOutput of 24
    requests (timeit, in .venv-vllm); steps/s and median step time with vs without, side by side;
and last ONE JSON line with the headline figures. Run (takes ~2 x (13 s start + --seconds)):

    flock /tmp/steplens-test.lock .venv/bin/python bench/inference/iterbench.py --seconds 35
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SITE = os.path.join(REPO, "agent", "bootstrap", "site")
VLLM_PY = os.path.join(REPO, ".venv-vllm", "bin", "python")
sys.path.insert(0, SITE)
import steplens_iters  # noqa: E402  (standard library only, from the bootstrap directory)

READER_BENCH = r'''
import sys, timeit
sys.path.insert(0, sys.argv[1])
import steplens_iters
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
n_new, n_cached = 4, 20
new = [NewRequestData(req_id=f"n{i}", prompt_token_ids=list(range(200)), mm_features=[], sampling_params=None,
                      pooling_params=None, block_ids=([0],), num_computed_tokens=0, lora_request=None)
       for i in range(n_new)]
cached = CachedRequestData(req_ids=[f"c{i}" for i in range(n_cached)], resumed_req_ids=set(), new_token_ids=[],
                           all_token_ids={}, new_block_ids=[None] * n_cached,
                           num_computed_tokens=[300 + i for i in range(n_cached)],
                           num_output_tokens=[10 + i for i in range(n_cached)])
sched = {f"n{i}": 200 for i in range(n_new)}
sched.update({f"c{i}": 1 for i in range(n_cached)})
out = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=sched,
                      total_num_scheduled_tokens=sum(sched.values()), scheduled_spec_decode_tokens={},
                      scheduled_encoder_inputs={}, num_common_prefix_blocks=[], finished_req_ids=set(),
                      free_encoder_mm_hashes=[])
print(steplens_iters.vllm_v1_counts(out))
t = min(timeit.repeat(lambda: steplens_iters.vllm_v1_counts(out), number=2000, repeat=5)) / 2000
print(t * 1e6)
'''


def run_record(seconds: float, out: str, run_dir: str, iters: bool) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPLENS_")}
    env.update(PYTHONPATH=SITE, STEPLENS_BOOTSTRAP="1", STEPLENS_RUNTIME_DIR=run_dir,
               STEPLENS_ITERS="1" if iters else "0")
    proc = subprocess.run([VLLM_PY, os.path.join(HERE, "record.py"), "--seconds", str(seconds), "--out", out,
                           "--rate", "2:14:20"], env=env, capture_output=True, text=True, timeout=seconds + 300)
    if proc.returncode != 0:
        raise SystemExit(f"record.py failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return out


def rows_of(path: str) -> list[dict]:
    with open(path) as fh:
        return [r for r in (json.loads(ln) for ln in fh) if "t0_real_ns" in r]


def pct(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def match(rows: list[dict], its: list[tuple], anchor: int) -> list[tuple[dict, tuple]]:
    """(row, iteration) pairs: the one iteration of `anchor` inside each row's [t0, t1] (realtime)."""
    its = sorted((i for i in its if i[3] == anchor), key=lambda i: i[1])
    pairs, j = [], 0
    for r in sorted(rows, key=lambda r: r["t0_real_ns"]):
        while j < len(its) and its[j][1] < r["t0_real_ns"]:
            j += 1
        inside = []
        k = j
        while k < len(its) and its[k][2] <= r["t1_real_ns"]:
            inside.append(its[k])
            k += 1
        if len(inside) == 1:
            pairs.append((r, inside[0]))
        j = k
    return pairs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=35.0, help="load per run (the engine's start comes on top)")
    ap.add_argument("--keep", default="", help="directory to keep the rows in")
    ap.add_argument("--run-dir", default="/dev/shm/steplens-iterbench",
                    help="the bootstrap's runtime dir (tmpfs, as /run/steplens/fr is on a host)")
    a = ap.parse_args()
    if not os.path.exists(VLLM_PY):
        raise SystemExit(f"no {VLLM_PY}: make inference-env")
    work = a.keep or tempfile.mkdtemp(prefix="iterbench-")
    os.makedirs(work, exist_ok=True)
    run_dir = a.run_dir
    os.makedirs(run_dir, exist_ok=True)
    for old in glob.glob(os.path.join(run_dir, "*.iters")):
        os.unlink(old)
    with_rows = rows_of(run_record(a.seconds, os.path.join(work, "with.jsonl"), run_dir, True))
    without_rows = rows_of(run_record(a.seconds, os.path.join(work, "without.jsonl"), run_dir, False))
    rings = glob.glob(os.path.join(run_dir, "*.iters"))
    if len(rings) != 1:
        raise SystemExit(f"expected one ring in {run_dir}, found {rings}")
    its, names, err = steplens_iters.read(rings[0])
    if err:
        raise SystemExit(f"{rings[0]}: {err}")
    anchor = names.index("vllm.v1.engine.llm_engine:LLMEngine.step")
    pairs = match(with_rows, its, anchor)
    by_anchor = {names[i]: sum(1 for x in its if x[3] == i) for i in {x[3] for x in its}}
    print(f"rows {len(with_rows)}, iterations {len(its)} by anchor {by_anchor}, matched {len(pairs)}")
    err_start = [(it[1] - r["t0_real_ns"]) / (r["t1_real_ns"] - r["t0_real_ns"]) * 100 for r, it in pairs]
    err_end = [(r["t1_real_ns"] - it[2]) / (r["t1_real_ns"] - r["t0_real_ns"]) * 100 for r, it in pairs]
    both = [max(s, e) for s, e in zip(err_start, err_end)]
    print(f"boundary error, % of the batch: start median {statistics.median(err_start):.4f} p95 "
          f"{pct(err_start, .95):.4f}; end median {statistics.median(err_end):.4f} p95 {pct(err_end, .95):.4f}; "
          f"worse of the two median {statistics.median(both):.4f} p95 {pct(both, .95):.4f}")
    wrap_us = [((r["t1_real_ns"] - r["t0_real_ns"]) - (it[2] - it[1])) / 1e3 for r, it in pairs]
    wrap_pct = [w * 1e3 / (r["t1_real_ns"] - r["t0_real_ns"]) * 100 for w, (r, _) in zip(wrap_us, pairs)]
    print(f"outer wrapper outside its clock reads (incl. record.py's two extra clock reads; the slot write is inside "
          f"them): median "
          f"{statistics.median(wrap_us):.2f} us p95 {pct(wrap_us, .95):.2f} us; {statistics.median(wrap_pct):.4f} %")
    fields = ("batch_size", "prefill_requests", "prefill_tokens", "decode_requests", "kv_tokens")
    agree = {}
    for f in fields:
        i = steplens_iters.COUNT_FIELDS.index(f)
        diffs = [it[5][i] - r[f] for r, it in pairs]
        agree[f] = (sum(1 for d in diffs if d == 0) / len(diffs) * 100, statistics.mean(diffs))
        print(f"  {f:17s} equal in {agree[f][0]:5.1f} % of batches, mean (ring - record.py) {agree[f][1]:+.2f}")
    phases = {}
    for r, it in pairs:
        key = (steplens_iters.PHASES[it[4]], "prefill" if r["mode"] == 1 else "decode")
        phases[key] = phases.get(key, 0) + 1
    print(f"  phase (ring, record.py mode): {phases}")
    rb = subprocess.run([VLLM_PY, "-c", READER_BENCH, SITE], capture_output=True, text=True, timeout=120)
    reader_us = float(rb.stdout.split()[-1]) if rb.returncode == 0 else float("nan")
    print(f"reader on vLLM's SchedulerOutput (4 new + 20 cached requests): {reader_us:.2f} us "
          f"({rb.stdout.splitlines()[0] if rb.returncode == 0 else rb.stderr[-500:]})")

    def summary(rows):
        span = (rows[-1]["t1_ns"] - rows[0]["t0_ns"]) / 1e9
        return len(rows) / span, statistics.median(r["dur_ns"] for r in rows) / 1e6, \
            statistics.mean(r["batch_size"] for r in rows)
    sw, sn = summary(with_rows), summary(without_rows)
    print(f"with iterations:    {sw[0]:.1f} steps/s, median step {sw[1]:.2f} ms, mean batch {sw[2]:.1f}")
    print(f"without (ITERS=0):  {sn[0]:.1f} steps/s, median step {sn[1]:.2f} ms, mean batch {sn[2]:.1f}")
    # the load is open-loop (Poisson arrivals): the two runs' batches differ, so compare like with like
    ratios, weights = [], []
    for b in sorted({r["batch_size"] for r in with_rows} & {r["batch_size"] for r in without_rows}):
        w = [r["dur_ns"] for r in with_rows if r["batch_size"] == b and r["mode"] == 2]
        n = [r["dur_ns"] for r in without_rows if r["batch_size"] == b and r["mode"] == 2]
        if len(w) >= 20 and len(n) >= 20:
            ratios.append(statistics.median(w) / statistics.median(n))
            weights.append(len(w) + len(n))
            print(f"  decode batch {b:2d}: median step {statistics.median(w) / 1e6:.3f} ms with, "
                  f"{statistics.median(n) / 1e6:.3f} ms without ({len(w)}, {len(n)} steps)")
    slower = (sum(r * w for r, w in zip(ratios, weights)) / sum(weights) - 1) * 100 if ratios else float("nan")
    print(f"decode steps of equal batch size, weighted: {slower:+.2f} % with iterations (one pair of runs on a "
          "shared 2-core VM: run-to-run noise is of the same order)")
    med_batch_ms = statistics.median(r["dur_ns"] for r, _ in pairs) / 1e6
    head = {"rows": len(with_rows), "iterations": by_anchor.get(names[anchor], 0), "matched": len(pairs),
            "boundary_error_median_pct": round(statistics.median(both), 5),
            "start_error_median_pct": round(statistics.median(err_start), 5),
            "end_error_median_pct": round(statistics.median(err_end), 5),
            "boundary_error_p95_pct": round(pct(both, .95), 5),
            "outside_bounds_median_us": round(statistics.median(wrap_us), 2),
            "outside_bounds_pct": round(statistics.median(wrap_us) / (med_batch_ms * 1e3) * 100, 4),
            "reader_us": round(reader_us, 2),
            "median_batch_ms": round(med_batch_ms, 3),
            "batch_size_equal_pct": round(agree["batch_size"][0], 1),
            "decode_requests_equal_pct": round(agree["decode_requests"][0], 1),
            "kv_tokens_equal_pct": round(agree["kv_tokens"][0], 1),
            "steps_per_s_with": round(sw[0], 2), "steps_per_s_without": round(sn[0], 2),
            "median_step_ms_with": round(sw[1], 3), "median_step_ms_without": round(sn[1], 3),
            "equal_batch_step_slower_pct": round(slower, 2)}
    print(json.dumps(head))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
