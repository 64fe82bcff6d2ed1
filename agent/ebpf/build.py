"""Compiling BPF C in a short-lived helper process, so the agent never holds bcc, clang or LLVM.

bcc compiles in-process with clang/LLVM: loading libbcc and compiling the agent's three programs left ~230 MB in
the agent (LLVM's heap, bcc's module state, the libraries' relocated pages), for programs that are compiled once.
So the agent starts `python -m steplens.agent.ebpf.build FD` with one end of a Unix socket pair; the helper
compiles the text with bcc, which creates the programs' maps, and sends back, in one message:

- the maps' file descriptors (SCM_RIGHTS), with each map's name, type, sizes, flags and bcc's JSON description of
  its key and value types (from which the agent builds ctypes types, agent/ebpf/maps.py);
- each function's bytecode as bcc emitted it (the maps referenced by the helper's fd numbers).

Then it exits. The maps live on because the agent holds their fds; the agent loads the programs itself with the
bpf() syscall after renumbering the map references to its own fds (maps.relocate), so loading errors, the
verifier's log and program lifetimes are all the agent's. Nothing is loaded or attached by the helper (bcc's
auto-attach of kprobe__*/tracepoint__* names is not used by any steplens program).

Protocol: the agent writes a 4-byte length and a JSON request {"text": ..., "cflags": [...]}; the helper answers
a 4-byte length, then the JSON reply ({"error": ...} or {"tables": [...], "functions": {...}}) whose first chunk
carries the fds.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import socket
import struct
import subprocess
import sys

HELPER_TIMEOUT_S = 120.0
MAX_FDS = 250


class BuildError(RuntimeError):
    pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(1 << 20, n - got))
        if not chunk:
            raise BuildError("the BPF compiler helper closed the connection early")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def compile_text(text: str, cflags: tuple[str, ...] = ()) -> tuple[list[dict], dict[str, bytes]]:
    """Compile in a helper process: ([table spec with "fd" the agent's own fd], {function: bytecode}).
    BuildError with the compiler's message when it fails."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        proc = subprocess.Popen([sys.executable, "-m", "steplens.agent.ebpf.build", str(child.fileno())],
                                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env=_helper_env())
        child.close()
        parent.settimeout(HELPER_TIMEOUT_S)
        try:
            req = json.dumps({"text": text, "cflags": list(cflags)}).encode()
            parent.sendall(struct.pack("<I", len(req)) + req)
            msg, fds, _flags, _addr = socket.recv_fds(parent, 1 << 16, MAX_FDS)
            if len(msg) < 4:
                raise BuildError("the BPF compiler helper answered nothing")
            size = struct.unpack_from("<I", msg)[0]
            body = msg[4:] + _recv_exact(parent, size - (len(msg) - 4))
            reply = json.loads(body)
        except (OSError, ValueError, BuildError) as exc:
            proc.kill()
            err = proc.communicate(timeout=10)[1].decode(errors="replace")
            tail = " | ".join(err.strip().splitlines()[-6:])
            what = "timed out" if isinstance(exc, TimeoutError) else f"failed ({exc})"
            raise BuildError(f"BPF compiler helper {what}; rc {proc.returncode}: {tail or 'no output'}") from None
        err = proc.communicate(timeout=30)[1].decode(errors="replace")
        if reply.get("error"):
            tail = " | ".join(err.strip().splitlines()[-8:])
            raise BuildError(reply["error"] + (f": {tail}" if tail else ""))
        tables = reply["tables"]
        if len(tables) != len(fds):
            raise BuildError(f"the BPF compiler helper sent {len(fds)} fds for {len(tables)} maps")
        for spec, fd in zip(tables, fds):
            spec["fd"] = fd
        fds = []
        return tables, {name: base64.b64decode(code) for name, code in reply["functions"].items()}
    finally:
        parent.close()
        for fd in fds:
            os.close(fd)


def _helper_env() -> dict:
    """The helper runs this interpreter with this environment: it finds steplens the way this process did (an
    installed or editable package, or PYTHONPATH)."""
    return dict(os.environ)


# ---- the helper ----------------------------------------------------------------------------------------------

def _declare(lib) -> None:
    """Prototypes of the libbcc calls used here (bcc_common.h); bcc's Python wrapper declares only some."""
    p, sz, i, s = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p
    for name, res, args in (("bpf_num_tables", sz, [p]), ("bpf_table_name", s, [p, sz]),
                            ("bpf_table_fd_id", i, [p, sz]), ("bpf_table_type_id", i, [p, sz]),
                            ("bpf_table_max_entries_id", sz, [p, sz]), ("bpf_table_flags_id", i, [p, sz]),
                            ("bpf_table_key_desc_id", s, [p, sz]), ("bpf_table_leaf_desc_id", s, [p, sz]),
                            ("bpf_table_key_size_id", sz, [p, sz]), ("bpf_table_leaf_size_id", sz, [p, sz]),
                            ("bpf_num_functions", sz, [p]), ("bpf_function_name", s, [p, sz]),
                            ("bpf_function_start", p, [p, s]), ("bpf_function_size", sz, [p, s])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


def _describe(bpf) -> tuple[list[dict], list[int], dict[str, str]]:
    lib = sys.modules["bcc"].lib
    _declare(lib)
    mod = bpf.module
    tables, fds = [], []
    for i in range(lib.bpf_num_tables(mod)):
        name = lib.bpf_table_name(mod, i)
        fd = lib.bpf_table_fd_id(mod, i)
        if fd < 0:
            continue
        key_desc = lib.bpf_table_key_desc_id(mod, i)
        leaf_desc = lib.bpf_table_leaf_desc_id(mod, i)
        tables.append({"name": name.decode(), "child_fd": fd, "type": lib.bpf_table_type_id(mod, i),
                       "max_entries": lib.bpf_table_max_entries_id(mod, i), "flags": lib.bpf_table_flags_id(mod, i),
                       "key_size": lib.bpf_table_key_size_id(mod, i), "leaf_size": lib.bpf_table_leaf_size_id(mod, i),
                       "key_desc": key_desc.decode() if key_desc else "",
                       "leaf_desc": leaf_desc.decode() if leaf_desc else ""})
        fds.append(fd)
    functions = {}
    for i in range(lib.bpf_num_functions(mod)):
        name = lib.bpf_function_name(mod, i)
        start, size = lib.bpf_function_start(mod, name), lib.bpf_function_size(mod, name)
        if start and size:
            functions[name.decode()] = base64.b64encode(ctypes.string_at(start, size)).decode()
    return tables, fds, functions


def _serve(fd: int) -> int:
    sock = socket.socket(fileno=fd)
    size = struct.unpack("<I", _recv_exact(sock, 4))[0]
    req = json.loads(_recv_exact(sock, size))
    fds: list[int] = []
    try:
        from steplens.agent.ebpf import load_bcc
        bcc = load_bcc()
        bpf = bcc.BPF(text=req["text"].encode(), cflags=req.get("cflags") or [])
        tables, fds, functions = _describe(bpf)
        reply = {"tables": tables, "functions": functions}
    except Exception as exc:  # the compiler's complaint goes back to the agent, with stderr
        reply = {"error": f"compiling the BPF program failed: {exc}"}
        fds = []
    body = json.dumps(reply).encode()
    msg = struct.pack("<I", len(body)) + body
    first, rest = msg[:1 << 16], msg[1 << 16:]
    socket.send_fds(sock, [first], fds)
    if rest:
        sock.sendall(rest)
    sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(_serve(int(sys.argv[1])))
