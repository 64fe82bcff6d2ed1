"""Step segmentation on the agent: per-process iteration boundaries from the comm-op stream, as Step records.

Reads: the CommOps every comm-op source hands to CommLog (Flight Recorder, Kineto, CUPTI), and the ProfilerStep
windows a Kineto trace has. A job that steps no profiler still repeats the same communication every iteration,
so the step is found in the ops themselves:
- **Period.** Each op's signature is (comm_id, op, bytes). The period is the shortest P (ops) such that the
  last `confirm_cycles` x P signatures repeat with period P. Signatures alone cannot tell one all-reduce per step
  from two identical ones, so the multiples m x P are tried too, and the first whose cut gap (below) is
  consistent from cycle to cycle wins (Q = m x P ops per step). Where every op has one signature, the gaps
  alone make the step, so 12 cycles are needed; random traffic (no rhythm) makes no steps.
- **Cut.** The cycle is cut before the op with the largest median idle gap before it (issue to issue): the
  optimizer and the next forward pass, where no communication runs. A step is the ops from one cut to the
  next; its end is the latest completion (or, where the source has no end, the issue) of its ops, i.e. the
  end of the DP all-reduce burst; its start is the previous step's end (consecutive steps share the boundary).
  The point is the same in every cycle, so step times are exact up to that point's jitter; the boundary
  precedes the job's own step end by what follows the last collective (the optimizer step, and the last
  collective's duration where only its issue time is known: gloo's Flight Recorder entries have no end).
  Measured (tests/test_steps_e2e.py, a real 2-rank gloo job, 24 ms steps, against the job's own
  time.monotonic_ns() log): median boundary error 1.3-1.4 % of the step time, 0.3-0.4 % once the constant
  phase (-0.3 ms, the last all-reduce) is taken out; step durations 0.5-0.6 %. On the testbed's DP2 x PP2 job
  (loopback) gloo's recorder shows only the 8 MB DP all-reduce, issue time only: 25-29 %, 4.6-6.9 % after the
  phase (-16..-20 ms, its duration), durations 6-12 %: the 1 % goal needs completion times (NCCL, CUPTI).
  The cut is one phase of the cycle, fixed when the pattern is learnt (the position of the learnt cycle's start
  in the ops): from one cut, the next is Q ops on when those Q ops are the pattern's signatures and the op
  after them has at least half the cut gap; a step is emitted every Q ops. Re-finding the cut op by its
  signature and gap at every op would also cut where that signature follows another long idle gap: on a middle
  1F1B pipeline stage the TP all-reduce (or recv) after the bubble that waits for the first gradient, which cut
  the iteration in two (16 + 9 of a 25-op cycle in bench/sim).
- **Step numbers** come from the collective sequence numbers where the source has them (Flight Recorder), so
  ranks of one group number a step alike and a step lost to a ring wrap leaves a hole, not a shift; otherwise
  a counter.
- **Robustness.** Ops missing from a poll shorten a step but keep its boundaries: only there is the cut op
  found again by its signature and a gap above the median gaps of that signature's other positions in the
  cycle (their geometric mean with the cut gap; half the cut gap where no other position comes close); a
  stretch that spans lost steps (sequence numbers jump, or twice the ops) is not a step and is dropped
  (counted); a job that changes its pattern (no cut op for a while, `relearn_after` mismatching steps in a
  row, or cut-to-cut times that lost their rhythm) is learnt afresh from its recent ops. A slower step is not
  a lost one: without sequence numbers only explicit losses (a dropped stretch, ops dropped from the buffer)
  break the chain of consecutive steps.
- **Anchors** (`add_anchors`: where the process's iterations end, which the bootstrap's hooks record and the
  flightrec source hands over: each optimizer step's end and, where the loop body calls zero_grad after the
  step, that zero_grad's end; see steplens_anchors) move a step's end from its last op to where the
  iteration ends: the last anchor between the step's last op (its end, or its issue) and the issue of the next
  step's cut op; the step's evidence is then `anchor`. A process that has sent anchors closes a step only once
  the next step's cut op is seen (one poll later than without: that op bounds the window, and the source asks
  for anchors after the ops, so none in the window is still to come); a step with no anchor in its window
  keeps its last op's end (evidence `comm_pattern`), as does an optimizer step that runs before the last
  collective (a loss all-reduce after it). The last anchor in the window is the zero_grad's end where the
  loop has one after its step, else the optimizer step's. Why: gloo's Flight Recorder has issue times only and
  nothing marks the optimizer step, so without anchors the testbed's DP2 x PP2 steps end an all-reduce plus an
  optimizer step early (25-29 % of the step time, above); with the optimizer-step ends alone they ended
  before the job's zero_grad(set_to_none=False) of 2.1 M floats, a constant -0.8..-0.9 ms (0.85-1.2 % of
  its step); with the zero_grad's end too, 0.10 % on the testbed (phase -0.10 ms, jitter 0.006 %) and 0.03 %
  for the same job on loopback (bench/testbed_steps.py, tests/test_steps_e2e.py; bench/testbed/README.md).
- **Iterations inside a step.** Where the cycle is several repeats of its signatures (the gaps chose: one
  all-reduce an iteration, as gloo records a DP-only rank) and an anchor (an iteration's end) falls between the
  repeats for `relearn_after` steps in a row, the cycle holds several iterations: the pattern is learnt again
  with at most as many repeats as one iteration showed (`split_relearned`). Seen on the testbed (2026-12-04): a
  link fault made every other gap long while the stage-0 ranks learnt, and their Steps held two iterations each
  from then on (half the step count, twice the step time), which kept the detectors from every later fault.
- **ProfilerStep windows win**: ops inside a window are that step's (evidence `profiler`), and comm-pattern
  steps of the same process overlapping a window are not emitted.
Evidence values: `profiler`, `comm_pattern`, `anchor` (a comm-pattern step whose end is an anchor: an optimizer
step's end or its zero_grad's).

Each Step carries per-communicator summaries (calls, bytes, busy and wait ns, the issue offset of each
collective from the step start, capped at `max_collectives` per step with the rest counted): what goes
upstream while the ops stay on the node. A point-to-point communicator's sends and receives are summarized
apart (two StepComms, op `send` and `recv`): a send's busy time is mostly its transfer, a receive's mostly
waiting for the peer, and the collector reads pair transfer times from the sends (commtime). Cost: O(ops) per add() plus, while a process has no pattern, a
period search over its last (confirm_cycles + 1) x max_period_ops ops (about 1,000: a few ms); memory is
bounded by `max_buffer_ops` per process (oldest dropped, counted), `max_anchors` per process and
`max_processes`. Pure: no clock, no I/O.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from statistics import median

from steplens.agent.records import CommOp, Step, StepComm

EVIDENCE = ("profiler", "comm_pattern", "anchor")
TAIL_TRIM = 8   # a process's last ops: learning also tries them without the last 1..TAIL_TRIM (its shutdown)
P2P_SPLIT = ("send", "recv")  # summarized apart per communicator
UNIFORM_CYCLES = 12  # cycles needed when every op has the same signature
MAX_MULTIPLE = 16    # identical signatures in a row told apart by their gaps: up to 16 per step (bounds learn())


@dataclass
class StepConfig:
    max_period_ops: int = 256       # longest cycle looked for (ops per step of one process)
    confirm_cycles: int = 3         # identical cycles needed to learn a pattern
    relearn_after: int = 4          # mismatching steps in a row that make the pattern be learnt afresh
    max_buffer_ops: int = 8192      # ops held per process while no step closes (oldest dropped, counted)
    max_collectives: int = 64       # issue offsets per step (all communicators); the rest are counted
    max_processes: int = 1024       # processes followed; the one updated longest ago is forgotten first
    consistency: float = 0.8        # share of cycles whose cut gap is within 2x of the median cut gap (and of
                                    # consecutive cut gaps within 2x of each other) for a pattern to be learnt
    max_anchors: int = 1024         # anchors (optimizer-step ends) held per process not yet past (oldest dropped)

    def validate(self) -> None:
        if not (1 <= self.max_period_ops <= 4096) or not (2 <= self.confirm_cycles <= 16):
            raise ValueError("max_period_ops must be within 1..4096 and confirm_cycles within 2..16")
        if not (0.5 <= self.consistency <= 1) or self.relearn_after < 1 or self.max_processes < 1:
            raise ValueError("consistency must be within 0.5..1, relearn_after and max_processes >= 1")
        if self.max_buffer_ops < self.max_period_ops * (self.confirm_cycles + 1) or self.max_collectives < 0:
            raise ValueError("max_buffer_ops must hold (confirm_cycles + 1) periods; max_collectives >= 0")
        if self.max_anchors < 1:
            raise ValueError("max_anchors must be >= 1")


def _issue(op: CommOp) -> int:
    return op.issue_mono_ns or op.start_mono_ns or op.mono_ns


def _end(op: CommOp) -> int:
    return op.end_mono_ns or _issue(op)


def _sig(op: CommOp) -> tuple:
    return (op.comm_id, op.op, op.bytes)


@dataclass
class Pattern:
    sigs: tuple                     # signatures of one cycle, from the cut op on
    cut_gap_ns: float               # median idle gap before the cut op
    seq_comm: str = ""              # communicator whose sequence numbers number the steps ("" = counter)
    seq_per_cycle: int = 0          # its ops per cycle
    seq_residue: int = 0            # seq - seq_residue of any of its ops, // seq_per_cycle: the step number
    cut_thr_ns: float = 0.0         # idle gap a re-found cut op needs: above those of its signature's other
                                    # positions in the cycle (a 1F1B stage's bubble precedes two of them)
    anchor: int = 0                 # ops from the newest learnt cycle start to the end of the learning window
    sub: int = 0                    # the signatures' own period where the cycle is a multiple of it (gaps chose)

    @property
    def ops(self) -> int:
        return len(self.sigs)


def _within_2x(a: float, b: float) -> bool:
    return a <= 2 * b and b <= 2 * a


def _steady(xs: list) -> float:
    """Share of consecutive pairs within a factor 2 of each other (a step change breaks one pair; random
    arrivals, with exponential gaps, about two pairs in three)."""
    pairs = list(zip(xs, xs[1:]))
    return sum(1 for a, b in pairs if _within_2x(a, b)) / len(pairs) if pairs else 1.0


def learn(ops: list[CommOp], cfg: StepConfig = StepConfig(), max_multiple: int = MAX_MULTIPLE) -> Pattern | None:
    """The step pattern of one process's recent ops (issue order), or None while they show none. max_multiple:
    at most this many repeats of the signatures' period in one cycle (the process's anchors said fewer)."""
    sigs = [_sig(o) for o in ops]
    t = [_issue(o) for o in ops]
    n, c = len(sigs), cfg.confirm_cycles
    for p in range(1, min(cfg.max_period_ops, (n - 1) // c) + 1):
        if any(sigs[i] != sigs[i - p] for i in range(n - (c - 1) * p, n)):
            continue
        lo = n - c * p  # how far back the signatures repeat with period p: the gaps come from there
        while lo > 0 and sigs[lo - 1] == sigs[lo - 1 + p]:
            lo -= 1
        lo += 1  # the gap before the region's first op may span ops that broke the pattern
        # one signature throughout says nothing by itself: then the gaps alone make the step, over more cycles
        need = c if p > 1 else max(c, UNIFORM_CYCLES)
        m = 1
        while m <= min(MAX_MULTIPLE, max_multiple) and m * p <= cfg.max_period_ops and need * m * p <= n - lo:
            q = m * p
            base = n - ((n - lo) // q) * q  # whole cycles only, ending with the newest op
            gaps = {k: [] for k in range(q)}
            for i in range(base, n):
                gaps[(i - base) % q].append(t[i] - t[i - 1])
            med = {k: median(v) for k, v in gaps.items()}
            cut = max(range(q), key=lambda k: (med[k], -k))
            g = gaps[cut]
            ref = med[cut]
            if sum(1 for x in g if 0.5 * ref <= x <= 2 * ref) >= cfg.consistency * len(g) and \
                    _steady(g) >= cfg.consistency:
                first = n - q + ((cut - (n - q - base)) % q)  # the newest cycle start at phase `cut`
                if first + q > n:
                    first -= q
                cyc_ops = ops[first:first + q]
                seq_comm = next((o.comm_id for o in cyc_ops if o.seq >= 0 and o.seq_source == "trace"), "")
                mine = [o.seq for o in cyc_ops if o.comm_id == seq_comm and o.seq >= 0] if seq_comm else []
                residue = mine[0] % len(mine) if mine else 0
                decoy = max((med[k] for k in range(q) if k != cut and sigs[base + k] == sigs[base + cut]),
                            default=0.0)
                thr = max(0.5 * ref, (ref * decoy) ** 0.5) if decoy < ref else 0.5 * ref
                return Pattern(tuple(sigs[first:first + q]), float(ref), seq_comm, len(mine), residue, float(thr),
                               n - first, p if m > 1 else 0)
            m += 1
        return None  # the shortest signature period has no consistent multiple (yet): more data
    return None


@dataclass
class _Proc:
    buf: list = field(default_factory=list)     # ops not in an emitted step, issue order
    pattern: Pattern | None = None
    prev_issue: int = 0                         # issue time of the op before buf[0]
    last_end: int = 0                           # end of the last emitted step
    last_step: int = -1
    mismatches: int = 0
    last_cut: int = 0                           # issue time of the last segment's cut op
    cycles: list = field(default_factory=list)  # cut op to cut op of the last steps (ns)
    unsteady: int = 0                           # consecutive pairs of `cycles` not within 2x (_steady, kept as
                                                # cycles come and go: it was recomputed over all 16 at each step)
    lost: bool = False                          # the cycles lost their rhythm: learn again
    synced: bool = False                        # buf[0] is a cut op (the start of a cycle)
    profiled: list = field(default_factory=list)  # (start, end) ProfilerStep windows seen, newest last
    anchors: list = field(default_factory=list)   # optimizer-step ends (mono ns) not yet past, sorted
    max_multiple: int = MAX_MULTIPLE            # what the anchors allow learn() (iterations seen inside a cycle)
    split: int = 0                              # steps in a row with an iteration's end inside them
    anchored: bool = False                      # the process sends anchors: close a step at the next cut op


class StepSegmenter:
    """Per-process step boundaries: add() CommOps (and ProfilerStep windows) as they come, get Steps back."""

    def __init__(self, config: StepConfig | None = None) -> None:
        self.config = config or StepConfig()
        self.config.validate()
        self.procs: dict[tuple[int, int], _Proc] = {}
        self.steps_emitted = 0
        self.ops_dropped = 0          # buffer overflow, or before the first cut of a learnt pattern
        self.segments_dropped = 0     # stretches that spanned lost steps
        self.relearned = 0
        self.anchors_dropped = 0      # anchors over max_anchors (oldest first)
        self.anchored_steps = 0       # steps whose end is an anchor
        self.split_relearned = 0      # patterns learnt again because iterations ended inside their steps

    def add_anchors(self, pid: int, start_ticks: int, ends_mono_ns: list[int]) -> None:
        """The ends of a process's optimizer steps (this host's monotonic ns, any order): where its steps end
        from now on (see the module docstring). Call before add() with the ops of the same poll."""
        st = self.procs.get((pid, start_ticks))
        if st is None:
            st = self.procs[(pid, start_ticks)] = _Proc()
            while len(self.procs) > self.config.max_processes:
                del self.procs[next(iter(self.procs))]
        st.anchored = True
        merged = sorted(set(st.anchors).union(ends_mono_ns))
        over = len(merged) - self.config.max_anchors
        if over > 0:
            self.anchors_dropped += over
            del merged[:over]
        st.anchors = merged

    def add(self, ops: list[CommOp], profiler_steps: list[tuple[int, int, int]] = (), final: bool = False
            ) -> list[Step]:
        """ops: any processes, any order; profiler_steps: (step, start_mono_ns, end_mono_ns) of the processes
        whose ops come in this call (a Kineto trace is one process's); final: these are the processes' last ops
        (an exit dump), which may end with the collectives of their shutdown (see _learn)."""
        by_proc: dict[tuple[int, int], list[CommOp]] = {}
        for o in ops:
            by_proc.setdefault((o.pid, o.start_ticks), []).append(o)
        out: list[Step] = []
        for key, pops in by_proc.items():
            st = self.procs.pop(key, None) or _Proc()
            self.procs[key] = st  # insertion order = last update: the oldest is first
            while len(self.procs) > self.config.max_processes:
                del self.procs[next(iter(self.procs))]
            if profiler_steps:
                pops = self._profiler(st, pops, profiler_steps, out)
            if pops:
                self._comm_pattern(st, pops, out, final)
        self.steps_emitted += len(out)
        return out

    def forget(self, pid: int, start_ticks: int) -> None:
        self.procs.pop((pid, start_ticks), None)

    # -- ProfilerStep windows ------------------------------------------------------------------------
    def _profiler(self, st: _Proc, ops: list[CommOp], windows, out: list[Step]) -> list[CommOp]:
        rest = []
        inside: dict[int, list[CommOp]] = {s: [] for s, _, _ in windows}
        for o in ops:
            t = _issue(o)
            for s, a, b in windows:
                if a <= t <= b:
                    inside[s].append(o)
                    break
            else:
                rest.append(o)
        first = ops[0]
        for s, a, b in sorted(windows, key=lambda w: w[1]):
            out.append(self._step(first, s, a, b, "profiler", 0, sorted(inside[s], key=_issue)))
            st.profiled.append((a, b))
        del st.profiled[:-64]
        return rest

    # -- comm pattern --------------------------------------------------------------------------------
    def _comm_pattern(self, st: _Proc, ops: list[CommOp], out: list[Step], final: bool = False) -> None:
        cfg = self.config
        st.buf.extend(ops)
        st.buf.sort(key=_issue)
        if len(st.buf) > cfg.max_buffer_ops:
            drop = len(st.buf) - cfg.max_buffer_ops
            st.prev_issue = _issue(st.buf[drop - 1])
            del st.buf[:drop]
            self.ops_dropped += drop
            st.last_end = 0  # the next step's start is gone with them
            st.synced = False
        for _ in range(2):  # a pattern dropped below is learnt again at once from the same ops
            if st.pattern is None:
                st.pattern = self._learn(st.buf, TAIL_TRIM if final else 0, st.max_multiple)
                if st.pattern is None:
                    return
                st.mismatches, st.lost, st.cycles, st.unsteady, st.last_cut = 0, False, [], 0, 0
                self._align(st)
            if self._segment(st, out):
                return
            st.pattern = None
            self.relearned += 1

    def _learn(self, buf: list, trim_up_to: int = 0, max_multiple: int = MAX_MULTIPLE) -> Pattern | None:
        """The pattern of the newest ops; failing that, with trim_up_to (a process's last ops, add(final=True)),
        of the newest ops but the last 1..trim_up_to: a process read rarely gives much of its run, or all of it,
        in its exit dump, which ends with the collectives of its shutdown (a barrier, a group's destruction);
        they break the period at the very end, where learn() looks. Only then: a window ending at an arbitrary
        op can show a false shorter period (a 1F1B stage's micro-batch sends and receives), and the more windows
        are tried the likelier one does. The pattern's `anchor` is counted from the buffer's end (_align)."""
        cfg = self.config
        window = cfg.max_period_ops * (cfg.confirm_cycles + 1) + 1
        for trim in range(min(trim_up_to, max(0, len(buf) - 2)) + 1):
            end = len(buf) - trim
            pat = learn(buf[max(0, end - window):end], cfg, max_multiple)
            if pat is not None:
                if trim:
                    pat.anchor += trim
                return pat
        return None

    def _align(self, st: _Proc) -> None:
        """Start st.buf at a cut: the newest learnt cycle start, back one whole cycle at a time while the
        signatures and the cut gap fit; before a cycle with ops missing, the earliest whole cycle that does (a
        whole cycle of a primitive signature sequence fixes the phase, where one op's signature and gap could
        be the pipeline bubble's; the steps between are cut as after any loss)."""
        pat, buf = st.pattern, st.buf
        q, thr = pat.ops, pat.cut_thr_ns

        def cut_gap(i: int) -> bool:
            return _issue(buf[i]) - _issue(buf[i - 1]) >= thr if i else \
                not st.prev_issue or _issue(buf[0]) - st.prev_issue >= thr

        a = len(buf) - pat.anchor
        while a - q >= 0 and tuple(_sig(o) for o in buf[a - q:a]) == pat.sigs and cut_gap(a - q):
            a -= q
        sg = [_sig(o) for o in buf[:a]] if a > q else []
        a = next((i for i in range(len(sg) - q) if sg[i] == pat.sigs[0] and tuple(sg[i:i + q]) == pat.sigs
                  and cut_gap(i)), a)
        if a > 0:  # a step whose start was not seen (before learning)
            self.ops_dropped += a
            st.prev_issue = _issue(buf[a - 1])
            del buf[:a]
        st.synced = True

    def _segment(self, st: _Proc, out: list[Step]) -> bool:
        """Emit the steps of st.buf that close; False when the pattern no longer fits (learn again).

        The cut is one phase of the cycle, learnt once: from a cut, a whole cycle of the pattern's signatures
        whose next op has the cut gap ends the step and begins the next, q ops on. Only where that fails (ops
        missing or extra) is the next cut found again, by its signature and a gap above those of the other
        ops with that signature (re-matching every op of that signature would also cut after the pipeline
        bubble of a middle 1F1B stage, which precedes another op of the cut op's signature)."""
        pat, cfg = st.pattern, self.config
        buf, q, sigs = st.buf, pat.ops, pat.sigs
        n = len(buf)
        sg = [(o.comm_id, o.op, o.bytes) for o in buf]
        t = [_issue(o) for o in buf]
        s0, thr, loose = sigs[0], pat.cut_thr_ns, 0.5 * pat.cut_gap_ns
        prev0 = st.prev_issue

        def gap_ok(i: int, g: float) -> bool:
            if i:
                return t[i] - t[i - 1] >= g
            return not prev0 or t[0] - prev0 >= g

        a = 0
        if not st.synced:
            a = next((i for i in range(n) if sg[i] == s0 and gap_ok(i, thr)), -1)
            if a < 0:
                return n <= (cfg.relearn_after + 1) * q
            if a > 0:  # a step whose start was not seen (after a loss)
                self.ops_dropped += a
                st.prev_issue = prev0 = t[a - 1]
                del buf[:a], sg[:a], t[:a]
                n, a = n - a, 0
            st.synced = True
        cuts, whole = [a], []
        while True:
            b = a + q
            if tuple(sg[a:b]) == sigs[:n - a]:
                if b > n:
                    break  # the cycle is not complete yet
                if b == n and st.anchored:
                    break  # its anchor window closes at the next cut op: wait for it
                if b == n or (sg[b] == s0 and gap_ok(b, loose)):
                    cuts.append(b)  # the last cycle is complete: close it now, not at the next one
                    whole.append(True)
                    a = b
                    continue
            b = next((i for i in range(a + 1, n) if sg[i] == s0 and gap_ok(i, thr)), -1)
            if b < 0:
                break
            cuts.append(b)
            whole.append(tuple(sg[a:b]) == sigs)
            a = b
        if len(cuts) == 1:
            return n - a <= (cfg.relearn_after + 1) * q
        done = cuts[-1]
        for a, b, w in zip(cuts, cuts[1:], whole):
            st.mismatches = 0 if w else st.mismatches + 1
            self._emit(st, buf[a:b], out, t[b] if b < n else 0)
            if st.lost:
                done = b
                break
        st.prev_issue = t[done - 1] if done > 0 else st.prev_issue
        del buf[:done]
        return st.mismatches < cfg.relearn_after and not st.lost

    def _emit(self, st: _Proc, seg: list[CommOp], out: list[Step], next_issue: int = 0) -> None:
        """next_issue: issue time of the next step's cut op (0: not seen), which closes the anchor window."""
        pat = st.pattern
        number, spans = st.last_step + 1, False
        if pat.seq_comm:
            seqs = [o.seq for o in seg if o.comm_id == pat.seq_comm and o.seq >= 0]
            # any of them numbers the step, so ops missing from the step do not shift its number
            number = (seqs[0] - pat.seq_residue) // pat.seq_per_cycle if seqs else -1
            spans = bool(seqs) and (seqs[-1] - pat.seq_residue) // pat.seq_per_cycle != number
        end = max(_end(o) for o in seg)
        evidence = "comm_pattern"
        if st.anchors and pat.sub and len(seg) == pat.ops:
            self._split_check(st, seg)
        if st.anchors and next_issue:
            # st.anchors is sorted: the last anchor in [end, next_issue) by bisection (a poll that brings many
            # steps brings as many anchors; a scan per step was quadratic in them)
            k = bisect_left(st.anchors, next_issue)
            if k and st.anchors[k - 1] >= end:  # the last optimizer step between this step's last op and the next's
                end, evidence = st.anchors[k - 1], "anchor"
            del st.anchors[:k]
        cut = _issue(seg[0])
        cycle = cut - st.last_cut if st.last_cut else 0
        st.last_cut = cut
        if spans or len(seg) > 1.5 * pat.ops + 1 or (pat.seq_comm and (number < 0 or number <= st.last_step)):
            self.segments_dropped += 1  # it spans lost steps (a missing cut op, a ring wrap)
            st.last_end = 0             # and the next step's start was not seen
            return
        if cycle:
            # without sequence numbers a slow step and a lost one look alike: only explicit losses (a dropped
            # segment, ops dropped from the buffer) break the chain of consecutive steps
            cyc = st.cycles
            if cyc:
                st.unsteady += not _within_2x(cyc[-1], cycle)
            cyc.append(cycle)
            if len(cyc) > 16:
                st.unsteady -= not _within_2x(cyc[0], cyc[1])
                del cyc[0]
            if len(cyc) == 16 and st.unsteady > 7.5:   # _steady(cyc) < 0.5: fewer than 7.5 of the 15 pairs steady
                st.lost = True  # no rhythm left: learn the pattern again
        contiguous = st.last_step >= 0 and number == st.last_step + 1 and st.last_end
        start = min(st.last_end if contiguous else _issue(seg[0]), end)  # overlapping async ops: never past end
        st.last_step, st.last_end = number, end
        if any(a <= end and start <= b for a, b in st.profiled):
            return  # a ProfilerStep window covers it: that step is the profiler's
        if evidence == "anchor":
            self.anchored_steps += 1
        out.append(self._step(seg[0], number, start, end, evidence, pat.ops, seg))

    def _split_check(self, st: _Proc, seg: list[CommOp]) -> None:
        """A cycle learnt as several repeats of its signatures (the gaps chose: one all-reduce a step looks like
        two when a fault made every other gap long while it was learnt) whose repeats an iteration's end (an
        anchor) separates holds several iterations: `relearn_after` such steps in a row make it learnt again,
        with at most as many repeats per cycle as one iteration showed."""
        pat, anchors = st.pattern, st.anchors
        inside = 0
        for j in range(pat.sub, pat.ops, pat.sub):
            lo, hi = _end(seg[j - 1]), _issue(seg[j])
            k = bisect_left(anchors, lo)
            inside += k < len(anchors) and anchors[k] < hi
        st.split = st.split + 1 if inside else 0
        if st.split >= self.config.relearn_after:
            st.max_multiple = max(1, (pat.ops // pat.sub) // (inside + 1))
            st.split, st.lost = 0, True
            self.split_relearned += 1

    def _step(self, proc_op: CommOp, number: int, start: int, end: int, evidence: str, period: int,
              ops: list[CommOp]) -> Step:
        comms: dict = {}
        budget = self.config.max_collectives
        waits: dict = {}
        for o in ops:
            key = (o.comm_id, o.op) if o.op in P2P_SPLIT else o.comm_id  # sends apart from receives
            c = comms.get(key)
            if c is None:
                c = comms[key] = StepComm(o.comm_id, o.op, 0, 0, 0, 0, o.seq, [], 0)
            elif c.op != o.op:
                c.op = "mixed"
            c.calls += 1
            c.bytes += o.bytes
            if o.start_mono_ns and o.end_mono_ns:
                c.busy_ns += max(0, o.end_mono_ns - o.start_mono_ns)
            if o.timing == "gpu_kernel" and o.issue_mono_ns and o.start_mono_ns:
                c.wait_ns += max(0, o.start_mono_ns - o.issue_mono_ns)
                waits[key] = True
            if o.seq >= 0 and (c.seq_first < 0 or o.seq < c.seq_first):
                c.seq_first = o.seq
            if budget > 0:
                c.issue_offsets_ns.append(_issue(o) - start)
                budget -= 1
            else:
                c.offsets_dropped += 1
        for cid, c in comms.items():
            if not waits.get(cid):
                c.wait_ns = -1
        return Step(end, proc_op.pid, proc_op.start_ticks, proc_op.job_key, proc_op.rank, number, start, end,
                    evidence, period, len(ops), list(comms.values()))
