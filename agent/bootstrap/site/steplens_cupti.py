"""cupti-python inside the job: CONCURRENT_KERNEL plus RUNTIME/DRIVER launch records, written as compact
JSON lines to <runtime dir>/<pid>.cupti.jsonl for the agent (steplens.agent.bootstrap.read_cupti).

Started by steplens_bootstrap when STEPLENS_CUPTI=1 and torch.cuda is initialized. Standard library plus
the `cupti` package (cupti-python 12.x for CUDA 12, 13.x for CUDA 13); a missing package leaves a reason
in the status and the job runs on untouched.

Arbitration with Kineto (one CUPTI activity subscriber per process until CUDA 13.2 / drivers r610):
  cupti-python is NOT enabled when KINETO_USE_DAEMON=1 and the CUDA runtime torch was built with is
  older than 13.2 — the process then stays free for Kineto on-demand traces (steplens' kineto source,
  which records kernels and launches itself during its windows). With CUDA >= 13.2 both run.
  `stop()` flushes (activity_flush_all(1)) then disables every kind; call it before anything else takes
  CUPTI over.

One line per completed buffer: {"pid", "k": [[name, device, stream, start, end, correlation, gx, gy, gz,
bx, by, bz, graph_id], ...], "a": [[api, cbid, start, end, correlation, tid], ...], "dropped": n}; times are
CUPTI's CLOCK_REALTIME ns. The file is rotated to .1 at STEPLENS_CUPTI_MAX_BYTES (64 MiB).

API names used, all from the cupti.cupti bindings reference (docs.nvidia.com/cupti-python, 12.8 / 13.x):
activity_register_callbacks, activity_enable, activity_disable, activity_flush_all,
activity_get_num_dropped_records, ActivityKind.{CONCURRENT_KERNEL, RUNTIME, DRIVER}. Unverified here (no
GPU in the development machine): the buffer-requested callback's return value (buffer size, max records)
and the record attribute names (name, device_id, stream_id, start, end, correlation_id, grid_x..z,
block_x..z, graph_id, cbid, thread_id) follow the cupti-python samples as remembered and are read with
getattr defaults, so a renamed attribute yields zeros rather than an exception; the `gpu` test checks them.
"""

from __future__ import annotations

import json
import os
import threading

BUFFER_BYTES = 8 * 1024 * 1024
MAX_BYTES = int(os.environ.get("STEPLENS_CUPTI_MAX_BYTES", str(64 << 20)) or (64 << 20))

_lock = threading.Lock()
_state = {"enabled": False, "path": "", "kinds": [], "records": 0, "reason": ""}


def cuda_version() -> tuple[int, int]:
    """(major, minor) of the CUDA runtime torch was built with; (0, 0) when unknown."""
    try:
        import torch
        major, minor = (torch.version.cuda or "0.0").split(".")[:2]
        return int(major), int(minor)
    except Exception:
        return (0, 0)


def allowed(env=os.environ, cuda: tuple[int, int] | None = None) -> tuple[bool, str]:
    """The arbitration rule, a pure function of the environment and the CUDA version."""
    if env.get("STEPLENS_CUPTI") != "1":
        return False, "STEPLENS_CUPTI is not 1"
    cuda = cuda_version() if cuda is None else cuda
    if env.get("KINETO_USE_DAEMON") == "1" and cuda < (13, 2):
        return False, (f"KINETO_USE_DAEMON=1 with CUDA {cuda[0]}.{cuda[1]} < 13.2: one CUPTI subscriber per "
                       "process, left to Kineto on-demand traces")
    return True, ""


def start_if_allowed(directory: str) -> dict:
    ok, reason = allowed()
    if not ok:
        _state["reason"] = reason
        return dict(_state)
    try:
        start(os.path.join(directory, f"{os.getpid()}.cupti.jsonl"))
    except Exception as exc:
        _state["reason"] = f"{type(exc).__name__}: {exc}"
    return dict(_state)


def _kinds(cupti):
    A = cupti.ActivityKind
    return [A.CONCURRENT_KERNEL, A.RUNTIME, A.DRIVER]


def start(path: str) -> None:
    from cupti import cupti
    _state["path"] = path

    def requested():
        return BUFFER_BYTES, 0

    def completed(activities):
        try:
            _write(cupti, activities)
        except Exception:  # inside a CUPTI callback thread: never raise
            pass

    cupti.activity_register_callbacks(requested, completed)
    for kind in _kinds(cupti):
        cupti.activity_enable(kind)
        _state["kinds"].append(int(kind))
    _state["enabled"] = True
    import atexit
    atexit.register(stop)


def stop() -> None:
    """Flush what CUPTI holds, then disable every kind this module enabled. Idempotent."""
    if not _state["enabled"]:
        return
    from cupti import cupti
    _state["enabled"] = False
    try:
        cupti.activity_flush_all(1)
    finally:
        for kind in _state["kinds"]:
            try:
                cupti.activity_disable(kind)
            except Exception:
                pass
        _state["kinds"] = []


def _write(cupti, activities) -> None:
    A = cupti.ActivityKind
    kernels, apis = [], []
    for r in activities:
        kind = getattr(r, "kind", None)
        g = lambda name, default=0: getattr(r, name, default)  # noqa: E731
        if kind == A.CONCURRENT_KERNEL:
            name = g("name", "")
            if isinstance(name, bytes):
                name = name.decode("utf-8", "replace")
            kernels.append([name, g("device_id"), g("stream_id"), g("start"), g("end"), g("correlation_id"),
                            g("grid_x"), g("grid_y"), g("grid_z"), g("block_x"), g("block_y"), g("block_z"),
                            g("graph_id")])
        elif kind in (A.RUNTIME, A.DRIVER):
            apis.append(["runtime" if kind == A.RUNTIME else "driver", g("cbid"), g("start"), g("end"),
                         g("correlation_id"), g("thread_id")])
    if not kernels and not apis:
        return
    try:
        dropped = int(cupti.activity_get_num_dropped_records(0, 0))
    except Exception:
        dropped = 0
    line = json.dumps({"pid": os.getpid(), "k": kernels, "a": apis, "dropped": dropped},
                      separators=(",", ":")) + "\n"
    with _lock:
        path = _state["path"]
        try:
            if os.path.getsize(path) + len(line) > MAX_BYTES:
                os.replace(path, path + ".1")
        except OSError:
            pass
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line)
        _state["records"] += len(kernels) + len(apis)


def status() -> dict:
    return dict(_state)
