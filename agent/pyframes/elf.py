"""Minimal ELF64 reader: the load segments and the addresses of named symbols (.dynsym, .symtab).

Reads the file once (through /proc/PID/root so a process in a container is read from its own
filesystem) and caches the result per (path, device, inode, mtime).
"""

from __future__ import annotations

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
