"""Minimal ELF64 reader: the load segments and the addresses of named symbols (.dynsym, .symtab).

Reads the file once (through /proc/PID/root so a process in a container is read from its own
filesystem) and caches the result per (path, device, inode, mtime).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

_CACHE: dict[tuple, "ElfInfo"] = {}


class ElfError(ValueError):
    pass


@dataclass
class ElfInfo:
    path: str
    symbols: dict[str, int]        # name -> st_value (unrelocated)
    min_load_vaddr: int            # lowest PT_LOAD p_vaddr, page-aligned down
    sections: dict[str, tuple[int, int]]  # name -> (sh_addr, sh_size)


def read_elf(path: str, wanted: tuple[str, ...]) -> ElfInfo:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ElfError(f"cannot stat {path}: {exc.strerror}") from None
    key = (path, st.st_dev, st.st_ino, st.st_mtime_ns, wanted)
    info = _CACHE.get(key)
    if info is None:
        with open(path, "rb") as fh:
            data = fh.read()
        info = parse(data, wanted, path)
        if len(_CACHE) > 64:
            _CACHE.clear()
        _CACHE[key] = info
    return info


def parse(data: bytes, wanted: tuple[str, ...], path: str = "<bytes>") -> ElfInfo:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ElfError(f"{path}: not a little-endian ELF64 file")
    e_phoff, e_shoff = struct.unpack_from("<QQ", data, 0x20)
    e_phentsize, e_phnum, e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHHHH", data, 0x36)
    loads = []
    for i in range(e_phnum):
        p_type, p_flags, p_offset, p_vaddr = struct.unpack_from("<IIQQ", data, e_phoff + i * e_phentsize)
        if p_type == 1:  # PT_LOAD
            loads.append(p_vaddr)
    if not loads:
        raise ElfError(f"{path}: no PT_LOAD segment")
    min_vaddr = min(loads) & ~0xFFF
    sections: dict[str, tuple[int, int, int, int, int]] = {}
    headers = []
    for i in range(e_shnum):
        sh = struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize)
        headers.append(sh)
    if e_shstrndx < len(headers):
        shstr_off = headers[e_shstrndx][4]
        for sh in headers:
            name_end = data.index(b"\0", shstr_off + sh[0])
            sections[data[shstr_off + sh[0]:name_end].decode(errors="replace")] = sh
    symbols: dict[str, int] = {}
    for symtab, strtab in ((".dynsym", ".dynstr"), (".symtab", ".strtab")):
        if symtab not in sections or strtab not in sections:
            continue
        s_off, s_size, s_ent = sections[symtab][4], sections[symtab][5], sections[symtab][8] or 24
        t_off, t_size = sections[strtab][4], sections[strtab][5]
        strings = data[t_off:t_off + t_size]
        name_index = {}
        for name in wanted:
            if name in symbols:
                continue
            pos = strings.find(b"\0" + name.encode() + b"\0")
            if pos >= 0:
                name_index[pos + 1] = name
        if not name_index:
            continue
        for st_name, st_info, st_other, st_shndx, st_value, st_size in struct.iter_unpack(
                "<IBBHQQ", data[s_off:s_off + s_size - (s_size % s_ent)]):
            name = name_index.get(st_name)
            if name is not None and st_value and st_shndx != 0:
                symbols[name] = st_value
    return ElfInfo(path, symbols, min_vaddr, {k: (v[3], v[5]) for k, v in sections.items()})


_SYMS_CACHE: dict[tuple, dict[str, int]] = {}


def find_symbols(path: str, wanted: tuple[str, ...]) -> dict[str, int]:
    """name -> st_value of the `wanted` symbols (.dynsym, then .symtab) without reading the whole file into memory:
    the file is mapped and searched in place (libtorch_cpu.so: 434 MB, a 76 MB .strtab; read_elf would hold all of
    it, and a heap that large stays with the process). Cached per (path, device, inode, mtime, wanted). Raises
    ElfError or OSError."""
    st = os.stat(path)
    key = (path, st.st_dev, st.st_ino, st.st_mtime_ns, wanted)
    found = _SYMS_CACHE.get(key)
    if found is not None:
        return dict(found)
    with open(path, "rb") as fh:
        if st.st_size < 64:
            raise ElfError(f"{path}: not a little-endian ELF64 file")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            found = _find_symbols(mm, wanted, path)
    if len(_SYMS_CACHE) > 64:
        _SYMS_CACHE.clear()
    _SYMS_CACHE[key] = found
    return dict(found)


def _find_symbols(mm, wanted: tuple[str, ...], path: str) -> dict[str, int]:
    if mm[:4] != b"\x7fELF" or mm[4] != 2 or mm[5] != 1:
        raise ElfError(f"{path}: not a little-endian ELF64 file")
    e_shoff, = struct.unpack_from("<Q", mm, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", mm, 0x3A)
    if not e_shnum or e_shentsize < 64 or e_shoff + e_shentsize * e_shnum > len(mm):
        raise ElfError(f"{path}: no section headers")
    headers = [struct.unpack_from("<IIQQQQIIQQ", mm, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    if e_shstrndx >= len(headers):
        raise ElfError(f"{path}: no section name table")
    n_off, n_size = headers[e_shstrndx][4], headers[e_shstrndx][5]
    names = mm[n_off:n_off + n_size]
    sections = {names[h[0]:names.find(b"\0", h[0])].decode(errors="replace"): h for h in headers if h[0] < len(names)}
    found: dict[str, int] = {}
    for symtab, strtab in ((".dynsym", ".dynstr"), (".symtab", ".strtab")):
        if symtab not in sections or strtab not in sections:
            continue
        t_off, t_size = sections[strtab][4], sections[strtab][5]
        s_off, s_size, s_ent = sections[symtab][4], sections[symtab][5], sections[symtab][8] or 24
        if t_off + t_size > len(mm) or s_off + s_size > len(mm):
            raise ElfError(f"{path}: {symtab} or {strtab} past the end of the file")
        for name in wanted:
            if name in found:
                continue
            at = mm.find(b"\0" + name.encode() + b"\0", t_off, t_off + t_size)
            if at < 0:
                continue
            needle = struct.pack("<I", at + 1 - t_off)
            i = mm.find(needle, s_off, s_off + s_size)
            while i >= 0:
                if (i - s_off) % s_ent == 0:
                    _, _, _, st_shndx, st_value, _ = struct.unpack_from("<IBBHQQ", mm, i)
                    if st_value and st_shndx != 0:
                        found[name] = st_value
                        break
                i = mm.find(needle, i + 1, s_off + s_size)
    return found


def min_load_vaddr(path: str) -> int:
    """The lowest PT_LOAD p_vaddr of the file, page-aligned down (reads only the program headers)."""
    with open(path, "rb") as fh:
        head = fh.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise ElfError(f"{path}: not a little-endian ELF64 file")
        e_phoff, = struct.unpack_from("<Q", head, 0x20)
        e_phentsize, e_phnum = struct.unpack_from("<HH", head, 0x36)
        fh.seek(e_phoff)
        raw = fh.read(e_phentsize * e_phnum)
    loads = [struct.unpack_from("<IIQQ", raw, i * e_phentsize)[3] for i in range(e_phnum)
             if len(raw) >= (i + 1) * e_phentsize and struct.unpack_from("<I", raw, i * e_phentsize)[0] == 1]
    if not loads:
        raise ElfError(f"{path}: no PT_LOAD segment")
    return min(loads) & ~0xFFF
