"""The agent's side of a compiled BPF module, over the bpf() and perf_event_open() syscalls only (no bcc, no LLVM in
this process): maps as Python tables, BPF ring buffers, and programs loaded and attached on demand.

A `Module` is what agent/ebpf/build.py's helper compiled: its maps (fds received from the helper) and each
function's bytecode. Programs are loaded here, after their map references are renumbered to this process's fds
(`relocate`), when first attached; an fd held by this process keeps each program, map and attachment alive, and
`cleanup()` (or the process exiting) releases them all.

The table interface follows what the sources used from bcc: `t[key]` (KeyError when absent), `t[key] = v`,
`del t[key]`, `items()`, `keys()`, `len(t)`, `clear()`, `t.Key`/`t.Leaf` (ctypes types from bcc's JSON type
description), per-CPU values as a list per key with `sum(i)`, `walk(stack_id)` on stack-trace maps, and
`open_ring_buffer(cb)` with `Module.ring_buffer_consume()`. Hash and array maps are read with BPF_MAP_LOOKUP_BATCH
where the kernel has it (Linux 5.6+: one syscall per 256 entries instead of two per entry).
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import threading

from . import elfsyms

_SYS_BPF = 321            # x86-64
_SYS_PERF_EVENT_OPEN = 298
(_MAP_LOOKUP, _MAP_UPDATE, _MAP_DELETE, _MAP_NEXT_KEY, _PROG_LOAD, _RAW_TP_OPEN, _LOOKUP_BATCH) = (
    1, 2, 3, 4, 5, 17, 24)
MAP_HASH, MAP_ARRAY, MAP_PERCPU_HASH, MAP_PERCPU_ARRAY, MAP_STACK_TRACE = 1, 2, 5, 6, 7
MAP_LRU_HASH, MAP_LRU_PERCPU_HASH, MAP_SK_STORAGE, MAP_RINGBUF = 9, 10, 24, 27
_PERCPU = (MAP_PERCPU_HASH, MAP_PERCPU_ARRAY, MAP_LRU_PERCPU_HASH)
_BATCHABLE = (MAP_HASH, MAP_PERCPU_HASH, MAP_LRU_HASH, MAP_LRU_PERCPU_HASH, MAP_ARRAY, MAP_PERCPU_ARRAY)
PROG_KPROBE, PROG_RAW_TRACEPOINT = 2, 17
_BPF_PSEUDO_MAP_FD = 1
_PERF_FLAG_FD_CLOEXEC = 8
_PERF_EVENT_IOC_ENABLE, _PERF_EVENT_IOC_SET_BPF = 0x2400, 0x40042408
_PROT_READ, _PROT_WRITE, _MAP_SHARED = 1, 2, 1
_RINGBUF_BUSY, _RINGBUF_DISCARD = 1 << 31, 1 << 30


class BpfError(RuntimeError):
    pass


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong]


def sys_bpf(cmd: int, attr) -> int:
    r = _libc.syscall(_SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return r


class _MapElemAttr(ctypes.Structure):
    _fields_ = [("map_fd", ctypes.c_uint32), ("_pad", ctypes.c_uint32), ("key", ctypes.c_uint64),
                ("value", ctypes.c_uint64), ("flags", ctypes.c_uint64)]


class _BatchAttr(ctypes.Structure):
    _fields_ = [("in_batch", ctypes.c_uint64), ("out_batch", ctypes.c_uint64), ("keys", ctypes.c_uint64),
                ("values", ctypes.c_uint64), ("count", ctypes.c_uint32), ("map_fd", ctypes.c_uint32),
                ("elem_flags", ctypes.c_uint64), ("flags", ctypes.c_uint64)]


class ProgLoadAttr(ctypes.Structure):
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


class RawTpOpenAttr(ctypes.Structure):
    """union bpf_attr, the BPF_RAW_TRACEPOINT_OPEN member."""
    _fields_ = [("name", ctypes.c_uint64), ("prog_fd", ctypes.c_uint32), ("_rest", ctypes.c_char * 60)]


class _PerfEventAttr(ctypes.Structure):
    """struct perf_event_attr up to config2 (probe_offset), padded to PERF_ATTR_SIZE_VER7 (128)."""
    _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
                ("sample_period", ctypes.c_uint64), ("sample_type", ctypes.c_uint64),
                ("read_format", ctypes.c_uint64), ("flags", ctypes.c_uint64), ("wakeup_events", ctypes.c_uint32),
                ("bp_type", ctypes.c_uint32), ("config1", ctypes.c_uint64), ("config2", ctypes.c_uint64),
                ("_rest", ctypes.c_char * 56)]


def kernel_version_code() -> int:
    parts = [int(p) for p in (platform.release().split("-")[0].split(".") + ["0", "0"])[:3] if p.isdigit()]
    a, b, c = (parts + [0, 0, 0])[:3]
    return (a << 16) | (b << 8) | min(c, 255)


def relocate(code: bytes, fd_map: dict[int, int]) -> bytes:
    """Renumber the map references (ld_imm64 with src_reg BPF_PSEUDO_MAP_FD) of bytecode from the helper's fds to
    ours; BpfError for a reference to a map the helper did not send."""
    out = bytearray(code)
    i = 0
    while i + 16 <= len(out):
        if out[i] == 0x18:  # BPF_LD | BPF_IMM | BPF_DW: two instruction slots
            if (out[i + 1] >> 4) == _BPF_PSEUDO_MAP_FD:
                old = int.from_bytes(out[i + 4:i + 8], "little", signed=True)
                if old not in fd_map:
                    raise BpfError(f"bytecode references map fd {old}, which the compiler helper did not send")
                out[i + 4:i + 8] = fd_map[old].to_bytes(4, "little")
            i += 16
        else:
            i += 8
    return bytes(out)


def load_program(code: bytes, prog_type: int, name: str, *, expected_attach_type: int = 0,
                 attach_btf_id: int = 0, what: str = "") -> int:
    """BPF_PROG_LOAD; the program fd, or BpfError with the verifier's last lines."""
    insns = ctypes.create_string_buffer(code, len(code))
    license_ = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(256 * 1024)
    attr = ProgLoadAttr(prog_type=prog_type, insn_cnt=len(code) // 8, insns=ctypes.addressof(insns),
                        license=ctypes.addressof(license_), log_level=1, log_size=len(log),
                        log_buf=ctypes.addressof(log), kern_version=kernel_version_code(),
                        prog_name=name.encode()[:15], expected_attach_type=expected_attach_type,
                        attach_btf_id=attach_btf_id)
    try:
        return sys_bpf(_PROG_LOAD, attr)
    except OSError as exc:
        tail = " | ".join(log.value.decode(errors="replace").strip().splitlines()[-4:])
        raise BpfError(f"{what or 'loading ' + name} failed: {exc.strerror}" + (f": {tail}" if tail else "")) from None


def possible_cpus() -> int:
    """Number of possible CPUs (the per-CPU value count of per-CPU maps)."""
    try:
        with open("/sys/devices/system/cpu/possible") as fh:
            text = fh.read().strip()
    except OSError:
        return os.cpu_count() or 1
    n = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        n = max(n, int(hi or lo) + 1)
    return n


_CTYPES = {"_Bool": ctypes.c_bool, "char": ctypes.c_char, "signed char": ctypes.c_byte,
           "unsigned char": ctypes.c_ubyte, "short": ctypes.c_short, "unsigned short": ctypes.c_ushort,
           "int": ctypes.c_int, "unsigned int": ctypes.c_uint, "long": ctypes.c_long,
           "unsigned long": ctypes.c_ulong, "long long": ctypes.c_longlong,
           "unsigned long long": ctypes.c_ulonglong, "float": ctypes.c_float, "double": ctypes.c_double,
           "__int128": ctypes.c_int64 * 2, "unsigned __int128": ctypes.c_uint64 * 2}


def ctype_of(desc):
    """A ctypes type from bcc's JSON type description: a scalar's C name, or [name, [fields], "struct" | "union" |
    "struct_packed"] with fields [name, type], [name, type, [count]], [name, type, bits] or a nested description."""
    if isinstance(desc, str):
        try:
            return _CTYPES[desc]
        except KeyError:
            raise BpfError(f"unknown C type {desc!r} in a BPF map description") from None
    name, members = desc[0], desc[1]
    kind = desc[2] if len(desc) > 2 else "struct"
    fields, anonymous = [], []
    for m in members:
        if len(m) == 2:
            fields.append((m[0], ctype_of(m[1])))
        elif len(m) == 3 and isinstance(m[2], list):
            fields.append((m[0], ctype_of(m[1]) * m[2][0]))
        elif len(m) == 3 and isinstance(m[2], int):
            fields.append((m[0], ctype_of(m[1]), m[2]))
        elif len(m) == 3 and m[2] in ("struct", "union", "struct_packed"):
            fname = m[0] or f"__anon{len(anonymous)}"
            if not m[0]:
                anonymous.append(fname)
            fields.append((fname, ctype_of(m)))
        else:
            raise BpfError(f"cannot read BPF map member description {m!r}")
    body = {"_fields_": fields, "_anonymous_": anonymous}
    if kind == "struct_packed":
        body["_pack_"] = 1
    return type(str(name) or "anon", (ctypes.Union if kind == "union" else ctypes.Structure,), body)


def _value(c):
    return c.value if isinstance(c, ctypes._SimpleCData) else c


class Table:
    """One BPF map."""

    def __init__(self, spec: dict) -> None:
        self.name = spec["name"]
        self.fd = spec["fd"]
        self.map_type = spec["type"]
        self.max_entries = spec["max_entries"]
        self.key_size, self.leaf_size = spec["key_size"], spec["leaf_size"]
        self.Key = ctype_of(json.loads(spec["key_desc"])) if spec.get("key_desc") else ctypes.c_uint32
        self.Leaf = ctype_of(json.loads(spec["leaf_desc"])) if spec.get("leaf_desc") else ctypes.c_uint8
        self.percpu = self.map_type in _PERCPU
        self.ncpus = possible_cpus() if self.percpu else 1
        self._stride = (self.leaf_size + 7) // 8 * 8 if self.percpu else self.leaf_size
        self._batch_ok = self.map_type in _BATCHABLE
        self.module: Module | None = None

    # -- single elements --
    def _key(self, key):
        if isinstance(key, self.Key):
            return key
        if isinstance(key, ctypes._SimpleCData) or isinstance(key, ctypes.Structure):
            return self.Key.from_buffer_copy(bytes(key)[:ctypes.sizeof(self.Key)])
        return self.Key(key)

    def _lookup_raw(self, key):
        buf = ctypes.create_string_buffer(self._stride * self.ncpus)
        k = self._key(key)
        try:
            sys_bpf(_MAP_LOOKUP, _MapElemAttr(map_fd=self.fd, key=ctypes.addressof(k), value=ctypes.addressof(buf)))
        except FileNotFoundError:
            raise KeyError(key) from None
        return buf

    def _decode(self, buf, offset: int = 0):
        if not self.percpu:
            return self.Leaf.from_buffer_copy(buf, offset)
        return [_value(self.Leaf.from_buffer_copy(buf, offset + i * self._stride)) for i in range(self.ncpus)]

    def __getitem__(self, key):
        return self._decode(self._lookup_raw(key))

    def __setitem__(self, key, leaf) -> None:
        k = self._key(key)
        if self.percpu:
            buf = ctypes.create_string_buffer(self._stride * self.ncpus)
            values = leaf if isinstance(leaf, (list, tuple)) else [leaf] * self.ncpus
            for i, v in enumerate(values):
                v = v if isinstance(v, self.Leaf) else self.Leaf(v)
                ctypes.memmove(ctypes.addressof(buf) + i * self._stride, ctypes.addressof(v), self.leaf_size)
            value = buf
        else:
            value = leaf if isinstance(leaf, self.Leaf) else self.Leaf(_value(leaf))
        sys_bpf(_MAP_UPDATE, _MapElemAttr(map_fd=self.fd, key=ctypes.addressof(k), value=ctypes.addressof(value)))

    def __delitem__(self, key) -> None:
        k = self._key(key)
        try:
            sys_bpf(_MAP_DELETE, _MapElemAttr(map_fd=self.fd, key=ctypes.addressof(k)))
        except FileNotFoundError:
            raise KeyError(key) from None

    # -- iteration --
    def keys(self) -> list:
        if self.map_type in (MAP_ARRAY, MAP_PERCPU_ARRAY):
            return [self.Key(i) for i in range(self.max_entries)]
        out = []
        prev = None
        while True:
            nxt = self.Key()
            attr = _MapElemAttr(map_fd=self.fd, key=ctypes.addressof(prev) if prev is not None else 0,
                                value=ctypes.addressof(nxt))
            try:
                sys_bpf(_MAP_NEXT_KEY, attr)
            except FileNotFoundError:
                return out
            out.append(nxt)
            prev = nxt
            if len(out) > self.max_entries * 2:  # keys churning under us: stop rather than loop
                return out

    def items(self, skip_zero: bool = False) -> list:
        """(key, value) of every entry; `skip_zero` leaves out entries whose value is all zero bytes on every CPU
        (an array slot never written), without decoding them."""
        if self._batch_ok:
            try:
                return self._items_batch(skip_zero)
            except OSError:
                self._batch_ok = False  # kernel without batch ops for this map type
        out = []
        for k in self.keys():
            try:
                raw = self._lookup_raw(k)
            except KeyError:
                continue  # deleted between the two calls
            if not (skip_zero and not any(raw.raw)):
                out.append((k, self._decode(raw)))
        return out

    items_lookup_batch = items

    def _items_batch(self, skip_zero: bool = False) -> list:
        chunk = 256
        ksz, vsz = ctypes.sizeof(self.Key), self._stride * self.ncpus
        keys = ctypes.create_string_buffer(ksz * chunk)
        values = ctypes.create_string_buffer(vsz * chunk)
        token_in = ctypes.create_string_buffer(max(ksz, 8))
        token_out = ctypes.create_string_buffer(max(ksz, 8))
        out, first = [], True
        while True:
            attr = _BatchAttr(in_batch=0 if first else ctypes.addressof(token_in),
                              out_batch=ctypes.addressof(token_out), keys=ctypes.addressof(keys),
                              values=ctypes.addressof(values), count=chunk, map_fd=self.fd)
            done = False
            try:
                sys_bpf(_LOOKUP_BATCH, attr)
            except FileNotFoundError:
                done = True  # the last entries (attr.count of them) came with ENOENT
            except OSError as exc:
                if exc.errno == 28 and chunk < 65536:  # ENOSPC: a hash bucket larger than the chunk
                    chunk *= 4
                    keys = ctypes.create_string_buffer(ksz * chunk)
                    values = ctypes.create_string_buffer(vsz * chunk)
                    continue
                raise
            raw = values.raw if skip_zero else b""
            zero = bytes(vsz)
            for i in range(attr.count):
                if skip_zero and raw[i * vsz:(i + 1) * vsz] == zero:
                    continue
                out.append((self.Key.from_buffer_copy(keys, i * ksz), self._decode(values, i * vsz)))
            if done or attr.count == 0:
                return out
            ctypes.memmove(token_in, token_out, len(token_out))
            first = False

    def __len__(self) -> int:
        return len(self.keys())

    def clear(self) -> None:
        if self.map_type in (MAP_ARRAY, MAP_PERCPU_ARRAY):
            zero = [self.Leaf()] * self.ncpus if self.percpu else self.Leaf()
            for k in self.keys():
                self[k] = zero
            return
        for k in self.keys():
            try:
                del self[k]
            except KeyError:
                pass

    def open_ring_buffer(self, callback) -> None:
        """Hand this ring buffer's records to `callback(0, address, size)` on Module.ring_buffer_consume()."""
        self.module.open_ring_buffer(self.name, callback)

    # -- per-CPU and stack-trace maps --
    def sum(self, key):
        """The sum over CPUs of a per-CPU scalar value, as a Leaf."""
        return self.Leaf(sum(self[self._key(key)]))

    def walk(self, stack_id: int):
        """The addresses of one stack, innermost first; KeyError when the stack id is not (or no longer) there."""
        leaf = self[ctypes.c_uint32(stack_id & 0xFFFFFFFF)]
        for addr in leaf.ip:
            if not addr:
                break
            yield addr


class RingBuffer:
    """A BPF_MAP_TYPE_RINGBUF map, read by mmap: the consumer page (ours to advance), then the producer page and
    the data area mapped twice in a row (so a record wrapping past the end reads contiguously)."""

    def __init__(self, table: Table, callback) -> None:
        self.table, self.callback = table, callback
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.size = table.max_entries
        cons = _libc.mmap(None, self.page, _PROT_READ | _PROT_WRITE, _MAP_SHARED, table.fd, 0)
        if cons in (None, ctypes.c_void_p(-1).value):
            raise BpfError(f"mmap of ring buffer {table.name} failed: {os.strerror(ctypes.get_errno())}")
        prod = _libc.mmap(None, self.page + 2 * self.size, _PROT_READ, _MAP_SHARED, table.fd, self.page)
        if prod in (None, ctypes.c_void_p(-1).value):
            _libc.munmap(cons, self.page)
            raise BpfError(f"mmap of ring buffer {table.name} failed: {os.strerror(ctypes.get_errno())}")
        self._cons, self._prod = cons, prod
        self._cons_pos = ctypes.c_uint64.from_address(cons)
        self._prod_pos = ctypes.c_uint64.from_address(prod)
        self._data = prod + self.page

    def consume(self) -> int:
        """Hand every committed record to the callback as (0, address, size); the number handed."""
        n = 0
        mask = self.size - 1
        cons = self._cons_pos.value
        prod = self._prod_pos.value  # x86-64 loads are acquire loads; the kernel's writes are ordered
        while cons < prod:
            hdr = self._data + (cons & mask)
            length = ctypes.c_uint32.from_address(hdr).value
            if length & _RINGBUF_BUSY:
                break  # reserved, not yet committed
            size = length & ~(_RINGBUF_BUSY | _RINGBUF_DISCARD)
            if not length & _RINGBUF_DISCARD:
                self.callback(0, hdr + 8, size)
                n += 1
            cons += (size + 8 + 7) // 8 * 8
            self._cons_pos.value = cons
            if cons >= prod:
                prod = self._prod_pos.value
        return n

    def close(self) -> None:
        if self._cons:
            _libc.munmap(self._cons, self.page)
            _libc.munmap(self._prod, self.page + 2 * self.size)
            self._cons = self._prod = 0


def _uprobe_pmu() -> int:
    try:
        with open("/sys/bus/event_source/devices/uprobe/type") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        raise BpfError("this kernel has no uprobe PMU (/sys/bus/event_source/devices/uprobe/type; needs Linux "
                       "4.17+ with CONFIG_UPROBE_EVENTS)") from None


class Module:
    """A compiled BPF module held by this process: maps, programs loaded on demand, attachments."""

    def __init__(self, tables: list[dict], functions: dict[str, bytes]) -> None:
        self._specs = {t["name"]: t for t in tables}
        self._fd_map = {t["child_fd"]: t["fd"] for t in tables}
        self._functions = functions
        self._tables: dict[str, Table] = {}
        self._progs: dict[tuple[str, int], int] = {}
        self._raw_tps: dict[str, int] = {}
        self.uprobe_fds: dict[str, int] = {}
        self._rings: list[RingBuffer] = []
        self._lock = threading.RLock()
        self._closed = False

    # -- maps --
    def __getitem__(self, name) -> Table:
        name = name.decode() if isinstance(name, bytes) else name
        t = self._tables.get(name)
        if t is None:
            spec = self._specs.get(name)
            if spec is None:
                raise KeyError(f"the BPF module has no map {name}")
            t = self._tables[name] = Table(spec)
            t.module = self
        return t

    def table_fd(self, name: str) -> int:
        return self[name].fd

    def open_ring_buffer(self, name, callback) -> None:
        t = self[name]
        if t.map_type != MAP_RINGBUF:
            raise BpfError(f"map {t.name} is not a ring buffer")
        self._rings.append(RingBuffer(t, callback))

    def ring_buffer_consume(self) -> int:
        return sum(r.consume() for r in self._rings)

    # -- programs --
    def code(self, fn_name: str) -> bytes:
        """A function's bytecode with this process's map fds."""
        fn_name = fn_name.decode() if isinstance(fn_name, bytes) else fn_name
        try:
            raw = self._functions[fn_name]
        except KeyError:
            raise BpfError(f"the BPF module has no function {fn_name}") from None
        return relocate(raw, self._fd_map)

    def load_func(self, fn_name, prog_type: int) -> int:
        fn_name = fn_name.decode() if isinstance(fn_name, bytes) else fn_name
        with self._lock:
            fd = self._progs.get((fn_name, prog_type))
            if fd is None:
                fd = load_program(self.code(fn_name), prog_type, fn_name)
                self._progs[(fn_name, prog_type)] = fd
            return fd

    def attach_raw_tracepoint(self, tp, fn_name) -> None:
        tp = tp.decode() if isinstance(tp, bytes) else tp
        with self._lock:
            if tp in self._raw_tps:
                raise BpfError(f"raw tracepoint {tp} is already attached")
            prog = self.load_func(fn_name, PROG_RAW_TRACEPOINT)
            name = ctypes.create_string_buffer(tp.encode())
            try:
                self._raw_tps[tp] = sys_bpf(_RAW_TP_OPEN, RawTpOpenAttr(name=ctypes.addressof(name), prog_fd=prog))
            except OSError as exc:
                raise BpfError(f"attaching {fn_name} to raw tracepoint {tp} failed: {exc.strerror}") from None

    def detach_raw_tracepoint(self, tp) -> None:
        tp = tp.decode() if isinstance(tp, bytes) else tp
        with self._lock:
            fd = self._raw_tps.pop(tp, None)
        if fd is None:
            raise BpfError(f"raw tracepoint {tp} is not attached")
        os.close(fd)

    def attach_uprobe(self, name, sym, fn_name, pid: int = -1) -> str:
        """A uprobe on function `sym` of the file `name`, running `fn_name`, for every process (pid -1) or one;
        its event id (for detach_uprobe_event). BpfError when the file has no such function."""
        path = name.decode() if isinstance(name, bytes) else name
        sym = sym.decode() if isinstance(sym, bytes) else sym
        try:
            offset = elfsyms.elf_symbols(path).symbol_offset(sym)
        except elfsyms.ElfSymbolError as exc:
            raise BpfError(str(exc)) from None
        prog = self.load_func(fn_name, PROG_KPROBE)
        cpath = ctypes.create_string_buffer(path.encode())
        attr = _PerfEventAttr(type=_uprobe_pmu(), size=ctypes.sizeof(_PerfEventAttr), sample_period=1,
                              wakeup_events=1, config1=ctypes.addressof(cpath), config2=offset)
        fd = _libc.syscall(_SYS_PERF_EVENT_OPEN, ctypes.byref(attr), pid, 0 if pid == -1 else -1, -1,
                           _PERF_FLAG_FD_CLOEXEC)
        if fd < 0:
            raise BpfError(f"uprobe on {sym} in {path} failed: {os.strerror(ctypes.get_errno())}")
        for req, arg in ((_PERF_EVENT_IOC_SET_BPF, prog), (_PERF_EVENT_IOC_ENABLE, 0)):
            if _libc.ioctl(fd, req, arg) < 0:
                err = os.strerror(ctypes.get_errno())
                os.close(fd)
                raise BpfError(f"uprobe on {sym} in {path}: attaching {fn_name} failed: {err}")
        ev = f"p_{path}_0x{offset:x}_{pid}_{fd}"
        with self._lock:
            self.uprobe_fds[ev] = fd
        return ev

    def detach_uprobe_event(self, ev: str) -> None:
        with self._lock:
            fd = self.uprobe_fds.pop(ev, None)
        if fd is None:
            raise BpfError(f"no uprobe event {ev}")
        os.close(fd)

    # -- symbols --
    def sym(self, addr: int, pid: int, show_module: bool = True, proc_root: str = "/proc") -> str:
        """"function [module]" for a user-space address of `pid` (show_module is always on)."""
        return elfsyms.symbolize(addr, pid, proc_root)

    # -- lifetime --
    def cleanup(self) -> None:
        """Detach everything, unmap the ring buffers and close every fd; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for r in self._rings:
                r.close()
            fds = list(self.uprobe_fds.values()) + list(self._raw_tps.values()) + list(self._progs.values())
            fds += [t["fd"] for t in self._specs.values()]
            self.uprobe_fds, self._raw_tps, self._progs, self._rings = {}, {}, {}, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        try:
            self.cleanup()
        except Exception:
            pass

