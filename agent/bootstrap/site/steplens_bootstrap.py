"""steplens in-process bootstrap: starts torch's Flight Recorder worker server on a per-process Unix socket
once torch.distributed is initialized, times the process's garbage collections into <pid>.gc, and
(STEPLENS_CUPTI=1, GPU hosts) cupti-python kernel records.

Loaded at interpreter start from sitecustomize.py or steplens_bootstrap.pth in this directory; standard
library only (the job's Python need not have steplens installed). `install()` does nothing unless
STEPLENS_BOOTSTRAP=1 and never raises into the program.

What it does when enabled:
- defaults TORCH_FR_BUFFER_SIZE (Flight Recorder ring, entries) and, for NCCL process groups,
  TORCH_NCCL_ENABLE_TIMING=1 and TORCH_NCCL_DEBUG_INFO_PIPE_FILE=<runtime dir>/<pid>.fr-pipe-
  (torch then listens on `<stem><rank>.pipe`; a write there dumps the trace). They only matter to
  ProcessGroupNCCL (gloo ignores them). TORCH_NCCL_ENABLE_TIMING=1 was seen to give CUDA-event durations in a
  real NCCL dump on an H100 (tests/fixtures/gpu-recorded); the pipe file and this bootstrap on a GPU job are
  not verified (tests/test_gpu_live.py has not yet passed on a GPU).
- does not import torch. A daemon thread looks at sys.modules every `STEPLENS_BOOTSTRAP_POLL_S`
  (0.25 s) until `torch.distributed` is fully imported and initialized, then starts
  `torch._C._distributed_c10d._WorkerServer(<runtime dir>/<pid>.sock)` and ends. A process that never
  imports torch pays for one sleeping thread that wakes 4 times a second (a dict lookup each).
- with STEPLENS_FR_SERVER_NICE=N (1-19; default 0: off), the worker server is created on a short-lived thread
  whose nice value is first raised to N: Linux keeps nice per thread and new threads inherit it, so the
  server's threads (its listener and HTTP pool) run at nice N and the program's own threads keep theirs.
  Off by default: on the 2-core VM it made no measurable difference to the job's step time (bench/commops.py),
  and the server holds the recorder's mutex while it copies the ring, so a niced server thread kept off a busy
  core would delay a collective issued meanwhile.
  Each read of the Flight Recorder by the agent makes one of them build the whole ring as JSON (~7 us of CPU per
  entry, 14 ms for 2000 entries on the 2-core VM); niced, that work yields to the job's threads on a busy core,
  but its one moment under the recorder's mutex (copying the ring, ~1 ms for 2000 entries) then lasts as long
  as the scheduler keeps the server thread off a CPU: only for hosts with idle cores.
- STEPLENS_CUPTI=1: once torch.cuda is initialized, steplens_cupti.start_if_allowed() (see there for the
  Kineto arbitration rule); the thread then ends when both are done.
- runtime dir: $STEPLENS_RUNTIME_DIR, default /run/steplens/fr; when that cannot be created or written,
  <tmp>/steplens-fr-<uid> (the agent's flightrec source looks in both by default).
The socket is removed at exit (atexit); a killed process leaves it behind, and the agent reports the
refused connection once.

Anchors (STEPLENS_ANCHORS, default 1): before the server starts, steplens_anchors.install() registers a global
optimizer-step post hook and wraps Optimizer.zero_grad and Module.zero_grad (STEPLENS_ANCHORS_ZERO_GRAD,
default 1), which write each optimizer step's end, and the end of the zero_grad that follows it in the same
loop body, into a shared-memory ring, <runtime dir>/<pid>.anchors, which the agent reads beside the socket to
end each step where the iteration ends (gloo's Flight Recorder has enqueue times only; see steplens_anchors
for the rule, the layout, the cost (a few us per optimizer step) and why a file rather than a worker-server
handler). The ring is removed at exit, after the exit dump's header has taken its anchors.

Exit dump: the source reads the ring every few seconds, so the ops of a job's last seconds would be lost
when it ends. At interpreter exit (atexit, before the socket goes) the bootstrap writes the whole ring,
torch._C._distributed_c10d._dump_fr_trace_json(), to <runtime dir>/<pid>-<start ticks>.fr-exit.json: one
JSON header line (pid, start ticks, the job's rank/world/job variables, the anchors the ring still holds) then
torch's dump as it is, written to a temporary name and renamed, so a file under its final name is complete.
The flightrec source reads it, deduplicates it against its periodic reads by record id, and deletes it; dumps
no agent read within an hour are removed by the next process's exit. Costs one dump at exit (a full 2000-entry
ring of gloo all-reduces: 0.94 MB in 26 ms, 2-core VM, torch 2.13); a killed process writes none.
STEPLENS_FR_EXIT_DUMP=0 turns it off.

Iterations (STEPLENS_ITERS, default 1), in every process, torch or not: steplens_iters.install() puts an import
hook on sys.meta_path that wraps the configured iteration anchors (vLLM's engine step by default) and feature
readers when their modules load, and an optimizer-step hook when torch.optim loads; they write each iteration's
start, end and workload into <runtime dir>/<pid>.iters, created at the first iteration and kept at exit for the
agent's iters source (see steplens_iters for the rule, the layout and the cost). The exit clean-up below removes
those of processes gone for an hour.

GC time (STEPLENS_GC, default 1), in every process the bootstrap loads into, torch or not: at install a
gc.callbacks entry times each collection of the cyclic garbage collector from its "start" call to its "stop" call
(CLOCK_MONOTONIC, time.monotonic_ns; the "start" calls of callbacks registered after it and the "stop" calls of
those before it fall inside the interval: the job's own callbacks, usually registered later, add little) and keeps
cumulative counters in a 128-byte shared-memory file <runtime dir>/<pid>.gc, which the agent's flightrec source
reads beside the socket (also for a process that never opens one) as python_gc_* metrics. Layout, little-endian:
  0   8s   magic b"SLGCTIM1"        8  u32  layout version (1)     12  u32  file size (128)
  16  u64  start time of the process (clock ticks since boot, /proc/self/stat field 22: a reused pid's stale file
           is told apart)
  24  u64  sequence: odd while the counters are being rewritten
  32  u64  collections of generation 0, 1, 2       56  u64  ns spent in generation 0, 1, 2
  80  u64  end of the last collection (CLOCK_MONOTONIC ns)         88..127 zero, reserved
Writer per collection: sequence + 1 (odd), the seven counters (one struct.pack_into), sequence + 1 (even). A
reader copies the file, reads the sequence again, and takes the copy only when both are the same even number
(read_gc, and flightrec's read_gc_file); else it tries again, and after three torn copies skips the poll. x86 keeps
stores in order; elsewhere a torn copy may mix two collections' counters, which only grow: harmless.
A new layout gets a new version; a reader refuses other versions (flightrec reports it once). A generation other
than 0-2 (none in CPython 3.8-3.13) is not counted. The file is created with a temporary name and renamed, removed
at exit; a killed process's is removed by the next exit of a bootstrapped process in the directory. A forked
child (multiprocessing's fork start method) would write into its parent's mapping: it stops timing (no file);
a spawned one is a new interpreter with its own. Cost: inside every collection, ~1.1 us (gc.collect(0) with and
without the timer, python 3.11 and 3.13, 2-core VM; 1.7-2.2 us on the H100 host, python 3.12; about half is CPython
building the info dict and calling any callback twice), against 20-60 us for a gen-0 collection of a real program;
at start-up ~0.4 ms (the mmap import, the file). tests/test_bootstrap_gc.py::test_gc_timer_cost prints the figure.
STEPLENS_GC=0 turns it off.
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile
import threading
import time

DEFAULT_RUNTIME_DIR = "/run/steplens/fr"
DEFAULT_FR_BUFFER_SIZE = "2000"

_state = {"installed": False, "server": None, "socket": "", "error": "", "cupti": None, "exit_dump": "",
          "anchors": "", "gc": "", "iters": ""}


def runtime_dir() -> str:
    """The first of $STEPLENS_RUNTIME_DIR (default /run/steplens/fr) and <tmp>/steplens-fr-<uid>
    that exists or can be created, and is writable."""
    for d in (os.environ.get("STEPLENS_RUNTIME_DIR") or DEFAULT_RUNTIME_DIR,
              os.path.join(tempfile.gettempdir(), f"steplens-fr-{os.getuid()}")):
        try:
            os.makedirs(d, mode=0o755, exist_ok=True)
            if os.access(d, os.W_OK | os.X_OK):
                return d
        except OSError:
            continue
    return tempfile.gettempdir()


def socket_path(pid: int | None = None, directory: str | None = None) -> str:
    return os.path.join(directory or runtime_dir(), f"{pid or os.getpid()}.sock")


def install() -> bool:
    """Set the launch defaults and start the watcher thread; True when it did (once per process)."""
    try:
        if _state["installed"] or os.environ.get("STEPLENS_BOOTSTRAP") != "1":
            return False
        _state["installed"] = True
        d = runtime_dir()
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", DEFAULT_FR_BUFFER_SIZE)
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", os.path.join(d, f"{os.getpid()}.fr-pipe-"))
        if os.environ.get("STEPLENS_GC", "1") != "0":
            _start_gc(d)
        if os.environ.get("STEPLENS_ITERS", "1") != "0":
            _start_iters(d)
        poll_s = float(os.environ.get("STEPLENS_BOOTSTRAP_POLL_S", "0.25") or 0.25)
        threading.Thread(target=_watch, args=(d, poll_s), name="steplens-bootstrap", daemon=True).start()
        return True
    except Exception as exc:
        _state["error"] = f"{type(exc).__name__}: {exc}"
        return False


def _imported(name: str):
    """The module if it is in sys.modules and done executing (not half-way through its import)."""
    mod = sys.modules.get(name)
    if mod is None:
        return None
    spec = getattr(mod, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return None
    return mod


def _watch(directory: str, poll_s: float) -> None:
    want_cupti = os.environ.get("STEPLENS_CUPTI") == "1"
    server_done = False
    try:
        while not server_done or want_cupti:
            time.sleep(poll_s)
            if _imported("torch") is None:
                continue
            if want_cupti:
                cuda = _imported("torch.cuda")
                try:
                    if cuda is not None and cuda.is_initialized():
                        want_cupti = False
                        _start_cupti()
                except Exception:
                    pass
            dist = _imported("torch.distributed")
            if server_done or dist is None:
                continue
            try:
                if not (dist.is_available() and dist.is_initialized()):
                    continue
            except Exception:
                continue
            server_done = True
            _start_server(directory)
    except Exception as exc:  # never into the program; interpreter shutdown lands here too
        _state["error"] = f"{type(exc).__name__}: {exc}"


def _start_server(directory: str) -> None:
    from torch._C._distributed_c10d import _WorkerServer
    path = socket_path(directory=directory)
    try:
        os.unlink(path)  # a stale socket of an earlier process with this pid
    except FileNotFoundError:
        pass
    if os.environ.get("STEPLENS_ANCHORS", "1") != "0":
        _start_anchors(directory)  # before the socket: the agent finds the ring when it finds the socket
    _state["server"] = _niced(lambda: _WorkerServer(path), _server_nice())
    _state["socket"] = path
    import atexit
    atexit.register(_shutdown)


def _server_nice() -> int:
    """STEPLENS_FR_SERVER_NICE (default 0: off): the nice value of the worker server's threads; 0 leaves them as
    the process is."""
    try:
        return max(0, min(19, int(os.environ.get("STEPLENS_FR_SERVER_NICE", "0") or 0)))
    except ValueError:
        return 0


def _niced(make, nice: int):
    """make() called on a short-lived thread whose nice value is raised to `nice` first (Linux keeps nice per
    thread): the threads it starts (torch's worker server: its listener and its HTTP thread pool) inherit it, the
    program's own threads keep theirs. The server's dumps (~7 us of CPU per Flight Recorder entry, in the
    process) then take CPU the job leaves idle before taking it from the job. Returns what make() returned."""
    if not nice:
        return make()
    box: dict = {}

    def run() -> None:
        try:
            tid = threading.get_native_id()
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except (OSError, AttributeError):
            pass
        try:
            box["value"] = make()
        except BaseException as exc:  # raised again on the caller's thread
            box["error"] = exc
    th = threading.Thread(target=run, name="steplens-fr-server", daemon=True)
    th.start()
    th.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _start_anchors(directory: str) -> None:
    try:
        import steplens_anchors
        _state["anchors"] = steplens_anchors.install(
            directory, _start_ticks(), zero_grad=os.environ.get("STEPLENS_ANCHORS_ZERO_GRAD", "1") != "0").path
    except Exception as exc:  # a torch without the global optimizer hooks: steps end at the comm ops
        _state["error"] = f"anchors: {type(exc).__name__}: {exc}"


def _start_iters(directory: str) -> None:
    try:
        import steplens_iters
        steplens_iters.install(directory, _start_ticks)
        _state["iters"] = "installed"
    except Exception as exc:  # a bad STEPLENS_ITER_* variable: no iterations, the program runs
        _state["error"] = f"iters: {type(exc).__name__}: {exc}"


def _start_cupti() -> None:
    try:
        import steplens_cupti
        _state["cupti"] = steplens_cupti.start_if_allowed(runtime_dir())
    except Exception as exc:
        _state["error"] = f"cupti: {type(exc).__name__}: {exc}"


# what the exit dump's header carries, so a process the agent never saw alive still gets its rank and job
EXIT_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "STEPLENS_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                 "MASTER_ADDR", "MASTER_PORT")


def exit_dump_path(directory: str, pid: int, start_ticks: int) -> str:
    return os.path.join(directory, f"{pid}-{start_ticks}.fr-exit.json")


def _start_ticks() -> int:
    with open("/proc/self/stat", "rb") as fh:
        data = fh.read()
    return int(data[data.rfind(b")") + 2:].split()[19])


def _dump_at_exit() -> None:
    """The whole Flight Recorder ring into the runtime dir (see the module docstring)."""
    if os.environ.get("STEPLENS_FR_EXIT_DUMP", "1") == "0" or not _state["socket"]:
        return
    try:
        import json
        from torch._C._distributed_c10d import _dump_fr_trace_json
        body = _dump_fr_trace_json()
        pid, ticks = os.getpid(), _start_ticks()
        head = {"pid": pid, "start_ticks": ticks, "env": {k: os.environ[k] for k in EXIT_ENV_KEYS if k in os.environ}}
        if _state["anchors"]:
            import steplens_anchors
            ring = steplens_anchors._ring
            if ring is not None:
                head["anchors"] = {"version": steplens_anchors.VERSION, "clock": "realtime",
                                   "anchors": ring.snapshot()}
        path = exit_dump_path(os.path.dirname(_state["socket"]), pid, ticks)
        tmp = path + ".tmp"
        with open(tmp, "wb") as fh:
            fh.write(json.dumps(head).encode() + b"\n")
            fh.write(body if isinstance(body, bytes) else str(body).encode())
        os.replace(tmp, path)
        _state["exit_dump"] = path
        _remove_stale_exit_dumps(os.path.dirname(path))
    except Exception as exc:  # never into the program's exit
        _state["error"] = f"exit dump: {type(exc).__name__}: {exc}"


STALE_EXIT_DUMP_S = 3600.0


def _remove_stale_exit_dumps(directory: str) -> None:
    """Exit dumps no agent read within an hour (no agent running, flightrec disabled), and the anchor rings of
    processes that are gone (killed: no exit), removed, so a host that runs many jobs does not fill its
    runtime dir (a tmpfs) with them."""
    cutoff = time.time() - STALE_EXIT_DUMP_S
    for name in os.listdir(directory):
        try:
            if name.endswith((".fr-exit.json", ".fr-exit.json.tmp")):
                if os.stat(os.path.join(directory, name)).st_mtime < cutoff:
                    os.unlink(os.path.join(directory, name))
            elif name.endswith((".anchors", GC_SUFFIX)):
                pid = name.rpartition(".")[0]
                if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                    os.unlink(os.path.join(directory, name))
            elif name.endswith(".iters"):  # kept at exit for the agent's last read (steplens_iters): an hour
                pid = name.rpartition(".")[0]
                if pid.isdigit() and not os.path.exists(f"/proc/{pid}") and \
                        os.stat(os.path.join(directory, name)).st_mtime < cutoff:
                    os.unlink(os.path.join(directory, name))
        except OSError:
            pass


# -- Python GC time ---------------------------------------------------------------------------------------------

GC_MAGIC = b"SLGCTIM1"
GC_VERSION = 1
GC_SUFFIX = ".gc"
GC_FILE_BYTES = 128
GC_SEQ_AT = 24
GC_BODY_AT = 32
_GC_HEAD = struct.Struct("<8sIIQ")  # magic, version, file bytes, start ticks
_GC_BODY = struct.Struct("<7Q")     # collections of gen 0, 1, 2; ns in gen 0, 1, 2; end of the last (monotonic ns)
_GC_U64 = struct.Struct("<Q")
_gc = {"map": None, "callback": None, "pid": 0}


def gc_path(directory: str, pid: int | None = None) -> str:
    return os.path.join(directory, f"{pid or os.getpid()}{GC_SUFFIX}")


def _gc_callback(mm, clock=time.monotonic_ns, pack_body=_GC_BODY.pack_into, pack_u64=_GC_U64.pack_into):
    """The gc.callbacks entry: times each collection from its "start" to its "stop" call and rewrites the counters
    (see the module docstring); locals and default arguments only, it runs inside every collection."""
    counts = [0, 0, 0, 0, 0, 0, 0]
    began = [0]
    seq = [0]

    def steplens_gc_timer(phase, info):
        if phase == "start":
            began[0] = clock()
            return
        try:
            end = clock()
            g = info["generation"]
            if not 0 <= g <= 2:  # a generation this layout has no slot for: not counted
                return
            counts[g] += 1
            counts[3 + g] += end - began[0]
            counts[6] = end
            s = seq[0] + 1
            pack_u64(mm, GC_SEQ_AT, s)  # odd: a reader that sees it, or sees it change, reads again
            pack_body(mm, GC_BODY_AT, *counts)
            seq[0] = s + 1
            pack_u64(mm, GC_SEQ_AT, s + 1)
        except Exception:  # a closed map at exit: never into the program
            pass
    return steplens_gc_timer


def _start_gc(directory: str) -> None:
    """Create <directory>/<pid>.gc and register the collection timer (never raises)."""
    tmp = ""
    try:
        import atexit
        import gc
        import mmap
        path = gc_path(directory)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(fd, GC_FILE_BYTES)
            mm = mmap.mmap(fd, GC_FILE_BYTES)
        finally:
            os.close(fd)
        _GC_HEAD.pack_into(mm, 0, GC_MAGIC, GC_VERSION, GC_FILE_BYTES, _start_ticks())
        os.replace(tmp, path)  # a reader never sees a file without its header
        callback = _gc_callback(mm)
        _gc.update(map=mm, callback=callback, pid=os.getpid())
        gc.callbacks.append(callback)
        _state["gc"] = path
        atexit.register(_stop_gc)
        os.register_at_fork(after_in_child=_gc_forked)
    except Exception as exc:
        _state["error"] = f"gc: {type(exc).__name__}: {exc}"
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _gc_forked() -> None:
    """A forked child (multiprocessing's fork start method) would write into its parent's file: it stops timing."""
    import gc
    callback, mm = _gc["callback"], _gc["map"]
    _gc.update(map=None, callback=None, pid=0)
    _state["gc"] = ""
    try:
        if callback in gc.callbacks:
            gc.callbacks.remove(callback)
        if mm is not None:
            mm.close()  # the child's mapping only; the parent's stays
    except Exception:
        pass


def _stop_gc() -> None:
    """At exit (the last atexit handler of the bootstrap's): stop timing, remove the file and the stale ones of
    processes that were killed."""
    import gc
    callback, mm, path = _gc["callback"], _gc["map"], _state["gc"]
    if callback is None or _gc["pid"] != os.getpid():
        return
    _gc.update(map=None, callback=None, pid=0)
    _state["gc"] = ""
    for undo in (lambda: gc.callbacks.remove(callback), mm.close, lambda: os.unlink(path),
                 lambda: _remove_stale_exit_dumps(os.path.dirname(path))):
        try:  # each on its own: a collection on another thread still writing must not keep the file
            undo()
        except Exception:
            pass


def read_gc(path: str, start_ticks: int = -1) -> tuple[dict | None, str]:
    """Reader side, for tests and tools (the agent's flightrec source has its own copy, tested against this):
    ({"collections": [g0, g1, g2], "ns": [g0, g1, g2], "last_end_mono_ns": t, "start_ticks": n}, "") or
    (None, why not)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        return None, f"{exc.strerror or exc}"
    try:
        for _ in range(3):
            data = os.pread(fd, GC_FILE_BYTES, 0)
            again = os.pread(fd, 8, GC_SEQ_AT)
            if len(data) < GC_BODY_AT + _GC_BODY.size:
                return None, "short file"
            magic, version, size, ticks = _GC_HEAD.unpack_from(data, 0)
            if magic != GC_MAGIC:
                return None, "not a gc counter file (magic)"
            if version != GC_VERSION:
                return None, f"gc counter file version {version}: this reader knows version {GC_VERSION} only"
            if start_ticks >= 0 and ticks != start_ticks:
                return None, "another process's file (pid reused)"
            seq = _GC_U64.unpack_from(data, GC_SEQ_AT)[0]
            if seq % 2 == 0 and again == data[GC_SEQ_AT:GC_SEQ_AT + 8]:
                v = _GC_BODY.unpack_from(data, GC_BODY_AT)
                return {"collections": list(v[:3]), "ns": list(v[3:6]), "last_end_mono_ns": v[6],
                        "start_ticks": ticks}, ""
        return None, "being written (torn three times)"
    finally:
        os.close(fd)


def _shutdown() -> None:
    _dump_at_exit()
    if _state["anchors"]:
        try:
            import steplens_anchors
            steplens_anchors.close()
        except Exception:
            pass
    server, path = _state["server"], _state["socket"]
    _state["server"] = None
    try:
        if server is not None:
            server.shutdown()
    except Exception:
        pass
    try:
        if path:
            os.unlink(path)
    except OSError:
        pass


def status() -> dict:
    """For tests and debugging: what the bootstrap did in this process."""
    return dict({k: v for k, v in _state.items() if k != "server"}, server=_state["server"] is not None)
