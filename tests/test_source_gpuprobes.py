"""gpuprobes: BPF rendering, maps scanning, and real uprobes against stand-in NCCL/CUDA runtime libraries.

There is no GPU, libnccl or libcudart on the test machine. The uprobe path is still tested for real: the
tests compile a `libnccl.so.2` and a `libcudart.so.12` exporting functions with the real NCCL/CUDA runtime
prototypes, a real Python process dlopens them and calls them N times with known arguments, and the source
finds them in /proc/PID/maps, attaches real uprobes, and must report exactly those calls and arguments.
What this does not cover: the real libraries on a GPU host.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from procutil import needs_ebpf, prog_ids_of, progs_alive
from procutil import start_ticks as _start_ticks

from steplens.agent.records import Event, Metric, Mode, ProcessInfo
from steplens.agent.sources.base import ConfigError, HostContext, build_config
from steplens.agent.sources.gpuprobes import (BPF_FILE, OPS, GpuprobesConfig, GpuprobesSource, render_program,
                                              _literal_start, lib_kb, scan_maps)

FAKE_NCCL = r"""
#include <stddef.h>
typedef struct ncclComm *ncclComm_t;
typedef struct CUstream_st *cudaStream_t;
volatile long sink;
int ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op, ncclComm_t comm,
                  cudaStream_t stream) { sink += (long)count + (long)stream; return 0; }
int ncclSend(const void *sendbuff, size_t count, int datatype, int peer, ncclComm_t comm, cudaStream_t stream)
                  { sink += 1; return 0; }
int ncclRecv(void *recvbuff, size_t count, int datatype, int peer, ncclComm_t comm, cudaStream_t stream)
                  { sink += 2; return 0; }
int ncclGroupStart(void) { sink += 3; return 0; }
int ncclGroupEnd(void) { sink += 4; return 0; }
"""

FAKE_CUDART = r"""
#include <stddef.h>
typedef struct { unsigned x, y, z; } dim3;
volatile long sink;
int cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args, size_t sharedMem, void *stream)
                  { sink += grid.x + block.x; return 0; }
"""

CALLER = textwrap.dedent(r"""
    import ctypes, sys
    from ctypes import c_void_p, c_size_t, c_int, c_uint
    nccl = ctypes.CDLL(sys.argv[1]); cudart = ctypes.CDLL(sys.argv[2]); n = int(sys.argv[3])
    class dim3(ctypes.Structure):
        _fields_ = [("x", c_uint), ("y", c_uint), ("z", c_uint)]
    ar = nccl.ncclAllReduce; ar.argtypes = [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]
    send = nccl.ncclSend; send.argtypes = [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]
    recv = nccl.ncclRecv; recv.argtypes = [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]
    launch = cudart.cudaLaunchKernel
    launch.argtypes = [c_void_p, dim3, dim3, c_void_p, c_size_t, c_void_p]
    print("ready", flush=True)
    sys.stdin.readline()
    for i in range(n):
        ar(0x1000, 0x2000, 1000 + i, 7, 4, 0xC0FFEE000, 0x5E000 + i)
    nccl.ncclGroupStart()
    send(0x1000, 77, 9, 3, 0xC0FFEE000, 0x5E000)
    recv(0x2000, 88, 9, 1, 0xC0FFEE000, 0x5E000)
    nccl.ncclGroupEnd()
    for i in range(2 * n):
        launch(0x400000, dim3(1, 1, 1), dim3(32, 1, 1), None, 0, 0x5E000)
    print("done", flush=True)
    sys.stdin.readline()
""")


@pytest.fixture(scope="module")
def fake_libs(tmp_path_factory):
    if not (subprocess.run(["which", "gcc"], capture_output=True).returncode == 0):
        pytest.skip("gcc not installed")
    d = tmp_path_factory.mktemp("fakegpu")
    for name, src in (("libnccl.so.2", FAKE_NCCL), ("libcudart.so.12", FAKE_CUDART)):
        c = d / (name + ".c")
        c.write_text(src)
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(d / name), str(c)], check=True)
    return str(d / "libnccl.so.2"), str(d / "libcudart.so.12")


class Caller:
    def __init__(self, nccl: str, cudart: str, n: int):
        self.p = subprocess.Popen([sys.executable, "-c", CALLER, nccl, cudart, str(n)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline().strip() == "ready"
        self.key = (self.p.pid, _start_ticks(self.p.pid))

    def run(self):
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        assert self.p.stdout.readline().strip() == "done"

    def close(self):
        self.p.kill()
        self.p.wait()


# -- pure ---------------------------------------------------------------------------------------------


def test_render_program_fills_every_placeholder():
    with open(BPF_FILE) as fh:
        text = render_program(fh.read(), GpuprobesConfig(ringbuf_pages=32, max_processes=77))
    assert "{{" not in text
    assert "BPF_RINGBUF_OUTPUT(calls, 32)" in text
    assert "BPF_HASH(watched, u32, u8, 77)" in text
    assert f"record(ctx, {OPS.index('AllReduce')}, PT_REGS_PARM3(ctx)" in text
    # every BPF function has the steplens_ prefix and fits the kernel's 15-character program name
    for fn in re.findall(r"^int (\w+)\(struct pt_regs", text, re.M):
        assert fn.startswith("steplens_") and len(fn) <= 15, fn


def test_config_defaults_and_validation():
    assert build_config(GpuprobesConfig, {}, "sources.gpuprobes") == GpuprobesConfig()
    assert GpuprobesConfig().cuda_launches is False  # ~20 µs per launch trap measured in a VM: opt in
    with pytest.raises(ConfigError):
        build_config(GpuprobesConfig, {"ringbuf_pages": 48}, "sources.gpuprobes")
    with pytest.raises(ConfigError):
        build_config(GpuprobesConfig, {"call_events": "sometimes"}, "sources.gpuprobes")
    with pytest.raises(ConfigError, match="max_rescan_seconds"):
        build_config(GpuprobesConfig, {"rescan_seconds": 10, "max_rescan_seconds": 5}, "sources.gpuprobes")


def test_scan_maps_finds_libraries_by_inode(fake_libs, tmp_path):
    nccl, cudart = fake_libs
    caller = Caller(nccl, cudart, 0)
    try:
        found = scan_maps("/proc", caller.p.pid, {"nccl": r"libnccl\.so(\.\d+)*$", "cudart": r"libcudart\.so(\.\d+)*$"})
        kinds = sorted(kind for kind, _ in found.values())
        assert kinds == ["cudart", "nccl"]
        for (dev, ino), (kind, path) in found.items():
            assert path.startswith(f"/proc/{caller.p.pid}/root/")
            st = os.stat(nccl if kind == "nccl" else cudart)
            assert (st.st_dev, st.st_ino) == (dev, ino)
        assert scan_maps("/proc", os.getpid(), {"nccl": r"libnccl\.so(\.\d+)*$"}) == {}
        assert scan_maps("/proc", 2**22 + 12345, {"nccl": r"libnccl"}) == {}
        # patterns without a plain start, or with an alternation, read every line: the same libraries
        assert {k for k, _ in scan_maps("/proc", caller.p.pid, {"nccl": r".*nccl\.so(\.\d+)*$",
                                                                "cudart": r"libxx|libcudart\.so"}).values()} == \
            {"nccl", "cudart"}
    finally:
        caller.close()


def test_the_literal_start_of_a_library_pattern():
    assert _literal_start(r"libnccl\.so(\.\d+)*$") == b"libnccl.so"
    assert _literal_start(r"libcuda\.so") == b"libcuda.so"
    assert _literal_start(r"libx_y-zs?\.so") == b"libx_y-z"      # the optional "s" is not required
    assert _literal_start(r".*nccl") == b"" and _literal_start(r"liba|libb") == b""
    assert _literal_start(r"lib\d") == b"lib"


# -- real uprobes ---------------------------------------------------------------------------------------


_prog_ids_of = prog_ids_of
_prog_ids_alive = progs_alive


@needs_ebpf
def test_no_library_mapped_gives_reason():
    ctx = HostContext(node_id="t")
    ctx.workloads.replace({(os.getpid(), _start_ticks(os.getpid())): ProcessInfo(0, os.getpid(), 0)})
    avail = GpuprobesSource.probe(ctx)
    assert avail.ok and "libnccl" in avail.reason
    src = GpuprobesSource(ctx, GpuprobesConfig())
    src.start()
    try:
        assert src.step() == []
        assert "no workload maps libnccl/libcudart" in src.reason
        assert src.attached_libraries == []
    finally:
        src.stop()


@needs_ebpf
def test_uprobes_count_exact_calls_and_args(fake_libs):
    nccl, cudart = fake_libs
    n = 50
    ctx = HostContext(node_id="t")
    worker = Caller(nccl, cudart, n)
    bystander = Caller(nccl, cudart, 7)  # uses the same library file but is not a workload
    src = GpuprobesSource(ctx, GpuprobesConfig(cuda_launches=True))
    try:
        ctx.workloads.replace({worker.key: ProcessInfo(0, worker.key[0], worker.key[1])})
        src.start()
        src.set_mode(Mode.DEEP)
        assert src.step() == []
        assert src.reason == ""
        assert len(src.attached_libraries) == 2
        programs = _prog_ids_of(os.getpid())
        assert programs
        worker.run()
        bystander.run()
        records = src.step()

        pid, start = worker.key
        metrics = {(m.name, m.entity): m.value for m in records if isinstance(m, Metric)}
        assert metrics[("nccl_calls_total", f"pid:{pid}:{start}:op:AllReduce")] == n
        assert metrics[("nccl_elements_total", f"pid:{pid}:{start}:op:AllReduce")] == sum(1000 + i for i in range(n))
        assert metrics[("nccl_calls_total", f"pid:{pid}:{start}:op:Send")] == 1
        assert metrics[("nccl_calls_total", f"pid:{pid}:{start}:op:Recv")] == 1
        assert metrics[("nccl_calls_total", f"pid:{pid}:{start}:op:GroupStart")] == 1
        assert metrics[("nccl_calls_total", f"pid:{pid}:{start}:op:GroupEnd")] == 1
        assert metrics[("cuda_kernel_launches_total", f"pid:{pid}:{start}:api:cudaLaunchKernel")] == 2 * n
        assert not any(str(bystander.p.pid) in e for _, e in metrics), "a non-workload process was counted"

        calls = [r for r in records if isinstance(r, Event) and r.kind == "nccl_call"]
        allreduce = [c for c in calls if c.message.startswith("AllReduce")]
        assert len(allreduce) == n
        for i, c in enumerate(sorted(allreduce, key=lambda c: c.mono_ns)):
            assert c.message == (f"AllReduce count={1000 + i} dtype=float32 redop=avg comm=0xc0ffee000 "
                                 f"stream=0x{0x5E000 + i:x}")  # stream: the 7th argument, read from the stack
            assert c.value == 1000 + i
            assert c.entity == f"pid:{pid}:{start}:tid:{pid}"
        msgs = [c.message for c in calls]
        assert "Send count=77 dtype=bfloat16 peer=3 comm=0xc0ffee000 stream=0x5e000" in msgs
        assert "Recv count=88 dtype=bfloat16 peer=1 comm=0xc0ffee000 stream=0x5e000" in msgs
        assert not [r for r in records if isinstance(r, Event) and r.kind == "gpuprobes_dropped"]

        # sentinel mode: counters only, no per-call events
        src.set_mode(Mode.SENTINEL)
        worker.close()
        worker = Caller(nccl, cudart, 3)
        ctx.workloads.replace({worker.key: ProcessInfo(0, worker.key[0], worker.key[1])})
        src.step()
        worker.run()
        records = src.step()
        pid, start = worker.key
        metrics = {(m.name, m.entity): m.value for m in records if isinstance(m, Metric)}
        assert metrics[("nccl_calls_total", f"pid:{pid}:{start}:op:AllReduce")] == 3
        assert not [r for r in records if isinstance(r, Event)]

        # no workload maps the libraries any more: probes are detached
        ctx.workloads.replace({})
        assert src.step() == []
        assert src.attached_libraries == [] and src.reason == "no workload processes"
    finally:
        src.stop()
        src.stop()
        worker.close()
        bystander.close()
    deadline = time.monotonic() + 10  # the kernel frees programs after an RCU grace period, not at close()
    while _prog_ids_alive(programs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _prog_ids_alive(programs) == set()


LATE = textwrap.dedent(r"""
    import ctypes, sys
    from ctypes import c_void_p, c_size_t, c_int
    print("ready", flush=True)
    sys.stdin.readline()
    big = bytearray(64 << 20)   # the heap grows by a mapping of its own
    print("grown", flush=True)
    sys.stdin.readline()
    nccl = ctypes.CDLL(sys.argv[1])
    ar = nccl.ncclAllReduce; ar.argtypes = [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]
    print("loaded", flush=True)
    sys.stdin.readline()
    for i in range(5):
        ar(0x1000, 0x2000, 10, 7, 0, 0xC0FFEE000, 0x5E000)
    print("done", flush=True)
    sys.stdin.readline()
""")


@needs_ebpf
def test_library_loaded_late_is_found_and_an_unchanged_process_is_not_rescanned(fake_libs):
    """A workload that loads libnccl after the source first scanned it (NCCL comes with the process group, after
    start-up): its library code grows, so the next check scans its maps again and attaches; while that stays the
    same, its maps are not read again (max_rescan_seconds), however its heap moves."""
    nccl, _ = fake_libs
    p = subprocess.Popen([sys.executable, "-c", LATE, nccl], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ctx = HostContext(node_id="t")
    src = GpuprobesSource(ctx, GpuprobesConfig(rescan_seconds=0, max_rescan_seconds=3600))
    try:
        assert p.stdout.readline().strip() == "ready"
        key = (p.pid, _start_ticks(p.pid))
        ctx.workloads.replace({key: ProcessInfo(0, p.pid, key[1])})
        src.start()
        size = lib_kb("/proc", p.pid)
        assert size > 0 and lib_kb("/proc", 2**22 + 12345) == -1
        assert src.step() == [] and src.maps_scans == 1 and "no workload maps" in src.reason
        for _ in range(3):
            src.step()
        assert lib_kb("/proc", p.pid) == size and src.maps_scans == 1   # same size: not scanned again
        vm = open(f"/proc/{p.pid}/statm").read().split()[0]
        p.stdin.write("grow\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "grown"
        assert open(f"/proc/{p.pid}/statm").read().split()[0] != vm
        src.step()
        assert lib_kb("/proc", p.pid) == size and src.maps_scans == 1   # the heap is not library code
        p.stdin.write("load\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "loaded"
        assert lib_kb("/proc", p.pid) > size
        src.step()
        assert src.maps_scans == 2 and len(src.attached_libraries) == 1 and src.reason == ""
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "done"
        metrics = {(m.name, m.entity): m.value for m in src.step() if isinstance(m, Metric)}
        assert metrics[("nccl_calls_total", f"pid:{key[0]}:{key[1]}:op:AllReduce")] == 5
    finally:
        src.stop()
        p.kill()
        p.wait()


@needs_ebpf
def test_sigkill_of_agent_leaves_no_programs(fake_libs, tmp_path):
    nccl, cudart = fake_libs
    caller = Caller(nccl, cudart, 1)
    script = textwrap.dedent(f"""
        import sys, time
        from steplens.agent.records import ProcessInfo
        from steplens.agent.sources.base import HostContext
        from steplens.agent.sources.gpuprobes import GpuprobesConfig, GpuprobesSource
        ctx = HostContext(node_id="t")
        ctx.workloads.replace({{{caller.key!r}: ProcessInfo(0, {caller.key[0]}, {caller.key[1]})}})
        src = GpuprobesSource(ctx, GpuprobesConfig(cuda_launches=True))
        src.start(); src.step()
        print(len(src.attached_libraries), flush=True)
        time.sleep(600)
    """)
    agent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout.readline().strip() == "2"
        programs = _prog_ids_of(agent.pid)
        assert programs
    finally:
        agent.kill()
        agent.wait()
        caller.close()
    deadline = time.monotonic() + 10
    while _prog_ids_alive(programs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _prog_ids_alive(programs) == set()
