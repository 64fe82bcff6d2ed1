"""The agent's typed configuration: an [agent] table and one [sources.NAME] table per source.

Read from TOML (default /etc/steplens/agent.toml when present), then command-line overrides.
Every key has a default; unknown keys and wrong types fail at start-up, before any thread runs.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field

from steplens import conn
from steplens.agent.sources import SOURCE_PATHS, load_source_class
from steplens.agent.sources.base import ConfigError, SourceConfig, build_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG_PATH = "/etc/steplens/agent.toml"


@dataclass
class AgentSettings:
    node_id: str = ""                       # default: the host name
    collector: str = "127.0.0.1:7707"
    state_dir: str = "/var/lib/steplens-agent"
    insecure: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    metrics_listen: str = "127.0.0.1:9464"  # "" disables /metrics
    proc_root: str = "/proc"
    sys_root: str = "/sys"
    batch_max_records: int = 2000
    batch_max_bytes: int = 1024 * 1024
    batch_max_delay_seconds: float = 1.0
    queue_max_records: int = 100_000
    spool_max_bytes: int = 256 * 1024 * 1024
    window_batches: int = 8
    status_interval_seconds: float = 5.0
    flush_timeout_seconds: float = 5.0
    reconnect_min_seconds: float = 0.5
    reconnect_max_seconds: float = 30.0
    log_level: str = "info"
    governor: bool = True                   # the overhead governor (agent/governor.py) stretches the intervals of
    cpu_budget_fraction: float = 0.0        # ... governed sources to keep the agent's CPU under this share of the
    deep_cpu_budget_fraction: float = 0.01  # host's CPUs (sentinel: 0 = not governed; deep mode: 1 %)
    gc_young_threshold: int = 20_000        # Python's gen-0 GC threshold in `run` (0: Python's own, 700); see cli

    def validate(self) -> None:
        if not 0 <= self.cpu_budget_fraction <= 1 or not 0 <= self.deep_cpu_budget_fraction <= 1:
            raise ConfigError("cpu_budget_fraction and deep_cpu_budget_fraction must be within 0..1")
        if self.gc_young_threshold and not 700 <= self.gc_young_threshold <= 1_000_000:
            raise ConfigError(f"gc_young_threshold must be 0 (Python's default) or within 700..1000000, got "
                              f"{self.gc_young_threshold}")
        if not self.node_id or any(c.isspace() for c in self.node_id) or len(self.node_id) > 128:
            raise ConfigError(f"node_id must be 1-128 characters without spaces, got {self.node_id!r}")
        conn.split_addresses(self.collector)
        if self.metrics_listen:
            conn.split_host_port(self.metrics_listen)
        if not (1 <= self.batch_max_records <= 100_000):
            raise ConfigError("batch_max_records must be within 1..100000")
        if not (4096 <= self.batch_max_bytes <= conn.MAX_MESSAGE_BYTES // 2):
            raise ConfigError(f"batch_max_bytes must be within 4096..{conn.MAX_MESSAGE_BYTES // 2}")
        if not (0.01 <= self.batch_max_delay_seconds <= 60):
            raise ConfigError("batch_max_delay_seconds must be within 0.01..60")
        if self.spool_max_bytes < 4 * self.batch_max_bytes:
            raise ConfigError("spool_max_bytes must hold at least 4 batches (4 x batch_max_bytes)")
        if self.queue_max_records < self.batch_max_records:
            raise ConfigError("queue_max_records must be >= batch_max_records")
        if not (1 <= self.window_batches <= 256):
            raise ConfigError("window_batches must be within 1..256")
        if not (0 < self.reconnect_min_seconds <= self.reconnect_max_seconds):
            raise ConfigError("need 0 < reconnect_min_seconds <= reconnect_max_seconds")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError("log_level is one of debug, info, warning, error")

    def validate_transport(self) -> None:
        """How the agent reaches the collector (skipped by `check`, which never connects)."""
        if self.insecure:
            conn.require_insecure_allowed(*conn.split_addresses(self.collector))
        elif not (self.tls_ca or self.tls_cert):
            raise ConfigError("without --insecure the agent needs TLS: set tls_ca, tls_cert and tls_key "
                              "(mutual TLS to the collector)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key go together")


@dataclass
class AgentConfig:
    agent: AgentSettings
    sources: dict[str, SourceConfig] = field(default_factory=dict)

    def as_toml(self) -> str:
        lines = ["[agent]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in dataclasses.asdict(self.agent).items()]
        for name, cfg in self.sources.items():
            lines += ["", f"[sources.{name}]"]
            lines += [f"{k} = {_toml_value(v)}" for k, v in dataclasses.asdict(cfg).items()]
        return "\n".join(lines) + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def load(path: str | None, overrides: dict | None = None, check_transport: bool = True) -> AgentConfig:
    """Read, merge overrides ({"agent": {...}, "sources": {name: {...}}}), type-check and validate."""
    data: dict = {}
    if path is None and os.path.exists(DEFAULT_CONFIG_PATH):
        path = DEFAULT_CONFIG_PATH
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read config {path!r}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config {path!r} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"agent", "sources"})
    if unknown:
        raise ConfigError(f"unknown top-level table(s) {', '.join(unknown)}; expected [agent] and [sources.NAME]")
    agent_table = dict(data.get("agent", {}))
    sources_table = {k: dict(v) for k, v in data.get("sources", {}).items()}
    for key, value in (overrides or {}).get("agent", {}).items():
        if value is not None:
            agent_table[key] = value
    for name, table in (overrides or {}).get("sources", {}).items():
        sources_table.setdefault(name, {}).update(table)
    if not agent_table.get("node_id"):
        agent_table["node_id"] = conn.hostname()
    settings = build_config(AgentSettings, agent_table, "[agent]")  # type: ignore[arg-type]
    if check_transport:
        try:
            settings.validate_transport()
        except ValueError as exc:
            raise ConfigError(f"[agent]: {exc}") from None
    unknown_sources = sorted(set(sources_table) - set(SOURCE_PATHS))
    if unknown_sources:
        raise ConfigError(f"unknown source(s) {', '.join(unknown_sources)}; known: {', '.join(SOURCE_PATHS)}")
    sources = {}
    for name in SOURCE_PATHS:
        cls = load_source_class(name)
        sources[name] = build_config(cls.config_class, sources_table.get(name, {}), f"[sources.{name}]")
    return AgentConfig(settings, sources)  # type: ignore[arg-type]
