"""The agent's sources, registered in one place (SOURCE_PATHS: name -> "module:Class").

Modules are imported when the agent builds its sources, with no import side effects. A source
whose module fails to import (a broken install, a missing optional dependency at module level)
becomes a placeholder that is unavailable with the import error as its reason: the agent runs on.
"""

from __future__ import annotations

import importlib

from steplens.agent.sources.base import Availability, Source, SourceConfig

SOURCE_PATHS: dict[str, str] = {
    "host": "steplens.agent.sources.host:HostSource",
    "procs": "steplens.agent.sources.procs:ProcsSource",
    "gpu": "steplens.agent.sources.gpu:GpuSource",
    "pystacks": "steplens.agent.sources.pystacks:PystacksSource",
    "netflows": "steplens.agent.sources.netflows:NetflowsSource",
    "tcpinfo": "steplens.agent.sources.tcpinfo:TcpinfoSource",
    "sched": "steplens.agent.sources.sched:SchedSource",
    "gpuprobes": "steplens.agent.sources.gpuprobes:GpuprobesSource",
    "kineto": "steplens.agent.sources.kineto:KinetoSource",
    "flightrec": "steplens.agent.sources.flightrec:FlightrecSource",
    "nccltopo": "steplens.agent.sources.nccltopo:NccltopoSource",
    "iters": "steplens.agent.sources.iters:ItersSource",
}


def _unimportable(name: str, error: Exception) -> type[Source]:
    reason = f"source module failed to import: {type(error).__name__}: {error}"

    class Unimportable(Source):
        description = "(not importable)"

        @classmethod
        def probe(cls, ctx) -> Availability:
            return Availability.no(reason)

    Unimportable.name = name
    Unimportable.config_class = SourceConfig
    return Unimportable


def load_source_class(name: str) -> type[Source]:
    module_name, _, cls_name = SOURCE_PATHS[name].partition(":")
    try:
        return getattr(importlib.import_module(module_name), cls_name)
    except Exception as exc:  # ImportError, SyntaxError, AttributeError in a broken install
        return _unimportable(name, exc)


def all_source_classes() -> dict[str, type[Source]]:
    return {name: load_source_class(name) for name in SOURCE_PATHS}
