"""frmemory: torch's Flight Recorder read from a live job's memory (no request to the job) gives what the job's
own fr_trace_json answer gives, entry for entry, in both decoders (C and Python); reads racing a job that records
as fast as it can never return a torn entry; what cannot be read so is refused with the reason; the layout file
is what its generator makes of the installed torch's headers; the mapped ELF lookup finds what the whole-file
one finds. Real gloo jobs (torch CPU in .venv, child processes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import free_port, wait_for
from procutil import bootstrapped_env, child_memory_readable, reap
from steplens.agent.pyframes import elf
from steplens.agent.sources import frmemory
from steplens.agent.sources.flightrec import http_post_unix, parse_dump
from steplens.agent.sources.frmemory import FrMemoryUnavailable, RecorderMemory
from test_source_flightrec import VENV_PY, _torch_available


pytestmark = [pytest.mark.skipif(not _torch_available(), reason="torch is not installed in .venv"),
              pytest.mark.skipif(not child_memory_readable(), reason="cannot read a child's memory here (not root, "
                                 "Yama ptrace_scope > 1)")]
DECODERS = [pytest.param(True, id="c"), pytest.param(False, id="python")]

# every kind of field an entry keeps on the heap: a group description past 15 characters, a 5-dimensional
# tensor (10 sizes: past the 8 a SmallVector keeps inline), 6 tensors of one op (past 4 dims inline), several
# dtypes, ops without tensors (barrier), gather/scatter with outputs unlike the inputs
VARIED = r'''
import os, sys, time
import torch, torch.distributed as dist
sync = sys.argv[1]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
g = dist.new_group([0, 1], group_desc="a group description longer than fifteen")
t = torch.ones(16)
dist.all_reduce(t)
dist.all_reduce(torch.ones(2, 3, 4, 5, 6, dtype=torch.float64), group=g)
dist.all_gather([torch.zeros(3, dtype=torch.int32) for _ in range(2)], torch.ones(3, dtype=torch.int32))
dist.all_gather_into_tensor(torch.zeros(4, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16))
dist.all_to_all_single(torch.zeros(4), torch.ones(4))
dist.barrier()
dist.gather(t, [torch.zeros(16) for _ in range(2)] if rank == 0 else None, dst=0)
dist.scatter(t, [torch.zeros(16) for _ in range(2)] if rank == 0 else None, src=0)
dist.all_reduce_coalesced([torch.ones(3) for _ in range(6)])
dist.broadcast(torch.ones(7, dtype=torch.int64), 0, group=g)
open(os.path.join(sync, f"ready.{rank}"), "w").close()
while not os.path.exists(os.path.join(sync, "exit")):
    time.sleep(0.05)
'''

# one rank recording as fast as it can (or pausing argv[2] s after each op); the op of record id k is known from k
FAST = r'''
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
dtypes = [torch.float32, torch.float64, torch.int32]
bufs = [torch.ones(*((k % 13 + 1,) if k % 5 else (1, 2, 1, 2, k % 3 + 1)), dtype=dtypes[k % 3]) for k in range(195)]
pause = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
print("ready", flush=True)
k = 0
while True:
    dist.all_reduce(bufs[k % 195])
    k += 1
    if pause:
        time.sleep(pause)
'''


def _fast_expect(k: int) -> tuple[list, str]:
    shape = [k % 13 + 1] if k % 5 else [1, 2, 1, 2, k % 3 + 1]
    return shape, ["Float", "Double", "Int"][k % 3]


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    base = tmp_path_factory.mktemp("frmem")
    run, sync = base / "run", base / "sync"
    run.mkdir()
    sync.mkdir()
    (base / "job.py").write_text(VARIED)
    port = free_port()
    procs = []
    for rank in range(2):
        env = bootstrapped_env(run, port, rank, 2, "varied")
        procs.append(subprocess.Popen([VENV_PY, str(base / "job.py"), str(sync)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=open(base / f"rank{rank}.err", "wb")))
    try:
        wait_for(lambda: all((sync / f"ready.{r}").exists() for r in range(2)) or
                 any(p.poll() is not None for p in procs), 120, what="the varied gloo job")
        assert all(p.poll() is None for p in procs), (base / "rank0.err").read_text()[-2000:]
        wait_for(lambda: all((run / f"{p.pid}.sock").exists() for p in procs), 30, what="worker-server sockets")
        yield {"procs": procs, "run": run}
    finally:
        (sync / "exit").touch()
        reap(procs)


@pytest.mark.parametrize("native", DECODERS)
def test_entries_from_memory_are_the_jobs_own_json(varied, native):
    for p in varied["procs"]:
        status, body = http_post_unix(str(varied["run"] / f"{p.pid}.sock"), "fr_trace_json")
        assert status == 200
        doc = json.loads(body)
        want = [{k: v for k, v in e.items() if k not in ("thread_id", "thread_name")} for e in doc["entries"]]
        reader = RecorderMemory(p.pid, native=native)
        try:
            got = reader.read()
            assert len(want) == 10 and got.entries == want   # every key, value and type
            assert got.version == doc["version"] and got.status == parse_dump(body).status
            assert got.members == parse_dump(body).members and reader.max_entries == 2000   # the bootstrap's ring
            assert {e["profiling_name"] for e in want} >= {"gloo:all_reduce", "gloo:barrier", "gloo:gather"}
            # from a record id on: only those (a poll's cursor), the ring's lowest id kept for the loss count
            part = reader.read(from_id=5)
            assert part.entries == want[5:] and part.ring_low == 0
            assert reader.read(from_id=10).entries == []
        finally:
            reader.close()


def test_the_source_reads_memory_and_says_why_when_it_cannot(varied, tmp_path, monkeypatch):
    """Through FlightrecSource: read from memory by default; with no layout for this torch (another layout
    directory), through the socket, with the reason reported once per process."""
    from procutil import start_ticks
    from steplens.agent.records import Event, ProcessInfo
    from steplens.agent.sources.base import HostContext
    from steplens.agent.sources.flightrec import FlightrecConfig, FlightrecSource

    def source(state):
        ctx = HostContext(node_id="t", state_dir=str(state))
        ctx.workloads.replace({(p.pid, start_ticks(p.pid)): ProcessInfo(0, p.pid, start_ticks(p.pid), rank=r,
                                                                       world_size=2, job_key="j")
                               for r, p in enumerate(varied["procs"])})
        src = FlightrecSource(ctx, FlightrecConfig(socket_dirs=[str(varied["run"])], max_interval_seconds=0))
        src.start()
        return src

    src = source(tmp_path / "a")
    try:
        out = src.step()
        assert src.reads_by_way == {"memory": 2} and not [e for e in out if isinstance(e, Event)]
    finally:
        src.stop()
    empty = tmp_path / "layouts"
    empty.mkdir()
    monkeypatch.setattr(frmemory, "LAYOUT_DIR", str(empty))
    src = source(tmp_path / "b")
    try:
        out = src.step() + src.step()
        events = [e for e in out if isinstance(e, Event)]
        assert src.reads_by_way == {"socket": 4}
        assert [e.kind for e in events] == ["flightrec_read_from_socket"] * 2
        assert all("no Flight Recorder layout for torch 2.13" in e.message for e in events)
    finally:
        src.stop()


@pytest.mark.parametrize("ring", [pytest.param(64, id="wrapping"), pytest.param(50000, id="growing")])
def test_reads_racing_the_job_never_return_a_torn_entry(ring):
    """A job recording thousands of ops a second, read over and over (both decoders): into a 64-entry ring, whose
    slots it overwrites while we read (left out, never returned half old, half new: checked to fail without the
    filter of slots written meanwhile); into a 50,000-entry ring, whose vector it grows 15 times while read from a
    cursor: nothing lost. Every entry returned is the op its record id says. (A read that meets a move of the
    vector is read again, frmemory's _read_ring; no run here was seen to meet one: the test passes without it.)"""
    port = free_port()
    # the growing ring at a few thousand ops a second: it must not wrap while read (~20,000 in the 4 s)
    job = subprocess.Popen([VENV_PY, "-c", FAST, str(port), "0" if ring == 64 else "0.0002"],
                           env=dict(os.environ, TORCH_FR_BUFFER_SIZE=str(ring)),
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert job.stdout.readline().strip() == "ready"
        readers = [RecorderMemory(job.pid, native=n) for n in (True, False)] if frmemory._native() else \
            [RecorderMemory(job.pid, native=False)]
        checked, reads, deadline = 0, 0, time.monotonic() + 4
        seen = set()
        cursor = {id(r): -1 for r in readers}
        while time.monotonic() < deadline:
            for reader in readers:
                d = reader.read(cursor[id(reader)] if ring > 64 else -1)
                reads += 1
                for e in d.entries:
                    k = e["record_id"]
                    shape, dtype = _fast_expect(k)
                    assert e["collective_seq_id"] == k + 1 and e["profiling_name"] == "gloo:all_reduce", e
                    assert e["input_sizes"] == [shape] and e["input_dtypes"] == [dtype], e
                    assert e["output_sizes"] == [shape] and e["process_group"] == ["0", "default_pg"], e
                    seen.add(k)
                    checked += 1
                if d.entries:
                    cursor[id(reader)] = d.entries[-1]["record_id"] + 1
        assert all(r.max_entries == ring for r in readers)
        if ring == 64:
            assert reads > 50 and checked > 50 * 40, (reads, checked)
            assert max(seen) > 5000   # the job went on while read: the ring wrapped many times
        else:   # nothing lost: each reader's cursor went through every id
            assert seen == set(range(max(seen) + 1)) and max(seen) > 2000, (len(seen), max(seen))
    finally:
        job.kill()
        job.wait()


def test_what_cannot_be_read_is_refused_with_the_reason(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(FrMemoryUnavailable, match="no libtorch_cpu.so mapped"):
            RecorderMemory(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    # torch loaded, no collective yet: nothing to read, not an error
    job = subprocess.Popen([VENV_PY, "-c", "import torch.distributed, sys; print('ready', flush=True); "
                            "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline().strip() == "ready"
        reader = RecorderMemory(job.pid)
        assert reader.read().entries == []
        reader.close()
        with pytest.raises(FrMemoryUnavailable, match="no Flight Recorder layout for torch"):
            RecorderMemory(job.pid, layout_dir=str(tmp_path))
        bad = tmp_path / "bad"
        bad.mkdir()
        layout = json.loads(open(os.path.join(frmemory.LAYOUT_DIR, "torch-2.13.json")).read())
        layout["machine"] = "riscv64"
        (bad / "torch-2.13.json").write_text(json.dumps(layout))
        frmemory._LAYOUTS.clear()
        with pytest.raises(FrMemoryUnavailable, match="riscv64"):
            RecorderMemory(job.pid, layout_dir=str(bad))
    finally:
        job.kill()
        job.wait()


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_the_layout_file_is_what_the_generator_makes_of_the_installed_torch(tmp_path):
    subprocess.run([VENV_PY, "-m", "steplens.agent.sources.frlayouts.gen", "--out", str(tmp_path)], check=True,
                   capture_output=True)
    made = json.loads((tmp_path / "torch-2.13.json").read_text())
    kept = json.loads(open(os.path.join(frmemory.LAYOUT_DIR, "torch-2.13.json")).read())
    assert made == kept


def test_mapped_symbol_lookup_finds_what_the_whole_file_lookup_finds():
    import torch  # noqa: F401  (only for where its libraries are: in this process's .venv)
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    names = ("_ZN3c106detail14torchCheckFailEPKcS2_jS2_", "_ZN3c1019UndefinedTensorImpl10_singletonE",
             "no_such_symbol_anywhere")
    whole = elf.read_elf(lib, names).symbols
    assert len(whole) == 2
    elf._SYMS_CACHE.clear()
    assert elf.find_symbols(lib, names) == whole
    assert elf.find_symbols(lib, names) == whole   # cached


def test_a_job_launched_without_the_bootstrap_is_read_from_memory(tmp_path):
    """torch 2.13 records 2,000 entries unless told otherwise, so a job launched plainly (no bootstrap, no
    socket, no steplens variable) is read too; a workload without torch's recorder is passed over quietly;
    `without_bootstrap = false` leaves such jobs alone."""
    from procutil import start_ticks
    from steplens.agent.records import Event, ProcessInfo
    from steplens.agent.sources.base import HostContext
    from steplens.agent.sources.flightrec import FlightrecConfig, FlightrecSource
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPLENS", "TORCH_FR", "PYTHONPATH"))}
    job = subprocess.Popen([VENV_PY, "-c", "import sys, torch, torch.distributed as dist\n"
                            f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=0, "
                            "world_size=1)\nt = torch.ones(8)\nfor _ in range(150): dist.all_reduce(t)\n"
                            "print('ready', flush=True)\nsys.stdin.read()"],
                           env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert job.stdout.readline().strip() == "ready"

        def source(state, **cfg):
            ctx = HostContext(node_id="t", state_dir=str(state))
            ctx.workloads.replace({(p.pid, start_ticks(p.pid)): ProcessInfo(0, p.pid, start_ticks(p.pid), rank=0,
                                                                           world_size=1, job_key="plain")
                                   for p in (job, sleeper)})
            src = FlightrecSource(ctx, FlightrecConfig(socket_dirs=[str(tmp_path / "none")],
                                                       max_interval_seconds=0, **cfg))
            src.start()
            return src

        src = source(tmp_path / "a")
        try:
            captured = []
            real_add = src.log.add
            src.log.add = lambda ops, *a, **k: captured.extend(ops) or real_add(ops, *a, **k)
            out = src.step() + src.step()
            assert not [e for e in out if isinstance(e, Event)], out
            assert len(captured) == 150 and {o.pid for o in captured} == {job.pid}
            assert sorted(o.seq for o in captured) == list(range(1, 151))
            assert src.reads_by_way == {"memory": 2}    # the job twice; the sleeper never (no recorder)
            key = (job.pid, start_ticks(job.pid))
            assert src.targets[key].ring == 2000 and list(src.targets) == [key]
            assert (sleeper.pid, start_ticks(sleeper.pid)) in src.failed
        finally:
            src.stop()
        src = source(tmp_path / "b", without_bootstrap=False)
        try:
            assert [r for r in src.step() if not isinstance(r, Event)] == [] and not src.targets
        finally:
            src.stop()
    finally:
        job.kill()
        sleeper.kill()
        job.wait()
        sleeper.wait()


def test_corrupt_slots_are_skipped_alike_by_both_decoders(varied):
    """Bytes of the job's real slots with a few changed at random (names, pointers, lengths, counts, dtypes):
    neither decoder crashes or raises, and both give the same entries and skip the same slots."""
    import random
    import struct as st
    if frmemory._native() is None:
        pytest.skip("the C decoder is not built")
    pid = varied["procs"][0].pid
    c, py = RecorderMemory(pid, native=True), RecorderMemory(pid, native=False)
    try:
        lay = c.layout
        inst = st.unpack("<Q", c.mem.read(c.instance_at, 8))[0]
        begin, end = st.unpack("<QQ", c.mem.read(inst + lay["recorder"]["entries"], 16))
        data = c.mem.read(begin, end - begin)
        size = lay["entry_size"]
        assert c._decode(data, begin, 0, 0, -1) == py._decode(data, begin, 0, 0, -1)
        assert len(c._decode(data, begin, 0, 0, -1)[0]) == len(data) // size == 10
        rng = random.Random(7)
        fields = sorted(lay["entry"].values())
        differ = 0
        for _ in range(400):
            b = bytearray(data)
            slot = rng.randrange(len(data) // size)
            for _ in range(rng.randint(1, 4)):
                at = slot * size + rng.choice(fields) + rng.choice((0, 0, 1, 4, 8, 9, 16))
                b[at % len(b)] = rng.randrange(256)
            got_c, got_py = c._decode(bytes(b), begin, 0, 0, -1), py._decode(bytes(b), begin, 0, 0, -1)
            assert got_c == got_py
            differ += got_c[0] != c._decode(data, begin, 0, 0, -1)[0]
        assert differ > 100   # the changes reached the entries (as values, or as slots skipped)
    finally:
        c.close()
        py.close()


def test_a_ring_read_from_memory_is_read_when_half_new_even_if_the_job_started_late(tmp_path):
    """The read schedule (FlightrecSource._due) with memory reads counts the entries recorded so far instead of
    estimating a rate: a job whose first reads found nothing recorded yet (it was still starting) and which then
    records fast into a small ring is read as its ring fills, and loses nothing (with a rate of 0 from those first
    reads it was left until max_interval_seconds, and its ring wrapped)."""
    from procutil import start_ticks
    from steplens.agent.records import ProcessInfo
    from steplens.agent.sources.base import HostContext
    from steplens.agent.sources.flightrec import FlightrecConfig, FlightrecSource
    go = tmp_path / "go"
    port = free_port()
    job = subprocess.Popen([VENV_PY, "-c", "import os, sys, time, torch, torch.distributed as dist\n"
                            f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=0, "
                            "world_size=1)\nt = torch.ones(4)\nprint('ready', flush=True)\n"
                            f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
                            "for _ in range(1500): dist.all_reduce(t); time.sleep(0.0005)\n"
                            "print('done', flush=True)\nsys.stdin.read()"],
                           env=dict(os.environ, TORCH_FR_BUFFER_SIZE="200"), stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline().strip() == "ready"
        ctx = HostContext(node_id="t", state_dir=str(tmp_path))
        key = (job.pid, start_ticks(job.pid))
        ctx.workloads.replace({key: ProcessInfo(0, job.pid, key[1], rank=0, world_size=1, job_key="late")})
        src = FlightrecSource(ctx, FlightrecConfig(socket_dirs=[str(tmp_path / "none")], interval_seconds=0.05,
                                                   max_interval_seconds=3))
        src.start()
        try:
            src.step()
            time.sleep(0.3)
            src.step()   # read once, nothing recorded yet
            assert src.reads["first"] == 1 and src.targets[key].cursors["fr_trace_json"].high == -1
            go.touch()
            deadline = time.monotonic() + 60
            while src.targets[key].cursors["fr_trace_json"].high < 1499 and time.monotonic() < deadline:
                src.step()
                time.sleep(0.02)
            assert src.targets[key].cursors["fr_trace_json"].high == 1499
            assert src.lost_entries == 0 and src.reads["ring_fill"] >= 7, src.reads
        finally:
            src.stop()
    finally:
        job.kill()
        job.wait()
