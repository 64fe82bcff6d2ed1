"""The agent's eBPF runtime without bcc in its own process (agent/ebpf: btf.py, elfsyms.py, build.py, maps.py).

Checked against independent readers of the same data: the kernel's BTF against bpftool's dump of it, ELF symbols
against the dynamic loader (ctypes/dlsym) and readelf, maps and ring buffers against a real BPF program the
kernel runs. Where eBPF is available (root, bcc, BTF), a module is compiled by the helper process and this
process is checked to hold no bcc/LLVM mapping afterwards.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from procutil import needs_ebpf

from steplens.agent.ebpf import btf, elfsyms, maps

BPFTOOL = shutil.which("bpftool") or "/usr/sbin/bpftool"


# -- BTF --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not os.path.exists(btf.BTF_PATH) or not os.path.exists(BPFTOOL), reason="no kernel BTF/bpftool")
def test_btf_offsets_and_ids_match_bpftool():
    """Offsets through named and anonymous members, and the ids of typedefs/functions, equal what bpftool reads
    from the same file."""
    dump = subprocess.run([BPFTOOL, "btf", "dump", "file", btf.BTF_PATH, "format", "raw"], capture_output=True,
                          text=True, check=True).stdout
    k = btf.Btf(open(btf.BTF_PATH, "rb").read())
    ids = {}
    for m in re.finditer(r"^\[(\d+)\] (TYPEDEF|FUNC|STRUCT) '([^']+)'", dump, re.M):
        ids.setdefault((m.group(2), m.group(3)), int(m.group(1)))
    for kind, name in (("TYPEDEF", "btf_trace_sched_switch"), ("FUNC", "tcp_sendmsg"), ("STRUCT", "task_struct"),
                       ("STRUCT", "sock")):
        assert k.find(kind, name) == ids[(kind, name)], (kind, name)
    assert k.find("STRUCT", "no_such_struct_steplens") is None
    # struct sock's first member is the anonymous-free struct sock_common __sk_common; skc_daddr sits in an
    # anonymous union/struct inside it: the offset must go through both
    sc = ids[("STRUCT", "sock_common")]
    block = dump[dump.index(f"[{sc}] STRUCT 'sock_common'"):]
    block = block[:block.index("\n[", 1)]
    assert k.offset("sock", "__sk_common") == 0
    for member in ("skc_daddr", "skc_dport", "skc_family"):
        got = k.offset("sock", f"__sk_common.{member}")
        direct = re.search(rf"'{member}' type_id=\d+ bits_offset=(\d+)", block)
        if direct:  # a direct member of sock_common
            assert got == int(direct.group(1)) // 8
        else:       # inside an anonymous member: at least within the struct
            assert 0 <= got < 256, (member, got)
    with pytest.raises(btf.BtfError, match="no member 'nope'"):
        k.offset("task_struct", "nope")
    with pytest.raises(btf.BtfError, match="not BTF"):
        btf.Btf(b"\0" * 64, "x")


def test_btf_parser_on_a_built_blob():
    """A hand-assembled BTF blob: an int, a struct with an anonymous union holding a bitfield, a typedef."""
    import struct
    strings = b"\0int\0outer\0a\0b\0c\0tdef\0"
    off = {name: strings.index(b"\0" + name.encode() + b"\0") + 1 for name in ("int", "outer", "a", "b", "c", "tdef")}
    types = struct.pack("<III", off["int"], 1 << 24, 4) + struct.pack("<I", 32)            # [1] INT
    types += struct.pack("<III", 0, (5 << 24) | (1 << 31) | 2, 4)                           # [2] anon UNION, kind_flag
    types += struct.pack("<III", off["b"], 1, (3 << 24) | 0)                               #   b: int:3 at bit 0
    types += struct.pack("<III", off["c"], 1, 0)                                           #   c: int at 0
    types += struct.pack("<III", off["outer"], (4 << 24) | 2, 12)                          # [3] STRUCT outer
    types += struct.pack("<III", off["a"], 1, 0)                                           #   a: int at 0
    types += struct.pack("<III", 0, 2, 64)                                                 #   (anon) at byte 8
    types += struct.pack("<III", off["tdef"], 8 << 24, 3)                                  # [4] TYPEDEF tdef
    blob = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(strings)) + types + strings
    k = btf.Btf(blob, "blob")
    assert len(k) == 4
    assert k.find("STRUCT", "outer") == 3 and k.find("TYPEDEF", "tdef") == 4 and k.resolve(4) == 3
    assert k.offset("outer", "a") == 0 and k.offset("outer", "c") == 8 and k.offset("outer", "b") == 8
    with pytest.raises(btf.BtfError, match="type boundary|past the end"):
        btf.Btf(blob[:24] + types[:-4] + strings, "cut")


# -- ELF symbols ------------------------------------------------------------------------------------------------

def _libc_path() -> str:
    for line in open("/proc/self/maps"):
        if "libc.so" in line or "libc-" in line:
            return line.split()[-1]
    pytest.skip("no libc mapping")


def test_elf_symbols_agree_with_the_dynamic_loader():
    """The address dlsym gives for a libc function, turned back into (module, function) by symbolize(), and its
    file offset against readelf's symbol value and segment table."""
    libc = ctypes.CDLL(None)
    path = _libc_path()
    for name in ("getpid", "clock_nanosleep", "malloc"):
        addr = ctypes.cast(getattr(libc, name), ctypes.c_void_p).value
        got = elfsyms.symbolize(addr + 1, os.getpid())
        assert got.endswith(f"[{os.path.basename(path)}]"), got
        assert got.split()[0] in (name, f"__{name}", f"__libc_{name}", f"__GI_{name}", f"__GI___{name}"), got
    syms = elfsyms.elf_symbols(path)
    readelf = shutil.which("readelf")
    if readelf:
        out = subprocess.run([readelf, "-Ws", "--dyn-syms", path], capture_output=True, text=True).stdout
        m = re.search(r"^\s*\d+: ([0-9a-f]+)\s+\d+ FUNC\s+\w+\s+\w+\s+\d+ getpid@", out, re.M)
        if m:
            vaddr = int(m.group(1), 16)
            assert syms.symbol_offset("getpid") == syms.file_offset(vaddr)
    with pytest.raises(elfsyms.ElfSymbolError, match="no function symbol"):
        syms.symbol_offset("steplens_no_such_function")
    assert elfsyms.symbolize(8, os.getpid()) == hex(8)  # no mapping holds it
    with pytest.raises(elfsyms.ElfSymbolError):
        elfsyms.elf_symbols(__file__)                    # not ELF


# -- pure parts of maps.py --------------------------------------------------------------------------------------

def test_ctypes_from_bcc_descriptions():
    desc = ["tstat", [["on", "unsigned long long"], ["tgid", "unsigned int"], ["arr", "char", [16]],
                      ["bits", "unsigned int", 3], ["", [["x", "int"], ["y", "unsigned int"]], "union"]],
            "struct"]
    T = maps.ctype_of(json.loads(json.dumps(desc)))
    v = T(on=5, tgid=7)
    v.x = -1
    assert v.on == 5 and v.tgid == 7 and v.y == 0xFFFFFFFF and type(v).arr.size == 16
    packed = maps.ctype_of(["p", [["a", "unsigned char"], ["b", "unsigned long long"]], "struct_packed"])
    assert ctypes.sizeof(packed) == 9
    assert maps.ctype_of("unsigned int") is ctypes.c_uint
    with pytest.raises(maps.BpfError, match="unknown C type"):
        maps.ctype_of("struct nope")


def test_relocate_renumbers_map_references_only():
    ld = lambda reg_src, imm: bytes([0x18, reg_src, 0, 0]) + imm.to_bytes(4, "little") + bytes(8)  # noqa: E731
    mov = bytes([0xB7, 0x01, 0, 0, 5, 0, 0, 0])
    code = ld(0x11, 7) + mov + ld(0x01, 1234) + ld(0x21, 9)  # map fd 7; a 64-bit constant; a map-value ref
    out = maps.relocate(code, {7: 42, 9: 43})
    assert out[4:8] == (42).to_bytes(4, "little")
    assert out[16:24] == mov and out[24:40] == code[24:40]   # src_reg 0: a plain constant, untouched
    assert out[40:56] == code[40:56]                          # src_reg 2 (map value) is not a map fd reference
    with pytest.raises(maps.BpfError, match="map fd 7"):
        maps.relocate(code, {})


# -- real eBPF: the helper process, maps, a ring buffer ------------------------------------------------------------

PROG = r"""
BPF_HASH(h, u32, u64, 1024);
BPF_ARRAY(a, u64, 4);
BPF_PERCPU_ARRAY(pc, u64, 2);
BPF_RINGBUF_OUTPUT(rb, 8);
BPF_ARRAY(target, u32, 1);
int steplens_t_enter(struct bpf_raw_tracepoint_args *ctx) {
    u32 zero = 0;
    u32 *want = target.lookup(&zero);
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    if (!want || *want != pid) return 0;
    u64 *n = pc.lookup(&zero);
    if (n) *n += 1;
    u64 id = ctx->args[1];
    rb.ringbuf_output(&id, sizeof(id), 0);
    return 0;
}
"""


@needs_ebpf
def test_compiled_module_maps_and_ring_buffer():
    """In a child (so this pytest process's own maps stay clean of earlier imports): compile through the helper,
    check that no bcc/LLVM library got mapped, exercise every table operation, then attach a raw tracepoint on
    sys_enter filtered to the child and read syscall numbers back through the ring buffer."""
    script = textwrap.dedent(f"""
        import ctypes, json, os, sys
        from steplens.agent import ebpf
        m = ebpf.compile_program({PROG!r}, tables=("h", "a", "pc", "rb", "target"))
        mapped = open("/proc/self/maps").read()
        out = {{"llvm": "libLLVM" in mapped or "libclang" in mapped, "bcc": "libbcc" in mapped}}
        h, a, pc = m["h"], m["a"], m["pc"]
        for i in range(600):                      # more than one batch of 256
            h[h.Key(i)] = h.Leaf(i * 10)
        out["len"] = len(h)
        items = dict((k.value, v.value) for k, v in h.items())
        out["items_ok"] = items == {{i: i * 10 for i in range(600)}}
        out["get"] = h[ctypes.c_uint32(599)].value
        del h[h.Key(599)]
        try:
            h[h.Key(599)]
            out["deleted"] = False
        except KeyError:
            out["deleted"] = True
        h.clear()
        out["cleared"] = len(h)
        a[ctypes.c_int(2)] = ctypes.c_uint64(77)
        out["array"] = [v.value for _, v in a.items()]
        out["array_nonzero"] = [k.value for k, _ in a.items(skip_zero=True)]
        m["target"][ctypes.c_int(0)] = ctypes.c_uint32(os.getpid())
        seen = []
        m["rb"].open_ring_buffer(lambda _cpu, data, size: seen.append(ctypes.c_uint64.from_address(data).value))
        m.attach_raw_tracepoint(b"sys_enter", b"steplens_t_enter")
        for _ in range(50):
            os.getppid()
        m.detach_raw_tracepoint(b"sys_enter")
        n = m.ring_buffer_consume()
        out["records"] = n
        out["getppid_seen"] = seen.count(110)    # __NR_getppid on x86-64
        out["pc_sum"] = m["pc"].sum(0).value
        m.cleanup()
        m.cleanup()
        print(json.dumps(out))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert not out["llvm"] and not out["bcc"], out
    assert out["len"] == 600 and out["items_ok"] and out["get"] == 5990 and out["deleted"] and out["cleared"] == 0
    assert out["array"] == [0, 0, 77, 0] and out["array_nonzero"] == [2]
    assert out["getppid_seen"] >= 50 and out["records"] >= out["getppid_seen"]
    assert out["pc_sum"] == out["records"]


@needs_ebpf
def test_compile_errors_come_back_with_the_compilers_words():
    from steplens.agent import ebpf
    with pytest.raises(ebpf.EbpfUnavailable, match="compiling the BPF program failed.*(error|undeclared)"):
        ebpf.compile_program("int steplens_bad(void *ctx) { return undeclared_thing; }")
    with pytest.raises(ebpf.EbpfUnavailable, match="no map nope"):
        ebpf.compile_program("BPF_ARRAY(a, u32, 1);\nint steplens_ok(void *ctx) { return 0; }", tables=("nope",))
