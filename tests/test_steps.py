"""Step segmentation (agent/steps.py) on synthetic CommOp streams with known step boundaries (DP and PP
patterns, ops missing from a poll, a ring wrap, a pattern change, ProfilerStep windows), and the Step record's
path: agent encoding -> collector decoding -> the real store writer -> the steps table -> step_times()."""

from __future__ import annotations

import random
import time

from steplens.agent import records as r
from steplens.agent.commlog import CommLog
from steplens.agent.steps import StepConfig, StepSegmenter, learn
from steplens.agent.transport.codec import decode_records, encode_records
from steplens.collector.analysis.steptime import from_steps, step_times
from steplens.collector.ingest.clock import ClockEstimate
from steplens.collector.ingest.decode import decode_batch
from steplens.collector.store.diagnosis import DATA_TABLES
from steplens.collector.store.queries import Reader
from steplens.collector.store.writer import BatchJob, StoreWriter

MS = 10**6
T0 = 10**12
TAIL = 1.5 * MS + 1  # what follows the last all-reduce in dp_job: 0.5 ms, then the optimizer


def op(t_issue, dur, comm, kind, nbytes, seq=-1, pid=100, rank=0, end=True):
    return r.CommOp(t_issue + dur if end else t_issue, "cuda_event" if end else "cpu_enqueue", pid, comm, kind,
                    start_ticks=7, rank=rank, bytes=nbytes, seq=seq, issue_mono_ns=t_issue,
                    start_mono_ns=t_issue if end else 0, end_mono_ns=t_issue + dur if end else 0, job_key="j",
                    seq_source="trace" if seq >= 0 else "")


def dp_job(n_steps, rng, buckets=(4 << 20, 4 << 20, 1 << 20), fwd_ms=40.0, seq0=5, t0=T0, jitter=0.05):
    """A DP rank: forward+backward compute, then the gradient all-reduce buckets on pg:0, then the optimizer.
    Returns (ops, [(step, job_start, job_end)]) where job_end is after the optimizer step."""
    ops, truth, t, seq = [], [], t0, seq0
    for s in range(n_steps):
        start = t
        t += int(fwd_ms * MS * (1 + rng.uniform(-jitter, jitter)))
        for b in buckets:
            d = int(3 * MS * (1 + rng.uniform(-jitter, jitter)))
            ops.append(op(t, d, "pg:0", "all_reduce", b, seq))
            seq += 1
            t += d + int(0.5 * MS)
        t += int(1 * MS)  # optimizer
        truth.append((s, start, t))
    return ops, truth


def feed(seg, ops, chunk=50, rng=None):
    out = []
    i = 0
    while i < len(ops):
        n = rng.randint(1, chunk) if rng else chunk
        out += seg.add(ops[i:i + n])
        i += n
    return out


def last_end(truth_step_ops):
    return max(o.end_mono_ns or o.issue_mono_ns for o in truth_step_ops)


def test_dp_steps_end_at_the_last_all_reduce_and_are_numbered_by_seq():
    rng = random.Random(1)
    ops, truth = dp_job(40, rng)
    steps = feed(StepSegmenter(), ops, rng=rng)
    assert len(steps) >= 36 and all(s.evidence == "comm_pattern" and s.period_ops == 3 for s in steps)
    ends = {s: e for s, _, e in truth}
    for st in steps:
        # seq 5 + 3 s .. : step number = seq // 3 = s + 1 (the offset of the pre-loop collectives is one step)
        s = st.step - 1
        assert 0 <= ends[s] - st.end_mono_ns <= TAIL  # after the last all-reduce: the optimizer step
        (c,) = st.comms
        assert (c.comm_id, c.op, c.calls, c.bytes, c.seq_first) == ("pg:0", "all_reduce", 3, 9 << 20, 5 + 3 * s)
        assert c.wait_ns == -1 and c.busy_ns > 8 * MS and len(c.issue_offsets_ns) == 3
        assert c.issue_offsets_ns == sorted(c.issue_offsets_ns)
        assert c.issue_offsets_ns[0] > 30 * MS or st is steps[0]  # the first step starts at its first op
    numbers = [s.step for s in steps]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    # consecutive steps share the boundary
    assert all(b.start_mono_ns == a.end_mono_ns for a, b in zip(steps, steps[1:]))


def test_identical_ops_per_step_are_told_apart_by_the_gaps():
    """Two identical all-reduces per step: the signatures repeat every op, the idle gaps every second op."""
    rng = random.Random(2)
    ops, truth = dp_job(30, rng, buckets=(1 << 20, 1 << 20))
    for o in ops:
        o.seq = -1
        o.seq_source = ""
    assert learn(ops[:20]) is None  # one signature throughout: the gaps alone decide, over 12 cycles
    pat = learn(ops[:30])
    assert pat is not None and pat.ops == 2
    steps = feed(StepSegmenter(), ops, rng=rng)
    assert all(s.ops == 2 for s in steps) and len(steps) >= 26
    ends = sorted(e for _, _, e in truth)
    for st in steps:
        err = min(abs(e - st.end_mono_ns) for e in ends)
        assert err <= TAIL


def test_pp_stage_with_p2p_and_dp_all_reduce():
    """A middle pipeline stage, 1F1B with 4 micro-batches: recv/send of activations and gradients on two P2P
    groups (no seq), then the DP all-reduce; the boundary is the end of the all-reduce in every step."""
    rng = random.Random(3)
    ops, truth, t, seq = [], [], T0, 0
    for s in range(30):
        start = t
        for m in range(4):
            for comm, kind in (("pg:prev", "recv"), ("pg:next", "send"), ("pg:next", "recv"), ("pg:prev", "send")):
                t += int(rng.uniform(2, 4) * MS)
                d = int(rng.uniform(0.2, 1.0) * MS)
                ops.append(op(t, d, comm, kind, 1 << 16))
                t += d
        t += int(1 * MS)
        d = int(5 * MS)
        ops.append(op(t, d, "pg:dp", "all_reduce", 8 << 20, seq))
        seq += 1
        t += d + int(2 * MS) + int(12 * MS)  # optimizer, then the wait for the first activation
        truth.append((s, start, t))
    steps = feed(StepSegmenter(), ops, chunk=37)
    assert len(steps) >= 26 and all(s.period_ops == 17 for s in steps)
    by_comm = {(c.comm_id, c.op): c for c in steps[-1].comms}
    assert {c for c, _ in by_comm} == {"pg:prev", "pg:next", "pg:dp"} and by_comm["pg:dp", "all_reduce"].calls == 1
    # a point-to-point communicator's sends and receives are summarized apart (send busy ~ transfer)
    assert by_comm["pg:prev", "send"].calls == 4 and by_comm["pg:prev", "recv"].calls == 4
    dp_ends = [o.end_mono_ns for o in ops if o.comm_id == "pg:dp"]
    for st in steps:
        assert st.end_mono_ns == dp_ends[st.step]


def one_f_one_b_middle_stage(n_steps, rng, jitter=0.05):
    """Stage 1 of 4, 1F1B with 4 micro-batches and TP: each forward/backward is recv (posted at once), then the
    TP all-reduce after the wait and the compute, then the send; then the DP all-reduce. The idle gap before
    the first TP all-reduce (optimizer and pipeline fill, 30 ms) is the cut; the one before the first backward's
    (the bubble until the first gradient comes, 22 ms) is more than half of it, on the same signature.
    Returns (ops, [(step, first op issue, DP all-reduce end)]), 25 ops per step."""
    ops, truth, t, tp_seq = [], [], T0, 0
    j = lambda x: int(x * MS * (1 + rng.uniform(-jitter, jitter)))  # noqa: E731
    for s in range(n_steps):
        start = None
        for k, (phase, wait_ms) in enumerate([("F", 30), ("F", 5), ("F", 5), ("B", 22), ("F", 5), ("B", 10),
                                              ("B", 10), ("B", 10)]):
            src, dst = ("pg:prev", "pg:next") if phase == "F" else ("pg:next", "pg:prev")
            ops.append(op(t, j(wait_ms), src, "recv", 1 << 20))
            start = start or t
            t += j(wait_ms)
            ops.append(op(t, j(0.5), "pg:tp", "all_reduce", 4 << 20, tp_seq))
            tp_seq += 1
            t += j(0.5) + int(0.2 * MS)
            ops.append(op(t, j(0.3), dst, "send", 1 << 20))
            t += int(0.1 * MS)
        t += j(0.3)
        d = j(5)
        ops.append(op(t, d, "pg:dp", "all_reduce", 64 << 20, s))
        truth.append((s, start, t + d))
        t += int(0.2 * MS)
    return ops, truth


def test_pp_middle_stage_1f1b_is_one_step_per_iteration():
    """The cut op's signature (the TP all-reduce) recurs inside the cycle after the pipeline bubble, with a gap
    over half the cut gap: the cut is still one phase of the 25-op cycle, one step per iteration."""
    rng = random.Random(11)
    ops, truth = one_f_one_b_middle_stage(30, rng)
    for chunk in (25, 7, 60):
        steps = feed(StepSegmenter(), ops, chunk=chunk)
        assert len(steps) >= 26 and all(s.ops == s.period_ops == 25 for s in steps), [s.ops for s in steps]
        numbers = [s.step for s in steps]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # TP seq // 8: the iteration
        assert all(b.start_mono_ns == a.end_mono_ns for a, b in zip(steps, steps[1:]))
        # one iteration each: the cut is after the first recv, whose end (the next iteration's first
        # activation) closes the step
        its = sorted(b[1] - a[1] for a, b in zip(truth, truth[1:]))
        assert all(0.9 < (s.end_mono_ns - s.start_mono_ns) / its[len(its) // 2] < 1.1 for s in steps[1:])
    # a missing op: that step is dropped or shorter, the next ones are whole again
    kept = [o for i, o in enumerate(ops) if i != 25 * 15 + 10]
    steps = feed(StepSegmenter(), kept, chunk=25)
    assert len(steps) >= 25 and all(s.ops == s.period_ops == 25 for s in steps if s.step != 15)


def test_missing_ops_and_a_ring_wrap_keep_the_boundaries():
    rng = random.Random(4)
    ops, truth = dp_job(80, rng)
    ends = [e for _, _, e in truth]
    kept = [o for i, o in enumerate(ops) if not (i % 3 == 0 and rng.random() < 0.3)]  # first buckets missing
    kept = [o for o in kept if not (100 <= o.seq < 130)]  # a ring wrap lost 10 steps
    steps = feed(StepSegmenter(), kept, rng=rng)
    numbers = [s.step for s in steps]
    assert numbers == sorted(set(numbers))
    assert not set(numbers) & set(range(33, 43)), "no step is made of the lost ones"
    assert len(steps) >= 40, len(steps)  # 80 - 10 lost - those whose first bucket (the cut op) is missing
    for st in steps:
        assert 0 <= ends[st.step - 1] - st.end_mono_ns <= TAIL
    # the step after the hole starts at its first op, not at the end of the step before the hole
    after = next(s for s in steps if s.step > 33)
    assert after.start_mono_ns > ends[after.step - 2]


def test_pattern_change_is_learnt_again():
    rng = random.Random(5)
    a, truth_a = dp_job(30, rng)
    t = truth_a[-1][2] + 20 * MS
    b, truth_b = dp_job(40, rng, buckets=(2 << 20, 2 << 20, 2 << 20, 512 << 10), fwd_ms=60, seq0=a[-1].seq + 1, t0=t)
    seg = StepSegmenter()
    steps = feed(seg, a + b, rng=rng)
    late = [s for s in steps if s.end_mono_ns > t + 10 * 70 * MS]
    assert seg.relearned >= 1 and len(late) >= 25 and all(s.period_ops == 4 for s in late)
    ends_b = [e for _, _, e in truth_b]
    for st in late:
        assert min(abs(e - st.end_mono_ns) for e in ends_b) <= TAIL


def test_profiler_windows_win():
    rng = random.Random(6)
    ops, truth = dp_job(20, rng)
    seg = StepSegmenter()
    out = seg.add(ops[:30])  # ten steps by the comm pattern
    assert out and all(s.evidence == "comm_pattern" for s in out)
    windows = [(100 + s, a, b) for s, a, b in truth[10:20]]
    prof = seg.add(ops[30:], windows)
    assert [s.step for s in prof if s.evidence == "profiler"] == list(range(110, 120))
    assert not [s for s in prof if s.evidence == "comm_pattern"]
    p = prof[0]
    assert (p.start_mono_ns, p.end_mono_ns, p.period_ops, p.comms[0].calls) == (truth[10][1], truth[10][2], 0, 3)


def test_offsets_are_capped_and_counted():
    rng = random.Random(7)
    ops, _ = dp_job(12, rng, buckets=tuple([1 << 20] * 9 + [1 << 10]))
    steps = StepSegmenter(StepConfig(max_collectives=4)).add(ops)
    assert steps and all(len(s.comms[0].issue_offsets_ns) == 4 and s.comms[0].offsets_dropped == 6 for s in steps)


def test_commlog_sends_steps_upstream(tmp_path):
    rng = random.Random(8)
    ops, _ = dp_job(10, rng)
    now = max(o.end_mono_ns for o in ops)
    log = CommLog(str(tmp_path), "flightrec", monotonic_ns=lambda: now)
    try:
        out = log.add(ops)
    finally:
        log.close()
    steps = [x for x in out if isinstance(x, r.Step)]
    assert len(steps) >= 8 and any(isinstance(x, r.CommSummary) for x in out)


def _stored(tmp_path, recs):
    clock = ClockEstimate(offset_ns=5 * 10**12, drift_ppm=0.0, ref_mono_ns=0, uncertainty_ns=1, best_rtt_ns=1,
                          samples=5)
    path = str(tmp_path / "s.db")
    w = StoreWriter(path)
    w.start()
    done = []
    try:
        w.submit(BatchJob("n1", "ab" * 8, 1, len(recs), encode_records([("flightrec", x) for x in recs]),
                          max(x.mono_ns for x in recs) + 1, clock, time.time_ns(), lambda *a: done.append(a)))
        deadline = time.monotonic() + 10
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        w.stop()
    return Reader(path), done[0], clock


def test_step_round_trip_store_and_step_times(tmp_path):
    rng = random.Random(9)
    recs = []
    for rank in range(2):
        ops, _ = dp_job(30, random.Random(9), seq0=6)
        for o in ops:
            o.pid, o.rank = 100 + rank, rank
        recs += StepSegmenter().add(ops)
    recs[0].comms[0].issue_offsets_ns[0] = -5  # offsets are signed
    pairs = [("flightrec", x) for x in recs]
    assert decode_records(encode_records(pairs)) == pairs
    d = decode_batch(encode_records(pairs), len(pairs), max(x.mono_ns for x in recs) + 1)
    assert not d.rejected and len(d.steps) == len(recs)
    bad = r.Step(T0 + 5, 1, 1, "j", 0, 1, T0 + 9, T0 + 5, "comm_pattern", 3, 3, [])
    worse = r.Step(T0 + 5, 1, 1, "j", 0, 1, T0, T0 + 5, "guess", 3, 3, [])
    d = decode_batch(encode_records([("f", bad), ("f", worse)]), 2, T0 + 10)
    assert sum(d.rejected.values()) == 2 and not d.steps

    reader, result, clock = _stored(tmp_path, recs)
    assert result[0] == "stored", result
    rows = reader.steps("j", with_comms=True)
    assert len(rows) == len(recs) and {x["rank"] for x in rows} == {0, 1}
    first = next(x for x in rows if x["rank"] == recs[0].rank and x["step"] == recs[0].step)
    assert first["end_ns"] == recs[0].end_mono_ns + clock.offset_ns  # cluster time
    assert first["evidence"] == "comm_pattern" and first["source"] == "flightrec" and first["node_id"] == "n1"
    assert first["comms"][0]["issue_offsets_ns"][0] == -5 and first["comms"][0]["calls"] == 3
    st = step_times(reader, "j", recent_steps=5, min_baseline_steps=5)
    assert st.source == "steps" and st.now_seconds and 0.04 < st.now_seconds < 0.06 and st.baseline_seconds
    tops, marks = reader.new_data_since(0)
    assert len(tops) == len(DATA_TABLES) and tops[DATA_TABLES.index("steps")] == len(recs) and \
        marks["j"] == max(x["end_ns"] for x in rows)
    assert reader.new_data_since(tops)[1] == {}
    assert reader.data_watermarks(["j"])["j"] == marks["j"]


def test_step_times_prefers_profiler_evidence_per_rank():
    rows = [{"rank": 0, "step": s, "end_ns": s * 100 * MS, "evidence": "comm_pattern", "source": "flightrec"}
            for s in range(20)]
    rows += [{"rank": 0, "step": s, "end_ns": s * 50 * MS + 7, "evidence": "profiler", "source": "kineto"}
             for s in range(5)]
    st = from_steps(rows, recent_steps=2, min_baseline_steps=2)
    assert st.source == "steps" and abs(st.now_seconds - 0.05) < 1e-9


def test_random_traffic_makes_no_steps():
    """Identical ops at random (Poisson) times: no rhythm, so no steps, whatever the chunking."""
    for seed in range(5):
        rng = random.Random(seed)
        t, ops = T0, []
        for _ in range(1100):
            t += int(rng.expovariate(1 / 5e6)) + 1
            ops.append(op(t, 0, "pg:0", "all_reduce", 8, end=False))
        assert len(feed(StepSegmenter(), ops, rng=rng)) <= 30  # a chance rhythm is dropped again within 16


def test_the_running_count_of_unsteady_cycles_is_the_recomputed_one():
    """_Proc.unsteady is kept as cycles come and go (it was recomputed over all 16 at each step): after every
    poll it is what _steady over the kept cycles says, on steps whose forward time jumps between 40 and 120 ms
    at random, so that both steady and unsteady pairs enter and leave the window."""
    from steplens.agent.steps import _steady
    rng = random.Random(3)
    ops, t = [], T0
    for s in range(400):
        part, _ = dp_job(1, rng, fwd_ms=rng.choice((40.0, 120.0)), seq0=5 + 3 * s, t0=t)
        ops += part
        t = part[-1].end_mono_ns + 2 * MS
    seg, checked = StepSegmenter(), 0
    for i in range(0, len(ops), 7):
        seg.add(ops[i:i + 7])
        for st in seg.procs.values():
            if len(st.cycles) >= 2:
                assert st.unsteady == round((1 - _steady(st.cycles)) * (len(st.cycles) - 1))
                checked += 1
    assert checked > 100 and 0 < seg.relearned


def test_a_slowdown_keeps_the_steps_coming():
    """A 3x slower forward from step 40 on (a fault the detectors must see): every step is still there."""
    rng = random.Random(10)
    a, ta = dp_job(40, rng)
    b, tb = dp_job(40, rng, fwd_ms=120, seq0=a[-1].seq + 1, t0=ta[-1][2])
    for seq_known in (True, False):
        ops = [op(o.issue_mono_ns, o.end_mono_ns - o.issue_mono_ns, o.comm_id, o.op, o.bytes,
                  o.seq if seq_known else -1) for o in a + b]
        steps = feed(StepSegmenter(), ops, rng=rng)
        assert len(steps) >= 78, (seq_known, len(steps))
        ends = [e for _, _, e in ta + tb]
        assert all(min(abs(e - s.end_mono_ns) for e in ends) <= TAIL for s in steps)
        slow = [s.end_mono_ns - s.start_mono_ns for s in steps[-30:]]
        assert all(125 * MS < d < 140 * MS for d in slow), slow


def polled(seg, ops, anchors, poll_ns=300 * MS, pid=100, ticks=7):
    """Feed as the flightrec source does: every poll_ns, the anchors up to now (asked after the dump), then the
    ops issued up to now; returns the steps."""
    out, t = [], min(o.issue_mono_ns for o in ops)
    end = max(o.issue_mono_ns for o in ops) + poll_ns
    i = j = 0
    ops = sorted(ops, key=lambda o: o.issue_mono_ns)
    while t <= end:
        k = j
        while k < len(anchors) and anchors[k] <= t:
            k += 1
        if k > j:
            seg.add_anchors(pid, ticks, anchors[j:k])
            j = k
        n = i
        while n < len(ops) and ops[n].issue_mono_ns <= t:
            n += 1
        out += seg.add(ops[i:n])
        i = n
        t += poll_ns
    return out


def test_anchors_end_the_steps_where_the_optimizer_ends():
    """Issue times only (gloo) plus the optimizer-step ends: each step ends at its optimizer step, not at its
    last all-reduce's issue; a step closes only once the next one's first op is seen."""
    rng = random.Random(11)
    ops, truth = dp_job(40, rng)
    gloo = [op(o.issue_mono_ns, 0, o.comm_id, o.op, o.bytes, o.seq, end=False) for o in ops]
    anchors = [e for _, _, e in truth]  # dp_job's step ends right after its optimizer step
    seg = StepSegmenter()
    steps = polled(seg, gloo, anchors)
    ends = {s: e for s, _, e in truth}
    assert len(steps) >= 35 and all(s.evidence == "anchor" for s in steps)
    for st in steps:
        assert st.end_mono_ns == ends[st.step - 1]
    assert all(b.start_mono_ns == a.end_mono_ns for a, b in zip(steps, steps[1:]))
    assert steps[-1].step - 1 < truth[-1][0]  # the last step waits for a next cut op that never comes
    assert seg.anchored_steps == len(steps) and seg.procs[(100, 7)].anchors == [anchors[-1]]
    # without anchors, the same ops end each step at its last all-reduce's issue
    plain = polled(StepSegmenter(), gloo, [])
    last_issue = {s: max(o.issue_mono_ns for o in gloo[3 * s:3 * s + 3]) for s in range(40)}
    assert all(s.evidence == "comm_pattern" and s.end_mono_ns == last_issue[s.step - 1] for s in plain)


def test_an_anchor_before_the_last_collective_leaves_the_end_alone():
    """The optimizer runs before a loss all-reduce: no anchor lies between the step's last op and the next
    step's first, so the step ends at its last op (evidence comm_pattern), and anchors stay bounded."""
    rng = random.Random(12)
    ops, truth = dp_job(30, rng, buckets=(4 << 20, 4 << 20, 8))  # the 8-byte one: the loss, after the optimizer
    anchors = [o.issue_mono_ns - int(0.2 * MS) for o in ops if o.bytes == 8]
    seg = StepSegmenter(StepConfig(max_anchors=4))
    steps = polled(seg, ops, anchors)
    assert len(steps) >= 25 and all(s.evidence == "comm_pattern" for s in steps)
    ends = {s: e for s, _, e in truth}
    assert all(0 <= ends[s.step - 1] - s.end_mono_ns <= TAIL for s in steps)
    assert len(seg.procs[(100, 7)].anchors) <= 4
    seg.add_anchors(100, 7, list(range(1, 10)))
    assert seg.anchors_dropped >= 5 and len(seg.procs[(100, 7)].anchors) == 4


def test_a_zero_grad_anchor_after_the_optimizer_step_ends_the_step():
    """Two anchors per iteration, as the bootstrap writes for a `step(); zero_grad()` loop: the optimizer step's
    end and, 0.8 ms later, the zero_grad's; the step ends at the later one (the last anchor before the next
    step's first op). An iteration without the zero_grad anchor (a zero_grad-first loop) ends at its step."""
    rng = random.Random(13)
    ops, truth = dp_job(40, rng)
    gloo = [op(o.issue_mono_ns, 0, o.comm_id, o.op, o.bytes, o.seq, end=False) for o in ops]
    zero_grad = int(0.8 * MS)
    anchors = sorted([e for _, _, e in truth] + [e + zero_grad for s, _, e in truth if s % 5])
    seg = StepSegmenter()
    steps = polled(seg, gloo, anchors)
    ends = {s: e for s, _, e in truth}
    assert len(steps) >= 35 and all(s.evidence == "anchor" for s in steps)
    for st in steps:
        s = st.step - 1
        assert st.end_mono_ns == ends[s] + (zero_grad if s % 5 else 0)
    assert all(b.start_mono_ns == a.end_mono_ns for a, b in zip(steps, steps[1:]))


def test_a_whole_job_in_its_exit_dump_ending_with_its_shutdown_collectives():
    """A process read only at its exit (sparse reads: the flightrec Schedule) gives its whole run in one add(), and
    its last ops are its shutdown's (here a barrier and a small all-reduce): the newest ops show no period. As the
    process's last ops (final=True) the pattern is learnt without them; otherwise the same ops give no step."""
    rng = random.Random(11)
    ops, truth = dp_job(30, rng)
    t = ops[-1].end_mono_ns + 5 * MS
    ops += [op(t, MS, "pg:0", "barrier", 0, ops[-1].seq + 1), op(t + 3 * MS, MS, "pg:0", "all_reduce", 8, ops[-1].seq + 2)]
    assert StepSegmenter().add(ops) == []
    steps = StepSegmenter().add(ops, final=True)
    assert len(steps) >= 28 and all(s.period_ops == 3 for s in steps)
    ends = {s: e for s, _, e in truth}
    assert all(0 <= ends[s.step - 1] - s.end_mono_ns <= TAIL for s in steps)


def test_a_cycle_learnt_as_two_iterations_is_split_where_the_anchors_say_iterations_end():
    """The testbed's stage-0 ranks (2026-12-04): gloo records one DP all-reduce per iteration, so the signatures
    repeat every op and the gaps decide; learnt while a link fault made every other gap long, the cycle was two
    all-reduces, and every Step after it held two iterations (half the step count, steps twice as long, for good).
    The iterations' ends (anchors) lie between the two: after `relearn_after` such steps the pattern is learnt
    again with one repeat per cycle, and each step is one iteration, ending at its anchor."""
    rng = random.Random(21)
    ops, anchors, t, seq = [], [], T0, 5
    for i in range(160):
        # iterations 0-29 alternate 40 ms and 8 ms of compute (the disturbance), then 40 ms each
        t += int((40 if i >= 30 or i % 2 == 0 else 8) * MS * (1 + rng.uniform(-0.03, 0.03)))
        ops.append(op(t, 0, "pg:0", "all_reduce", 8 << 20, seq, end=False))
        seq += 1
        t += int(3 * MS)
        anchors.append(t)   # the optimizer step's end, after the all-reduce
    assert learn(ops[:30]).ops == 2 and learn(ops[:30]).sub == 1   # the disturbed gaps: two all-reduces a cycle
    seg = StepSegmenter()
    steps = polled(seg, ops, anchors)
    assert seg.split_relearned == 1 and seg.procs[(100, 7)].max_multiple == 1
    # learnt again once the disturbed gaps are under a fifth of those it learns from (consistency 0.8)
    late = [s for s in steps if s.start_mono_ns >= ops[100].issue_mono_ns]
    assert len(late) >= 50 and all(s.ops == 1 and s.period_ops == 1 and s.evidence == "anchor" for s in late)
    ends = set(anchors)
    assert all(s.end_mono_ns in ends for s in late)
    numbers = [s.step for s in late]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))   # one step number per iteration now
    # without anchors nothing tells the two apart: the doubled cycle stays (what the testbed showed)
    plain = polled(StepSegmenter(), ops, [])
    assert all(s.ops == 2 for s in plain if s.start_mono_ns >= ops[100].issue_mono_ns)
