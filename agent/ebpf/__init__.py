"""Shared plumbing for the agent's eBPF sources: whether eBPF can run here and exactly why not, struct offsets
from the running kernel's BTF (agent/ebpf/btf.py), rendering of the BPF C templates (`*.bpf.c` beside each
source) by a pure function, and compiling them.

BPF C is compiled by bcc in a short-lived helper process (agent/ebpf/build.py): the agent itself never loads
bcc, clang or LLVM (they cost it ~230 MB). The helper sends back the maps (fds) and bytecode; the agent loads and
attaches the programs with plain syscalls (agent/ebpf/maps.py). bcc is Debian's `python3-bpfcc` (pure Python +
ctypes over libbcc), installed under /usr/lib/python3/dist-packages; the helper imports it from there without
putting the rest of that directory on sys.path. The PyPI package named `bcc` is unrelated.

Kernel headers on a build host may be older than the running kernel (here: 6.1 headers, 6.18
kernel): programs read kernel struct fields at offsets taken from BTF at run time, never from the
headers, so a field that moved between versions is still read right.

Kernels differ in which BTF program types they accept (seen: one refused BPF iterators with EPERM, another
fentry), so sources that use them fall back to a classic build, and `tracing_support()` tells beforehand
(loading minimal programs) which build a source will get. The environment variable STEPLENS_EBPF_REFUSE
(comma-separated: tp_btf, iter, fentry, fexit, or tracing for all of them) makes this process refuse those
program types as such a kernel would (EPERM at load), so the fallbacks run and are tested on every host.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import platform
import re
import sys
import threading

from . import btf, build, maps

BCC_DIRS = ("/usr/lib/python3/dist-packages", "/usr/local/lib/python3/dist-packages")
BTF_PATH = "/sys/kernel/btf/vmlinux"


class EbpfUnavailable(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def load_bcc():
    """The bcc module, or EbpfUnavailable with the reason."""
    if "bcc" in sys.modules and hasattr(sys.modules["bcc"], "BPF"):
        return sys.modules["bcc"]
    for base in BCC_DIRS:
        init = os.path.join(base, "bcc", "__init__.py")
        if os.path.exists(init):
            spec = importlib.util.spec_from_file_location("bcc", init, submodule_search_locations=[os.path.dirname(init)])
            module = importlib.util.module_from_spec(spec)
            sys.modules["bcc"] = module
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                del sys.modules["bcc"]
                raise EbpfUnavailable(f"bcc found at {init} but failed to load: {exc}") from None
            return module
    raise EbpfUnavailable("bcc is not installed (Debian: apt-get install python3-bpfcc; `make install` does it)")


def unavailable_reason(proc_root: str = "/proc") -> str:
    """"" when eBPF sources can run here, else the first thing that is missing, said exactly."""
    if os.geteuid() != 0:
        caps = _effective_caps(proc_root)
        if not (caps >> 39 & 1 and caps >> 38 & 1) and not caps >> 21 & 1:  # CAP_BPF+CAP_PERFMON or CAP_SYS_ADMIN
            return "not root and no CAP_BPF+CAP_PERFMON (or CAP_SYS_ADMIN): eBPF programs cannot be loaded"
    if not os.path.exists(BTF_PATH):
        return f"no kernel BTF ({BTF_PATH} missing): struct offsets cannot be read (needs CONFIG_DEBUG_INFO_BTF)"
    build = f"/lib/modules/{platform.release()}/build"
    if not os.path.exists(os.path.join(build, "include")):
        return (f"no kernel headers at {build} (install linux-headers-{platform.release()}, or run `make install` "
                "which links the closest available headers)")
    if not (os.path.exists("/sys/kernel/tracing/events") or os.path.exists("/sys/kernel/debug/tracing/events")):
        return "tracefs is not mounted (mount -t tracefs tracefs /sys/kernel/tracing)"
    return bcc_missing()


def bcc_missing() -> str:
    """"" when bcc (its Python package and libbcc) is installed, else what is missing; checked by looking, not by
    importing (which would map LLVM into this process)."""
    if not any(os.path.exists(os.path.join(base, "bcc", "__init__.py")) for base in BCC_DIRS):
        return "bcc is not installed (Debian: apt-get install python3-bpfcc; `make install` does it)"
    libdirs = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
               "/usr/local/lib", "/lib/x86_64-linux-gnu")
    if not any(os.path.exists(os.path.join(d, "libbcc.so.0")) for d in libdirs):
        return "bcc's Python package is installed but libbcc.so.0 is not (apt-get install libbpfcc)"
    return ""


def _effective_caps(proc_root: str) -> int:
    try:
        with open(os.path.join(proc_root, "self", "status")) as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def btf_offset(struct: str, path: str) -> int:
    """Byte offset of `path` ("a.b" through named or anonymous members) inside `struct S` of the kernel's BTF."""
    try:
        return btf.kernel().offset(struct, path)
    except btf.BtfError as exc:
        raise EbpfUnavailable(str(exc)) from None


def _btf_find(kind: str, name: str) -> int | None:
    try:
        return btf.kernel().find(kind, name)
    except btf.BtfError as exc:
        raise EbpfUnavailable(str(exc)) from None


@functools.lru_cache(maxsize=None)
def btf_tracepoint_id(tp: str) -> int | None:
    """BTF type id of `btf_trace_<tp>` (the typedef a BTF raw tracepoint program attaches to), or None."""
    return _btf_find("TYPEDEF", f"btf_trace_{tp}")


_ProgLoadAttr, _RawTpOpenAttr = maps.ProgLoadAttr, maps.RawTpOpenAttr


_SYS_BPF = 321  # x86-64
_BPF_PROG_LOAD, _BPF_RAW_TRACEPOINT_OPEN = 5, 17
_BPF_PROG_TYPE_TRACING, _BPF_TRACE_RAW_TP = 26, 23


@functools.lru_cache(maxsize=None)
def btf_struct_id(name: str) -> int | None:
    """BTF type id of `struct name` in the kernel's BTF, or None."""
    return _btf_find("STRUCT", name)


@functools.lru_cache(maxsize=None)
def btf_func_id(name: str) -> int | None:
    """BTF type id of the kernel FUNC `name` (an iterator target is `bpf_iter_<target>`), or None."""
    return _btf_find("FUNC", name)


_BPF_LINK_CREATE, _BPF_ITER_CREATE = 28, 33
_BPF_TRACE_ITER = 28


@functools.lru_cache(maxsize=1)
def _timens_monotonic_offset_ns() -> int:
    """This process's time-namespace shift of CLOCK_MONOTONIC (0 outside one, or before 5.6 had them)."""
    try:
        with open("/proc/self/timens_offsets") as fh:
            for line in fh:
                name, sec, nsec = line.split()
                if name in ("monotonic", "1"):
                    return int(sec) * 1_000_000_000 + int(nsec)
    except (OSError, ValueError):
        pass
    return 0


def ktime_now_ns() -> int:
    """The clock of bpf_ktime_get_ns() read from user space: CLOCK_MONOTONIC less the time namespace's shift
    (BPF helpers read the host's clock, unshifted)."""
    import time

    return time.monotonic_ns() - _timens_monotonic_offset_ns()


def _libc():
    return ctypes.CDLL(None, use_errno=True)


# Kernel functions (kfuncs) a bcc program may call: bcc 0.26 cannot emit kfunc calls, so the C calls a
# placeholder helper number (real helpers are numbered below 1000) and the loader rewrites
# each such call into a kfunc call (src_reg = BPF_PSEUDO_KFUNC_CALL, imm = the kfunc's id in vmlinux BTF).
KFUNC_PLACEHOLDERS = {0x7FF0: "bpf_rdonly_cast"}
_BPF_PSEUDO_KFUNC_CALL = 2


def patch_kfunc_calls(insns: bytearray) -> int:
    """Rewrite placeholder calls (KFUNC_PLACEHOLDERS) in BPF bytecode into kfunc calls, in place; the number
    rewritten. EbpfUnavailable if the kernel has no such kfunc."""
    n = 0
    for i in range(0, len(insns) - 7, 8):
        if insns[i] != 0x85:  # BPF_JMP | BPF_CALL
            continue
        imm = int.from_bytes(insns[i + 4:i + 8], "little", signed=True)
        name = KFUNC_PLACEHOLDERS.get(imm)
        if name is None:
            continue
        fid = btf_func_id(name)
        if fid is None:
            raise EbpfUnavailable(f"kernel has no kfunc {name}")
        insns[i + 1] = (insns[i + 1] & 0x0F) | (_BPF_PSEUDO_KFUNC_CALL << 4)
        insns[i + 2:i + 4] = b"\0\0"  # off 0: vmlinux BTF
        insns[i + 4:i + 8] = fid.to_bytes(4, "little")
        n += 1
    return n


REFUSE_ENV = "STEPLENS_EBPF_REFUSE"
_BPF_TRACE_FENTRY, _BPF_TRACE_FEXIT = 24, 25
TRACING_KINDS = {_BPF_TRACE_RAW_TP: "tp_btf", 28: "iter", _BPF_TRACE_FENTRY: "fentry", _BPF_TRACE_FEXIT: "fexit"}


def refused_by_env(kind: str) -> str:
    """"" unless STEPLENS_EBPF_REFUSE names this tracing kind (or "tracing"); then the error to raise."""
    names = {n.strip() for n in os.environ.get(REFUSE_ENV, "").split(",") if n.strip()}
    if kind in names or "tracing" in names:
        return f"Operation not permitted ({REFUSE_ENV}={os.environ[REFUSE_ENV]} refuses {kind} programs here)"
    return ""


def _load_tracing(module, fn_name: str, attach_type: int, btf_id: int, prog_name: str, what: str) -> int:
    """Load the bytecode bcc compiled for `fn_name` (map fds renumbered to ours, kfunc placeholders rewritten) as
    BPF_PROG_TYPE_TRACING with this expected attach type and BTF target; the program fd, or EbpfUnavailable
    with the verifier's last lines."""
    if platform.machine() != "x86_64":
        raise EbpfUnavailable("BTF tracing programs are loaded by syscall number only on x86-64 here")
    try:
        code = bytearray(module.code(fn_name))
    except maps.BpfError as exc:
        raise EbpfUnavailable(str(exc)) from None
    patch_kfunc_calls(code)
    return _prog_load_tracing(bytes(code), attach_type, btf_id, prog_name, f"loading {fn_name} as {what}")


def _prog_load_tracing(code: bytes, attach_type: int, btf_id: int, prog_name: str, what: str) -> int:
    refused = refused_by_env(TRACING_KINDS.get(attach_type, "tracing"))
    if refused:
        raise EbpfUnavailable(f"{what} failed: {refused}")
    try:
        return maps.load_program(code, _BPF_PROG_TYPE_TRACING, prog_name, expected_attach_type=attach_type,
                                 attach_btf_id=btf_id, what=what)
    except maps.BpfError as exc:
        raise EbpfUnavailable(str(exc)) from None


class BtfRawTracepoint:
    """A bcc-compiled function loaded and attached as a BTF raw tracepoint ("tp_btf"): its arguments are
    typed, so kernel memory read through them is a plain load the verifier checks against BTF, not a
    bpf_probe_read_kernel() call (measured: ~35 % of a packet hook's time here), and helpers that need a
    typed socket (bpf_sk_storage_get) are allowed. bcc 0.26 cannot load this program type itself; the bytecode
    it compiled goes through the bpf() syscall like every program here. The program lives as long as the two
    fds: close() (or process exit) detaches it."""

    def __init__(self, bpf, fn_name: str, tp: str, prog_name: str) -> None:
        btf_id = btf_tracepoint_id(tp)
        if btf_id is None:
            raise EbpfUnavailable(f"no btf_trace_{tp} in kernel BTF")
        self.prog_fd = _load_tracing(bpf, fn_name, _BPF_TRACE_RAW_TP, btf_id, prog_name,
                                     f"BTF raw tracepoint {tp}")
        self.what = f"{fn_name} on BTF raw tracepoint {tp}"
        self.link_fd = -1
        try:
            self.attach()
        except EbpfUnavailable:
            os.close(self.prog_fd)
            self.prog_fd = -1
            raise

    def attach(self) -> None:
        """Attach the loaded program (again, after detach())."""
        if self.link_fd >= 0:
            return
        ra = _RawTpOpenAttr(name=0, prog_fd=self.prog_fd)
        fd = _libc().syscall(_SYS_BPF, _BPF_RAW_TRACEPOINT_OPEN, ctypes.byref(ra), ctypes.sizeof(ra))
        if fd < 0:
            raise EbpfUnavailable(f"attaching {self.what} failed: {os.strerror(ctypes.get_errno())}")
        self.link_fd = fd

    def detach(self) -> None:
        """Detach, keeping the program loaded (its maps keep their contents)."""
        if self.link_fd >= 0:
            os.close(self.link_fd)
            self.link_fd = -1

    def close(self) -> None:
        for fd in (getattr(self, "link_fd", -1), getattr(self, "prog_fd", -1)):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.link_fd = self.prog_fd = -1


class _LinkCreateIterAttr(ctypes.Structure):
    """union bpf_attr, the BPF_LINK_CREATE member with iter_info (include/uapi/linux/bpf.h)."""
    _fields_ = [("prog_fd", ctypes.c_uint32), ("target_fd", ctypes.c_uint32), ("attach_type", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("iter_info", ctypes.c_uint64), ("iter_info_len", ctypes.c_uint32),
                ("_rest", ctypes.c_char * 36)]


class MapIterator:
    """A BPF map iterator ("iter/<target>", e.g. bpf_sk_storage_map): a bcc-compiled function loaded as a
    BPF_TRACE_ITER tracing program and linked to one map. read() runs it once over every element and returns
    what it wrote with bpf_seq_write(). Used for maps user space cannot walk with get-next-key (socket-local
    storage). close() (or process exit) frees it."""

    def __init__(self, bpf, fn_name: str, target: str, map_fd: int, prog_name: str) -> None:
        btf_id = btf_func_id(f"bpf_iter_{target}")
        if btf_id is None:
            raise EbpfUnavailable(f"no iterator target {target} (bpf_iter_{target}) in kernel BTF")
        self.prog_fd = _load_tracing(bpf, fn_name, _BPF_TRACE_ITER, btf_id, prog_name, f"iterator {target}")
        info = (ctypes.c_uint32 * 4)(map_fd, 0, 0, 0)  # union bpf_iter_link_info: .map.map_fd
        attr = _LinkCreateIterAttr(prog_fd=self.prog_fd, attach_type=_BPF_TRACE_ITER,
                                   iter_info=ctypes.addressof(info), iter_info_len=ctypes.sizeof(info))
        self.link_fd = _libc().syscall(_SYS_BPF, _BPF_LINK_CREATE, ctypes.byref(attr), ctypes.sizeof(attr))
        if self.link_fd < 0:
            err = os.strerror(ctypes.get_errno())
            os.close(self.prog_fd)
            self.prog_fd = -1
            raise EbpfUnavailable(f"linking iterator {fn_name} to {target} failed: {err}")

    def read(self) -> bytes:
        if self.link_fd < 0:
            raise EbpfUnavailable("iterator is closed")
        attr = (ctypes.c_uint32 * 2)(self.link_fd, 0)
        fd = _libc().syscall(_SYS_BPF, _BPF_ITER_CREATE, ctypes.byref(attr), ctypes.sizeof(attr))
        if fd < 0:
            raise OSError(ctypes.get_errno(), f"BPF_ITER_CREATE: {os.strerror(ctypes.get_errno())}")
        chunks = []
        try:
            while True:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(fd)
        return b"".join(chunks)

    close = BtfRawTracepoint.close


def table_fd(module, name: str) -> int:
    """The fd of one of a module's maps."""
    try:
        return module.table_fd(name)
    except KeyError as exc:
        raise EbpfUnavailable(str(exc)) from None


# One compilation at a time: each is a helper process running clang/LLVM (~150 MB and one core for a second or
# two); sources starting on their threads at once queue here instead of multiplying that.
BUILD_LOCK = threading.Lock()


def compile_program(text: str, tables: tuple[str, ...] = ()) -> "maps.Module":
    """Compile BPF C in the helper process (agent/ebpf/build.py): the module with its maps; `tables` must exist.
    EbpfUnavailable with the compiler's message on failure."""
    with BUILD_LOCK:
        try:
            specs, functions = build.compile_text(text)
        except build.BuildError as exc:
            raise EbpfUnavailable(str(exc)) from None
    module = maps.Module(specs, functions)
    missing = [name for name in tables if name not in {t["name"] for t in specs}]
    if missing:
        module.cleanup()
        raise EbpfUnavailable(f"the compiled BPF module has no map {', '.join(missing)}")
    return module


def cleanup(module) -> None:
    """Detach and free a module (idempotent)."""
    module.cleanup()


def release_btf() -> None:
    """Drop the kernel BTF read for offsets and ids (read again when next needed)."""
    btf.release()


def render(template: str, **values) -> str:
    """Replace every {{NAME}} in the BPF C template; a missing or unused value is an error."""
    names = set(re.findall(r"\{\{(\w+)\}\}", template))
    missing = names - set(values)
    if missing:
        raise KeyError(f"BPF template needs values for {', '.join(sorted(missing))}")
    unused = set(values) - names
    if unused:
        raise KeyError(f"BPF template has no placeholder for {', '.join(sorted(unused))}")
    return re.sub(r"\{\{(\w+)\}\}", lambda m: str(values[m.group(1)]), template)


# ---- what the kernel accepts, found out with minimal programs (no bcc, no compiler) ----------------------

_MINIMAL_PROG = bytes.fromhex("b700000000000000" "9500000000000000")  # r0 = 0; exit
_BPF_MAP_CREATE, _BPF_BTF_LOAD = 0, 18
_BPF_MAP_TYPE_SK_STORAGE, _BPF_F_NO_PREALLOC = 24, 1


def _sys_bpf(cmd: int, attr) -> int:
    fd = _libc().syscall(_SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if fd < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return fd


def _int_btf_fd() -> int:
    """A BTF object holding one type, [1] `int` (4 bytes, signed): what a socket-storage map's key and value
    are declared as here."""
    import struct
    strings = b"\0int\0"
    types = struct.pack("<III", 1, 1 << 24, 4) + struct.pack("<I", (1 << 24) | 32)  # INT "int", size 4, signed 32
    blob = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(strings)) + types + strings
    buf = ctypes.create_string_buffer(blob, len(blob))
    attr = (ctypes.c_uint32 * 12)()   # union bpf_attr, BPF_BTF_LOAD: btf (u64), btf_log_buf (u64), btf_size, ...
    ctypes.memmove(attr, ctypes.byref(ctypes.c_uint64(ctypes.addressof(buf))), 8)  # btf
    attr[4] = len(blob)                                                                # btf_size
    return _sys_bpf(_BPF_BTF_LOAD, attr)


def _sk_storage_map_fd() -> int:
    btf = _int_btf_fd()
    try:
        attr = (ctypes.c_uint32 * 30)()
        attr[0], attr[1], attr[2], attr[3], attr[4] = _BPF_MAP_TYPE_SK_STORAGE, 4, 4, 0, _BPF_F_NO_PREALLOC
        attr[12], attr[13], attr[14] = btf, 1, 1   # btf_fd, btf_key_type_id, btf_value_type_id (after map_name)
        return _sys_bpf(_BPF_MAP_CREATE, attr)
    finally:
        os.close(btf)


def _try_tp_btf(tp: str) -> str:
    btf_id = btf_tracepoint_id(tp)
    if btf_id is None:
        return f"no btf_trace_{tp} in kernel BTF"
    fd = link = -1
    try:
        fd = _prog_load_tracing(_MINIMAL_PROG, _BPF_TRACE_RAW_TP, btf_id, "steplens_probe", "loading a BTF raw "
                                f"tracepoint (tp_btf) program on {tp}")
        link = _sys_bpf(_BPF_RAW_TRACEPOINT_OPEN, _RawTpOpenAttr(name=0, prog_fd=fd))
        return ""
    except EbpfUnavailable as exc:
        return str(exc)
    except OSError as exc:
        return f"attaching a BTF raw tracepoint (tp_btf) program to {tp} failed: {exc.strerror}"
    finally:
        for f in (link, fd):
            if f >= 0:
                os.close(f)


def _try_map_iter(target: str) -> str:
    btf_id = btf_func_id(f"bpf_iter_{target}")
    if btf_id is None:
        return f"no iterator target {target} (bpf_iter_{target}) in kernel BTF"
    fd = map_fd = link = -1
    try:
        fd = _prog_load_tracing(_MINIMAL_PROG, _BPF_TRACE_ITER, btf_id, "steplens_probe",
                                f"loading a BPF iterator (iter/{target}) program")
        map_fd = _sk_storage_map_fd()
        info = (ctypes.c_uint32 * 4)(map_fd, 0, 0, 0)
        link = _sys_bpf(_BPF_LINK_CREATE, _LinkCreateIterAttr(prog_fd=fd, attach_type=_BPF_TRACE_ITER,
                                                              iter_info=ctypes.addressof(info),
                                                              iter_info_len=ctypes.sizeof(info)))
        return ""
    except EbpfUnavailable as exc:
        return str(exc)
    except OSError as exc:
        what = "creating a socket-storage map" if map_fd < 0 else f"linking a BPF iterator to {target}"
        return f"{what} failed: {exc.strerror}"
    finally:
        for f in (link, map_fd, fd):
            if f >= 0:
                os.close(f)


def tracing_support(tp_btf: tuple[str, ...] = (), map_iter: tuple[str, ...] = ()) -> dict[str, str]:
    """Whether this kernel (and STEPLENS_EBPF_REFUSE) accepts the BTF tracing programs a source would load:
    {"tp_btf:<tracepoint>" or "iter:<target>": "" if accepted, else why not}. Each is tried with a minimal
    program (r0 = 0; exit) of that type, attached (tp_btf) or linked to a socket-storage map (iter), then closed:
    a few ms, nothing left loaded. Needs what eBPF needs (unavailable_reason() == "")."""
    if platform.machine() != "x86_64":
        return {**{f"tp_btf:{t}": "BTF tracing programs are loaded only on x86-64 here" for t in tp_btf},
                **{f"iter:{t}": "BTF tracing programs are loaded only on x86-64 here" for t in map_iter}}
    out = {}
    for tp in tp_btf:
        out[f"tp_btf:{tp}"] = _try_tp_btf(tp)
    for target in map_iter:
        out[f"iter:{target}"] = _try_map_iter(target)
    return out
