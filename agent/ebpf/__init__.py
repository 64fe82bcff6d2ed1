"""Shared plumbing for the agent's eBPF sources (bcc): where bcc lives, whether eBPF can run here
and exactly why not, struct offsets from the running kernel's BTF, and rendering of the BPF C
templates (`*.bpf.c` beside each source) by a pure function.

bcc is Debian's `python3-bpfcc` (pure Python + ctypes over libbcc), installed under
/usr/lib/python3/dist-packages; it is imported from there without putting the rest of that
directory on sys.path. The PyPI package named `bcc` is unrelated.

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
import shutil
import subprocess
import sys
import threading

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
    try:
        load_bcc()
    except EbpfUnavailable as exc:
        return str(exc)
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


@functools.lru_cache(maxsize=1)
def _btf_dump() -> list[str]:
    tool = shutil.which("bpftool") or "/usr/sbin/bpftool"
    try:
        out = subprocess.run([tool, "btf", "dump", "file", BTF_PATH, "format", "raw"], capture_output=True,
                             text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise EbpfUnavailable(f"cannot read BTF with bpftool ({exc}); apt-get install bpftool") from None
    return out.splitlines()


_TYPE_RE = re.compile(r"^\[(\d+)\] (\w+) '([^']*)'(.*)$")
_MEMBER_RE = re.compile(r"^\s+'([^']*)' type_id=(\d+) bits_offset=(\d+)")


@functools.lru_cache(maxsize=1)
def _btf_types() -> tuple[dict, dict]:
    types: dict[int, tuple[str, str, list]] = {}
    by_name: dict[tuple[str, str], int] = {}
    current = None
    for line in _btf_dump():
        m = _TYPE_RE.match(line)
        if m:
            tid, kind, name = int(m.group(1)), m.group(2), m.group(3)
            current = (kind, name, [])
            types[tid] = current
            if kind in ("STRUCT", "UNION") and name and (kind, name) not in by_name:
                by_name[(kind, name)] = tid
            continue
        mm = _MEMBER_RE.match(line)
        if mm and current is not None:
            current[2].append((mm.group(1), int(mm.group(2)), int(mm.group(3))))
    return types, by_name


def btf_offset(struct: str, path: str) -> int:
    """Byte offset of `path` ("a.b" through named or anonymous members) inside `struct S`."""
    types, by_name = _btf_types()
    tid = by_name.get(("STRUCT", struct)) or by_name.get(("UNION", struct))
    if tid is None:
        raise EbpfUnavailable(f"struct {struct} not found in kernel BTF")

    def find(type_id: int, name: str) -> tuple[int, int] | None:
        kind, _, members = types[type_id]
        for mname, mtype, bits in members:
            if mname == name:
                return bits // 8, mtype
            if mname in ("", "(anon)"):  # anonymous struct/union: look inside
                inner = find(_resolve(mtype), name)
                if inner is not None:
                    return bits // 8 + inner[0], inner[1]
        return None

    offset = 0
    for part in path.split("."):
        hit = find(_resolve(tid), part)
        if hit is None:
            raise EbpfUnavailable(f"{struct}.{path}: no member {part!r} in kernel BTF")
        offset += hit[0]
        tid = hit[1]
    return offset


def _resolve(type_id: int) -> int:
    """Follow typedefs and qualifiers to the struct/union they name."""
    types, _ = _btf_types()
    refs = _btf_refs()
    for _ in range(32):
        kind = types.get(type_id, ("", "", []))[0]
        if kind not in ("TYPEDEF", "CONST", "VOLATILE", "RESTRICT", "TYPE_TAG") or type_id not in refs:
            return type_id
        type_id = refs[type_id]
    return type_id


@functools.lru_cache(maxsize=1)
def _btf_refs() -> dict[int, int]:
    refs = {}
    for line in _btf_dump():
        m = _TYPE_RE.match(line)
        if m and m.group(2) in ("TYPEDEF", "CONST", "VOLATILE", "RESTRICT", "TYPE_TAG"):
            t = re.search(r"type_id=(\d+)", m.group(4))
            if t:
                refs[int(m.group(1))] = int(t.group(1))
    return refs


@functools.lru_cache(maxsize=None)
def btf_tracepoint_id(tp: str) -> int | None:
    """BTF type id of `btf_trace_<tp>` (the typedef a BTF raw tracepoint program attaches to), or None."""
    want = f"btf_trace_{tp}"
    for line in _btf_dump():
        m = _TYPE_RE.match(line)
        if m and m.group(2) == "TYPEDEF" and m.group(3) == want:
            return int(m.group(1))
    return None


class _ProgLoadAttr(ctypes.Structure):
    """union bpf_attr, the BPF_PROG_LOAD member (include/uapi/linux/bpf.h), up to attach_btf_obj_fd."""
    _fields_ = [("prog_type", ctypes.c_uint32), ("insn_cnt", ctypes.c_uint32), ("insns", ctypes.c_uint64),
                ("license", ctypes.c_uint64), ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32),
                ("log_buf", ctypes.c_uint64), ("kern_version", ctypes.c_uint32), ("prog_flags", ctypes.c_uint32),
                ("prog_name", ctypes.c_char * 16), ("prog_ifindex", ctypes.c_uint32),
                ("expected_attach_type", ctypes.c_uint32), ("prog_btf_fd", ctypes.c_uint32),
                ("func_info_rec_size", ctypes.c_uint32), ("func_info", ctypes.c_uint64),
                ("func_info_cnt", ctypes.c_uint32), ("line_info_rec_size", ctypes.c_uint32),
                ("line_info", ctypes.c_uint64), ("line_info_cnt", ctypes.c_uint32),
                ("attach_btf_id", ctypes.c_uint32), ("attach_btf_obj_fd", ctypes.c_uint32),
                ("_rest", ctypes.c_char * 64)]


class _RawTpOpenAttr(ctypes.Structure):
    """union bpf_attr, the BPF_RAW_TRACEPOINT_OPEN member."""
    _fields_ = [("name", ctypes.c_uint64), ("prog_fd", ctypes.c_uint32), ("_rest", ctypes.c_char * 60)]


_SYS_BPF = 321  # x86-64
_BPF_PROG_LOAD, _BPF_RAW_TRACEPOINT_OPEN = 5, 17
_BPF_PROG_TYPE_TRACING, _BPF_TRACE_RAW_TP = 26, 23


def btf_struct_id(name: str) -> int | None:
    """BTF type id of `struct name` in the kernel's BTF, or None."""
    return _btf_types()[1].get(("STRUCT", name))


@functools.lru_cache(maxsize=None)
def btf_func_id(name: str) -> int | None:
    """BTF type id of the kernel FUNC `name` (an iterator target is `bpf_iter_<target>`), or None."""
    for line in _btf_dump():
        m = _TYPE_RE.match(line)
        if m and m.group(2) == "FUNC" and m.group(3) == name:
            return int(m.group(1))
    return None


_BPF_LINK_CREATE, _BPF_ITER_CREATE = 28, 33
_BPF_TRACE_ITER = 28


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


def _load_tracing(bpf, fn_name: str, attach_type: int, btf_id: int, prog_name: str, what: str) -> int:
    """Load the bytecode bcc compiled for `fn_name` (map fds already in it, kfunc placeholders rewritten) as
    BPF_PROG_TYPE_TRACING with this expected attach type and BTF target; the program fd, or EbpfUnavailable
    with the verifier's last lines."""
    if platform.machine() != "x86_64":
        raise EbpfUnavailable("BTF tracing programs are loaded by syscall number only on x86-64 here")
    lib = load_bcc().lib
    fn = fn_name.encode()
    start, size = lib.bpf_function_start(bpf.module, fn), lib.bpf_function_size(bpf.module, fn)
    if not start or not size:
        raise EbpfUnavailable(f"bcc compiled no function {fn_name}")
    code = bytearray(ctypes.string_at(start, size))
    patch_kfunc_calls(code)
    return _prog_load_tracing(bytes(code), attach_type, btf_id, prog_name, f"loading {fn_name} as {what}")


def _prog_load_tracing(code: bytes, attach_type: int, btf_id: int, prog_name: str, what: str) -> int:
    refused = refused_by_env(TRACING_KINDS.get(attach_type, "tracing"))
    if refused:
        raise EbpfUnavailable(f"{what} failed: {refused}")
    size = len(code)
    insns = ctypes.create_string_buffer(code, size)
    license_ = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(256 * 1024)
    attr = _ProgLoadAttr(prog_type=_BPF_PROG_TYPE_TRACING, insn_cnt=size // 8, insns=ctypes.addressof(insns),
                         license=ctypes.addressof(license_), log_level=1, log_size=len(log),
                         log_buf=ctypes.addressof(log), prog_name=prog_name.encode()[:15],
                         expected_attach_type=attach_type, attach_btf_id=btf_id)
    fd = _libc().syscall(_SYS_BPF, _BPF_PROG_LOAD, ctypes.byref(attr), ctypes.sizeof(attr))
    if fd < 0:
        err = os.strerror(ctypes.get_errno())
        tail = " | ".join(log.value.decode(errors="replace").strip().splitlines()[-4:])
        raise EbpfUnavailable(f"{what} failed: {err}: {tail}")
    return fd


class BtfRawTracepoint:
    """A bcc-compiled function loaded and attached as a BTF raw tracepoint ("tp_btf"): its arguments are
    typed, so kernel memory read through them is a plain load the verifier checks against BTF, not a
    bpf_probe_read_kernel() call (measured: ~35 % of a packet hook's time here), and helpers that need a
    typed socket (bpf_sk_storage_get) are allowed. bcc 0.26 cannot load this program type itself, so the
    bytecode bcc compiled (map fds already in it) goes through the bpf() syscall. The program lives as long
    as the two fds: close() (or process exit) detaches it."""

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


def table_fd(bpf, name: str) -> int:
    """The fd of one of a bcc module's maps, also for map types bcc's Python wrapper does not know
    (socket-local storage)."""
    fd = load_bcc().lib.bpf_table_fd(bpf.module, name.encode())
    if fd < 0:
        raise EbpfUnavailable(f"bcc module has no map {name}")
    return fd


# libbcc keeps the tables of every module of the process in one shared storage: building a module (compile),
# destroying one (cleanup) and resolving a table by name all walk or change it, and doing two at once on
# different threads crashes inside libbcc (seen: SIGSEGV in ebpf::TableStorage::iterator when one source
# stopped while another resolved a table). The agent runs each source on its own thread, so all three go
# through this one lock; a table resolved once is cached by bcc and later reads are map syscalls only.
BCC_LOCK = threading.RLock()


def compile_program(text: str, tables: tuple[str, ...] = ()):
    """bcc.BPF(text=...) under the process-wide lock (concurrent bcc/LLVM compilations in one process also
    fail: headers not found), with `tables` resolved while it is held."""
    bcc = load_bcc()
    with BCC_LOCK:
        b = bcc.BPF(text=text.encode() if isinstance(text, str) else text)
        try:
            for name in tables:
                b[name.encode()]
        except Exception:
            b.cleanup()
            raise
        return b


def cleanup(b) -> None:
    """Detach and free a bcc module under the process-wide lock."""
    with BCC_LOCK:
        b.cleanup()


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
