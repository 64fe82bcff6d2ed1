"""The sentinel detector scored against ground truth on the real recordings kept in tests/fixtures (issue
"Sentinel"): each replayed through the detector itself (bench/sentinel.py score_iterations: one pass per second
of data), per judged iteration and per finding against the recorded fault windows.

  vllm-noisy      tests/fixtures/inference/vllm-steps-noisy.jsonl.gz: vLLM's CPU build, 80 s, a noisy neighbour
                  from 50 s to 70 s; each batch as the Iteration the anchors send (its times and workload counts:
                  the counts record.py kept, which iterbench found equal to the anchors' reader in every batch);
                  the fault column is the ground truth only.
  training-30     tests/fixtures/training/testbed-iters-slow30.jsonl.gz: stored Iterations of the DP2 testbed job,
                  every rank 1.39x slower for 60 s.
  training-5      .../testbed-iters-slow5.jsonl.gz: the same, 1.057x (inside this VM's step jitter).
Last line: one JSON object.

    cd bench/eval && ../../.venv/bin/python sentinel.py
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from bench.sentinel import score_iterations  # noqa: E402

FIX = os.path.join(REPO, "tests", "fixtures")


def vllm_recording(out: str) -> None:
    """The inference fixture as a recording of Iteration rows with its fault windows."""
    with gzip.open(os.path.join(FIX, "inference", "vllm-steps-noisy.jsonl.gz"), "rt") as fh:
        json.loads(fh.readline())
        rows = [json.loads(line) for line in fh]
    on = [r for r in rows if r["fault"]]
    head = {"job_key": "pid:1", "faults": [{"kind": "noisy", "start_ns": min(r["t0_ns"] for r in on),
                                           "end_ns": max(r["t1_ns"] for r in on)}]}
    with gzip.open(out, "wt") as fh:
        fh.write(json.dumps(head) + "\n")
        for i, x in enumerate(rows):
            b = x["batch_size"]
            phase = "decode" if x["mode"] == 2 else "prefill" if x["decode_requests"] == 0 else "mixed"
            fh.write(json.dumps({
                "node_id": "n1", "pid": 1, "start_ticks": 1, "job_key": "pid:1", "rank": -1, "seq": i,
                "start_ns": x["t0_ns"], "end_ns": x["t1_ns"], "anchor": "vllm.v1.engine.llm_engine:LLMEngine.step",
                "phase": phase, "batch_size": b, "prefill_requests": x["prefill_requests"],
                "prefill_tokens": x["prefill_tokens"], "decode_requests": x["decode_requests"],
                "kv_tokens": x["kv_tokens"], "input_tokens": round(x["avg_input_length"] * b),
                "output_tokens": round(x["avg_output_length"] * b),
                "tokens": x["prefill_tokens"] + x["decode_requests"], "micro_batches": 0}) + "\n")


def main() -> int:
    keep = ("iterations", "fit_r2", "fit_mape_pct", "ucl", "precision", "recall", "f1", "fpr_pct",
            "first_alarm_after_s", "faults_found", "faults", "false_findings")
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "vllm.jsonl.gz")
        vllm_recording(path)
        for name, p in (("vllm-noisy", path),
                        ("training-30", os.path.join(FIX, "training", "testbed-iters-slow30.jsonl.gz")),
                        ("training-5", os.path.join(FIX, "training", "testbed-iters-slow5.jsonl.gz"))):
            r = score_iterations(p, {})
            res[name] = {k: r[k] for k in keep}
            print(f"{name}: {res[name]}", flush=True)
    print(json.dumps({f"{n}_{k}": v[k] for n, v in res.items() for k in ("f1", "fpr_pct", "faults_found",
                                                                          "false_findings")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
