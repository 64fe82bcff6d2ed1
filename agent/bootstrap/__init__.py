"""The job-side bootstrap and what the agent needs to know about it: where its directory is
(`site_dir()`, the PYTHONPATH entry), the launch environment `steplens-agent env` prints
(`launch_env()`), and the reader of the cupti records it writes (`read_cupti()`).

The bootstrap itself lives in ./site (steplens_bootstrap.py, which also times the process's garbage collections
into <runtime dir>/<pid>.gc (STEPLENS_GC, read by the flightrec source as python_gc_* metrics), steplens_cupti.py,
steplens_anchors.py: the ends of the job's iterations (optimizer steps and the zero_grad after them), the step
segmenter's anchors, sitecustomize.py, steplens_bootstrap.pth): standard-library modules loaded into the user's
interpreter, so they never import steplens. Nothing here runs in the job.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

from steplens.agent.commlog import RealtimeClock, time_problem
from steplens.agent.records import KernelRec

DEFAULT_RUNTIME_DIR = "/run/steplens/fr"
DEFAULT_FR_BUFFER_SIZE = 2000
DEFAULT_NCCL_LOG_DIR = "/var/log/steplens/nccl"


def site_dir() -> str:
    """The directory to put on the job's PYTHONPATH."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")


def launch_env(kineto: bool = True, flightrec: bool = True, nccl_log: bool = True, cupti: bool = False,
               runtime_dir: str = DEFAULT_RUNTIME_DIR, fr_buffer_size: int = DEFAULT_FR_BUFFER_SIZE,
               nccl_log_dir: str = DEFAULT_NCCL_LOG_DIR, pythonpath: str = "") -> list[tuple[str, str, str]]:
    """(KEY, VALUE, why) for the user's launcher; PYTHONPATH keeps `pythonpath` after the bootstrap."""
    env: list[tuple[str, str, str]] = []
    if kineto:
        env.append(("KINETO_USE_DAEMON", "1", "kineto: torch polls the agent's dynolog-compatible socket"))
    if flightrec or cupti:
        pp = site_dir() + (os.pathsep + pythonpath if pythonpath else "")
        env.append(("PYTHONPATH", pp, "loads the steplens bootstrap (sitecustomize.py; inert without the next line)"))
        env.append(("STEPLENS_BOOTSTRAP", "1", "turns the bootstrap on"))
        env.append(("STEPLENS_RUNTIME_DIR", runtime_dir,
                    "where the per-process sockets and GC counters go (<pid>.sock, <pid>.gc)"))
    if flightrec:
        env.append(("TORCH_FR_BUFFER_SIZE", str(fr_buffer_size), "flightrec: Flight Recorder ring (entries)"))
    if cupti:
        env.append(("STEPLENS_CUPTI", "1", "cupti: kernel + launch records from inside the process (GPU hosts)"))
    if nccl_log:
        env.append(("NCCL_DEBUG", "INFO", "nccl topology: Init COMPLETE lines (comm hash -> rank -> GPU)"))
        env.append(("NCCL_DEBUG_SUBSYS", "INIT,COLL", "nccl topology: only init and collective lines"))
        env.append(("NCCL_DEBUG_FILE", os.path.join(nccl_log_dir, "nccl.%h.%p.log"),
                    "nccl topology: one log per process (the directory must exist)"))
    return env


ATTACH_NOTES = (
    "attach at run time, no variable needed: host, procs, gpu, pystacks, sched, netflows, gpuprobes "
    "(eBPF uprobes on libnccl/libcudart), NCCL RAS (localhost:28028, NCCL >= 2.24)",
    "need the variables at launch: kineto (KINETO_USE_DAEMON), flightrec, Python GC time and cupti (PYTHONPATH + "
    "STEPLENS_BOOTSTRAP), NCCL topology from logs (NCCL_DEBUG*)",
)


def read_cupti(path: str, offset: int = 0, clock: RealtimeClock | None = None, pid: int = 0,
               start_ticks: int = 0, rank: int = -1, rejects: Counter | None = None,
               monotonic_ns=time.monotonic_ns) -> tuple[list[KernelRec], int, int]:
    """KernelRecs from a <pid>.cupti.jsonl file written by steplens_cupti, from byte `offset`:
    (kernels, new offset, CUPTI dropped-records count). A partly written last line is left for the
    next call; a corrupt line is skipped. Each kernel is joined with its launch API by correlation id.
    Kernels left out are counted into `rejects` by reason: "malformed" (an entry of the wrong shape or
    type) or a commlog.DROP_REASONS key (a CUPTI time that is not one of this boot once converted)."""
    clock = clock or RealtimeClock(monotonic_ns=monotonic_ns)
    rejects = Counter() if rejects is None else rejects
    kernels: list[KernelRec] = []
    dropped = 0
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except OSError:
        return [], offset, 0
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        try:
            doc = json.loads(line)
            dropped = max(dropped, int(doc.get("dropped", 0)))
            launches = {a[4]: a for a in doc.get("a", [])
                        if isinstance(a, list) and len(a) >= 6 and isinstance(a[4], int)}
            entries = doc.get("k", [])
            doc_pid = int(doc.get("pid", 0))
        except (ValueError, TypeError, AttributeError):
            rejects["malformed"] += 1
            continue
        now = monotonic_ns()
        for k in entries if isinstance(entries, list) else ():
            try:
                name, dev, stream, start, stop, corr, gx, gy, gz, bx, by, bz, graph = k[:13]
                launch = launches.get(corr)
                s, e = clock.to_mono(int(start)), clock.to_mono(int(stop))
                rec = KernelRec(e, pid or doc_pid, str(name), s, e, start_ticks, 0, int(dev), int(stream),
                                [int(gx), int(gy), int(gz)], [int(bx), int(by), int(bz)], int(corr),
                                f"{launch[0]}:{launch[1]}" if launch else "",
                                clock.to_mono(int(launch[2])) if launch else 0,
                                clock.to_mono(int(launch[3])) if launch else 0, int(graph), rank)
            except (ValueError, TypeError, OverflowError):
                rejects["malformed"] += 1
                continue
            reason, _ = time_problem(rec, now)
            if reason:
                rejects[reason] += 1
            else:
                kernels.append(rec)
    return kernels, offset + end, dropped
