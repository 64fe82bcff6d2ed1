"""steplens iterations: every iteration of a serving engine or training loop, with its exact start and end and the
workload it carried, written into a shared-memory ring the agent reads, without a change to the job's code.

Loaded by steplens_bootstrap in every bootstrapped process, torch.distributed or not (vLLM's engine-core process
is a plain process); standard library only. `install()` puts an import hook first on sys.meta_path: when a
module that holds a configured function finishes executing, the function (a module attribute or a class
attribute, "module:Qual.name") is replaced by a thin wrapper; a module already imported at install is patched at
once. Patching the class, before any instance exists, matters: vLLM's EngineCore binds `self.step_fn =
self.step` in __init__, so a later patch would never be called. The hook costs one dict lookup per import.

Two roles:
- iteration anchors: the wrapper reads CLOCK_REALTIME ns (as the anchors ring) before and after the call and
  writes one slot: number, start, end, anchor index, phase and counts. Nested anchors on one thread: only the
  outermost writes (vLLM in-process: LLMEngine.step calls EngineCore.step). An anchor that raised is still an
  iteration (written, the exception goes on).
- feature readers: functions whose return value gives the workload of the enclosing iteration on the same thread
  (the first call in an iteration wins; one outside any iteration is ignored). A reader never raises into the job:
  its own errors are swallowed, counted in `status()`, and leave the counts 0.
Default set (STEPLENS_ITER_DEFAULTS=0 drops it), verified with vLLM 0.32.0 (CPU build, bench/inference/iterbench.py):
  anchors vllm.v1.engine.llm_engine:LLMEngine.step, vllm.v1.engine.core:EngineCore.step and
  EngineCore.step_with_batch_queue; reader vllm.v1.core.sched.scheduler:Scheduler.schedule (AsyncScheduler
  inherits it). Also listed, NOT verified here (not installed, never run under this hook): SGLang
  sglang.srt.managers.scheduler:Scheduler.run_batch, Megatron megatron.training.training:train_step, DeepSpeed
  deepspeed.runtime.engine:DeepSpeedEngine.step (no reader: batch_size etc. 0 unless the training rule below
  finds them). STEPLENS_ITER_ANCHORS="module:Qual.name,..." adds anchors, STEPLENS_ITER_READERS=
  "module:Qual.name=vllm_v1,..." readers (kinds: READERS), STEPLENS_ITERS=0 turns everything off.

vLLM V1 reader (SchedulerOutput -> counts): batch_size = requests scheduled (num_scheduled_tokens); a request is in
its context phase (prefill, chunks of a chunked prefill included) when it is new (scheduled_new_reqs), or cached
with no output token yet (vLLM's own CachedRequestData.is_context_phase), or cached and given more tokens than one
plus its speculative ones (a preempted request recomputing its prompt and output); prefill_requests /
prefill_tokens are those and their scheduled tokens; decode_requests the others; kv_tokens = their
num_computed_tokens + scheduled tokens (the context the new token attends to, itself included: prompt + output so
far); input_tokens = prompt lengths: len(prompt_token_ids) for a new request, num_computed_tokens + scheduled -
num_output_tokens for a cached one (exact for a decode without speculative tokens; for a prefill chunk that is
not the last, the prompt tokens computed so far: a lower bound); output_tokens = num_output_tokens summed (0 for
new ones); tokens = total_num_scheduled_tokens; phase prefill if only context requests, decode if only
generating ones, mixed otherwise, "" when no reader ran (an EngineCore.step with nothing to schedule returns
before schedule(): written with phase "" and zero counts). In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) an
iteration is LLMEngine.step with EngineCore.step nested in it. With the engine core in its own process (vLLM's
default; checked with record.py for 8 s: 870 EngineCore.step iterations with counts in the engine-core process's
ring), the front end's LLMEngine.step is only its wait for outputs: its own ring, phase "", no counts.

Training (phase "train"): a plain PyTorch loop has no step function to anchor. When torch.optim.optimizer is
imported, the hook registers one global optimizer-step post hook (torch >= 2.0, the same API steplens_anchors
uses; that module is installed only in torch.distributed processes and keeps its own hook: the two are
independent, ~0.3 us each). Each optimizer step ends an iteration that starts at the previous step's end (the
first step has no start: not written, it holds start-up and compilation anyway). Where steplens_anchors runs too
(torch.distributed jobs) and finds the zero_grad that closes the loop body after the step (its call-site rule),
the iteration ends at that zero_grad's end instead (`iteration_end_moved`; the iteration stays open until the
next step), as the job's own step logs do: on the gloo testbed the step's end alone was 1.5 % of a step early (the
zero_grad's memset of 8 MB of gradients). Finished training iterations are held and written HOLD_STEPS (8) at
a time, or at the first step after the oldest held one ended more than HOLD_NS (0.25 s) ago, and at exit or
when switched off: one ring write per 8 steps of ~30 ms, and a step of 0.25 s or more written at the next one
as before. The agent reads every second, so it sees them as soon as before give or take 0.25 s; a process that
ends by os._exit (a fork-started multiprocessing child, a crash) loses what it still held: up to 8 iterations,
where it lost the one still open before. A step that ends no iteration (the first, the first after a
pause) has its zero_grad too: the next iteration starts there (torch 2.13's first zero_grad took 8 ms). Its
counts come from the locals of the frames that called step() (torch's own frames skipped, MAX_FRAMES outward,
the first frame that has the name wins), named by
STEPLENS_STEP_FEATURES="tokens=input_ids,batch_size=batch.input_ids,..." (fields of Iteration; `name.key` is a
mapping key or an attribute of a local): a tensor gives numel() (for batch_size, its
first dimension), an int its value, a list or tuple its length. Inside an active iteration anchor (DeepSpeed's
step calls the optimizer's) the hook only gives that iteration phase "train" and these counts. Cost: f_locals
of up to MAX_FRAMES frames at the first step, only when STEPLENS_STEP_FEATURES is set; once one frame held them
all, its depth and code object are kept and later steps read that frame alone (_train_counts): on CPython
3.11-3.13 straight from its local slots (fast_plan, below: no f_locals dict), elsewhere through its f_locals.
The hook's CPU per step on the DP2 gloo testbed (bench/sentinel_cost.py, bench/README.md; 2-core VM, the
runs of 2026-12-06, 7 / 8 / 4 of them): 67-108 us with f_locals and a write per step, 35-50 us with the slots
read directly, 26-33 us with the writes held.

Layout of <runtime dir>/<pid>.iters (little-endian; HEADER_BYTES + slots x SLOT_BYTES, 1 MiB by default):
  0   8s   magic b"SLITERS1"
  8   u32  version (1)          12  u32  slots
  16  u64  start time of the process (clock ticks since boot, /proc/self/stat field 22: a recycled pid's
           stale file is told apart)
  24  u32  clock (1: CLOCK_REALTIME)  28  u32  slot bytes (128)
  32  u64  count: iterations written so far
  40  u32  bytes of the anchor-name table   44..63 reserved
  64  the anchor-name table, "module:Qual.name" joined by "\\n" (UTF-8; a slot's anchor index is a line number),
      up to 4032 bytes; written once at creation (every anchor is configured before the first iteration)
  4096 slots; slot k holds iteration number n with n % slots == k: u64 n + 1 (0 while being rewritten), u64 start
      ns, u64 end ns, u32 anchor index, u32 phase (PHASES index), u64 x 9 counts (COUNT_FIELDS), 24 bytes zero.
Writer order per iteration, reading rule and torn-slot rule as steplens_anchors': the slot's number to 0 and the
body (one struct.pack_into, which stores field after field in order), the number, then count; a reader keeps a
slot only if its number is the one expected and drops those the writer may have reached again while it read
(number <= count re-read after - slots). A reader refuses another
magic, version, clock or slot size with a message that says which; bump VERSION when the layout changes.
The ring is created at the first iteration (a process that never runs one has no file), after a fork in the child
anew (os.register_at_fork: a forked engine-core process never writes into its parent's mapping). At exit the file
is kept (touched: its mtime is the exit) so the agent reads the last iterations; the agent deletes it once the
process is gone and read, and steplens_bootstrap's exit clean-up removes those of processes gone for an hour.
Bounded: 8192 slots last 41 s at 200 iterations/s (vLLM decode steps of a small model; a real GPU engine runs
20-100 per second); the agent reads every second, a lap it missed is counted as lost.

Cost: two clock reads, a thread-local and a 128-byte slot write (a lock, three struct.pack_into), no system call;
nested anchors a thread-local and a counter; the vLLM reader one pass over the scheduled requests. Hot (a tight
loop, tests/test_iters.py::test_wrapper_cost_in_place): 1.3 us per iteration for the outer anchor, 2.9 us with a
nested anchor and the reader on 2 requests; the reader alone on vLLM's own SchedulerOutput of 24 requests 3.3 us.
In place, in vLLM 0.32.0 CPU (bench/inference/iterbench.py, tiny Llama, decode batches of 1-8 requests, ~3 ms
each, 2-core VM shared with other work, python 3.11, three runs of 30-35 s, ~6,000 batches each): the slot write
after a 3 ms step costs ~9.5 us (cold caches: the same write again right after costs 1.4 us). A serving anchor's
end is therefore read once the slot's body is stored (Ring.add's clock), before its number and the count: the
write's cost lies inside the iteration, as the caller's own timing of the call sees it, not after its end. The
driver's timing of engine.step was 13.8-20.1 us longer than the iteration with the end read before the write
(0.29-0.30 % of 4.5-6.9 ms batches) and 5.8-5.9 us with it after the body (0.094-0.099 % of 5.8-6.2 ms batches;
2026-12-06, four 30 s runs alternating); the start is 0.04 % after the driver's clock read. Decode steps of equal
batch size with vs without (STEPLENS_ITERS=0): +0.32 % and -0.53 % (two pairs of 35 s runs), +5.7 % (a pair of
15 s runs): run-to-run noise on this shared VM, larger than the ~0.4 % the in-place figures add up to; not
resolved here. A GPU engine's 20-100 ms steps make the same ~15 us 0.015-0.07 %.
"""

from __future__ import annotations

import functools
import os
import struct
import sys
import threading
import time

MAGIC = b"SLITERS1"
VERSION = 1
CLOCK_REALTIME = 1
HEADER_BYTES = 4096
NAMES_AT = 64
SLOT_BYTES = 128
DEFAULT_SLOTS = 8192
SUFFIX = ".iters"
COUNT_AT = 32
PHASES = ("", "prefill", "decode", "mixed", "train")
TRAIN_PHASE = PHASES.index("train")
COUNT_FIELDS = ("batch_size", "prefill_requests", "prefill_tokens", "decode_requests", "kv_tokens", "input_tokens",
                "output_tokens", "tokens", "micro_batches")
_HEAD = struct.Struct("<8sIIQII")    # magic, version, slots, start ticks, clock, slot bytes
_SLOT = struct.Struct("<QQQII9Q")    # number + 1 (0: being written), start ns, end ns, anchor index, phase, counts
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
TRAIN_ANCHOR = "torch.optim.optimizer:Optimizer.step"
MAX_FRAMES = 8
CO_OPTIMIZED = 0x1   # inspect.CO_OPTIMIZED: a function's frame (not a module's or a class body's)

DEFAULT_ANCHORS = (
    "vllm.v1.engine.llm_engine:LLMEngine.step",                 # verified, vLLM 0.32.0
    "vllm.v1.engine.core:EngineCore.step",                      # verified, vLLM 0.32.0
    "vllm.v1.engine.core:EngineCore.step_with_batch_queue",     # vLLM 0.32.0 has it; not exercised (no batch queue)
    "sglang.srt.managers.scheduler:Scheduler.run_batch",        # UNVERIFIED: SGLang not installed here
    "megatron.training.training:train_step",                    # UNVERIFIED: Megatron not installed here
    "deepspeed.runtime.engine:DeepSpeedEngine.step",            # UNVERIFIED: DeepSpeed not installed here
)
DEFAULT_READERS = (("vllm.v1.core.sched.scheduler:Scheduler.schedule", "vllm_v1"),)  # verified, vLLM 0.32.0


def path_for(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{pid}{SUFFIX}")


class Ring:
    """The writer side: a fixed-size mapped file, one slot per iteration (see the module docstring)."""

    def __init__(self, path: str, start_ticks: int, names: list[str], slots: int = DEFAULT_SLOTS) -> None:
        import mmap
        table = "\n".join(names).encode()
        if len(table) > HEADER_BYTES - NAMES_AT:
            raise ValueError(f"anchor names take {len(table)} bytes, the table holds {HEADER_BYTES - NAMES_AT}")
        self.path, self.slots, self.count, self.pid = path, slots, 0, os.getpid()
        self.lock = threading.Lock()
        size = HEADER_BYTES + slots * SLOT_BYTES
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _HEAD.pack_into(self.map, 0, MAGIC, VERSION, slots, start_ticks, CLOCK_REALTIME, SLOT_BYTES)
        _U32.pack_into(self.map, 40, len(table))
        self.map[NAMES_AT:NAMES_AT + len(table)] = table
        os.replace(tmp, path)  # a reader never sees a file without its header

    def add(self, start_ns: int, end_ns: int, anchor: int, phase: int, counts, clock=None,
            pack_slot=_SLOT.pack_into, pack_u64=_U64.pack_into) -> None:
        """clock: the end is read from it once the body is stored (end_ns unused): the write's cold cost then lies
        inside the iteration, as its caller's own timing sees it, not after its end (see Cost)."""
        # the slot with number 0 and its body in one store, then its number, then count (the module docstring's
        # order); as few steps as can be: it runs right after a long step, with cold caches (see Cost)
        lock = self.lock
        lock.acquire()
        try:
            n = self.count
            off = HEADER_BYTES + (n % self.slots) * SLOT_BYTES
            mm = self.map
            pack_slot(mm, off, 0, start_ns, end_ns, anchor, phase, *counts)
            if clock is not None:
                pack_u64(mm, off + 16, clock())
            pack_u64(mm, off, n + 1)
            self.count = n + 1
            pack_u64(mm, COUNT_AT, n + 1)
        finally:
            lock.release()

    def add_many(self, items, anchor: int, phase: int, pack_slot=_SLOT.pack_into, pack_u64=_U64.pack_into) -> None:
        """add() for each (start ns, end ns, counts) of items, under one lock, count moved once after them all
        (add() stays its own copy of the loop's body: it is the serving anchors' write per batch, called cold)."""
        with self.lock:
            n, mm, slots = self.count, self.map, self.slots
            for start_ns, end_ns, counts in items:
                off = HEADER_BYTES + (n % slots) * SLOT_BYTES
                pack_slot(mm, off, 0, start_ns, end_ns, anchor, phase, *counts)
                pack_u64(mm, off, n + 1)
                n += 1
            self.count = n
            pack_u64(mm, COUNT_AT, n)

    def close(self) -> None:
        try:
            self.map.close()
        except (ValueError, BufferError):
            pass


# -- reading workloads --------------------------------------------------------------------------------------------

NO_COUNTS = (0,) * len(COUNT_FIELDS)


def vllm_v1_counts(out) -> tuple[int, tuple]:
    """(phase index, counts) of a vLLM V1 SchedulerOutput (the rule in the module docstring). Raises on an object
    of another shape; the caller catches."""
    sched = out.num_scheduled_tokens
    spec = out.scheduled_spec_decode_tokens or {}
    pre_n = pre_tok = dec_n = kv = inp = outp = 0
    for r in out.scheduled_new_reqs:
        pre_n += 1
        pre_tok += sched.get(r.req_id, 0)
        ids = r.prompt_token_ids
        inp += len(ids) if ids is not None else r.num_computed_tokens + sched.get(r.req_id, 0)
    cached = out.scheduled_cached_reqs
    for rid, comp, gen in zip(cached.req_ids, cached.num_computed_tokens, cached.num_output_tokens):
        n = sched.get(rid, 0)
        inp += comp + n - gen
        outp += gen
        if gen == 0 or n > 1 + len(spec.get(rid, ())):
            pre_n += 1
            pre_tok += n
        else:
            dec_n += 1
            kv += comp + n
    phase = 1 if pre_n and not dec_n else 2 if dec_n and not pre_n else 3 if pre_n else 0
    return phase, (len(sched), pre_n, pre_tok, dec_n, kv, inp, outp, out.total_num_scheduled_tokens, 0)


READERS = {"vllm_v1": vllm_v1_counts}


# -- the wrappers ------------------------------------------------------------------------------------------------

_state = {"dir": "", "start_ticks": None, "slots": DEFAULT_SLOTS, "names": [], "patched": [], "pending": {},
          "errors": [], "reader_errors": 0, "write_errors": 0, "path": "", "installed": False}
_ring: Ring | None = None
_ring_lock = threading.Lock()
_tls = threading.local()   # .it: [depth, phase, counts] of this thread's active iteration, or absent/None


def _ring_now() -> Ring | None:
    """The process's ring, created at the first iteration (None when it cannot be: recorded once, not retried)."""
    global _ring
    ring = _ring
    if ring is not None or _state["path"] is None:
        return ring
    with _ring_lock:
        if _ring is None and _state["path"] is not None:
            try:
                _ring = Ring(path_for(_state["dir"], os.getpid()), _state["start_ticks"](), _state["names"],
                             _state["slots"])
                _state["path"] = _ring.path
            except Exception as exc:
                _state["path"] = None
                _state["errors"].append(f"ring: {type(exc).__name__}: {exc}")
        return _ring


def _write(start_ns: int, clock, index: int, it: list) -> None:
    """A serving anchor's iteration, ending now (Ring.add's clock)."""
    try:
        ring = _ring
        if ring is None:
            ring = _ring_now()
            if ring is None:
                return
        ring.add(start_ns, 0, index, it[1], it[2], clock)
    except Exception:
        _state["write_errors"] += 1


_on = [True]   # set_enabled(): the wrappers and the optimizer hook pass straight through while False
_anchored = [False]   # an anchor's iteration has begun in this process: the optimizer hook looks at _tls from then on
# STEPLENS_ITERS_SELFTIME=1 (benches): the wrappers' and the hook's own time, wall (ns) and the thread's CPU
# (cpu_ns: what they took from the job; wall also holds any time the thread was preempted inside them, which a
# loaded host adds whether they run or not), and each call's wall time (`each`, the first 200,000) for its median
_self = {"ns": 0, "cpu_ns": 0, "calls": 0, "each": []}
SELF_EACH_MAX = 200_000


def _self_add(wall: int, cpu: int) -> None:
    _self["ns"] += wall
    _self["cpu_ns"] += cpu
    _self["calls"] += 1
    if len(_self["each"]) < SELF_EACH_MAX:
        _self["each"].append(wall)


def _selftimed(make):
    """A wrapper factory whose wrappers also add their own time (theirs minus the wrapped call's, the timers'
    own clock reads included) to _self: what bench/sentinel_cost.py reports per iteration."""
    perf, cpu = time.perf_counter_ns, time.thread_time_ns

    def factory(fn, **kw):
        inner = [0, 0]

        def timed_fn(*args, **kwargs):
            t, c = perf(), cpu()
            try:
                return fn(*args, **kwargs)
            finally:
                inner[1] += cpu() - c
                inner[0] += perf() - t
        wrapped = make(timed_fn, **kw)

        @functools.wraps(fn)
        def outer(*args, **kwargs):
            before, before_cpu, t0, c0 = inner[0], inner[1], perf(), cpu()
            try:
                return wrapped(*args, **kwargs)
            finally:
                if _on[0]:
                    c1 = cpu()
                    _self_add(perf() - t0 - (inner[0] - before), c1 - c0 - (inner[1] - before_cpu))
        outer.__steplens_orig__ = fn
        return outer
    return factory


def _selftimed_hook(hook):
    perf, cpu = time.perf_counter_ns, time.thread_time_ns

    def timed(*args, **kwargs):
        t0, c0 = perf(), cpu()
        try:
            return hook(*args, **kwargs)
        finally:
            if _on[0]:
                c1 = cpu()
                _self_add(perf() - t0, c1 - c0)
    return timed


def set_enabled(on: bool) -> None:
    """Turn the anchors, readers and the training hook off and on in this process, at run time: the switch
    bench/sentinel_cost.py flips to time the same job with and without them, side by side in one run (a check
    of one list item per call while on). Off, nothing is written; the first training step after it starts no
    iteration (its start would lie before the pause)."""
    _on[0] = bool(on)
    if not on:
        _flush_train()
        _train["last_end"] = 0


def _anchor_wrapper(fn, index: int, clock=time.time_ns):
    @functools.wraps(fn)
    def steplens_iteration(*args, **kwargs):
        if not _on[0]:
            return fn(*args, **kwargs)
        it = getattr(_tls, "it", None)
        if it is not None:  # nested: the outermost anchor writes
            it[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                it[0] -= 1
        _anchored[0] = True
        it = _tls.it = [1, 0, NO_COUNTS]
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            _tls.it = None
            _write(start, clock, index, it)   # the end: read once the slot's body is stored (Ring.add)

    steplens_iteration.__steplens_orig__ = fn
    return steplens_iteration


def _reader_wrapper(fn, read):
    @functools.wraps(fn)
    def steplens_features(*args, **kwargs):
        out = fn(*args, **kwargs)
        if not _on[0]:
            return out
        it = getattr(_tls, "it", None)
        if it is not None and it[1] == 0 and it[2] is NO_COUNTS:
            try:
                it[1], it[2] = read(out)
            except Exception:
                _state["reader_errors"] += 1
        return out

    steplens_features.__steplens_orig__ = fn
    return steplens_features


# -- training: the optimizer step -------------------------------------------------------------------------------

_train = {"last_end": 0, "features": (), "skip": "", "index": -1, "pending": None, "where": None, "held": []}
HOLD_STEPS = 8               # finished training iterations are written to the ring this many at a time, or
HOLD_NS = 250_000_000        # once the oldest held one ended this long ago (the hook's Cost, module docstring)


def parse_step_features(spec: str) -> tuple[tuple[int, str, str], ...]:
    """"tokens=input_ids,batch_size=batch.input_ids" -> ((COUNT_FIELDS index, local name, key or ""), ...);
    unknown fields raise ValueError."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        field, eq, ref = part.partition("=")
        if not eq or field.strip() not in COUNT_FIELDS or not ref.strip():
            raise ValueError(f"STEPLENS_STEP_FEATURES: {part!r} is not FIELD=local[.key] with FIELD one of "
                             f"{', '.join(COUNT_FIELDS)}")
        name, _, key = ref.strip().partition(".")
        out.append((COUNT_FIELDS.index(field.strip()), name, key))
    return tuple(out)


def _count_of(value, first_dim: bool) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)):
        return len(value)
    if first_dim:
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape):
            return int(shape[0])
    numel = getattr(value, "numel", None)
    return int(numel()) if callable(numel) else 0


def _keyed(value, key: str):
    """`name.key` of STEPLENS_STEP_FEATURES: a mapping's key, else an attribute (None when neither)."""
    getter = getattr(value, "get", None)
    return getter(key) if callable(getter) else getattr(value, key, None)


def _counts_in(local, todo: list, counts: list) -> None:
    """Fill counts from one frame's locals (a dict, or 3.13's frame proxy) for the items of todo it holds; those
    are removed from todo."""
    for item in [t for t in todo if t[1] in local]:
        i, name, key = item
        value = local[name]
        if key:
            value = _keyed(value, key)
        counts[i] = _count_of(value, COUNT_FIELDS[i] == "batch_size")
        todo.remove(item)


def find_step_counts(frame, features, skip_prefix: str = "") -> tuple[tuple, int, object]:
    """(counts, depth, code): COUNT_FIELDS values read from the locals of `frame` and up to MAX_FRAMES frames
    outward (frames whose file starts with skip_prefix skipped at the inner end), per parse_step_features()'s
    spec; with the depth (frames outward of `frame`) and the code object of the one frame that held them all,
    or (-1, None) when they were spread over several or some were not found."""
    depth = 0
    while skip_prefix and frame is not None and frame.f_code.co_filename.startswith(skip_prefix):
        frame, depth = frame.f_back, depth + 1
    counts = [0] * len(COUNT_FIELDS)
    todo = list(features)
    holders = []
    for _ in range(MAX_FRAMES):
        if frame is None or not todo:
            break
        code = frame.f_code
        names = code.co_varnames + code.co_cellvars + code.co_freevars
        # a function's f_locals builds a dict: only where a name is one of its variables; a module's is its globals
        if not code.co_flags & CO_OPTIMIZED or any(name in names for _, name, _ in todo):
            left = len(todo)
            _counts_in(frame.f_locals, todo, counts)
            if len(todo) < left:
                holders.append((depth, code))
        frame, depth = frame.f_back, depth + 1
    one = holders[0] if len(holders) == 1 and not todo else (-1, None)
    return tuple(counts), one[0], one[1]


# -- reading a frame's locals directly (CPython 3.11-3.13) --------------------------------------------------------
# frame.f_locals on 3.11 and 3.12 builds a dict of every local of the frame (the testbed's loop frame: ~50 us of
# the hook's ~95 us per step, cold after a step). A live frame's locals are an array of object pointers in its
# interpreter frame (PyFrameObject.f_frame, the 4th word, points to it; its slots start FAST_OFFSET bytes in on
# 3.11, 3.12 and 3.13, 64-bit); a function's plain local k (co_varnames[k], not a cell) is slot k. The offset is
# used only once checked on a live probe frame of this very interpreter (two known objects in slots 0 and 1), and a
# remembered frame's plan only once its slots agree with its f_locals; any other version or build (debug,
# free-threaded, 32-bit) reads f_locals. A step then reads the frame object's 4th word and the feature slots
# through memoryviews made once per frame and plan (no frame is held: a frame is matched by its address, its
# interpreter frame's address, its code and the plan, and read only while it is live on this thread's stack), and
# turns each slot's address into its object with _ctypes.PyObj_FromPtr (a new reference; a NULL slot, an unbound
# local, is refused before it).
FAST_OFFSET = 72
_fast = {"offset": None, "checked": False, "view": None}


def fast_locals_offset():
    """The byte offset of a live frame's local slots from its interpreter frame, checked on this interpreter, or
    None where the direct read is not to be used (see above). Probed once."""
    if _fast["checked"]:
        return _fast["offset"]
    _fast["checked"] = True
    try:
        import sysconfig
        if (sys.implementation.name != "cpython" or not (3, 11) <= sys.version_info[:2] <= (3, 13)
                or hasattr(sys, "gettotalrefcount") or sysconfig.get_config_var("Py_GIL_DISABLED")
                or sys.maxsize <= 2 ** 32):
            return None
        import ctypes
        from _ctypes import PyObj_FromPtr
        words = ctypes.c_uint64 * 4
        a, b = object(), object()
        if _probe_live(a, b, words) == (id(a), id(b)):
            _fast.update(offset=FAST_OFFSET, words=words, array=ctypes.c_uint64.__mul__, from_ptr=PyObj_FromPtr)
    except Exception:
        pass
    return _fast["offset"]


def _probe_live(x, y, words):
    frame = sys._getframe()   # no comprehension or closure in here: x and y must stay plain locals (not cells)
    base = words.from_address(id(frame))[3]
    slots = words.from_address(base + FAST_OFFSET)
    return slots[0], slots[1]


def fast_plan(frame, features):
    """((count index, slot, key, first dim), ...) to read `features` straight from `frame`'s slots, or None
    (no checked offset, a feature not a plain local of its code, or the slots disagree with f_locals)."""
    if fast_locals_offset() is None:
        return None
    code = frame.f_code
    if not code.co_flags & CO_OPTIMIZED:
        return None
    plan = []
    for i, name, key in features:
        if name not in code.co_varnames or name in code.co_cellvars:
            return None
        plan.append((i, code.co_varnames.index(name), key, COUNT_FIELDS[i] == "batch_size"))
    plan = tuple(plan)
    local = frame.f_locals
    try:
        view = _fast_view(frame, plan)
        values = [_fast["from_ptr"](view[3][slot]) if view[3][slot] else None for _, slot, _, _ in plan]
    except Exception:
        return None
    if any(name not in local or local[name] is not v for (_, name, _), v in zip(features, values)):
        return None
    return plan


def _fast_view(frame, plan) -> tuple:
    """(frame address, interpreter frame address, the frame object's first 4 words, its slots up to plan's last,
    plan), the words as memoryviews of unsigned 64-bit integers (an index is a plain load), for a live frame: made
    when the frame or the plan is not the one of the last view."""
    words = memoryview(_fast["words"].from_address(id(frame))).cast("B").cast("Q")
    base = words[3]
    slots = _fast["array"](max(slot for _, slot, _, _ in plan) + 1).from_address(base + _fast["offset"])
    view = (id(frame), base, words, memoryview(slots).cast("B").cast("Q"), plan)
    _fast["view"] = view
    return view


def _fast_counts(frame, plan) -> tuple:
    """The counts of plan read from the live `frame`'s slots; ValueError when a feature's slot is NULL (unbound
    now). As few steps as can be: it runs right after a step, with cold caches (Cost in the module docstring)."""
    view = _fast["view"]
    if view is None or view[4] is not plan or view[0] != id(frame) or view[2][3] != view[1]:
        view = _fast_view(frame, plan)
    slots, from_ptr = view[3], _fast["from_ptr"]
    counts = [0] * len(COUNT_FIELDS)
    for i, slot, key, first in plan:
        address = slots[slot]
        if not address:
            raise ValueError("unbound local")
        value = from_ptr(address)
        if key:
            value = _keyed(value, key)
        counts[i] = value if type(value) is int else _count_of(value, first)
    return tuple(counts)


def _train_counts(features) -> tuple:
    """The step's counts for the optimizer hook (called from it: depth 2 is its caller). Once the frame that
    holds every feature is known (its depth and code object), a step goes straight to it (sys._getframe: no walk,
    no name checks) and falls back to the walk when the frame at that depth runs other code or lacks a feature.
    On the gloo testbed (bench/sentinel_cost.py) the hook's CPU time per step went from 127-151 to 93-103 us
    (the module docstring has the later figures)."""
    where = _train["where"]
    if where is not None:
        try:
            frame = sys._getframe(where[0] + 2)
        except ValueError:
            frame = None
        if frame is not None and frame.f_code is where[1]:
            if where[2] is not None:
                try:
                    return _fast_counts(frame, where[2])
                except ValueError:   # a feature unbound now (a NULL slot): the walk says what is there
                    pass
            counts = [0] * len(COUNT_FIELDS)
            todo = list(features)
            _counts_in(frame.f_locals, todo, counts)
            if not todo:
                return tuple(counts)
    counts, depth, code = find_step_counts(sys._getframe(2), features, _train["skip"])
    _train["where"] = None
    if code is not None:
        try:
            plan = fast_plan(sys._getframe(depth + 2), features)
        except Exception:
            plan = None
        _train["where"] = (depth, code, plan)
    return counts


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    """Global optimizer-step post hook: one "train" iteration per step, from the previous step's end (module
    docstring, Training); inside an active anchor, that anchor's features only. Never raises. It runs right
    after the step, with the caches the step evicted, where every object and function touched costs several
    times its hot time (bench/README.md, sentinel_cost.py): hence the thread-local looked at only once an anchor
    has run, and finished iterations held and written HOLD_STEPS at a time (module docstring, Training)."""
    if not _on[0]:
        return
    try:
        end = time.time_ns()
        train = _train
        counts = NO_COUNTS
        if train["features"]:
            try:
                counts = _train_counts(train["features"])
            except Exception:
                _state["reader_errors"] += 1
        if _anchored[0]:
            it = getattr(_tls, "it", None)
            if it is not None:
                if it[1] == 0:
                    it[1], it[2] = TRAIN_PHASE, counts
                return
        pend = train["pending"]
        if pend is not None:
            train["pending"] = None
            held = train["held"]
            held.append(pend)
            if len(held) >= HOLD_STEPS or end - held[0][1] > HOLD_NS:
                _write_held()
        last, train["last_end"] = train["last_end"], end
        if last:   # held until the iteration's end is known: this step's, or the zero_grad's that follows it
            train["pending"] = (last, end, counts)
    except Exception:
        _state["write_errors"] += 1


def _write_held() -> None:
    """Write the held training iterations (oldest first) in one go; never raises (a failure is counted)."""
    held, _train["held"] = _train["held"], []
    if not held:
        return
    try:
        ring = _ring
        if ring is None:
            ring = _ring_now()
        if ring is not None:
            ring.add_many(held, _train["index"], TRAIN_PHASE)
    except Exception:
        _state["write_errors"] += 1


def _flush_train() -> None:
    """Write the training iterations not yet written, the one still open to a zero_grad included (when the
    iterations are switched off, at exit)."""
    pend, _train["pending"] = _train["pending"], None
    if pend is not None:
        _train["held"].append(pend)
    _write_held()


def iteration_end_moved(end_ns: int) -> None:
    """steplens_anchors found the zero_grad that ends the last optimizer step's iteration (its call-site rule):
    that iteration, and the next one's start, end there instead (the job's own step logs end after the
    zero_grad: 1-2 ms of a gloo testbed step, 1.5 % when the step ended at the optimizer). Never raises."""
    try:
        pend = _train["pending"]
        if not _on[0]:
            return
        if pend is not None and end_ns > pend[1]:
            _train["pending"] = (pend[0], end_ns, pend[2])   # held from the next step: its slot write (~10 us
            _train["last_end"] = end_ns                      # cold) then lies inside the next iteration, not
                                                             # between this end and the job's own clock read
        elif pend is None and 0 < _train["last_end"] < end_ns:   # a step that ended no iteration: the next
            _train["last_end"] = end_ns                           # one starts at its zero_grad all the same
    except Exception:
        _state["write_errors"] += 1


def _hook_optimizer(module) -> None:
    """torch.optim.optimizer was imported: register the global step post hook (torch >= 2.0)."""
    _train["skip"] = os.path.dirname(os.path.dirname(os.path.abspath(module.__file__))) + os.sep
    module.register_optimizer_step_post_hook(
        _selftimed_hook(_on_optimizer_step) if _state.get("selftime") else _on_optimizer_step)
    _state["patched"].append(TRAIN_ANCHOR)


# -- the import hook ---------------------------------------------------------------------------------------------

def _patch(module, attrs) -> None:
    """Replace each (qualname, make_wrapper) of the freshly executed `module`; a missing attribute is recorded,
    never raised."""
    for qual, make in attrs:
        try:
            if make is None:
                _hook_optimizer(module)
                continue
            *outer, leaf = qual.split(".")
            owner = module
            for part in outer:
                owner = getattr(owner, part)
            raw = owner.__dict__.get(leaf) if isinstance(owner, type) else None
            orig = raw if raw is not None else getattr(owner, leaf)
            if isinstance(orig, (staticmethod, classmethod)):
                wrapped = type(orig)(make(orig.__func__))
            elif callable(orig):
                if hasattr(orig, "__steplens_orig__"):
                    continue
                wrapped = make(orig)
            else:
                raise TypeError(f"{type(orig).__name__} is not callable")
            setattr(owner, leaf, wrapped)
            _state["patched"].append(f"{module.__name__}:{qual}")
        except Exception as exc:
            _state["errors"].append(f"{module.__name__}:{qual}: {type(exc).__name__}: {exc}")


class _Loader:
    """The module's own loader, with the patch after it executes the module."""

    def __init__(self, loader, attrs) -> None:
        self._loader, self._attrs = loader, attrs

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        try:  # the module shows its own loader, as without the hook
            module.__loader__ = self._loader
            module.__spec__.loader = self._loader
        except Exception:
            pass
        self._loader.exec_module(module)
        _patch(module, self._attrs)

    def __getattr__(self, name):
        if name in ("_loader", "_attrs"):  # before __init__ (copy, pickle)
            raise AttributeError(name)
        return getattr(self._loader, name)


class Finder:
    """First on sys.meta_path: for a module with functions to patch, the spec the other finders give, its loader
    wrapped; for any other module None at the cost of one dict lookup."""

    def find_spec(self, fullname, path=None, target=None):
        attrs = _state["pending"].get(fullname)
        if attrs is None:
            return None
        del _state["pending"][fullname]  # once: also keeps the search below from finding this finder again
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            try:
                spec = finder.find_spec(fullname, path, target)
            except Exception:
                continue
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, attrs)
                return spec
        return None


def _targets(env) -> tuple[list[str], dict[str, list]]:
    """(anchor names in index order, {module: [(qualname, make_wrapper)]}) from the defaults and the variables."""
    anchors = [] if env.get("STEPLENS_ITER_DEFAULTS", "1") == "0" else list(DEFAULT_ANCHORS)
    anchors += [a.strip() for a in env.get("STEPLENS_ITER_ANCHORS", "").split(",") if a.strip()]
    readers = [] if env.get("STEPLENS_ITER_DEFAULTS", "1") == "0" else list(DEFAULT_READERS)
    for item in filter(None, (x.strip() for x in env.get("STEPLENS_ITER_READERS", "").split(","))):
        name, _, kind = item.partition("=")
        if kind not in READERS:
            raise ValueError(f"STEPLENS_ITER_READERS: {item!r}: reader kind must be one of {', '.join(READERS)}")
        readers.append((name, kind))
    names: list[str] = []
    by_module: dict[str, list] = {}
    for name in anchors:
        mod, colon, qual = name.partition(":")
        if not colon or not mod or not qual:
            raise ValueError(f"STEPLENS_ITER_ANCHORS: {name!r} is not module:Qual.name")
        if name in names:
            continue
        names.append(name)
        make = _selftimed(_anchor_wrapper) if env.get("STEPLENS_ITERS_SELFTIME") == "1" else _anchor_wrapper
        by_module.setdefault(mod, []).append((qual, functools.partial(make, index=len(names) - 1)))
    for name, kind in readers:
        mod, colon, qual = name.partition(":")
        if not colon or not mod or not qual:
            raise ValueError(f"STEPLENS_ITER_READERS: {name!r} is not module:Qual.name")
        make = _selftimed(_reader_wrapper) if env.get("STEPLENS_ITERS_SELFTIME") == "1" else _reader_wrapper
        by_module.setdefault(mod, []).append((qual, functools.partial(make, read=READERS[kind])))
    if env.get("STEPLENS_ITER_TRAIN", "1") != "0":
        names.append(TRAIN_ANCHOR)
        _train["index"] = len(names) - 1
        _train["features"] = parse_step_features(env.get("STEPLENS_STEP_FEATURES", ""))
        by_module.setdefault(TRAIN_ANCHOR.partition(":")[0], []).append(("", None))
    return names, by_module


def _forked() -> None:
    """In a forked child: its own ring at its first iteration, no iteration of the parent's thread in flight."""
    global _ring, _tls
    ring, _ring, _tls = _ring, None, threading.local()
    _train["last_end"] = 0
    _train["pending"] = None
    _train["held"] = []
    _train["where"] = None
    _state["path"] = ""
    if ring is not None:
        ring.close()  # the child's mapping only


def _at_exit() -> None:
    """Keep the file for the agent's last read: its mtime says when the process ended (module docstring)."""
    _flush_train()
    ring = _ring
    if ring is not None and ring.pid == os.getpid():
        try:
            os.utime(ring.path)
        except OSError:
            pass


def install(directory: str, start_ticks, env=None, slots: int = DEFAULT_SLOTS) -> list[str]:
    """Put the import hook in place and patch what is already imported (start_ticks: a function, called when the
    ring is created); the anchor names. Raises on a bad variable, the caller catches."""
    env = os.environ if env is None else env
    if _state["installed"]:
        return _state["names"]
    names, by_module = _targets(env)
    _state.update(dir=directory, start_ticks=start_ticks, slots=int(env.get("STEPLENS_ITER_SLOTS") or slots),
                  names=names, installed=True, selftime=env.get("STEPLENS_ITERS_SELFTIME") == "1")
    for mod, attrs in by_module.items():
        module = sys.modules.get(mod)
        spec = getattr(module, "__spec__", None)
        if module is not None and not getattr(spec, "_initializing", False):
            _patch(module, attrs)
        else:
            _state["pending"][mod] = attrs
    sys.meta_path.insert(0, Finder())
    os.register_at_fork(after_in_child=_forked)
    import atexit
    atexit.register(_at_exit)
    return names


def status() -> dict:
    """For tests and tools: what is patched, what is waiting for its module, errors and counters."""
    return {"patched": list(_state["patched"]), "pending": sorted(_state["pending"]), "errors": list(_state["errors"]),
            "reader_errors": _state["reader_errors"], "write_errors": _state["write_errors"],
            "path": _state["path"] or "", "names": list(_state["names"]),
            "self_ns": _self["ns"], "self_cpu_ns": _self["cpu_ns"], "self_calls": _self["calls"],
            "self_median_ns": sorted(_self["each"])[len(_self["each"]) // 2] if _self["each"] else 0}


def read(path: str, start_ticks: int = -1, after: int = -1) -> tuple[list[tuple], list[str], str]:
    """Reader side, for tests and tools (the agent's iters source has its own, tested against this):
    ([(number, start ns, end ns, anchor index, phase index, counts)] newer than `after`, oldest first; anchor
    names; "" or why none could be read)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
            again = os.pread(fh.fileno(), 8, COUNT_AT)
    except OSError as exc:
        return [], [], f"{exc.strerror or exc}"
    if len(data) < HEADER_BYTES or len(again) < 8:
        return [], [], "short file"
    magic, version, slots, ticks, clock, slot_bytes = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        return [], [], "not an iterations ring (magic)"
    if version != VERSION or clock != CLOCK_REALTIME or slot_bytes != SLOT_BYTES:
        return [], [], f"iterations ring version {version} clock {clock} slot {slot_bytes}: this reader knows " \
                       f"version {VERSION} clock 1 slot {SLOT_BYTES} only"
    if len(data) < HEADER_BYTES + slots * SLOT_BYTES:
        return [], [], f"short file for {slots} slots"
    if start_ticks >= 0 and ticks != start_ticks:
        return [], [], "another process's ring (pid reused)"
    size = _U32.unpack_from(data, 40)[0]
    names = data[NAMES_AT:NAMES_AT + size].decode(errors="replace").split("\n") if size else []
    count = _U64.unpack_from(data, COUNT_AT)[0]
    out = []
    for n in range(max(after + 1, _U64.unpack(again)[0] - slots + 1, 0), count):
        off = HEADER_BYTES + (n % slots) * SLOT_BYTES
        v = _SLOT.unpack_from(data, off)
        if v[0] == n + 1:
            out.append((n, v[1], v[2], v[3], v[4], v[5:]))
    return out, names, ""
