"""ELF64 function symbols for the eBPF sources, without bcc: where a symbol sits in its file (to place a uprobe) and
which function holds an address of a process (to name the frames of an off-CPU stack).

Symbols come from .symtab when the file has one, else .dynsym. Files are read through /proc/PID/root for processes in
containers and cached by (device, inode, mtime), at most `_MAX_FILES` of them.
"""

from __future__ import annotations

import array
import bisect
import mmap
import os
import struct
import threading
import time

_STT_FUNC, _STT_GNU_IFUNC = 2, 10
_MAX_FILES = 32


class ElfSymbolError(ValueError):
    pass


class ElfSymbols:
    """One file's PT_LOAD segments and function symbols, sorted by address. The file is mapped, not read: only
    its headers, symbol tables and the names looked up are touched (libtorch_cpu.so is ~500 MB with ~300k
    symbols), and symbols are kept as two arrays (address, name offset), names decoded when asked for."""

    def __init__(self, data, path: str) -> None:
        if data[:4] != b"\x7fELF" or len(data) < 64 or data[4] != 2 or data[5] != 1:
            raise ElfSymbolError(f"{path}: not a little-endian ELF64 file")
        self.path = path
        self._data = data
        e_phoff, e_shoff = struct.unpack_from("<QQ", data, 0x20)
        e_phentsize, e_phnum, e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHHHH", data, 0x36)
        self.segments: list[tuple[int, int, int]] = []  # (p_offset, p_vaddr, p_filesz) of PT_LOAD
        for i in range(e_phnum):
            p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from(
                "<IIQQQQ", data, e_phoff + i * e_phentsize)
            if p_type == 1:
                self.segments.append((p_offset, p_vaddr, p_filesz))
        sections = {}
        headers = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
        if e_shstrndx < len(headers):
            shstr = headers[e_shstrndx][4]
            for sh in headers:
                start = shstr + sh[0]
                sections[bytes(data[start:data.find(b"\0", start)]).decode(errors="replace")] = sh
        # one table: .symtab when present (it includes the local functions), else .dynsym
        self._strtab = 0
        addrs, sizes, names = array.array("Q"), array.array("Q"), array.array("Q")
        for symtab, strtab in ((".symtab", ".strtab"), (".dynsym", ".dynstr")):
            if symtab not in sections or strtab not in sections:
                continue
            s_off, s_size, s_ent = sections[symtab][4], sections[symtab][5], sections[symtab][8] or 24
            self._strtab = sections[strtab][4]
            for st_name, st_info, _other, st_shndx, st_value, st_size in struct.iter_unpack(
                    "<IBBHQQ", data[s_off:s_off + s_size - (s_size % s_ent)]):
                if st_info & 0xF in (_STT_FUNC, _STT_GNU_IFUNC) and st_value and st_shndx != 0:
                    addrs.append(st_value)
                    sizes.append(st_size)
                    names.append(st_name)
            break
        order = sorted(range(len(addrs)), key=addrs.__getitem__)
        self._addrs = array.array("Q", (addrs[i] for i in order))
        self._sizes = array.array("Q", (sizes[i] for i in order))
        self._names = array.array("Q", (names[i] for i in order))

    def _name(self, st_name: int) -> str:
        start = self._strtab + st_name
        return bytes(self._data[start:self._data.find(b"\0", start)]).decode(errors="replace")

    def file_offset(self, vaddr: int) -> int:
        """The file offset a uprobe on this (unrelocated) address is placed at."""
        for p_offset, p_vaddr, p_filesz in self.segments:
            if p_vaddr <= vaddr < p_vaddr + p_filesz:
                return vaddr - p_vaddr + p_offset
        raise ElfSymbolError(f"{self.path}: address 0x{vaddr:x} is in no loaded segment")

    def vaddr(self, file_offset: int) -> int | None:
        for p_offset, p_vaddr, p_filesz in self.segments:
            if p_offset <= file_offset < p_offset + p_filesz:
                return file_offset - p_offset + p_vaddr
        return None

    def symbol_offset(self, name: str) -> int:
        """File offset of function `name`; ElfSymbolError if the file has no such function. (Versioned names,
        "f@@GLIBC_2.17", are stored without the version in .dynstr, so they match plainly.)"""
        want = name.encode()
        for i, st_name in enumerate(self._names):
            start = self._strtab + st_name
            if self._data[start:start + len(want) + 1] == want + b"\0":
                return self.file_offset(self._addrs[i])
        raise ElfSymbolError(f"{self.path}: no function symbol {name}")

    def lookup(self, vaddr: int) -> str | None:
        """The function holding this (unrelocated) address, or None."""
        i = bisect.bisect_right(self._addrs, vaddr) - 1
        if i < 0:
            return None
        # aliases share an address: take the one with a size, if any
        while i > 0 and self._addrs[i - 1] == self._addrs[i] and not self._sizes[i]:
            i -= 1
        size = self._sizes[i]
        if size and vaddr >= self._addrs[i] + size:
            return None
        return self._name(self._names[i])


_cache: dict[tuple, ElfSymbols] = {}
_lock = threading.Lock()


def elf_symbols(path: str) -> ElfSymbols:
    """The symbols of the file at `path` (cached); ElfSymbolError if it cannot be read or is no ELF64 file."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ElfSymbolError(f"cannot stat {path}: {exc.strerror}") from None
    key = (st.st_dev, st.st_ino, st.st_mtime_ns)
    with _lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    try:
        with open(path, "rb") as fh:
            data = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    except (OSError, ValueError) as exc:
        raise ElfSymbolError(f"cannot map {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        syms = ElfSymbols(data, path)
    except (struct.error, ValueError, IndexError) as exc:
        data.close()
        raise ElfSymbolError(f"{path}: malformed ELF ({exc})") from None
    with _lock:
        if len(_cache) >= _MAX_FILES:
            _cache.pop(next(iter(_cache)))._data.close()
        _cache[key] = syms
    return syms


_maps_cache: dict[tuple[str, int], tuple[float, list[str]]] = {}
MAPS_TTL_S = 1.0


def _maps(pid: int, proc_root: str) -> list[str]:
    """/proc/PID/maps lines, read at most once per MAPS_TTL_S per process (a deep step names hundreds of frames)."""
    now = time.monotonic()
    key = (proc_root, pid)
    with _lock:
        hit = _maps_cache.get(key)
    if hit is not None and now - hit[0] < MAPS_TTL_S:
        return hit[1]
    try:
        with open(os.path.join(proc_root, str(pid), "maps")) as fh:
            lines = fh.readlines()
    except OSError:
        lines = []
    with _lock:
        for k in [k for k, (t, _) in _maps_cache.items() if now - t >= MAPS_TTL_S]:
            del _maps_cache[k]
        _maps_cache[key] = (now, lines)
    return lines


def symbolize(addr: int, pid: int, proc_root: str = "/proc") -> str:
    """"function [module]" for a user-space address of process `pid`, "[module]+0xoff" when the module has no
    symbol there, hex(addr) when no file mapping holds it."""
    lines = _maps(pid, proc_root)
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        lo, _, hi = parts[0].partition("-")
        start, end = int(lo, 16), int(hi, 16)
        if not start <= addr < end:
            continue
        path = parts[5].strip()
        if not path.startswith("/"):
            return hex(addr)
        module = os.path.basename(path)
        file_off = addr - start + int(parts[2], 16)
        try:
            syms = elf_symbols(os.path.join(proc_root, str(pid), "root", path.lstrip("/")))
        except ElfSymbolError:
            return f"[{module}]+0x{file_off:x}"
        vaddr = syms.vaddr(file_off)
        name = syms.lookup(vaddr) if vaddr is not None else None
        return f"{name} [{module}]" if name else f"[{module}]+0x{file_off:x}"
    return hex(addr)
