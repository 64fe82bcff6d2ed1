"""The flightrec source's CPU per comm op, by stage, parsing each answer whole or from the poll's cursor on, side by
side in one run.

A poll of the sentinel read schedule answers with the whole ring (TORCH_FR_BUFFER_SIZE, 2000 here) of which about
half is new (ring_fill 0.5). Each new op is then parsed, deduplicated (new_entries), converted (OpConverter) and
handed to the CommLog (detail store + step summaries + step segmenter): CPU time of the thread (time.thread_time),
not wall time. The garbage collector is set as `steplens-agent run` sets it (agent/cli.py tune_gc; `--python-gc`
leaves Python's own thresholds). Compared, in alternating rounds: parsing the whole answer (before) or only the
entries from the poll's cursor on (after: parse_dump's from_record_id).
The answers are laid out as torch 2.13 writes them (compact JSON, sorted keys; the entry of
tests/fixtures/flightrec-gloo with a gloo step of four all_reduces of different sizes). A fetch of the stored ops
(FetchDetail's read of the detail store) is timed too.

    .venv/bin/python bench/flightrec_ops.py [--rounds 5] [--ring 2000] [--new 1000] [--polls 12] [--python-gc]

Last line: one JSON object, microseconds per new op.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "flightrec-gloo", "fr_pending_gloo_rank0.json")
SIZES = [[[128, 128]], [[128]], [[10, 128]], [[10]]]


def answers(ring: int, new: int, polls: int) -> list[bytes]:
    base = json.load(open(FIXTURE))
    proto = base["entries"][-1]
    out = []
    now = time.time_ns()
    for p in range(polls):
        high = ring - 1 + p * new
        ents = []
        for rid in range(max(0, high - ring + 1), high + 1):
            e = dict(proto, record_id=rid, collective_seq_id=rid + 1, op_id=rid + 1, retired=True, state="completed",
                     input_sizes=SIZES[rid % 4], output_sizes=SIZES[rid % 4],
                     time_created_ns=now - (high - rid) * 5_000_000)
            ents.append(e)
        status = {"0": {"last_completed_collective": str(high + 1), "last_enqueued_collective": str(high + 1),
                        "last_started_collective": "-1"}}
        out.append(json.dumps(dict(base, entries=ents, pg_status=status), separators=(",", ":"),
                              sort_keys=True).encode())
    return out


def run(bodies: list[bytes], cut: bool) -> dict:
    from steplens.agent.commlog import CommLog, RealtimeClock
    from steplens.agent.sources import flightrec as fr
    clock = RealtimeClock()
    tmp = tempfile.mkdtemp(prefix="steplens-frops-")
    log = CommLog(tmp, "flightrec")
    cur = fr._Cursor()
    t = dict.fromkeys(("parse", "dedup", "convert", "commlog"), 0.0)
    n = 0
    for i, body in enumerate(bodies):
        first = (min(cur.pending) if cur.pending else cur.high + 1) if cut else -1
        t0 = time.thread_time()
        d = fr.parse_dump(body, from_record_id=first)
        t1 = time.thread_time()
        ents, _ = fr.new_entries(d, cur, now_ns=time.monotonic_ns())
        t2 = time.thread_time()
        conv = fr.OpConverter(d, clock, 4242, 7, 0, 2, "bench")
        ops = [conv(e) for e in ents]
        t3 = time.thread_time()
        log.add(ops, checked=True)
        t4 = time.thread_time()
        if i == 0:  # the first read sets the cursor (the whole ring is new)
            continue
        n += len(ops)
        for k, a, b in (("parse", t0, t1), ("dedup", t1, t2), ("convert", t2, t3), ("commlog", t3, t4)):
            t[k] += b - a
    t0 = time.thread_time()
    fetched = log.store.records(["commop"], limit=1 << 30)
    fetch_s = time.thread_time() - t0
    res = {k: v / n * 1e6 for k, v in t.items()}
    res["total"] = sum(res.values())
    res["fetch"] = fetch_s / max(1, len(fetched)) * 1e6
    res["ops"] = n
    log.close()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ring", type=int, default=2000)
    ap.add_argument("--new", type=int, default=1000, help="new ops per poll (ring_fill x ring)")
    ap.add_argument("--polls", type=int, default=12)
    ap.add_argument("--python-gc", action="store_true", help="Python's GC thresholds, not the agent's")
    args = ap.parse_args()
    if not args.python_gc:
        from steplens.agent.cli import tune_gc
        from steplens.agent.config import AgentSettings
        tune_gc(AgentSettings().gc_young_threshold)
    bodies = answers(args.ring, args.new, args.polls)
    variants = {"before": False, "after": True}
    got: dict[str, list[dict]] = {k: [] for k in variants}
    for r in range(args.rounds):
        for name, cut in variants.items():
            got[name].append(run(bodies, cut))
        print(f"round {r + 1}: " + ", ".join(f"{k} {got[k][-1]['total']:.1f}" for k in variants) + " us/op",
              flush=True)
    out: dict = {"ring": args.ring, "new_per_poll": args.new, "rounds": args.rounds}
    print(f"\nmedian of {args.rounds} rounds, us per new op ({args.new} new of a {args.ring}-entry ring per poll):")
    print(f"{'':14} {'parse':>7} {'dedup':>7} {'convert':>8} {'commlog':>8} {'total':>7} {'fetch':>7}")
    for name in variants:
        med = {k: statistics.median(x[k] for x in got[name]) for k in got[name][0]}
        print(f"{name:14} {med['parse']:7.1f} {med['dedup']:7.1f} {med['convert']:8.1f} {med['commlog']:8.1f} "
              f"{med['total']:7.1f} {med['fetch']:7.1f}")
        for k in ("parse", "commlog", "total", "fetch"):
            out[f"{name}_{k}_us_per_op"] = round(med[k], 2)
    out["parse_ratio_after_before"] = round(out["after_parse_us_per_op"] / out["before_parse_us_per_op"], 3)
    out["total_ratio_after_before"] = round(out["after_total_us_per_op"] / out["before_total_us_per_op"], 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
