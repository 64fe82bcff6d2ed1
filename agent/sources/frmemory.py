"""frmemory: a process's torch Flight Recorder ring read from its memory, so that reading it costs the job nothing.

The flightrec source's other way in, `POST /handler/fr_trace_json` on the bootstrap's worker-server socket, makes
the job itself build the whole ring as JSON at every read (~7 us of the job's CPU per entry, and a read comes when
about half of the ring is new: ~14 us per op; torch has no "entries since" request). Here the agent reads the
recorder where it lives instead, through /proc/PID/mem (pread, as the Python-frame sampler does: agent/pyframes/
memory.py), without stopping the process, taking its lock or running anything in it; only the entries from the
poll's cursor on are read.

Finding it: `FlightRecorder<EventType>::get()` keeps its instance in a function-local static pointer, which torch's
wheels list in libtorch_cpu.so's .symtab (`_ZZN4c10d14FlightRecorderIN3c105EventEE3getEvE8instance`, the recorder
that gloo and fr_trace_json use; torch 2.13). The library's load address comes from /proc/PID/maps, the symbol from
the file (elf.find_symbols, searched mapped, not read: the file is 434 MB), the layout of the recorder and its Entry
from frlayouts/torch-<major>.<minor>.json, which frlayouts/gen.py compiles against that torch's own headers
(offsets, libstdc++'s string and red-black tree, the ScalarType names). A torch without a layout file here, a
library without the symbol (a stripped build) or a recorder that fails the checks below raises FrMemoryUnavailable,
and the source reads that process through its socket as before.

What one read does (RecorderMemory.read): the instance pointer, then the recorder's header (enabled_, entries_,
max_entries_, next_, id_, reset_epoch_), checked: enabled a bool, the vector's bounds ordered and a whole number of
entries no more than max_entries_, next_ within it (else, twice, FrMemoryUnavailable: not a recorder of this
layout), as many ids recorded as slots filled (else read again: a copy taken mid-record). Entry k of the current
reset epoch 0 lives in slot k % max_entries_ (record(): the vector grows to max_entries_, then slot next_ is
overwritten, and next_ and id_ advance together); after a reset (reset_all, epoch > 0) the whole vector is read and
sorted by id. The slots of the ids wanted are read in one or two preads; what an entry keeps on the heap (its dtype
vectors, names longer than libstdc++'s 15 inline characters, shapes of more dimensions than c10's SmallVector keeps
inline) is read next, nearby addresses in one pread. Then id_ is read again: an entry whose slot the job may have
overwritten meanwhile (its id + max_entries_ <= id_ now) is left out, as is one whose slot holds another id or epoch
than expected: the job writes without telling us, and such an entry is what a wrapped ring lost (the source counts
it as lost, as for a dump). The job's process-group status (all_pg_status_, a std::map of
shared_ptr<ProcessGroupStatus>) and the groups' ranks (pg_name_to_ranks_) are read by walking their trees. Where the
vector's start moved while read (it grows while the ring fills, moving every entry: the old copy's are moved-from,
names and shapes empty, then freed) the whole read is made again; three in a row raise ReadError.

The entries come back as dicts with the keys, values and types of a fr_trace_json entry (record_id, pg_id,
process_group, collective_seq_id, p2p_seq_id, op_id, profiling_name, time_created_ns, duration_ms where set,
input/output sizes and dtypes, state, time_discovered_*_ns, retired, timeout_ms, is_p2p), in a flightrec.Dump,
so everything after the read is the same code (tests/test_frmemory.py compares the two, entry for entry, on a
live gloo job). Two differences, both from where the JSON is made: `state` is what the recorder last stored (the
JSON's dump first asks each op's events, update_state; gloo records no events, so there it is the same; an NCCL
op the watchdog has not retired yet may read "started" here where the dump says "completed" for ~100 ms), and
thread_id / thread_name are not read (nothing here uses them).

Not verified: NCCL builds. FlightRecorder<at::cuda::CUDAEvent> in libtorch_cuda.so has the same Entry (its
events are pointers) and would be found by its own symbol (RECORDERS), but no GPU build was at hand; the
checks above refuse a recorder whose fields do not hold together.
"""

from __future__ import annotations

import json
import os
import re
import struct

from steplens.agent.pyframes import elf
from steplens.agent.pyframes.memory import Memory, PyFramesError, ReadError

LAYOUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "frlayouts")
# endpoint (the socket handler whose dump this replaces) -> (library, symbol of get()'s static instance pointer)
RECORDERS = {
    "fr_trace_json": ("libtorch_cpu.so", "_ZZN4c10d14FlightRecorderIN3c105EventEE3getEvE8instance"),
    "dump_nccl_trace_json": ("libtorch_cuda.so", "_ZZN4c10d14FlightRecorderIN2at4cuda9CUDAEventEE3getEvE8instance"),
}
MAX_NAME = 4096        # a profiling or group name longer than this is not one
MAX_DIMS = 64          # tensors per op, dimensions per tensor
MAX_GROUPS = 4096      # process groups walked in a tree
_CLUSTER_GAP = 4096    # heap reads closer than this are one pread
_CLUSTER_MAX = 1 << 20
_U64 = struct.Struct("<Q")
_VERSION_RE = re.compile(r"""__version__\s*=\s*['"](\d+)\.(\d+)""")
_LAYOUTS: dict[str, dict] = {}


# _frread.c's LAYOUT_ORDER after the entry's size (and before the SmallVectors' inline element counts)
_NATIVE_ORDER = ("id", "reset_epoch", "pg_id", "pg_name", "pg_desc", "collective_seq_id", "p2p_seq_id", "op_id",
                 "profiling_name", "time_created", "timeout_ms", "is_p2p", "duration", "time_discovered_started",
                 "time_discovered_completed", "input_dims", "input_dtypes", "output_dims", "output_dtypes", "sizes",
                 "retired")


def _native():
    """The C decoder, or None where it is not built or STEPLENS_FRREAD_NATIVE=0."""
    if os.environ.get("STEPLENS_FRREAD_NATIVE", "1") == "0":
        return None
    try:
        from steplens.agent.sources import _frread
    except ImportError:
        return None
    return _frread


class FrMemoryUnavailable(Exception):
    """This process's recorder cannot be read from its memory (the reason says why); read its socket instead.
    kind "no_library": the process has not loaded the recorder's library (not a torch process, or not yet)."""

    def __init__(self, message: str, kind: str = "refused") -> None:
        super().__init__(message)
        self.kind = kind


def load_layout(major_minor: str, layout_dir: str = LAYOUT_DIR) -> dict:
    key = os.path.join(layout_dir, f"torch-{major_minor}.json")
    layout = _LAYOUTS.get(key)
    if layout is None:
        try:
            with open(key) as fh:
                layout = json.load(fh)
        except FileNotFoundError:
            raise FrMemoryUnavailable(f"no Flight Recorder layout for torch {major_minor} (frlayouts/gen.py writes "
                                      "one from that torch's headers)") from None
        except (OSError, ValueError) as exc:
            raise FrMemoryUnavailable(f"layout {key}: {exc}") from None
        if layout.get("machine") != os.uname().machine:
            raise FrMemoryUnavailable(f"layout {key} is of {layout.get('machine')}, not {os.uname().machine}")
        _LAYOUTS[key] = layout
    return layout


def _maps(pid: int, proc_root: str) -> list[tuple[int, int, int, str]]:
    out = []
    try:
        with open(os.path.join(proc_root, str(pid), "maps")) as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    out.append((lo, hi, int(parts[2], 16), parts[5].strip()))
    except OSError as exc:
        raise FrMemoryUnavailable(f"process {pid}: cannot read its maps ({exc.strerror})") from None
    return out


class _EntryFormat:
    """One struct over an Entry's fixed fields, built from the layout's offsets."""

    def __init__(self, lay: dict) -> None:
        e, sz = lay["entry"], lay["sizes"]
        fields = []   # (offset, code, name)

        def string(name: str) -> None:
            fields.extend([(e[name], "Q", name + ".ptr"), (e[name] + 8, "Q", name + ".len"),
                           (e[name] + 16, "16s", name + ".local")])

        def smallvec(name: str, inline: int) -> None:
            fields.extend([(e[name], "Q", name + ".ptr"), (e[name] + 8, "I", name + ".len"),
                           (e[name] + 16, f"{inline * 8}s", name + ".inline")])

        for name in ("id", "reset_epoch", "pg_id", "collective_seq_id", "p2p_seq_id", "op_id"):
            fields.append((e[name], "Q", name))
        for name in ("pg_name", "pg_desc", "profiling_name"):
            string(name)
        fields += [(e["time_created"], "q", "time_created"), (e["timeout_ms"], "q", "timeout_ms"),
                   (e["is_p2p"], "B", "is_p2p"), (e["retired"], "B", "retired"),
                   (e["duration"], "f", "duration"), (e["duration"] + 4, "B", "duration.set"),
                   (e["time_discovered_started"], "q", "started"),
                   (e["time_discovered_started"] + 8, "B", "started.set"),
                   (e["time_discovered_completed"], "q", "completed"),
                   (e["time_discovered_completed"] + 8, "B", "completed.set")]
        smallvec("input_dims", (sz["smallvec4"] - 16) // 8)
        smallvec("output_dims", (sz["smallvec4"] - 16) // 8)
        smallvec("sizes", (sz["smallvec8"] - 16) // 8)
        for name in ("input_dtypes", "output_dtypes"):
            fields.extend([(e[name], "Q", name + ".begin"), (e[name] + 8, "Q", name + ".end")])
        fields.sort()
        fmt, pos = "<", 0
        self.index: dict[str, int] = {}
        for i, (off, code, name) in enumerate(fields):
            if off < pos:
                raise FrMemoryUnavailable(f"layout: field {name} at {off} overlaps the one before")
            fmt += f"{off - pos}x" if off > pos else ""
            fmt += code
            self.index[name] = i
            pos = off + struct.calcsize("<" + code)
        if pos > lay["entry_size"]:
            raise FrMemoryUnavailable("layout: fields past the entry's size")
        self.struct = struct.Struct(fmt)
        self.offsets = {name: off for off, code, name in fields}


class RecorderMemory:
    """One process's Flight Recorder (of `endpoint`'s recorder, RECORDERS), read from its memory."""

    def __init__(self, pid: int, endpoint: str = "fr_trace_json", proc_root: str = "/proc",
                 layout_dir: str | None = None, native: bool | None = None) -> None:
        self.pid, self.endpoint = pid, endpoint
        libname, symbol = RECORDERS[endpoint]
        maps = _maps(pid, proc_root)
        path = next((p for lo, hi, off, p in maps if os.path.basename(p.replace(" (deleted)", "")) == libname), None)
        if path is None:
            raise FrMemoryUnavailable(f"process {pid} has no {libname} mapped", "no_library")
        host = os.path.join(proc_root, str(pid), "root", path.replace(" (deleted)", "").lstrip("/"))
        try:
            with open(os.path.join(os.path.dirname(os.path.dirname(host)), "version.py")) as fh:
                m = _VERSION_RE.search(fh.read(1 << 16))
        except OSError:
            m = None
        if m is None:
            raise FrMemoryUnavailable(f"cannot tell the torch version of {path} (no torch/version.py beside it)")
        self.torch = f"{m.group(1)}.{m.group(2)}"
        self.layout = lay = load_layout(self.torch, layout_dir or LAYOUT_DIR)
        try:
            syms = elf.find_symbols(host, (symbol,))
            info = elf.min_load_vaddr(host)
        except (elf.ElfError, OSError) as exc:
            raise FrMemoryUnavailable(f"{path}: {exc}") from None
        if symbol not in syms:
            raise FrMemoryUnavailable(f"{path} does not list the recorder's instance ({symbol}): a stripped build?")
        starts = [lo - off for lo, hi, off, p in maps if p == path]
        self.instance_at = min(starts) - info + syms[symbol]
        try:
            self.mem = Memory(pid, proc_root)
        except PyFramesError as exc:
            raise FrMemoryUnavailable(str(exc)) from None
        self.fmt = _EntryFormat(lay)
        r = lay["recorder"]
        self._head = struct.Struct("<" + "".join(f"{max(0, off - prev)}x{code}" for prev, off, code in _head_fields(r)))
        self.entry_size = lay["entry_size"]
        self.version = lay["version"]
        self.max_entries = 0
        self.reads = 0          # preads made, all reads together
        self.bytes = 0
        self.skipped = 0        # slots left out: overwritten while read, or not holding together
        self._inst = 0          # the recorder's address, once get() made it
        e = lay["entry"]
        self.native_layout = (lay["entry_size"],) + tuple(e[k] for k in _NATIVE_ORDER) + (
            (lay["sizes"]["smallvec4"] - 16) // 8, (lay["sizes"]["smallvec8"] - 16) // 8)
        self.dtype_names = tuple(lay["scalar_types"])
        self.native = _native() if native is None else (_native() if native else None)
        if native and self.native is None:
            raise FrMemoryUnavailable("the C decoder (steplens.agent.sources._frread) is not built")

    def close(self) -> None:
        self.mem.close()

    def _read(self, addr: int, size: int) -> bytes:
        self.reads += 1
        self.bytes += size
        return self.mem.read(addr, size)

    def recorded(self) -> int:
        """The recorder's next record id (the entries recorded so far in its reset epoch): one 8-byte read once
        the instance is known (it never moves: torch leaks it on purpose); 0 before the first collective."""
        if not self._inst:
            self._inst = _U64.unpack(self._read(self.instance_at, 8))[0]
            if not self._inst:
                return 0
        return _U64.unpack(self._read(self._inst + self.layout["recorder"]["id"], 8))[0]

    def read(self, from_id: int = -1):
        """A flightrec.Dump of the entries with ids >= from_id (all with -1) the ring still holds, the groups'
        status and ranks. Raises FrMemoryUnavailable (the recorder fails a check: read the socket instead) or
        pyframes' ProcessGone / ReadError."""
        from steplens.agent.sources.flightrec import Dump
        lay = self.layout
        inst = self._inst = self._inst or _U64.unpack(self._read(self.instance_at, 8))[0]
        if inst == 0:   # no collective recorded yet: get() not called
            return Dump(self.version, [], {}, {}, {}, 0, -1)
        for attempt in (1, 2, 3):
            got = self._read_ring(inst, from_id)
            if got is not None:
                return got
        raise ReadError(f"process {self.pid}: its Flight Recorder changed under three reads in a row")

    def _read_ring(self, inst: int, from_id: int):
        """read()'s work; None where the job changed what it was read from: the counters copied mid-record, or the
        entries moved (the vector grew while the ring filled: the old copy's entries are moved-from, their names
        and shapes empty): read again."""
        from steplens.agent.sources.flightrec import Dump
        lay = self.layout
        size = self.entry_size
        for attempt in (1, 2):   # a copy taken while the job grew the vector may not hold together: once more
            head = self._head.unpack(self._read(inst, self._head.size))
            enabled, begin, end, cap, max_entries, nxt, next_id, epoch = head
            filled = (end - begin) // size if end >= begin else -1
            if not (enabled > 1 or not (0 < max_entries < 1 << 27) or not (begin <= end <= cap) or
                    (end - begin) % size or filled > max_entries or nxt > max_entries or (begin == 0 and filled)):
                break
            if attempt == 2:   # not a recorder of this layout
                raise FrMemoryUnavailable(f"process {self.pid}: the recorder at {inst:#x} does not hold together "
                                          f"(enabled {enabled}, {filled} slots of {max_entries}, next {nxt}, id "
                                          f"{next_id})")
        if epoch == 0 and (next_id < filled or (filled < max_entries and next_id != filled)):
            return None   # the counters copied between a slot's write and id_'s: read again
        self.max_entries = max_entries
        members, sizes = self._ranks(inst)
        status = self._status(inst)
        if not enabled or filled <= 0:
            return Dump(self.version, [], members, sizes, status, 0, -1)
        ring_low = next_id - filled if epoch == 0 else -1
        if epoch == 0:   # entry k in slot k % max_entries (the checks above: a full ring, or slots 0..k in order)
            runs, k = [], max(from_id, ring_low)
            while k < next_id:
                slot = k % max_entries
                n = min(next_id - k, filled - slot)
                runs.append((k, slot, n))
                k += n
        else:   # after reset_all the slots of an epoch start anywhere: read them all
            runs = [(-1, 0, filled)]
        entries = []
        for k, slot, n in runs:
            data = self._read(begin + slot * size, n * size)
            got, skipped = self._decode(data, begin + slot * size, k, epoch, from_id)
            entries += got
            self.skipped += skipped
        at = lay["recorder"]["entries"]
        again_begin = _U64.unpack(self._read(inst + at, 8))[0]
        again = _U64.unpack(self._read(inst + lay["recorder"]["id"], 8))[0]
        if again_begin != begin:
            return None
        if epoch == 0:   # a slot the job may have written over while we read: lost, as in a wrapped dump
            entries = [e for e in entries if e["record_id"] + max_entries > again]
        entries.sort(key=lambda e: e["record_id"])
        return Dump(self.version, entries, members, sizes, status, 0, ring_low if entries and ring_low >= 0 else -1)

    # -- entries ------------------------------------------------------------------------------------------------
    def _decode(self, data: bytes, base: int, first_id: int, epoch: int, from_id: int) -> tuple[list[dict], int]:
        """(entries, slots skipped) of the slots in `data` (the first at remote address `base`, holding id
        `first_id`, the next ones +1 each; -1: any id >= from_id): _frread.decode where built, else in Python."""
        if self.native is not None:
            return self.native.decode(self.mem.fd, data, base, first_id, epoch, from_id, self.native_layout,
                                      self.dtype_names)
        size = self.entry_size
        raw = [(first_id + i if first_id >= 0 else -1, base + i * size, data, i * size)
               for i in range(len(data) // size)]
        return self._decode_py(raw, epoch, from_id)

    def _decode_py(self, raw, epoch: int, from_id: int) -> tuple[list[dict], int]:
        f = self.fmt
        ix, off = f.index, f.offsets
        unpack = f.struct.unpack_from
        names = self.layout["scalar_types"]
        rows, wants, skipped = [], [], 0
        for expect, addr, data, o in raw:
            v = unpack(data, o)
            rid = v[ix["id"]]
            if v[ix["reset_epoch"]] != epoch or (expect >= 0 and rid != expect) or (expect < 0 and rid < from_id):
                continue   # another epoch's, or overwritten since id_ was read: left out
            row = [v, addr, {}]
            for name in ("pg_name", "pg_desc", "profiling_name"):
                p, n = v[ix[name + ".ptr"]], v[ix[name + ".len"]]
                if n > MAX_NAME:
                    row = None
                    break
                if p == addr + off[name + ".local"]:
                    if n > 15:   # longer than libstdc++'s inline buffer, yet pointing at it
                        row = None
                        break
                    row[2][name] = v[ix[name + ".local"]][:n]
                else:
                    wants.append((p, n, row, name))
            if row is None:
                skipped += 1
                continue
            for name in ("input_dims", "output_dims", "sizes"):
                p, n = v[ix[name + ".ptr"]], v[ix[name + ".len"]]
                if n > MAX_DIMS * (MAX_DIMS + 2):
                    row = None
                    break
                if not n:
                    row[2][name] = b""
                elif p == addr + off[name + ".inline"]:
                    if n * 8 > len(v[ix[name + ".inline"]]):
                        row = None
                        break
                    row[2][name] = v[ix[name + ".inline"]][:n * 8]
                else:
                    wants.append((p, n * 8, row, name))
            if row is None:
                skipped += 1
                continue
            for name in ("input_dtypes", "output_dtypes"):
                b, e = v[ix[name + ".begin"]], v[ix[name + ".end"]]
                if e < b or e - b > MAX_DIMS:
                    row = None
                    break
                if e > b:
                    wants.append((b, e - b, row, name))
                else:
                    row[2][name] = b""
            if row is not None:
                rows.append(row)
            else:
                skipped += 1
        self._heap(wants)
        out = []
        for v, addr, got in rows:
            if len(got) < 8:
                skipped += 1   # a heap read failed: freed meanwhile (overwritten)
                continue
            try:
                out.append(self._entry(v, got, names))
            except (ValueError, IndexError, struct.error):
                skipped += 1
        return out, skipped

    def _heap(self, wants: list) -> None:
        """Each (address, size, row, field) read into row[2][field]; addresses near each other in one pread."""
        wants.sort(key=lambda w: w[0])
        i = 0
        while i < len(wants):
            lo, hi, j = wants[i][0], wants[i][0] + wants[i][1], i + 1
            while j < len(wants) and wants[j][0] <= hi + _CLUSTER_GAP and \
                    max(hi, wants[j][0] + wants[j][1]) - lo <= _CLUSTER_MAX:
                hi = max(hi, wants[j][0] + wants[j][1])
                j += 1
            try:
                data = self._read(lo, hi - lo)
                for p, n, row, name in wants[i:j]:
                    row[2][name] = data[p - lo:p - lo + n]
            except PyFramesError:
                for p, n, row, name in wants[i:j]:   # one by one: those still mapped
                    try:
                        row[2][name] = self._read(p, n)
                    except PyFramesError:
                        pass
            i = j

    def _entry(self, v: tuple, got: dict, names: list) -> dict:
        ix = self.fmt.index
        dims_in = struct.unpack(f"<{len(got['input_dims']) // 8}q", got["input_dims"])
        dims_out = struct.unpack(f"<{len(got['output_dims']) // 8}q", got["output_dims"])
        flat = struct.unpack(f"<{len(got['sizes']) // 8}q", got["sizes"])
        if any(not 0 <= d <= MAX_DIMS for d in dims_in + dims_out) or sum(dims_in) + sum(dims_out) != len(flat):
            raise ValueError("shapes do not add up")
        pos, shapes = 0, []
        for d in dims_in + dims_out:
            shapes.append(list(flat[pos:pos + d]))
            pos += d
        e = {"record_id": v[ix["id"]], "pg_id": v[ix["pg_id"]],
             "process_group": [got["pg_name"].decode(errors="replace"), got["pg_desc"].decode(errors="replace")],
             "collective_seq_id": v[ix["collective_seq_id"]], "p2p_seq_id": v[ix["p2p_seq_id"]],
             "op_id": v[ix["op_id"]], "profiling_name": got["profiling_name"].decode(errors="replace"),
             "time_created_ns": v[ix["time_created"]],
             "input_sizes": shapes[:len(dims_in)], "input_dtypes": [names[t] for t in got["input_dtypes"]],
             "output_sizes": shapes[len(dims_in):], "output_dtypes": [names[t] for t in got["output_dtypes"]],
             "state": "completed" if v[ix["completed.set"]] else "started" if v[ix["started.set"]] else "scheduled",
             # 0 where not set, as fr_trace_json writes them
             "time_discovered_started_ns": v[ix["started"]] if v[ix["started.set"]] else 0,
             "time_discovered_completed_ns": v[ix["completed"]] if v[ix["completed.set"]] else 0,
             "retired": bool(v[ix["retired"]]), "timeout_ms": v[ix["timeout_ms"]], "is_p2p": bool(v[ix["is_p2p"]])}
        if v[ix["duration.set"]]:
            e["duration_ms"] = v[ix["duration"]]
        return e

    # -- the groups ---------------------------------------------------------------------------------------------
    def _nodes(self, tree_at: int, value_bytes: int) -> list[tuple[int, bytes]]:
        """(node address, its value's bytes) of every node of the std::map at `tree_at`."""
        m = self.layout["map"]
        root = _U64.unpack(self._read(tree_at + m["root"], 8))[0]
        out, todo, seen = [], [root] if root else [], set()
        while todo:
            node = todo.pop()
            if node in seen or len(seen) >= MAX_GROUPS:
                raise FrMemoryUnavailable(f"process {self.pid}: a process-group tree at {tree_at:#x} loops or is "
                                          f"larger than {MAX_GROUPS}")
            seen.add(node)
            data = self._read(node, m["node_value"] + value_bytes)
            for at in (m["node_left"], m["node_right"]):
                child = _U64.unpack_from(data, at)[0]
                if child:
                    todo.append(child)
            out.append((node, data[m["node_value"]:]))
        return out

    def _status(self, inst: int) -> dict:
        """pg id (str, as the dump keys it) -> (last enqueued, started, completed seq)."""
        lay = self.layout
        st = lay["pg_status"]
        out = {}
        for node, value in self._nodes(inst + lay["recorder"]["all_pg_status"], 16):
            pg_id, ptr = struct.unpack_from("<QQ", value)
            if ptr:
                b = self._read(ptr, max(st.values()) + 8)
                out[str(pg_id)] = tuple(struct.unpack_from("<q", b, st[k])[0]
                                        for k in ("last_enqueued", "last_started", "last_completed"))
        return out

    def _ranks(self, inst: int) -> tuple[dict, dict]:
        """pg name -> [global ranks] and pg name -> size, of the groups the job recorded ranks for."""
        lay = self.layout
        e = lay["entry"]
        tup = min(e["pg_name"], e["pg_desc"])
        name_at, key_size = e["pg_name"] - tup, lay["sizes"]["tuple2"]
        members, sizes = {}, {}
        for node, value in self._nodes(inst + lay["recorder"]["pg_name_to_ranks"], key_size + 24):
            ptr, n = struct.unpack_from("<QQ", value, name_at)
            node_value = node + lay["map"]["node_value"]
            if n > MAX_NAME:
                continue
            name = value[name_at + 16:name_at + 16 + n] if ptr == node_value + name_at + 16 else self._read(ptr, n)
            b, end = struct.unpack_from("<QQ", value, key_size)
            if end < b or (end - b) % 8 or end - b > 8 << 20:
                continue
            ranks = list(struct.unpack(f"<{(end - b) // 8}Q", self._read(b, end - b))) if end > b else []
            if ranks:
                members[name.decode(errors="replace")] = ranks
                sizes[name.decode(errors="replace")] = len(ranks)
        return members, sizes


def _head_fields(r: dict) -> list[tuple[int, int, str]]:
    """(previous end, offset, code) of the recorder header fields read, in the order read() unpacks them."""
    fields = [(r["enabled"], "B"), (r["entries"], "Q"), (r["entries"] + 8, "Q"), (r["entries"] + 16, "Q"),
              (r["max_entries"], "Q"), (r["next"], "Q"), (r["id"], "Q"), (r["reset_epoch"], "Q")]
    out, pos = [], 0
    for off, code in fields:
        if off < pos:
            raise FrMemoryUnavailable("layout: recorder fields out of order")
        out.append((pos, off, code))
        pos = off + struct.calcsize("<" + code)
    return out
