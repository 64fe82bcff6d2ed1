"""The running kernel's BTF (/sys/kernel/btf/vmlinux), read from its binary format: struct member offsets and the
type ids of named typedefs, structs and functions.

The file is ~5 MB with ~100k types. Only an index of where each type starts is built (4 bytes per type); names are
compared as string-section offsets, so a lookup is one pass over the index without decoding any other name. The
whole thing is dropped by release() (the agent calls it once its sources are up), so the agent does not keep kernel
type information it no longer needs. (An earlier version kept bpftool's text dump parsed into Python objects:
~100 MB of the agent's memory.)

Format: include/uapi/linux/btf.h, Documentation/bpf/btf.rst.
"""

from __future__ import annotations

import array
import struct
import threading

BTF_PATH = "/sys/kernel/btf/vmlinux"

KIND = {"INT": 1, "PTR": 2, "ARRAY": 3, "STRUCT": 4, "UNION": 5, "ENUM": 6, "FWD": 7, "TYPEDEF": 8,
        "VOLATILE": 9, "CONST": 10, "RESTRICT": 11, "FUNC": 12, "FUNC_PROTO": 13, "VAR": 14, "DATASEC": 15,
        "FLOAT": 16, "DECL_TAG": 17, "TYPE_TAG": 18, "ENUM64": 19}
_MODIFIERS = (KIND["TYPEDEF"], KIND["VOLATILE"], KIND["CONST"], KIND["RESTRICT"], KIND["TYPE_TAG"])
# bytes following the 12-byte common header: fixed, and per vlen entry
_EXTRA = {1: (4, 0), 3: (12, 0), 4: (0, 12), 5: (0, 12), 6: (0, 8), 13: (0, 8), 14: (4, 0), 15: (0, 12),
          17: (4, 0), 19: (0, 12)}


class BtfError(ValueError):
    pass


class Btf:
    """One BTF blob: types by id (1-based), names by string offset."""

    def __init__(self, data: bytes, path: str = BTF_PATH) -> None:
        if len(data) < 24:
            raise BtfError(f"{path}: too short for a BTF header")
        magic, version, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from("<HBBIIIII", data)
        if magic != 0xEB9F:
            raise BtfError(f"{path}: not BTF (magic 0x{magic:04x}, expected 0xeb9f; big-endian BTF is not read)")
        if version != 1:
            raise BtfError(f"{path}: BTF version {version}, only version 1 is known")
        self.data = data
        self.path = path
        self._types = hdr_len + type_off
        self._strings = hdr_len + str_off
        self._str_len = str_len
        end = self._types + type_len
        if end > len(data) or self._strings + str_len > len(data):
            raise BtfError(f"{path}: sections run past the end of the file")
        offsets = array.array("I", [0])  # id 0 is void
        pos = self._types
        while pos < end:
            offsets.append(pos)
            info = struct.unpack_from("<I", data, pos + 4)[0]
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            fixed, per = _EXTRA.get(kind, (0, 0))
            pos += 12 + fixed + per * vlen
        if pos != end:
            raise BtfError(f"{path}: type section does not end on a type boundary")
        self._offsets = offsets

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def header(self, type_id: int) -> tuple[int, int, int, int]:
        """(name_off, kind, vlen, size_or_type) of one type."""
        if not 0 < type_id < len(self._offsets):
            raise BtfError(f"BTF type id {type_id} out of range")
        name_off, info, size = struct.unpack_from("<III", self.data, self._offsets[type_id])
        return name_off, (info >> 24) & 0x1F, info & 0xFFFF, size

    def name(self, name_off: int) -> str:
        start = self._strings + name_off
        return self.data[start:self.data.index(b"\0", start)].decode(errors="replace")

    def _name_offset(self, name: str) -> int | None:
        """The string-section offset of `name` (vmlinux BTF deduplicates strings), or None."""
        strings = self.data[self._strings:self._strings + self._str_len]
        needle = b"\0" + name.encode() + b"\0"
        pos = strings.find(needle)
        return None if pos < 0 else pos + 1

    def find(self, kind: str, name: str) -> int | None:
        """The first type id of this kind and name, or None."""
        off = self._name_offset(name)
        if off is None:
            return None
        want = KIND[kind]
        data, unpack = self.data, struct.unpack_from
        for tid in range(1, len(self._offsets)):
            name_off, info = unpack("<II", data, self._offsets[tid])
            if name_off == off and (info >> 24) & 0x1F == want:
                return tid
        return None

    def members(self, type_id: int) -> list[tuple[int, int, int]]:
        """(name_off, type_id, bit offset) of a struct's or union's members."""
        _, kind, vlen, _ = self.header(type_id)
        if kind not in (KIND["STRUCT"], KIND["UNION"]):
            return []
        kind_flag = struct.unpack_from("<I", self.data, self._offsets[type_id] + 4)[0] >> 31
        base = self._offsets[type_id] + 12
        out = []
        for i in range(vlen):
            name_off, mtype, offset = struct.unpack_from("<III", self.data, base + 12 * i)
            out.append((name_off, mtype, offset & 0xFFFFFF if kind_flag else offset))
        return out

    def resolve(self, type_id: int) -> int:
        """Follow typedefs and qualifiers to the type they name."""
        for _ in range(32):
            if type_id == 0:
                return 0
            _, kind, _, ref = self.header(type_id)
            if kind not in _MODIFIERS:
                return type_id
            type_id = ref
        return type_id

    def offset(self, struct_name: str, path: str) -> int:
        """Byte offset of `path` ("a.b", through named or anonymous members) inside struct/union `struct_name`."""
        tid = self.find("STRUCT", struct_name) or self.find("UNION", struct_name)
        if tid is None:
            raise BtfError(f"struct {struct_name} not found in kernel BTF")
        offset = 0
        for part in path.split("."):
            hit = self._member(self.resolve(tid), part)
            if hit is None:
                raise BtfError(f"{struct_name}.{path}: no member {part!r} in kernel BTF")
            offset += hit[0]
            tid = hit[1]
        return offset

    def _member(self, type_id: int, name: str, depth: int = 0) -> tuple[int, int] | None:
        if depth > 16:
            return None
        for name_off, mtype, bits in self.members(type_id):
            if name_off and self.name(name_off) == name:
                return bits // 8, mtype
            if not name_off:  # anonymous struct/union: look inside
                inner = self._member(self.resolve(mtype), name, depth + 1)
                if inner is not None:
                    return bits // 8 + inner[0], inner[1]
        return None


_lock = threading.Lock()
_kernel: Btf | None = None


def kernel() -> Btf:
    """The running kernel's BTF, read once until release()."""
    global _kernel
    with _lock:
        if _kernel is None:
            try:
                with open(BTF_PATH, "rb") as fh:
                    data = fh.read()
            except OSError as exc:
                raise BtfError(f"cannot read {BTF_PATH}: {exc.strerror}") from None
            _kernel = Btf(data)
        return _kernel


def release() -> None:
    """Forget the kernel's BTF (it is read again when next needed)."""
    global _kernel
    with _lock:
        _kernel = None
