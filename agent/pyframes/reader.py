"""Reads the Python stacks of a live CPython process from outside, without stopping it.

Attach once: find the interpreter (libpython*.so or the executable) in /proc/PID/maps, read its
ELF symbols through /proc/PID/root (so containers work) to locate _PyRuntime and PyCode_Type,
pick the layout for its minor version (a generated table for 3.9-3.12; the interpreter's own
_Py_DebugOffsets for 3.13+), and fall back to a validated scan of its data segment when the
symbol is missing. Then each sample walks interpreters -> thread states -> frames with pread on
/proc/PID/mem.

The target keeps running, so any read can be torn. What is read is checked (a thread state must
point back to its interpreter, a code object must have PyCode_Type as its type, frame chains must
end within a bound and not loop, string sizes must be sane); a failed check retries the sample
and is never reported as a stack. Code objects are cached by address with a fingerprint
(filename, name, line table pointers, first line) that is re-checked when an instruction pointer
falls outside the cached code or after `revalidate_seconds`, so a reused address is not misread.

Cost (this machine: bench/pystacks.py, bench/README.md). At the low rates of sentinel mode every
sample starts cold (the machine has run other work since the last one), and what a sample costs is
then about proportional to what it does (measured here at 10 Hz: ~35 µs for the first pread after the
sleep, ~5 µs for each further one, ~20 µs for a /proc line, Python several times its warm cost). So
a sample does little of either:
- one pread each for _PyRuntime's head (with the GIL on 3.9-3.11), an interpreter's links and its GIL
  (3.12+), each thread state, and the 4 KiB blocks holding a walked thread's frames (3.11+: a data
  stack page holds many frames);
- a thread that has not been on a CPU since its state was last read from /proc (an unchanged
  schedstat, see _task) keeps its stack without any read of it;
- a frame whose bytes were seen before is decoded by one dict lookup (the memo); below the first frame
  of a walk found at its old address with its old bytes, the rest of the thread's last walk is checked
  by one C-level comparison and reused (_frames_interp), so a deep stack costs about its changed top.
Batching the reads into one process_vm_readv was tried and dropped: through ctypes it cost more
cold (~115 µs for one call) than the preads it saved.

The walk in C (_walker.c, built by `pip install` where there is a compiler; STEPLENS_PYFRAMES_NATIVE=0 or
attach(native=False) turns it off) does the same walk with the same checks and the same /proc logic, from
the same layout tables, with no Python work per read or per frame: what is left to Python is decoding a
(code, instruction) pair the first time it is seen (_interp_frame/_object_frame, which validate the code
object) and one Sample per sample; an unchanged thread comes back as the same ThreadStack object. The
Python walk (_sample_once) stays for ptrace mode (stop_threads) and where the extension is not built. At
10 Hz a sample costs ~95 µs in the C walk (about 10 preads and 4 /proc reads, each cold) and ~30 µs in
Python, against ~290 µs for the Python walk (bench/README.md). Batching the C walk's reads into one
process_vm_readv (the last sample's blocks) was tried again from C and was slower than the preads.
"""

from __future__ import annotations

import errno
import os
import re
import struct
import time
import weakref
from dataclasses import dataclass, field
from operator import getitem

from steplens.agent.pyframes import elf, layouts
from steplens.agent.pyframes.linetable import DECODERS
from steplens.agent.pyframes.memory import Memory, ProcessGone, PyFramesError, ReadError, process_state
from steplens.agent.pyframes.model import Frame, Sample, ThreadStack

_U64 = struct.Struct("<Q")
_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_VERSION_RE = re.compile(r"python(\d)\.(\d+)")
MAX_DEPTH = 4096
MAX_THREADS = 20000
BLOCK = 4096
_DEPTH = range(MAX_DEPTH)
_FAST = 200   # frames walked before a walk starts to check for loops (a torn read can make one)
_EMPTY: dict = {}


class NotPython(PyFramesError):
    pass


class TornRead(PyFramesError):
    pass


_STATES = {"R": "running", "S": "sleeping", "D": "disk-wait", "T": "stopped", "t": "stopped", "Z": "zombie",
           "X": "dead", "I": "idle"}


@dataclass
class CodeInfo:
    name: str
    qualname: str
    filename: str
    firstlineno: int
    linetable: bytes
    n_units: int                # code units (3.11+), or len(co_code) // 2 before
    fingerprint: tuple
    checked: float
    lines: dict = field(default_factory=dict)


def _maps(pid: int, proc_root: str) -> list[tuple[int, int, str, int, str]]:
    out = []
    try:
        with open(os.path.join(proc_root, str(pid), "maps")) as fh:
            for line in fh:
                parts = line.split(None, 5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, parts[1], int(parts[2], 16), parts[5].strip() if len(parts) > 5 else ""))
    except FileNotFoundError:
        raise ProcessGone(f"process {pid} does not exist") from None
    except PermissionError:
        raise layouts_permission(pid) from None
    return out


def _span_of(*offsets: int) -> tuple[int, int]:
    """(first offset, size) of one read covering 8 bytes at each offset; size 0 when that is over a block."""
    lo, hi = min(offsets), max(offsets) + 8
    return lo, (hi - lo if hi - lo <= BLOCK else 0)


def layouts_permission(pid: int):
    from steplens.agent.pyframes.memory import NoPermission
    return NoPermission(f"cannot read /proc/{pid}/maps: needs root or CAP_SYS_PTRACE")


class PythonProcess:
    def __init__(self, pid: int, proc_root: str = "/proc", revalidate_seconds: float = 2.0,
                 thread_states: bool = True, state_refresh_seconds: float = 0.005, native: bool | None = None) -> None:
        self.pid = pid
        # a thread's scheduler state is re-read at most this often: at 1 kHz five samples share one
        # read of /proc/PID/task/TID/stat (the costliest syscall of a sample); at 100 Hz each is fresh
        self.state_refresh_seconds = state_refresh_seconds
        self.proc_root = proc_root
        self.revalidate_seconds = revalidate_seconds
        self.thread_states = thread_states
        self.mem = Memory(pid, proc_root)
        try:
            self._attach()
        except Exception:
            self.mem.close()
            raise
        self._code: dict[int, CodeInfo] = {}
        self._tid_off: int | None = None
        self._cur: dict[int, bytes] = {}   # this sample's 4 KiB blocks of the target
        self._touched: list[int] = []
        self._frame_memo: dict[bytes, tuple] = {}  # frame bytes -> (Frame or None, previous frame)
        self._memo_cleared = time.monotonic()
        self._memo_gen = 0
        self._chains: dict[int, tuple] = {}       # tstate -> its last walk, for _frames_interp
        # tstate -> (frame, [(block, bytes)], frames, memo generation, (first block, count) to read at once)
        self._walk_cache: dict[int, tuple] = {}
        self._threads_last: dict[int, tuple] = {}  # tstate -> (thread state bytes, frames) of its last walk
        self._schedstat: dict[int, int] = {}       # tid -> open fd of /proc/PID/task/TID/schedstat
        # tid -> [stat fd, name, name read at, state, state read at, schedstat before that state's read]
        self._tasks: dict[int, list] = {}
        self._main_pthread_id = 0
        self._tid_fallback = -1
        self._gil_ptr: dict[int, int] = {}
        self._state_override: dict[int, tuple[str, str]] | None = None
        # a target in another PID namespace stores its own tids; map them to ours (NSpid)
        self.ns_pid = self._ns_pid()
        self._ns_tids: dict[int, int] = {}
        self._ns_refreshed = 0.0
        self.samples = 0
        self.torn = 0
        self.stopped_ns_total = 0
        self._python_tids: list[int] = []
        # the walk in C (_walker.c) when built, unless native=False or STEPLENS_PYFRAMES_NATIVE=0
        self._native = self._make_walker() if native is not False else None
        self._native_tids = self._native is not None and self.layout.tstate_native_thread_id is None
        if native and self._native is None:
            self.close()
            raise PyFramesError("the sampler's C walk (steplens.agent.pyframes._walker) is not built")

    def _make_walker(self):
        if os.environ.get("STEPLENS_PYFRAMES_NATIVE", "1") == "0":
            return None
        try:
            from steplens.agent.pyframes import _walker
        except ImportError:
            return None
        lay = self.layout
        offsets = (lay.runtime_interpreters_head, 0 if lay.gil_mode == "runtime" else 1, lay.gil_last_holder,
                   lay.gil_locked, lay.interp_ceval_gil, lay.interp_next, lay.interp_tstate_head, lay.tstate_next,
                   lay.tstate_interp, lay.tstate_thread_id, lay.tstate_native_thread_id, lay.tstate_read_size,
                   lay.tstate_frame, lay.tstate_cframe, lay.cframe_current_frame,
                   0 if lay.frame_kind == "object" else 1, lay.frame_back, lay.frame_code, lay.frame_lasti,
                   lay.frame_instr, lay.frame_owner, lay.frame_read_size, lay.code_code_adaptive,
                   1 if self.version == (3, 9) else 2)
        ref = weakref.ref(self)   # the walk calls back; weakly, so no cycle keeps this process open
        resolver = None
        if self.ns_pid:   # the target stores tids of its PID namespace: the walk asks for ours

            def resolver(tid: int, stale: int = 0) -> int:
                proc = ref()
                if proc is None:
                    return 0
                if stale:   # the answer given names no task any more (_host_tid)
                    proc._ns_tids.pop(tid, None)
                return proc._host_tid(tid, time.monotonic())

        interp = lay.frame_kind == "interp"

        def decode(code: int, value: int, now: float):
            proc = ref()
            if proc is None:
                raise ProcessGone("detached")
            frame = proc._interp_frame(code, value, now) if interp else proc._object_frame(code, value, now)
            return frame[0] if frame else None
        try:
            walker = _walker.Walker(self.mem.fd, os.path.join(self.proc_root, str(self.pid), "task") + "/",
                                    self.runtime, offsets, self.thread_states, self.state_refresh_seconds,
                                    self.revalidate_seconds, resolver, decode, ThreadStack, {**_STATES, "?": "unknown"})
        except ValueError:   # a layout the C walk cannot take (a thread state over 4 KiB, say): the Python walk can
            return None
        walker.set_tag_mask(lay.code_tag_mask)
        return walker

    @property
    def native(self) -> bool:
        """Whether samples are walked in C (_walker.c)."""
        return self._native is not None

    # -- PID namespaces -----------------------------------------------------------------------
    def _ns_pid(self) -> int:
        try:
            with open(os.path.join(self.proc_root, str(self.pid), "status")) as fh:
                for line in fh:
                    if line.startswith("NSpid:"):
                        ids = line.split()[1:]
                        return int(ids[-1]) if len(ids) > 1 else 0
        except (OSError, ValueError):
            pass
        return 0

    def _host_tid(self, tid: int, now: float) -> int:
        """Our tid of a thread of a target in another PID namespace (which stores the tids of its own), from its
        tasks' NSpid lines, read again (at most every 0.5 s) when a tid is not known. An answer is kept until
        the task it names cannot be read: that thread ended and the namespace may have given its tid to a new
        one (tids are handed out in turn, so rarely soon; a container's init that sets ns_last_pid does), and
        the walks forget it (the Python walk below, the C walk through its resolver) and ask again."""
        if not self.ns_pid or not tid:
            return tid
        host = self._ns_tids.get(tid)
        if host is None and now - self._ns_refreshed > 0.5:
            self._ns_refreshed = now
            task_dir = os.path.join(self.proc_root, str(self.pid), "task")
            mapping = {}
            try:
                for t in os.listdir(task_dir):
                    try:
                        with open(os.path.join(task_dir, t, "status")) as fh:
                            for line in fh:
                                if line.startswith("NSpid:"):
                                    mapping[int(line.split()[-1])] = int(t)
                                    break
                    except OSError:
                        continue
            except OSError:
                pass
            self._ns_tids = mapping
            host = mapping.get(tid)
        return host or 0

    # -- attach ----------------------------------------------------------------------------
    def _attach(self) -> None:
        maps = _maps(self.pid, self.proc_root)
        lib = exe = None
        for lo, hi, perms, off, path in maps:
            base = os.path.basename(path)
            if lib is None and base.startswith("libpython3") and ".so" in base:
                lib = path
        try:
            exe = os.readlink(os.path.join(self.proc_root, str(self.pid), "exe"))
        except OSError as exc:
            raise ProcessGone(f"process {self.pid}: {exc.strerror}") from None
        candidates = [p for p in (lib, exe) if p]
        wanted = ("_PyRuntime", "PyCode_Type", "Py_Version", "PyUnicode_Type", "PyBytes_Type", "_Py_InitCleanup")
        found = None
        for path in candidates:
            host_path = os.path.join(self.proc_root, str(self.pid), "root", path.lstrip("/")).replace(" (deleted)", "")
            try:
                info = elf.read_elf(host_path, wanted)
            except (elf.ElfError, OSError):
                continue
            bias = self._load_bias(maps, path, info)
            if bias is None:
                continue
            if "_PyRuntime" in info.symbols or path == lib:
                found = (path, info, bias)
                break
        if found is None:
            raise NotPython(f"process {self.pid} ({exe}) is not a CPython process (no libpython or _PyRuntime)")
        path, info, bias = found
        self.binary = path
        self.version = self._version(path, info, bias)
        if "_PyRuntime" in info.symbols:
            self.runtime = bias + info.symbols["_PyRuntime"]
        else:
            self.runtime = self._scan_runtime(maps, path)
        self.code_type = bias + info.symbols["PyCode_Type"] if "PyCode_Type" in info.symbols else 0
        self.str_type = bias + info.symbols["PyUnicode_Type"] if "PyUnicode_Type" in info.symbols else 0
        self.bytes_type = bias + info.symbols["PyBytes_Type"] if "PyBytes_Type" in info.symbols else 0
        # 3.13+: the static code object the interpreter runs after a specialized __init__ call; it is
        # interpreter machinery, not Python code (local symbol; matched by its shape when stripped)
        self.init_cleanup = bias + info.symbols["_Py_InitCleanup"] if "_Py_InitCleanup" in info.symbols else 0
        if self.version >= (3, 13):
            size = layouts.debug_offsets_size(self.version)
            d = layouts.parse_debug_offsets(self.mem.read(self.runtime, size), self.version)
            self.layout = layouts.for_debug_offsets(d, self.version)
        else:
            self.layout = layouts.for_table(self.version)
        self._decode_line = DECODERS[self.layout.linetable]
        # the few words a sample reads first, as one region each: the interpreters' head in _PyRuntime
        # (with the GIL where it lives there, 3.9-3.11) and an interpreter's next and threads' head
        lay = self.layout
        self._rt_lo, self._rt_size = _span_of(lay.runtime_interpreters_head, *(
            [lay.gil_last_holder, lay.gil_locked] if lay.gil_mode == "runtime" else []))
        if not self._rt_size:
            self._rt_lo = lay.runtime_interpreters_head
        self._in_lo, self._in_size = _span_of(lay.interp_next, lay.interp_tstate_head)

    def _load_bias(self, maps, path, info) -> int | None:
        starts = [lo - off for lo, hi, perms, off, p in maps if p == path or p == path + " (deleted)"]
        if not starts:
            return None
        return min(starts) - info.min_load_vaddr

    def _version(self, path: str, info, bias: int) -> tuple[int, int]:
        m = _VERSION_RE.search(os.path.basename(path))
        if m:
            return int(m.group(1)), int(m.group(2))
        if "Py_Version" in info.symbols:  # 3.11+: PY_VERSION_HEX
            v = _U32.unpack(self.mem.read(bias + info.symbols["Py_Version"], 4))[0]
            return v >> 24, (v >> 16) & 0xFF
        raise NotPython(f"cannot tell the CPython version of {path}")

    def _scan_runtime(self, maps, path) -> int:
        """No _PyRuntime symbol (stripped binary): scan the binary's writable mappings."""
        regions = [(lo, hi) for lo, hi, perms, off, p in maps if p == path and perms.startswith("rw")]
        # the anonymous mapping right after the file's data segment is its .bss
        for i, (lo, hi, perms, off, p) in enumerate(maps):
            if p == path and perms.startswith("rw") and i + 1 < len(maps) and not maps[i + 1][4]:
                regions.append((maps[i + 1][0], maps[i + 1][1]))
        if self.version >= (3, 13):
            for lo, hi in regions:
                data = self.mem.read(lo, hi - lo)
                pos = data.find(b"xdebugpy")
                if pos >= 0 and pos % 8 == 0:
                    return lo + pos
            raise NotPython(f"no _PyRuntime symbol and no _Py_DebugOffsets cookie in {path}")
        lay = layouts.for_table(self.version)
        heap = [(lo, hi) for lo, hi, perms, off, p in maps if perms.startswith("rw")]

        def plausible(ptr: int) -> bool:
            return ptr and ptr % 8 == 0 and any(lo <= ptr < hi for lo, hi in heap)
        for lo, hi in regions:
            data = self.mem.read(lo, hi - lo)
            for off in range(0, len(data) - lay.runtime_interpreters_head - 8, 8):
                interp = _U64.unpack_from(data, off + lay.runtime_interpreters_head)[0]
                if not plausible(interp):
                    continue
                try:
                    tstate = self.mem.u64(interp + lay.interp_tstate_head)
                    if plausible(tstate) and self.mem.u64(tstate + lay.tstate_interp) == interp:
                        return lo + off
                except ReadError:
                    continue
        raise NotPython(f"no _PyRuntime symbol in {path} and the data-segment scan found none")

    # -- reading helpers --------------------------------------------------------------------
    def _block(self, blk: int) -> bytes:
        """A 4 KiB block of the target, read once per sample (a thread's frames share a few)."""
        data = self._cur.get(blk)
        if data is None:
            data = self._cur[blk] = self.mem.read(blk, BLOCK)
        return data

    def _walk(self, key: int, frame: int, now: float) -> list[Frame]:
        """The frames of one thread. When every block its last walk touched reads back byte-identical
        (an idle thread), the stack cannot have changed and the last result is reused (until the memo
        is emptied: the result trusts its code objects just as the memo does)."""
        prev = self._walk_cache.get(key)
        if prev is not None and prev[4]:
            # the blocks of the last walk, in one read where they lie close together (a deep stack spans
            # several): what this walk needs is mostly among them
            lo, n = prev[4]
            if lo not in self._cur:
                try:
                    data = self.mem.read(lo, n * BLOCK)
                    for i in range(n):
                        self._cur[lo + i * BLOCK] = data[i * BLOCK:(i + 1) * BLOCK]
                except ReadError:
                    pass
        if prev is not None and prev[0] == frame and prev[3] == self._memo_gen:
            try:
                for b, data in prev[1]:
                    if self._block(b) != data:
                        break
                else:
                    return prev[2]
            except ReadError:
                pass
        self._touched = touched = []
        frames = (self._frames_interp(frame, now, key) if self.layout.frame_kind == "interp"
                  else self._frames_object(frame, now))
        cur = self._cur
        blocks = dict.fromkeys(touched)
        lo, hi = (min(blocks), max(blocks)) if blocks else (0, -BLOCK)
        span = (lo, (hi - lo) // BLOCK + 1) if 1 < (hi - lo) // BLOCK + 1 <= 4 else None
        self._walk_cache[key] = (frame, [(b, cur[b]) for b in blocks], frames, self._memo_gen, span)
        return frames

    def _string(self, addr: int) -> str:
        lay = self.layout
        head = self.mem.read(addr, lay.unicode_compact_size)
        if self.str_type and _U64.unpack_from(head, lay.pyobject_ob_type)[0] != self.str_type:
            raise TornRead(f"object at {addr:#x} is not a str")
        length = _U64.unpack_from(head, lay.unicode_length)[0]
        state = _U32.unpack_from(head, lay.unicode_state)[0]
        kind = (state >> 2) & 7
        compact = (state >> 5) & 1
        ascii_ = (state >> 6) & 1
        if not compact or kind not in (1, 2, 4) or length > 1 << 20:
            raise TornRead(f"implausible string at {addr:#x}")
        data_at = addr + (lay.unicode_ascii_size if ascii_ else lay.unicode_compact_size)
        raw = self.mem.read(data_at, length * kind) if length else b""
        codec = "latin-1" if kind == 1 else "utf-16-le" if kind == 2 else "utf-32-le"
        return raw.decode(codec, errors="replace")

    def _bytes(self, addr: int, limit: int = 1 << 20) -> bytes:
        lay = self.layout
        head = self.mem.read(addr, lay.bytes_ob_sval)
        if self.bytes_type and _U64.unpack_from(head, lay.pyobject_ob_type)[0] != self.bytes_type:
            raise TornRead(f"object at {addr:#x} is not bytes")
        size = _U64.unpack_from(head, lay.varobject_ob_size)[0]
        if size > limit:
            raise TornRead(f"implausible bytes size {size}")
        return self.mem.read(addr + lay.bytes_ob_sval, size) if size else b""

    def _code_info(self, addr: int, now: float, instr_units: int | None) -> CodeInfo:
        info = self._code.get(addr)
        if info is not None:
            fresh = now - info.checked < self.revalidate_seconds
            in_range = instr_units is None or 0 <= instr_units < max(info.n_units, 1) + 1
            if fresh and in_range:
                return info
        lay = self.layout
        raw = self.mem.read(addr, lay.code_read_size)
        refcnt = _U64.unpack_from(raw, 0)[0]
        # a freed object keeps its type pointer (the allocator links free blocks through the first
        # word, the refcount), so a live code object also needs a refcount that is not an address
        if (self.code_type and _U64.unpack_from(raw, lay.pyobject_ob_type)[0] != self.code_type) \
                or refcnt == 0 or refcnt > 0xFFFFFFFF:
            self._code.pop(addr, None)
            raise TornRead(f"object at {addr:#x} is not a live code object")
        fn_p = _U64.unpack_from(raw, lay.code_filename)[0]
        name_p = _U64.unpack_from(raw, lay.code_name)[0]
        qual_p = _U64.unpack_from(raw, lay.code_qualname)[0] if lay.code_qualname is not None else 0
        lt_p = _U64.unpack_from(raw, lay.code_linetable)[0]
        first = _I32.unpack_from(raw, lay.code_firstlineno)[0]
        fp = (fn_p, name_p, qual_p, lt_p, first)
        if info is not None and info.fingerprint == fp:
            info.checked = now
            return info
        if lay.code_code_adaptive is not None:
            n_units = _U64.unpack_from(raw, lay.varobject_ob_size)[0]
        else:
            code_p = _U64.unpack_from(raw, lay.code_code)[0]
            n_units = _U64.unpack(self.mem.read(code_p + lay.varobject_ob_size, 8))[0] // 2
        if n_units > 1 << 24:
            raise TornRead("implausible code size")
        name = self._string(name_p)
        info = CodeInfo(name=name, qualname=self._string(qual_p) if qual_p else name, filename=self._string(fn_p),
                        firstlineno=first, linetable=self._bytes(lt_p), n_units=n_units, fingerprint=fp, checked=now)
        if len(self._code) > 20000:
            self._code.clear()
        self._code[addr] = info
        return info

    def _frame(self, info: CodeInfo, byte_offset: int) -> Frame:
        """The Frame for this code at this offset, decoded once and then shared (frames are immutable).
        An instruction without a location (exception cleanup, implicit return: co_positions() says None)
        gets the line of the table entry before it, as py-spy reports it; one the table cannot place (a
        torn or misread table) the function's first line. So a frame always has a line to print."""
        frame = info.lines.get(byte_offset)
        if frame is None:
            line = self._decode_line(info.linetable, info.firstlineno, byte_offset, carry=True)
            if line < 0:
                line = info.firstlineno
            frame = Frame(info.name, info.qualname, info.filename, line)
            if len(info.lines) < 4096:
                info.lines[byte_offset] = frame
        return frame

    # -- frames ----------------------------------------------------------------------------
    # One loop per frame kind, kept tight: a sample's cost is mostly the Python work per frame. A frame
    # whose bytes were seen before (the same code, instruction and link) decodes the same way, so the
    # memo maps its bytes straight to (Frame or None, previous frame); the memo trusts the code objects
    # it names and is emptied every revalidate_seconds, when they are checked again.
    def _frames_object(self, frame: int, now: float) -> list[Frame]:
        lay = self.layout
        size = lay.frame_read_size
        limit = BLOCK - size
        memo_get = self._frame_memo.get
        out: list[Frame] = []
        if not frame:
            return out
        base = -1 - BLOCK
        buf = b""
        seen = None
        for i in _DEPTH:
            if i >= _FAST:   # deep, or a torn chain that loops: from here on, remember every address
                if seen is None:
                    seen = set()
                if frame in seen:
                    break
                seen.add(frame)
            o = frame - base
            if o < 0 or o > limit:
                buf, o, base = self._locate(frame, size)
            key = buf[o + 8:o + size]   # not the refcount, which changes without the frame changing
            hit = memo_get(key)
            if hit is None:
                code = _U64.unpack_from(key, lay.frame_code - 8)[0]
                lasti = _I32.unpack_from(key, lay.frame_lasti - 8)[0]
                hit = self._frame_memo[key] = (self._object_frame(code, lasti if self.version == (3, 9) else lasti * 2,
                                                                  now), _U64.unpack_from(key, lay.frame_back - 8)[0])
            found, frame = hit
            out += found
            if not frame:
                return out
        raise TornRead("frame chain loops or is too deep")

    def _frames_interp(self, frame: int, now: float, tkey: int | None = None) -> list[Frame]:
        """The frames from `frame` down (innermost first). With tkey (the thread state), the walk before
        of that thread is kept as a chain (see _chain): once a frame turns up at the address and with the
        bytes it had there, the frames below it are checked in one C-level comparison of their bytes
        instead of one Python iteration each, and reused when all are the same."""
        if not frame:
            return []
        size = self.layout.frame_read_size
        limit = BLOCK - size
        memo_get = self._frame_memo.get
        rec = self._chains.get(tkey) if tkey is not None else None
        if rec is not None and rec[0] != self._memo_gen:
            rec = None   # the memo was emptied since: decode everything afresh (code objects re-checked)
        pos = rec[6] if rec is not None else _EMPTY
        n_rec = len(rec[1]) if rec is not None else 0
        out: list[Frame] = []
        top: list[tuple] = []
        base = -1 - BLOCK
        buf = b""
        seen = None
        for i in _DEPTH:
            if i >= _FAST:   # deep, or a torn chain that loops: from here on, remember every address
                if seen is None:
                    seen = set()
                if frame in seen:
                    break
                seen.add(frame)
            o = frame - base
            if o < 0 or o > limit:
                buf, o, base = self._locate(frame, size)
            key = buf[o:o + size]
            j = pos.get(frame)
            if j is not None and j < n_rec and rec[2][j] == key and rec[1][j] == frame and self._same_below(rec, j):
                out += rec[7][len(rec[7]) - rec[5][j]:]
                return self._chain(tkey, rec, j, out, top, size)
            hit = memo_get(key)
            if hit is None:
                hit = self._frame_memo[key] = self._decode_interp(key, now)
            found, nxt = hit
            out += found
            if tkey is not None:
                top.append((frame, key, base, o, len(found)))
            frame = nxt
            if not frame:
                return self._chain(tkey, None, -1, out, top, size) if tkey is not None else out
        raise TornRead("frame chain loops or is too deep")

    def _same_below(self, rec: tuple, j: int) -> bool:
        """Whether every frame of the chain below index j (bottom-first) reads back as it was."""
        if not j:
            return True
        bases = rec[3][:j]
        need = set(bases)
        cur = self._cur
        try:
            for b in need:
                if b not in cur:
                    if b < 0:
                        return False   # a frame that crossed a block boundary: not kept in a block
                    self._block(b)
        except ReadError:
            return False
        if list(map(getitem, map(cur.__getitem__, bases), rec[4][:j])) != rec[2][:j]:
            return False
        self._touched += need
        return True

    def _chain(self, tkey: int, rec: tuple | None, j: int, out: list, top: list, size: int) -> list[Frame]:
        """Keep this walk of a thread as (memo generation, then bottom-first: frame addresses, frame
        bytes, their blocks, their slices in the blocks, running count of Frames; address -> index;
        the Frames innermost first): the frames 0..j of `rec` and, above them, the `top` just walked."""
        if rec is not None:
            addrs, keys, bases, slices, cnt = rec[1][:j + 1], rec[2][:j + 1], rec[3][:j + 1], rec[4][:j + 1], \
                rec[5][:j + 1]
            pos = rec[6]
            total = cnt[-1]
        else:
            addrs, keys, bases, slices, cnt, pos, total = [], [], [], [], [], {}, 0
        for addr, key, base, o, nf in reversed(top):
            pos[addr] = len(addrs)
            addrs.append(addr)
            keys.append(key)
            if base < 0:
                base, o = -1, 0
            bases.append(base)
            slices.append(slice(o, o + size))
            total += nf
            cnt.append(total)
        if len(pos) > 2 * len(addrs) + 64:   # addresses of frames long gone
            pos = {a: i for i, a in enumerate(addrs)}
        self._chains[tkey] = (self._memo_gen, addrs, keys, bases, slices, cnt, pos, out)
        return out

    def _locate(self, frame: int, size: int) -> tuple[bytes, int, int]:
        """(buffer, offset of the frame in it, address of the buffer) for the frame loops: its 4 KiB block,
        or both blocks joined where the frame crosses into the next one (then at an address the loops'
        range check never accepts, so the next frame is located afresh)."""
        base = frame & ~(BLOCK - 1)
        o = frame - base
        if o > BLOCK - size:
            self._touched += (base, base + BLOCK)
            return self._block(base) + self._block(base + BLOCK), o, -1 - 2 * BLOCK
        self._touched.append(base)
        return self._block(base), o, base

    def _decode_interp(self, raw: bytes, now: float) -> tuple:
        lay = self.layout
        prev = _U64.unpack_from(raw, lay.frame_back)[0]
        if raw[lay.frame_owner] >= 3:  # a C-stack shim frame (3.12+), not Python code
            return (), prev
        code = _U64.unpack_from(raw, lay.frame_code)[0] & ~lay.code_tag_mask
        instr = _U64.unpack_from(raw, lay.frame_instr)[0]
        return self._interp_frame(code, (instr - code - lay.code_code_adaptive) // 2, now), prev

    def _interp_frame(self, code: int, units: int, now: float) -> tuple:
        """() or (Frame,) for a _PyInterpreterFrame running `code` at instruction `units` (code units)."""
        info = self._code_info(code, now, units)
        units = min(max(units, 0), max(info.n_units - 1, 0))
        internal = (info.filename == "<shim>"  # 3.12's trampoline frames
                    or code == self.init_cleanup
                    or (info.filename == "__init__" == info.name and not info.linetable))
        return () if internal else (self._frame(info, units * 2),)

    def _object_frame(self, code: int, byte_off: int, now: float) -> tuple:
        """(Frame,) for a PyFrameObject (3.9/3.10) running `code` at byte offset `byte_off`."""
        return (self._frame(self._code_info(code, now, byte_off // 2), max(byte_off, 0)),)

    # -- threads ---------------------------------------------------------------------------
    def _native_tid(self, raw: bytes) -> int:
        """The thread's tid as the target sees it (3.11+ store it; 3.9/3.10 via glibc's struct pthread)."""
        lay = self.layout
        if lay.tstate_native_thread_id is not None:
            return _U64.unpack_from(raw, lay.tstate_native_thread_id)[0] & 0xFFFFFFFF
        if self._tid_off is None or self._tid_off < 0:
            return 0
        pthread = _U64.unpack_from(raw, lay.tstate_thread_id)[0]
        try:
            return _U32.unpack(self.mem.read(pthread + self._tid_off, 4))[0]
        except ReadError:
            return 0

    def _calibrate_tid_offset(self, pthreads: list[int], main_pthread: int) -> None:
        """3.9/3.10 keep only pthread_t (the address of glibc's struct pthread). Find the offset of its
        `tid` field: where the main thread's struct holds the PID (as the target sees it) and every
        other thread's struct holds one of the process's thread ids."""
        own = self.ns_pid or self.pid
        try:
            blob = self.mem.read(main_pthread, 2048)
        except ReadError:
            self._tid_off = -1
            return
        candidates = [o for o in range(0, 2048, 4) if _U32.unpack_from(blob, o)[0] == own]
        if self.ns_pid:
            self._host_tid(-1, float("inf"))  # refresh the namespace map
            valid = set(self._ns_tids)
        else:
            try:
                valid = {int(t) for t in os.listdir(os.path.join(self.proc_root, str(self.pid), "task"))}
            except OSError:
                valid = set()
        others = [p for p in pthreads if p != main_pthread]
        for off in candidates:
            try:
                values = [_U32.unpack(self.mem.read(p + off, 4))[0] for p in others]
                # every thread's value must be one of the process's tids, and no two alike (a field that
                # happens to hold 1 everywhere would otherwise pass in a PID namespace, where the PID is 1)
                if all(v in valid and v != own for v in values) and len(set(values)) == len(values):
                    # with one thread nothing disambiguates: decide again when there are more
                    self._tid_off = off if others else None
                    self._tid_fallback = off
                    return
            except ReadError:
                continue
        self._tid_off = -1

    def _task(self, tid: int, now: float) -> tuple[str, str, bool]:
        """(scheduler state, thread name, quiet): quiet when the thread is known not to have been on a
        CPU since the state was last read from /proc (so neither its state nor its stack has changed).

        The state is the one of a pread on a kept-open /proc/PID/task/TID/stat, re-read at most every
        state_refresh_seconds (not quiet in between). Past that, a thread last seen not running whose
        /proc/.../schedstat (run time, wait time, times scheduled in) reads back the same as just before
        that stat read has not been scheduled in since: quiet, its state stands (one cheaper read; a
        thread woken but still waiting for a CPU shows as sleeping until it runs). A thread last seen
        running gets its stat read every time: a running thread's run time is only brought up to date at
        scheduler ticks and switches, so an unchanged schedstat says nothing about it (trusting it
        reused stale stacks of a busy thread at 250 Hz and more). The name is re-read every 5 s.
        """
        if self._state_override is not None and tid in self._state_override:
            return self._state_override[tid] + (False,)
        entry = self._tasks.get(tid)
        try:
            if entry is None:
                base = os.path.join(self.proc_root, str(self.pid), "task", str(tid))
                fd = os.open(base + "/stat", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    with open(base + "/comm", "rb") as fh:
                        name = fh.read().strip().decode(errors="replace")
                except OSError:
                    os.close(fd)
                    raise
                entry = self._tasks[tid] = [fd, name, now, "", -1.0, None]
            elif now - entry[4] < self.state_refresh_seconds:
                return entry[3], entry[1], False
            if entry[3] != "running":
                fd = self._schedstat.get(tid)
                ss = (os.pread(fd, 96, 0) or None) if fd is not None else self._schedstat_raw(tid)
                if ss is not None and ss == entry[5]:
                    entry[4] = now
                    return entry[3], entry[1], True
                entry[5] = ss
            stat = os.pread(entry[0], 512, 0)
            if not stat:
                raise OSError("thread gone")
            if now - entry[2] > 5.0:  # names change rarely; refresh now and then
                entry[2] = now
                with open(os.path.join(self.proc_root, str(self.pid), "task", str(tid), "comm"), "rb") as fh:
                    entry[1] = fh.read().strip().decode(errors="replace")
            entry[3] = _STATES.get(chr(stat[stat.rindex(b")") + 2]), "unknown")
            entry[4] = now
            if entry[3] == "running":
                entry[5] = None
            return entry[3], entry[1], False
        except (OSError, ValueError):
            if entry is not None:
                self._forget_task(tid)
            return "unknown", "", False

    def _schedstat_raw(self, tid: int) -> bytes | None:
        """The thread's /proc/PID/task/TID/schedstat line (on-CPU ns, run-queue wait ns, times scheduled
        in), None when unavailable."""
        fd = self._schedstat.get(tid)
        try:
            if fd is None:
                fd = self._schedstat[tid] = os.open(os.path.join(self.proc_root, str(self.pid), "task", str(tid),
                                                                 "schedstat"), os.O_RDONLY | os.O_CLOEXEC)
            return os.pread(fd, 96, 0) or None
        except OSError:
            fd = self._schedstat.pop(tid, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
            return None

    def _forget_task(self, tid: int) -> None:
        fd = self._schedstat.pop(tid, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        entry = self._tasks.pop(tid, None)
        if entry is not None:
            try:
                os.close(entry[0])
            except OSError:
                pass

    def _interp_read(self, interp: int) -> tuple[int, int, int]:
        """(next interpreter, first thread state, GIL holder's thread state or 0) of an interpreter: one
        read where the interpreter's links and its GIL (3.12+: a struct inside it) are near each other."""
        lay = self.layout
        lo, size = self._in_lo, self._in_size
        gil = 0
        blob = b""
        if lay.gil_mode != "runtime":
            gil = self._gil_ptr.get(interp)
            if gil is None:
                gil = self._gil_ptr[interp] = self.mem.u64(interp + lay.interp_ceval_gil)
            g_lo, g_hi = min(lay.gil_last_holder, lay.gil_locked), max(lay.gil_last_holder + 8, lay.gil_locked + 4)
            if size and gil and 0 <= gil + g_lo - interp and gil + g_hi - interp - lo <= 2 * BLOCK:
                try:
                    blob = self.mem.read(interp + lo, max(size, gil + g_hi - interp - lo))
                    size = len(blob)
                except ReadError:
                    blob = b""    # read the links alone below, and the GIL on its own
        if size:
            if len(blob) < size:
                blob = self.mem.read(interp + lo, size)
            nxt = _U64.unpack_from(blob, lay.interp_next - lo)[0]
            head = _U64.unpack_from(blob, lay.interp_tstate_head - lo)[0]
        else:
            blob = b""
            nxt, head = self.mem.u64(interp + lay.interp_next), self.mem.u64(interp + lay.interp_tstate_head)
        if lay.gil_mode == "runtime" or not gil:
            return nxt, head, 0
        at = gil - interp - lo
        if at < 0 or at + g_hi > len(blob):
            try:
                blob, at = self.mem.read(gil + g_lo, g_hi - g_lo), -g_lo
            except ReadError:
                return nxt, head, 0
        locked = _I32.unpack_from(blob, at + lay.gil_locked)[0]
        return nxt, head, (_U64.unpack_from(blob, at + lay.gil_last_holder)[0] if locked else 0)

    def sample(self, retries: int = 3, stop_threads: bool = False) -> Sample:
        """One sample of every thread, the target running (default) or with only its Python threads
        stopped for the read (stop_threads); raises ProcessGone when it exited."""
        if self._native is not None and not stop_threads and self._state_override is None:
            # the walk in C (_walker.c), as lean as Python allows: at low rates every bytecode here is cold.
            # It keeps each thread's last walk: a thread whose stack cannot have changed (not on a CPU since,
            # with the same thread-state bytes; or the same frame records) comes back as the same ThreadStack,
            # and of a changed stack only the records above its unchanged bottom are decoded, each (code,
            # instruction) once (calling back _interp_frame/_object_frame), until every revalidate_seconds
            # a fresh walk re-checks the code objects.
            try:
                res = self._native.sample()
            except (TornRead, ReadError) as exc:   # from decoding a code object that read back torn
                res = (2, str(exc))
            if type(res[1]) is list and not self._native_tids:
                self.samples += 1
                return Sample(res[0], self.pid, res[1])
            return self._sample_native(res, retries)
        if stop_threads:
            from steplens.agent.pyframes.seize import StoppedThreads
            tids = self._python_tids or [t.tid for t in self.sample(retries).threads]
            now = time.monotonic()
            # the scheduler state as it was before we stopped them (inside, every thread is "stopped")
            before = {tid: self._task(tid, now)[:2] for tid in tids} if self.thread_states else {}
            with StoppedThreads(tids) as stopped:
                self._state_override = before
                try:
                    sample = self.sample(retries)
                finally:
                    self._state_override = None
            self.stopped_ns_total += stopped.stopped_ns
            self._python_tids = [t.tid for t in sample.threads]
            return sample
        last: Exception | None = None
        for _ in range(retries + 1):
            try:
                return self._sample_once()
            except (TornRead, ReadError) as exc:
                self.torn += 1
                last = exc
        if process_state(self.pid, self.proc_root) in ("", "Z", "X"):
            raise ProcessGone(f"process {self.pid} exited")
        raise TornRead(f"no consistent sample of process {self.pid} after {retries + 1} tries: {last}")

    def _sample_native(self, res: tuple, retries: int) -> Sample:
        """The rest of a sample walked in C, past sample()'s common case: a failed try (retried as the Python
        walk's are), and 3.9/3.10's tid offset, calibrated from the first interpreter's threads."""
        last: Exception | None = None
        for attempt in range(retries + 1):
            try:
                if attempt:
                    res = self._native.sample()
                if type(res[1]) is not list:
                    self._native_error(res)
                if self._native_tids and self._native_tid_offset(res[1][:res[2]]):
                    res = self._native.sample()   # the offset was (re)calibrated: this sample's tids are stale
                    if type(res[1]) is not list:
                        self._native_error(res)
            except (TornRead, ReadError) as exc:
                self.torn += 1
                last = exc
                continue
            self.samples += 1
            return Sample(res[0], self.pid, res[1])
        if process_state(self.pid, self.proc_root) in ("", "Z", "X"):
            raise ProcessGone(f"process {self.pid} exited")
        raise TornRead(f"no consistent sample of process {self.pid} after {retries + 1} tries: {last}")

    def _native_error(self, res: tuple) -> None:
        if res[0] == 1:
            _, err, addr = res
            if err == errno.ESRCH:
                raise ProcessGone(f"process {self.pid} exited")
            self.mem._check_alive()
            raise ReadError(f"cannot read at {addr:#x} in process {self.pid}: {os.strerror(err)}")
        raise TornRead(res[1])

    def _native_tid_offset(self, threads: list[ThreadStack]) -> bool:
        """3.9/3.10: calibrate the tid offset from the first interpreter's threads (see _check_tid_offset);
        True when it changed (the walk is told)."""
        before = self._tid_off
        self._check_tid_offset([t.thread_id for t in threads])
        if self._tid_off == before:
            return False
        self._native.set_tid_off(-1 if self._tid_off is None else self._tid_off)
        return True

    def _sample_once(self) -> Sample:
        # kept lean: at a low rate every sample starts with cold caches, and its cost is then mostly the
        # number of Python operations and system calls it makes (bench/README.md, pystacks.py)
        lay = self.layout
        now = time.monotonic()
        if now - self._memo_cleared > self.revalidate_seconds or len(self._frame_memo) > 50_000:
            # decoded frames trust their code objects; re-derive them now and then (address reuse)
            self._frame_memo = {}
            self._memo_cleared = now
            self._memo_gen += 1
        mono = time.monotonic_ns()
        self._cur = {}
        blob = self.mem.read(self.runtime + self._rt_lo, self._rt_size or 8)
        interp = _U64.unpack_from(blob, lay.runtime_interpreters_head - self._rt_lo)[0]
        if not interp:
            raise TornRead("no interpreter (starting up or finalizing)")
        runtime_holder = 0
        if lay.gil_mode == "runtime":
            if not self._rt_size:
                blob = self.mem.read(self.runtime + lay.gil_last_holder, lay.gil_locked + 4 - lay.gil_last_holder)
                base = lay.gil_last_holder
            else:
                base = self._rt_lo
            if _I32.unpack_from(blob, lay.gil_locked - base)[0]:
                runtime_holder = _U64.unpack_from(blob, lay.gil_last_holder - base)[0]
        threads = []
        live_tids: set[int] = set()
        all_tstates: set[int] = set()
        seen_interps = set()
        tsize = lay.tstate_read_size
        t_interp, t_next, t_thread_id = lay.tstate_interp, lay.tstate_next, lay.tstate_thread_id
        native = lay.tstate_native_thread_id
        cframe_off = lay.tstate_cframe
        want_states = self.thread_states
        last_walks = self._threads_last
        read = self.mem.read
        while interp:
            if interp in seen_interps or len(seen_interps) > 64:
                raise TornRead("interpreter list loops")
            seen_interps.add(interp)
            next_interp, tstate, holder = self._interp_read(interp)
            holder = holder or runtime_holder
            found = []
            while tstate:
                if tstate in all_tstates or len(all_tstates) > MAX_THREADS:
                    raise TornRead("thread list loops")
                all_tstates.add(tstate)
                raw = read(tstate, tsize)
                if _U64.unpack_from(raw, t_interp)[0] != interp:
                    raise TornRead("thread state does not point back to its interpreter")
                found.append((tstate, raw))
                tstate = _U64.unpack_from(raw, t_next)[0]
            if native is None:
                self._check_tid_offset([_U64.unpack_from(raw, lay.tstate_thread_id)[0] for _, raw in found])
            for tstate, raw in found:
                if native is not None:
                    tid = _U64.unpack_from(raw, native)[0] & 0xFFFFFFFF
                else:
                    tid = self._native_tid(raw)
                ns_tid = tid
                if self.ns_pid:
                    tid = self._host_tid(tid, now)
                # the scheduler state first (see _task): a thread that has not been on a CPU since its last
                # walk, with the same thread state bytes, has the same stack (no read of its frames)
                state, name, quiet = self._task(tid, now) if (want_states and tid) else ("unknown", "", False)
                if self.ns_pid and want_states and tid and tid not in self._tasks and self._state_override is None:
                    self._ns_tids.pop(ns_tid, None)   # its task is gone: the tid may name a new thread now
                    again = self._host_tid(ns_tid, now)
                    if again and again != tid:
                        tid = again
                        state, name, quiet = self._task(tid, now)
                live_tids.add(tid)
                last = last_walks.get(tstate)
                if quiet and last is not None and last[0] == raw:
                    frames = last[1]
                else:
                    if cframe_off is not None:
                        # the _PyCFrame is a local of the C function that runs the thread's Python code,
                        # as is (3.12) the shim frame at the bottom of its frame chain: read their block
                        at = _U64.unpack_from(raw, cframe_off)[0] + lay.cframe_current_frame
                        o = at & (BLOCK - 1)
                        if at - lay.cframe_current_frame == 0:
                            frame = 0
                        elif o <= BLOCK - 8:
                            frame = _U64.unpack_from(self._block(at - o), o)[0]
                        else:
                            frame = self.mem.u64(at)
                    else:
                        frame = _U64.unpack_from(raw, lay.tstate_frame)[0]
                    frames = self._walk(tstate, frame, now)
                    last_walks[tstate] = (raw, frames)
                threads.append(ThreadStack(tid, _U64.unpack_from(raw, t_thread_id)[0], name, tstate == holder,
                                           state, frames))
            interp = next_interp
        if not (self._tasks.keys() <= live_tids and self._schedstat.keys() <= live_tids):
            for gone in (self._tasks.keys() | self._schedstat.keys()) - live_tids:
                self._forget_task(gone)
        if len(self._walk_cache) > len(all_tstates) + 64:
            self._walk_cache = {k: v for k, v in self._walk_cache.items() if k in all_tstates}
        if len(last_walks) > len(all_tstates) + 64:
            self._threads_last = {k: v for k, v in last_walks.items() if k in all_tstates}
        if len(self._chains) > len(all_tstates) + 64:
            self._chains = {k: v for k, v in self._chains.items() if k in all_tstates}
        self.samples += 1
        return Sample(mono, self.pid, threads)

    def _check_tid_offset(self, pthreads: list[int]) -> None:
        """3.9/3.10: (re)calibrate where glibc's struct pthread keeps the tid (see _calibrate_tid_offset),
        from the pthread_t of an interpreter's threads in list order."""
        if pthreads and self._tid_off is None:
            # threads are prepended: the main thread is the last in the list
            self._calibrate_tid_offset(pthreads, pthreads[-1])
            if self._tid_off is None:
                self._tid_off = self._tid_fallback  # single thread for now: use it, re-check later
                self._recheck_tid = True
        elif getattr(self, "_recheck_tid", False) and len(pthreads) > 1:
            self._recheck_tid = False
            self._tid_off = None

    def _main_pthread(self, interp: int) -> int:
        """The main thread's pthread_t: the last thread state in the list (threads are prepended)."""
        lay = self.layout
        t = self.mem.u64(interp + lay.interp_tstate_head)
        last = t
        for _ in range(MAX_THREADS):
            nxt = self.mem.u64(t + lay.tstate_next)
            if not nxt:
                break
            last = t = nxt
        return self.mem.u64(last + lay.tstate_thread_id)

    def close(self) -> None:
        self._native = None   # closes its /proc descriptors; it reads through self.mem's, closed below
        for tid in list(self._tasks.keys() | self._schedstat.keys()):
            self._forget_task(tid)
        self.mem.close()


def native_unavailable() -> str:
    """Why samples are not walked in C (_walker.c), or "" when they are."""
    if os.environ.get("STEPLENS_PYFRAMES_NATIVE", "1") == "0":
        return "the sampler's C walk is turned off (STEPLENS_PYFRAMES_NATIVE=0): it walks in Python"
    try:
        from steplens.agent.pyframes import _walker  # noqa: F401
    except ImportError as exc:
        return f"the sampler's C walk is not built ({exc}): it walks in Python, at 2-3x the CPU per sample"
    return ""


def attach(pid: int, proc_root: str = "/proc", **kwargs) -> PythonProcess:
    return PythonProcess(pid, proc_root, **kwargs)
