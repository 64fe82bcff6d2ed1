"""What one sample of a Python process is: threads, each with its frames innermost first."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Frame:
    function: str      # co_name
    qualname: str      # co_qualname (3.11+); co_name before 3.11
    file: str          # co_filename
    line: int          # for an instruction without a location, the line before it (see PythonProcess._frame)


@dataclass(slots=True)
class ThreadStack:
    tid: int                 # native thread id (0 when it could not be determined)
    thread_id: int           # pthread_t as CPython stores it
    name: str                # /proc/PID/task/TID/comm
    gil: bool                # holds the GIL at the sample
    state: str               # running, sleeping, disk-wait, stopped, zombie, unknown (from /proc .../stat)
    frames: list[Frame] = field(default_factory=list)  # innermost first

    @property
    def active(self) -> bool:
        return self.state == "running" or self.gil

    def as_dict(self) -> dict:
        return {"tid": self.tid, "thread_id": self.thread_id, "name": self.name, "gil": self.gil,
                "state": self.state, "active": self.active,
                "frames": [{"function": f.function, "qualname": f.qualname, "file": f.file, "line": f.line}
                           for f in self.frames]}


@dataclass(slots=True)
class Sample:
    mono_ns: int
    pid: int
    threads: list[ThreadStack] = field(default_factory=list)
