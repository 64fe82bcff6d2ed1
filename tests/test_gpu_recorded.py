"""GPU-side parsers on artifacts recorded by steplens itself on a real H100 (tests/fixtures/gpu-recorded/README.md:
torch 2.11.0+cu130, NCCL 2.28.9, driver 580.159.04; recorded by record.py there). The job logged what it
issued (job.json), so the figures are checked against the job's own account, and against counts made here
with plain json/regex, not with the parsers' code. Times are the files' own clocks (identity).
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections import Counter

from steplens.agent import nccltopo, parse
from steplens.agent.kineto import trace

REC = os.path.join(os.path.dirname(__file__), "fixtures", "gpu-recorded")
KINETO = os.path.join(REC, "kineto-nccl.json.gz")
FR_JSON = os.path.join(REC, "fr-nccl.json")
FR_PKL = os.path.join(REC, "fr-nccl.pkl")
NCCL_LOG = os.path.join(REC, "nccl-h100-1rank.log")
SMI = os.path.join(REC, "nvidia-smi-q.txt")


def job() -> dict:
    with open(os.path.join(REC, "job.json")) as fh:
        return json.load(fh)


def issued(steps=None) -> Counter:
    return Counter(i["op"] for i in job()["issued"] if steps is None or i["step"] in steps)


def issued_bytes(op: str) -> set:
    return {i["bytes"] for i in job()["issued"] if i["op"] == op}


def test_kineto_h100_trace_ops_match_what_the_job_issued():
    res = parse.parse_file(KINETO)
    assert res.kind == "kineto"
    profiled = set(job()["profiled_steps"])
    assert Counter(o.op for o in res.ops) == issued(profiled)            # 6 all_reduce, 3 of each other kind
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        assert {o.bytes for o in res.ops if o.op == op} == issued_bytes(op), op
    assert res.notes["waits"] == 3                                       # the async all_reduce's work.wait()
    # torch 2.11 writes no "Seq": collectives numbered in issue order on the one group
    assert [o.seq for o in res.ops] == list(range(len(res.ops)))
    assert {o.seq_source for o in res.ops} == {"order"} and {o.comm_id for o in res.ops} == {"pg:0"}
    # one rank, so NCCL launches no kernel for a collective: every op is timed on the CPU
    assert {o.timing for o in res.ops} == {"cpu_enqueue"}
    # the op order inside each profiled step is the job's
    per_step = [o.op for o in res.ops][:7]
    assert per_step == [i["op"] for i in job()["issued"] if i["step"] == 2]


def test_kineto_h100_trace_kernels_names_launches_and_steps():
    with gzip.open(KINETO) as fh:
        doc = json.load(fh)
    evs = doc["traceEvents"]
    kernels = [e for e in evs if e.get("cat") == "kernel"]
    launches = {e["args"]["correlation"]: e for e in evs if e.get("cat") == "cuda_runtime"}
    parsed = trace.parse(doc, lambda t: t, pid=583)
    assert len(parsed.kernels) == len(kernels) == 63
    assert Counter(k.name for k in parsed.kernels) == Counter(e["name"] for e in kernels)
    assert len({k.name for k in parsed.kernels}) > 5                    # not one name for all
    by_corr = {k.correlation_id: k for k in parsed.kernels}
    base = doc["baseTimeNanoseconds"]
    for e in kernels:
        k, a = by_corr[e["args"]["correlation"]], e["args"]
        assert (k.device, k.stream, k.grid, k.block) == (a["device"], a["stream"], a["grid"], a["block"])
        launch = launches[a["correlation"]]
        assert k.launch_api == launch["name"]
        # issue latency (kernel start - launch start), computed here from the µs timestamps
        expect = round((e["ts"] - launch["ts"]) * 1000)
        assert abs((k.start_mono_ns - k.launch_start_mono_ns) - expect) <= 1
        assert k.start_mono_ns - base == round(e["ts"] * 1000) or abs(k.start_mono_ns - base - e["ts"] * 1000) <= 1
    lat = sorted(k.start_mono_ns - k.launch_start_mono_ns for k in parsed.kernels)
    assert 1_000 < lat[len(lat) // 2] < 100_000                          # H100, idle stream: microseconds
    # ProfilerStep#2..4 once each: the CPU span, not its mirror on the GPU timeline
    assert [s for s, _, _ in parsed.steps] == job()["profiled_steps"]


def test_flight_recorder_nccl_dump_json_and_pickle():
    res = parse.parse_file(FR_JSON)
    assert res.kind == "flightrec" and res.notes.get("version") == "2.10"
    assert Counter(o.op for o in res.ops) == issued()                    # all 6 steps, barrier included
    assert [o.seq for o in res.ops] == list(range(1, 43)) and {o.seq_source for o in res.ops} == {"trace"}
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        assert {o.bytes for o in res.ops if o.op == op} == issued_bytes(op), op
    with open(FR_JSON) as fh:
        entries = json.load(fh)["entries"]
    timed = [(o, e) for o, e in zip(res.ops, entries) if e.get("duration_ms") is not None]
    # ProcessGroupNCCL timed the ops of the first step (CUDA events); under the profiler it timed none
    assert len(timed) == 7 and all(o.timing == "cuda_event" for o, _ in timed)
    for o, e in timed:
        assert o.issue_mono_ns == e["time_created_ns"] == o.start_mono_ns
        assert o.end_mono_ns - o.start_mono_ns == int(e["duration_ms"] * 1e6)
        # the watchdog's discovery times bound the op from above: placing it there would be ~95 ms late
        assert o.end_mono_ns <= e["time_discovered_completed_ns"]
        assert e["time_discovered_started_ns"] - e["time_created_ns"] > 50e6
    assert all(o.timing == "cpu_enqueue" for o in res.ops[7:])
    # the pickle torch writes on a timeout carries the same entries
    pk = parse.parse_file(FR_PKL)
    assert pk.kind == "flightrec"
    assert [(o.op, o.seq, o.bytes, o.issue_mono_ns) for o in pk.ops] == \
           [(o.op, o.seq, o.bytes, o.issue_mono_ns) for o in res.ops]


def test_nccl_2_28_log_collective_lines_and_communicator():
    res = parse.parse_file(NCCL_LOG)
    assert res.kind == "nccl-log"
    with open(NCCL_LOG) as fh:
        lines = fh.read().splitlines()
    coll = [m for m in (re.search(r"NCCL INFO (\w+): opCount (\w+) .* count (\d+) datatype (\d+) .*"
                                  r"\[nranks=(\d+)\]", ln) for ln in lines) if m]
    assert len(res.ops) == len(coll) == 36
    names = {"AllReduce": "all_reduce", "AllGather": "all_gather", "Broadcast": "broadcast", "AlltoAll": "all_to_all"}
    assert Counter(o.op for o in res.ops) == Counter(names[m.group(1)] for m in coll)
    size = {"7": 4, "9": 2, "4": 8}                                      # float32, bfloat16, int64 (nccl.h)
    assert [o.bytes for o in res.ops] == [int(m.group(3)) * size[m.group(4)] for m in coll]
    # What NCCL 2.28 does on a 1-rank communicator, as logged: opCount stays 0, and ReduceScatter is not
    # logged at all (the job issued 6): the log's seq cannot order ops here, and its op count is short
    assert {o.seq for o in res.ops} == {0}
    assert "reduce_scatter" not in {o.op for o in res.ops} and issued()["reduce_scatter"] == 6
    # barrier(): a 1-element all-reduce in NCCL's log
    assert sum(1 for o in res.ops if o.op == "all_reduce" and o.bytes == 4) == issued()["barrier"]
    assert {o.comm_id for o in res.ops} == {"73209f01231a30c4"}


def test_nccl_bus_id_matches_nvidia_smi_on_the_same_host():
    comm = nccltopo.parse_log_files([NCCL_LOG])["73209f01231a30c4"]
    assert comm.complete and comm.nranks == 1
    place = comm.ranks[0]
    assert (place.host, place.pid, place.cuda_dev, place.bus_id) == ("vm", 583, 0, "60")
    smi_bus = re.search(r"Bus Id\s+:\s+(\S+)", open(SMI).read()).group(1)
    assert nccltopo.norm_bus_id(place.bus_id) == smi_bus == "00000000:00:06.0"


# --- recorded in a later session on the same kind of H100 (README.md "Live recordings") ---------------------------

def _identity_clock():
    from steplens.agent.commlog import RealtimeClock
    return RealtimeClock(monotonic_ns=lambda: 0, realtime_ns=lambda: 0)


def _fr_live(n: int, ep: str = "dump_nccl_trace_json") -> bytes:
    with gzip.open(os.path.join(REC, f"fr-live-{n}-{ep}.json.gz")) as fh:
        return fh.read()


def test_live_nccl_flight_recorder_polls_emit_each_op_once_with_its_cuda_event_duration():
    """Four successive answers of a live 1-rank NCCL job's worker server, 0.5 s apart (record_fr_live.py). Each
    holds ~7 ops whose CUDA events say completed but which the watchdog has not retired yet, without duration_ms:
    emitting them then would lose the duration for good. They must wait for the poll that sees them retired."""
    from steplens.agent.sources.flightrec import _Cursor, entry_to_op, new_entries, parse_dump, progress_records

    # on an NCCL build fr_trace_json answers an empty document: the entries come from dump_nccl_trace_json
    empty = json.loads(_fr_live(0, "fr_trace_json"))
    assert "entries" not in empty and empty["pg_status"] == {} and empty["version"] == "2.10"
    cur, emitted, withheld = _Cursor(), [], []
    for n in range(4):
        raw = json.loads(_fr_live(n))
        unretired = [e for e in raw["entries"] if e["state"] == "completed" and not e["retired"]]
        assert 5 <= len(unretired) <= 12 and all("duration_ms" not in e for e in unretired)
        dump = parse_dump(_fr_live(n))
        got, lost = new_entries(dump, cur, now_ns=n * 500_000_000)
        assert lost == 0
        emitted += got
        withheld = unretired
    ids = [e["record_id"] for e in emitted]
    assert ids == list(range(len(ids))) and len(ids) >= 100            # every op once, in order, none skipped
    ops = [entry_to_op(e, dump, _identity_clock(), pid=1) for e in emitted]
    assert {o.timing for o in ops} == {"cuda_event"} and {o.op for o in ops} == {"all_reduce"}
    assert all(o.bytes == 4 << 20 and 0 < o.end_mono_ns - o.start_mono_ns < 1_000_000 for o in ops)
    # the last answer's unretired ops are held; a watchdog that never retires them gets them out untimed later
    assert {e["record_id"] for e in withheld} <= cur.pending
    late, _ = new_entries(dump, cur, now_ns=3 * 500_000_000 + 3_100_000_000)
    assert {e["record_id"] for e in late} == {e["record_id"] for e in withheld}
    assert {entry_to_op(e, dump, _identity_clock(), pid=1).timing for e in late} == {"cpu_enqueue"}
    # progress: a completed-but-unretired op is not pending; the one still scheduled is (answer 1)
    raw1 = json.loads(_fr_live(1))
    scheduled = [e for e in raw1["entries"] if e["state"] == "scheduled"]
    assert len(scheduled) == 1
    recs, problems = progress_records(parse_dump(_fr_live(1)), _identity_clock(), scheduled[0]["time_created_ns"] + 1,
                                      pid=1)
    assert not problems and len(recs) == 1
    assert recs[0].pending_seq == scheduled[0]["collective_seq_id"] == recs[0].last_enqueued
    assert recs[0].pending_since_mono_ns == scheduled[0]["time_created_ns"]


def test_live_nccl_answers_parsed_from_the_cursor_give_what_the_whole_answer_gives():
    """A poll parses only the entries from its cursor on (parse_dump's from_record_id: the rest was handled by
    earlier polls). On the same four recorded answers the emitted entries, their order, the pending set and the
    ring's span are those of parsing each answer whole, and the real answers are laid out so that the older
    entries are in fact left out."""
    from steplens.agent.sources.flightrec import _Cursor, new_entries, parse_dump, progress_records

    whole, cut = _Cursor(), _Cursor()
    left_out = 0
    for n in range(4):
        body = _fr_live(n)
        a = parse_dump(body)
        first = min(cut.pending) if cut.pending else cut.high + 1
        b = parse_dump(body, from_record_id=first)
        if n:
            assert b.ring_low == 0 and len(b.entries) < len(a.entries)
            left_out += first
        assert b.ring_span() == a.ring_span() and (b.members, b.status) == (a.members, a.status)
        got_a, lost_a = new_entries(a, whole, now_ns=n * 500_000_000)
        got_b, lost_b = new_entries(b, cut, now_ns=n * 500_000_000)
        assert got_a == got_b and lost_a == lost_b == 0
        assert (whole.high, whole.pending, whole.unretired) == (cut.high, cut.pending, cut.unretired)
        assert progress_records(a, _identity_clock(), 1 << 62, pid=1) == progress_records(b, _identity_clock(),
                                                                                           1 << 62, pid=1)
    assert left_out > 100


def test_parse_from_a_cursor_falls_back_to_the_whole_answer():
    """Where the answer cannot be cut safely the whole of it is parsed: a ring that wrapped past the cursor
    (its loss must be counted), a cursor not in the ring, another layout (indented), a string value that holds
    the key's bytes (escaped, so never matched), and bytes that do not parse once cut."""
    from steplens.agent.sources.flightrec import FlightrecError, _Cursor, new_entries, parse_dump

    raw = json.loads(_fr_live(2))
    compact = json.dumps(raw, separators=(",", ":"), sort_keys=True).encode()
    rids = [e["record_id"] for e in raw["entries"]]
    mid = rids[len(rids) // 2]
    assert len(parse_dump(compact, from_record_id=mid).entries) == len(rids) - len(rids) // 2
    # wrapped: the ring starts after the cursor -> whole, and new_entries counts the lost ones
    wrapped = dict(raw, entries=raw["entries"][len(rids) // 2:])
    d = parse_dump(json.dumps(wrapped, separators=(",", ":"), sort_keys=True).encode(), from_record_id=3)
    assert d.ring_low == -1 and len(d.entries) == len(rids) - len(rids) // 2
    cur = _Cursor()
    cur.high = 2
    assert new_entries(d, cur)[1] == mid - 3
    # a cursor past the newest entry (not in the ring), and an indented layout: whole
    for body, first in ((compact, rids[-1] + 5), (json.dumps(raw, indent=1).encode(), mid)):
        d = parse_dump(body, from_record_id=first)
        assert d.ring_low == -1 and len(d.entries) == len(rids)
    # a frame name holding the key's text is escaped in JSON, never taken for the key
    trick = json.loads(compact)
    trick["entries"][0]["frames"] = [{"filename": f'x"record_id":{mid},"', "line": 1, "name": '{"collective_seq_id":'}]
    body = json.dumps(trick, separators=(",", ":"), sort_keys=True).encode()
    d = parse_dump(body, from_record_id=mid)
    assert d.ring_low == 0 and d.entries[0]["record_id"] == mid
    # bytes that do not parse in what is needed: the whole is tried, and the answer is reported as not JSON;
    # in the part left out (entries handled by earlier polls) they are not looked at
    for at, fails in ((compact.rindex(b'"record_id":'), True), (compact.index(b'"record_id":'), False)):
        bad = compact[:at] + b'"x' + compact[at:]
        try:
            d = parse_dump(bad, from_record_id=mid)
        except FlightrecError as exc:
            assert fails and exc.kind == "bad_json"
        else:
            assert not fails and d.ring_low == 0 and len(d.entries) == len(rids) - len(rids) // 2


def _nvml_lines():
    with open(os.path.join(REC, "nvml-h100-load.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def test_nvml_h100_idle_and_full_load_clock_reasons():
    """What steplens' gpu source sent from the H100 idle, under a bf16 matmul load and after (record_nvml.py),
    with pynvml read right after each step: the facts the slow-GPU cause relies on. Under full load this card
    runs at its 700 W limit with SW power cap (0x4) active and its SM clock ~30 % under its maximum: normal for
    every GPU of a busy job, so a cause must compare a GPU with its peers, never with its datasheet."""
    lines = _nvml_lines()
    head = lines[0]
    assert head["kind"] == "header" and head["name"] == "NVIDIA H100 80GB HBM3" and head["max_sm_mhz"] == 1980
    phases = {line["phase"]: line["mono_ns"] for line in lines if line["kind"] == "phase"}
    metrics = [line["fields"] for line in lines if line["kind"] == "record" and line["type"] == "Metric"]
    raws = [line for line in lines if line["kind"] == "raw"]
    reasons = [m for m in metrics if m["name"] == "gpu_clocks_event_reasons"]
    assert len(reasons) == len(raws) >= 50
    # the source's bitmask is the one pynvml read a moment later (equal but at the changes)
    assert sum(r["value"] == x["reasons"] for r, x in zip(reasons, raws)) >= 0.9 * len(raws)
    sm = {m["mono_ns"]: m["value"] for m in metrics if m["name"] == "gpu_sm_clock_mhz"}
    util = {m["mono_ns"]: m["value"] for m in metrics if m["name"] == "gpu_utilization_percent"}
    power = {m["mono_ns"]: m["value"] for m in metrics if m["name"] == "gpu_power_watts"}
    busy = [t for t, u in util.items() if phases["load"] < t < phases["after"] and u >= 98]
    assert len(busy) >= 20
    for t in busy:
        r = next(x["value"] for x in reasons if x["mono_ns"] == t)
        assert int(r) == 0x4, hex(int(r))                                  # SW power cap, nothing else
        assert sm[t] < 0.8 * head["max_sm_mhz"]
    at_limit = [t for t in busy if abs(power[t] * 1000 - head["power_limit_mw"]) < 0.05 * head["power_limit_mw"]]
    assert len(at_limit) >= 0.9 * len(busy)                                # the first second still ramps up
    idle = [x for x in reasons if x["mono_ns"] < phases["load"] and int(x["value"]) & 0x1]
    assert idle and all(sm[x["mono_ns"]] <= 500 for x in idle)            # idle: the clock drops to ~345 MHz
    events = [line["fields"]["message"] for line in lines if line["kind"] == "record" and line["type"] == "Event"]
    assert events[:3] == ["0x0 -> 0x1", "0x1 -> 0x0", "0x0 -> 0x4"]
    with open(os.path.join(REC, "nvidia-smi-perf-load.txt")) as fh:
        smi = fh.read()
    assert re.search(r"SW Power Cap\s+: Active", smi) and re.search(r"HW Thermal Slowdown\s+: Not Active", smi)


def _cupti_phases():
    import tempfile

    from steplens.agent.bootstrap import read_cupti
    from steplens.agent.commlog import RealtimeClock

    with open(os.path.join(REC, "cupti-phases.json")) as fh:
        acc = json.load(fh)
    ph = acc["phases"]
    off = ph[0]["start_real_ns"] - ph[0]["start_mono_ns"]
    end = ph[-1]["end_mono_ns"]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "1.cupti.jsonl")
        with gzip.open(os.path.join(REC, "cupti-phases.cupti.jsonl.gz")) as src, open(path, "wb") as dst:
            dst.write(src.read())
        kernels, _, dropped = read_cupti(path, clock=RealtimeClock(monotonic_ns=lambda: end,
                                                                   realtime_ns=lambda: end + off),
                                         monotonic_ns=lambda: end + 10**9)
    assert dropped == 0
    return {p["phase"]: (p, [k for k in kernels if p["start_mono_ns"] <= k.start_mono_ns <= p["end_mono_ns"]])
            for p in ph}


def test_cupti_phases_issue_latency_and_identical_kernels():
    """steplens' own CUPTI log of one job in three phases (record_cupti_phases.py): the same 4096^2 fp32 GEMM,
    queued (GPU-bound), launched 3 ms apart (CPU-bound), and sharing the GPU with another process. XPUTimer's
    metrics must tell them apart: issue latency says who waits for whom; identical kernels say the GPU is slower."""
    from steplens.collector.analysis import kernels as km

    by = _cupti_phases()
    m = {name: km.rank_metrics(ks) for name, (_, ks) in by.items()}
    for name, (p, ks) in by.items():
        assert len(ks) == p["matmuls"] == 320, name                      # every kernel, in its phase
        assert {k.name for k in ks} == {next(iter(ks)).name} and "gemm" in ks[0].name
        assert all(k.launch_start_mono_ns and k.start_mono_ns >= k.launch_start_mono_ns for k in ks)
    gpu, cpu, shared = m["gpu_bound"], m["cpu_bound"], m["shared"]
    # queued: the CPU runs ahead (milliseconds); CPU-bound: the GPU waits for each launch (tens of µs)
    assert gpu["issue_latency"]["p50_ns"] > 1_000_000 and gpu["issue_latency"]["below_50us_fraction"] < 0.2
    assert cpu["issue_latency"]["p50_ns"] < 50_000 and cpu["issue_latency"]["below_50us_fraction"] > 0.8
    assert km.ks_distance(km.issue_latencies(by["gpu_bound"][1]), km.issue_latencies(by["cpu_bound"][1])) > 0.7
    name = by["gpu_bound"][1][0].name
    d = {k: km.per_name(by[k][1])[name] for k in by}
    # the kernel itself is as fast when the CPU is late: the GPU is not the slow part
    assert abs(d["cpu_bound"]["p50_ns"] / d["gpu_bound"]["p50_ns"] - 1) < 0.02
    # sharing the GPU: the same kernel's tail and mean grow (the other process's kernels run in between)
    assert d["shared"]["mean_ns"] > 1.2 * d["gpu_bound"]["mean_ns"]
    assert d["shared"]["p99_ns"] > 2 * d["gpu_bound"]["p99_ns"]
    assert shared["minority_void"][0]["v_minority"] > 5 * gpu["minority_void"][0]["v_minority"]
