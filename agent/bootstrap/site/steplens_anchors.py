"""steplens anchors: where each iteration of the job ends, in a shared-memory ring the agent reads: the end of
each optimizer step, and of the zero_grad that closes the loop body after it.

Loaded by steplens_bootstrap inside the job (standard library only). Why: Flight Recorder gives a gloo
collective's enqueue time only and nothing marks what follows the last collective of an iteration (the
optimizer step, zero_grad), so a step cut from the comm ops alone ends an all-reduce plus an optimizer step
early. `install()` registers a global torch.optim optimizer-step post hook
(`torch.optim.optimizer.register_optimizer_step_post_hook`, public since torch 2.0) that writes CLOCK_REALTIME
ns of each optimizer step's end into the ring, and wraps `torch.optim.Optimizer.zero_grad` and
`torch.nn.Module.zero_grad` so that the end of the first zero_grad after a step is written too when that
zero_grad ends the step's iteration. The agent's flightrec source reads the ring next to the process's
worker-server socket and its segmenter ends each step at the last anchor between the step's last collective
and the next step's first (agent/steps.py): the zero_grad's end where there is one, else the step's.

Which zero_grad ends an iteration (`ends_iteration`): the step hook keeps its call site (code objects and
instruction offsets of up to MAX_FRAMES frames, torch's own frames skipped); the zero_grad wrapper walks its
own call stack to the innermost function that is also on the step's. A later instruction there is the same
loop body after the step (`step(); zero_grad()`; HF Trainer's `optimizer.step(); model.zero_grad()`; through
a wrapper such as accelerate's AcceleratedOptimizer, or a helper called after the step): an anchor. An earlier
one is the top of the next iteration (`zero_grad(); forward; backward; step()`, also the tutorials'
`loss = f(x); zero_grad(); backward(); step()`, where the zero_grad comes after the next forward): the step's
end stays the boundary, as the loop's own step logging would put it. The same instruction is a zero_grad
inside the step call (a closure, Lightning): not one. Only the first zero_grad after a step counts, and an
Optimizer's only after its own step (two optimizers written zero_grad-first give none). Gradient accumulation
(several forwards and backwards per optimizer step) is one step and one zero_grad per optimizer step;
pipeline schedules call both outside the schedule; the call-site rule needs no forward hooks.
Why not the alternatives: a global module forward pre hook (`register_module_forward_pre_hook`) to mark the
next iteration's first forward costs every module call of every forward, not one call per step (1.0-1.4 us
per module call, bench.testbed.anchorcost: ~1 ms per forward of a model of a thousand modules), turns off
nn.Module's hook-free fast path, is traced into every torch.compile'd forward, and on a pipeline stage
that first forward comes after the receive of the previous stage's activations (the wait for the pipeline),
not where the iteration ended.

Why a file and not a worker-server handler: a Python handler runs on the server's thread and needs the GIL,
while `_WorkerServer.shutdown()` at exit joins that thread holding the GIL: a request arriving during the
job's exit deadlocked it (seen on the testbed job). Reading a file needs nothing from the job.

Layout of <runtime dir>/<pid>.anchors (little-endian; HEADER_BYTES + slots x 16 bytes, 128 KiB by default):
  0   8s   magic b"SLANCHR1"
  8   u32  version (1)          12  u32  slots
  16  u64  start time of the process (clock ticks since boot, /proc/self/stat field 22: a recycled pid's
           stale file is told apart)
  24  u32  clock (1: CLOCK_REALTIME)
  32  u64  count: anchors written so far
  64  slots, slot k holds anchor number n with n % slots == k: u64 n + 1 (0 while being rewritten), u64 end ns
The zero_grad anchors did not change the layout (version 1: an anchor is an iteration end, whichever hook
wrote it; an agent that predates them takes the last anchor in its window too, so it gets them). A reader
refuses a ring of another version or clock with a message that says which (flightrec reports it once as
flightrec_bad_anchors and ends the steps at the comm ops); bump VERSION when the layout changes.
Writer order per anchor: the slot's number to 0, the time, the number, then count; a reader takes the numbers
it has not seen below count, keeps a slot only if its number is the one expected, and drops those the writer
may have reached again meanwhile (number <= count re-read after - slots), so a torn or overwritten slot is
never taken (x86 keeps stores in order; elsewhere a torn slot could give one wrong time).
Cost per optimizer step: the step hook (a lock, a clock read, three 8-byte stores into the mapping, the call
site: up to 8 frames) and the zero_grad wrapper (a clock read, the walk to the common frame, usually the
first, and a second anchor); no system call. `python -m bench.testbed.anchorcost` (2-core VM shared with other
work, python 3.11, torch 2.13, a 1-parameter SGD step + zero_grad, 10 frames deep, three runs): step hook
alone 1.0-1.7 us, step hook and zero_grad wrapper together 6.0-9.9 us per iteration (of which 1.3-2.0 us in
the zero_grad's anchor path, timed in place; the rest is not attributed, this VM's noise being +-2 us);
the step hook alone was 0.6 us before it kept the call site. Against that, a no-op global module forward pre
hook costs 1.0-1.4 us per module call. Both return what torch returns and swallow their own errors, so they
never change or break the step. Bounded: the ring (oldest overwritten); 8192 slots last 40 s at 100 steps/s
with two anchors a step, the agent reads every 1-5 s.
Effect (bench/testbed_steps.py, DP2 x PP2 gloo job whose loop is `opt.step(); opt.zero_grad(set_to_none=False)`
then its log; 2026-11-24, ~100 ms steps on the loaded VM): median boundary error 0.85 % (phase -0.78..-0.90
ms) with the step ends alone (`--no-zero-grad-anchors`), 0.10 % with the zero_grad ends (phase -0.10 ms,
~0.07 ms of it probably the collector's clock mapping: on loopback, agent clock only,
tests/test_steps_e2e.py gives 0.026-0.028 % and -0.03 ms); step durations 0.2-0.34 % -> 0.005 %.
Caveats: a global optimizer hook is visible to torch.compile of an optimizer step. While dynamo traces a
zero_grad the wrapper is the original alone (torch.compiler.is_compiling), so a compiled function calling
Module.zero_grad keeps its graph whole (tested) and Optimizer.zero_grad stays the graph break it was; a
zero_grad run inside a compiled graph writes no anchor (the step's end stays). An optimizer class that
overrides zero_grad without calling Optimizer.zero_grad is not wrapped (its steps end at the optimizer step).
STEPLENS_ANCHORS=0 turns all of this off, STEPLENS_ANCHORS_ZERO_GRAD=0 the zero_grad part only.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import sys
import threading
import time

MAGIC = b"SLANCHR1"
VERSION = 1
CLOCK_REALTIME = 1
HEADER_BYTES = 64
SLOT_BYTES = 16
DEFAULT_SLOTS = 8192
SUFFIX = ".anchors"
_HEAD = struct.Struct("<8sIIQI")   # magic, version, slots, start ticks, clock
_U64 = struct.Struct("<Q")
COUNT_AT = 32


def path_for(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{pid}{SUFFIX}")


class Ring:
    """The writer side: a fixed-size mapped file, one slot per anchor (see the module docstring)."""

    def __init__(self, path: str, start_ticks: int, slots: int = DEFAULT_SLOTS) -> None:
        self.path, self.slots, self.count = path, slots, 0
        self.lock = threading.Lock()
        size = HEADER_BYTES + slots * SLOT_BYTES
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _HEAD.pack_into(self.map, 0, MAGIC, VERSION, slots, start_ticks, CLOCK_REALTIME)
        os.replace(tmp, path)  # a reader never sees a file without its header

    def add(self, end_ns: int) -> None:
        with self.lock:
            n = self.count
            off = HEADER_BYTES + (n % self.slots) * SLOT_BYTES
            _U64.pack_into(self.map, off, 0)
            _U64.pack_into(self.map, off + 8, end_ns)
            _U64.pack_into(self.map, off, n + 1)
            self.count = n + 1
            _U64.pack_into(self.map, COUNT_AT, n + 1)

    def snapshot(self) -> list[list[int]]:
        """[[number, end ns], ...] of the anchors the ring still holds, oldest first (for the exit dump)."""
        with self.lock:
            n = self.count
            out = []
            for k in range(max(0, n - self.slots), n):
                off = HEADER_BYTES + (k % self.slots) * SLOT_BYTES
                out.append([k, _U64.unpack_from(self.map, off + 8)[0]])
            return out

    def close(self, unlink: bool = True) -> None:
        try:
            self.map.close()
        except (ValueError, BufferError):
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except OSError:
                pass


_ring: Ring | None = None
# the latest optimizer step not yet followed by a zero_grad: (id of its optimizer, call site codes, offsets)
_last_step: tuple | None = None
_skip_prefix = ""    # torch's own files (set by install()): their frames are not the call site
_zero_grad = False   # zero_grad is wrapped: the step hook keeps its call site
MAX_FRAMES = 8       # call-site frames kept per optimizer step (a wrapper library adds one or two)


def call_site(frame, skip_prefix: str = "", limit: int = MAX_FRAMES) -> tuple[tuple, tuple]:
    """(code objects, instruction offsets) of up to `limit` frames from `frame` outward, after skipping those at
    the inner end whose file starts with skip_prefix (torch's step wrapper, GradScaler, LR-scheduler counters)."""
    while skip_prefix and frame is not None and frame.f_code.co_filename.startswith(skip_prefix):
        frame = frame.f_back
    codes, offsets = [], []
    while frame is not None and len(codes) < limit:
        codes.append(frame.f_code)
        offsets.append(frame.f_lasti)
        frame = frame.f_back
    return tuple(codes), tuple(offsets)


def _frames(frame, skip_prefix: str):
    """call_site() as a generator of (code, offset): the zero_grad side walks only as far as it must."""
    while skip_prefix and frame is not None and frame.f_code.co_filename.startswith(skip_prefix):
        frame = frame.f_back
    for _ in range(MAX_FRAMES):
        if frame is None:
            return
        yield frame.f_code, frame.f_lasti
        frame = frame.f_back


def ends_iteration(step_codes, step_offsets, zero_site) -> bool:
    """Whether a zero_grad called at zero_site ((code, offset) pairs) ends the iteration of the optimizer step
    called at (step_codes, step_offsets) (call_site()'s), both innermost first. The innermost function of the
    zero_grad's call stack that is also on the step's decides: a later instruction there is the same loop body
    after the step (`step(); zero_grad()`, also through wrappers such as accelerate's, or a helper called after
    the step); an earlier one is the top of the next iteration (`zero_grad(); forward; backward; step()`, and
    the tutorials' `forward; zero_grad(); backward; step()`), where the step's end stays the boundary; the same
    one is a zero_grad inside the step call (a closure, Lightning). No function in common (another thread, or
    deeper than MAX_FRAMES): False. Functions by identity: code objects of distinct functions can compare
    equal."""
    for code, offset in zero_site:
        for j, c in enumerate(step_codes):
            if c is code:
                return offset > step_offsets[j]
    return False


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    """Global optimizer-step post hook: the step's end into the ring, and its call site for the zero_grad that
    may follow (returns None, never raises)."""
    global _last_step
    try:
        ring = _ring
        if ring is not None:
            ring.add(time.time_ns())
            if _zero_grad:
                _last_step = (id(optimizer),) + call_site(sys._getframe(1), _skip_prefix)
    except Exception:
        pass


def _after_zero_grad(owner, frame, end_ns: int) -> None:
    """A zero_grad returned at end_ns: its end into the ring when it is the first zero_grad after an optimizer
    step (of the same optimizer; a Module's: any) and ends that step's iteration (ends_iteration)."""
    global _last_step
    try:
        last, ring = _last_step, _ring
        if last is None or ring is None or (owner is not None and id(owner) != last[0]):
            return
        _last_step = None
        codes, offsets = last[1], last[2]
        if codes and frame.f_code is codes[0]:  # called from where the step was: the common case, decided here
            after = frame.f_lasti > offsets[0]
        else:
            after = ends_iteration(codes, offsets, _frames(frame, _skip_prefix))
        if after:
            ring.add(end_ns)
            iters = sys.modules.get("steplens_iters")   # its training iteration ends here too
            if iters is not None:
                iters.iteration_end_moved(end_ns)
    except Exception:
        pass


def _wrap_zero_grad(orig, of_optimizer: bool):
    """`orig` (Optimizer.zero_grad or Module.zero_grad) followed by _after_zero_grad. While torch.compile traces
    it, the wrapper is only `orig`, so dynamo sees what it saw before (Optimizer.zero_grad is
    dynamo-disabled: a graph break either way; Module.zero_grad is traced)."""
    compiling = _is_compiling()

    @functools.wraps(orig)
    def zero_grad(self, *args, **kwargs):
        if compiling():
            return orig(self, *args, **kwargs)
        out = orig(self, *args, **kwargs)
        if _ring is not None:
            _after_zero_grad(self if of_optimizer else None, sys._getframe(1), time.time_ns())
        return out

    zero_grad.__steplens_orig__ = orig
    return zero_grad


def _is_compiling():
    """torch.compiler.is_compiling where torch is already imported and has it (2.3+), else a constant False
    (never imports torch itself)."""
    compiler = sys.modules.get("torch.compiler")
    fn = getattr(compiler, "is_compiling", None)
    return fn if callable(fn) else (lambda: False)


def patch_zero_grad() -> list[str]:
    """Wrap torch.optim.Optimizer.zero_grad and torch.nn.Module.zero_grad (once; subclasses that override
    zero_grad without calling the base class keep the step's end): the classes patched."""
    import torch
    done = []
    for cls, of_optimizer in ((torch.optim.Optimizer, True), (torch.nn.Module, False)):
        orig = cls.__dict__.get("zero_grad")
        if orig is not None and not hasattr(orig, "__steplens_orig__"):
            cls.zero_grad = _wrap_zero_grad(orig, of_optimizer)
            done.append(f"{cls.__module__}.{cls.__qualname__}")
    return done


def install(directory: str, start_ticks: int, slots: int = DEFAULT_SLOTS, zero_grad: bool = True) -> Ring:
    """Create the ring, register the step hook and (zero_grad) wrap zero_grad (torch must be imported); raises
    on failure, the caller catches."""
    global _ring, _skip_prefix, _zero_grad
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    ring = Ring(path_for(directory, os.getpid()), start_ticks, slots)
    _skip_prefix = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    _ring = ring
    register_optimizer_step_post_hook(_on_optimizer_step)
    if zero_grad:
        patch_zero_grad()
        _zero_grad = True
    return ring


def close() -> None:
    """At exit, after the exit dump took the snapshot: the hooks stop writing and the file goes."""
    global _ring, _last_step
    ring, _ring, _last_step = _ring, None, None
    if ring is not None:
        ring.close()


def read(path: str, start_ticks: int = -1, after: int = -1) -> tuple[list[tuple[int, int]], str]:
    """Reader side, for tests and tools (the agent's flightrec source has its own copy, tested against this):
    ([(number, end ns)] newer than `after`, oldest first; "" or why none could be read)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
            again = os.pread(fh.fileno(), 8, COUNT_AT)  # the count after the copy: slots it reached are unsafe
    except OSError as exc:
        return [], f"{exc.strerror or exc}"
    if len(data) < HEADER_BYTES or len(again) < 8:
        return [], "short file"
    magic, version, slots, ticks, clock = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        return [], "not an anchors ring (magic)"
    if version != VERSION or clock != CLOCK_REALTIME:
        return [], f"anchors ring version {version} clock {clock}: this reader knows version {VERSION} clock 1 only"
    if len(data) < HEADER_BYTES + slots * SLOT_BYTES:
        return [], f"short file for {slots} slots"
    if start_ticks >= 0 and ticks != start_ticks:
        return [], "another process's ring (pid reused)"
    count = _U64.unpack_from(data, COUNT_AT)[0]
    out = []
    for n in range(max(after + 1, _U64.unpack(again)[0] - slots + 1, 0), count):
        off = HEADER_BYTES + (n % slots) * SLOT_BYTES
        num, ns = struct.unpack_from("<QQ", data, off)
        if num == n + 1:
            out.append((n, ns))
    return out, ""
