"""Wires one agent together: sources -> runner -> spool -> transport, plus control and /metrics.

Start-up fails fast (bad config, unwritable state dir, busy metrics port) before any thread runs;
after that nothing stops the agent but a signal. stop() is idempotent: it stops the sources,
flushes the queue into the spool, drains the spool to the collector for up to
flush_timeout_seconds, sends a final status, and closes.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from steplens import conn
from steplens.agent.config import AgentConfig
from steplens.agent.control import CommandHandler, DeepModeScheduler
from steplens.agent.records import Gap, Mode
from steplens.agent.governor import Governor, GovernorSettings
from steplens.agent.runner import BatchPolicy, Runner
from steplens.agent.sources import load_source_class
from steplens.agent.sources.base import HostContext
from steplens.agent.spool import Spool
from steplens.agent.transport.client import StreamClient, TransportConfig
from steplens.agent.transport.codec import encode_records
from steplens.v1 import ingest_pb2 as ipb
from steplens.v1 import records_pb2 as rpb

log = logging.getLogger("steplens.agent")


def _gap_payload(dropped_records: int, dropped_batches: int, first: int, last: int) -> tuple[bytes, int]:
    gap = Gap(time.monotonic_ns(), dropped_records, dropped_batches, first, last, "spool full")
    return encode_records([("agent", gap)]), 1


def _boot_id(proc_root: str) -> str:
    try:
        with open(os.path.join(proc_root, "sys/kernel/random/boot_id")) as fh:
            return fh.read().strip()
    except OSError:
        return ""


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        a = config.agent
        self.config = config
        try:
            os.makedirs(a.state_dir, exist_ok=True)
        except OSError as exc:
            raise RuntimeError(f"cannot create state dir {a.state_dir!r}: {exc.strerror}") from None
        if not os.access(a.state_dir, os.W_OK):
            raise RuntimeError(f"state dir {a.state_dir!r} is not writable")
        self.ctx = HostContext(node_id=a.node_id, proc_root=a.proc_root, sys_root=a.sys_root, state_dir=a.state_dir)
        self.spool = Spool(os.path.join(a.state_dir, "spool.db"), a.spool_max_bytes, _gap_payload)
        specs = {name: (load_source_class(name), cfg) for name, cfg in config.sources.items()}
        observers = []
        self.exporter_handle = None
        if a.metrics_listen:
            from steplens.agent.exporter import AgentExporter, LatestValues, serve_metrics
            self.latest = LatestValues()
            observers.append(lambda items: self.latest.observe([rec for _, rec in items]))
            exporter = AgentExporter(self.latest, self.health, a.node_id)
            try:
                self.exporter_handle = serve_metrics(exporter, a.metrics_listen)
            except OSError as exc:
                self.spool.close()
                raise RuntimeError(f"cannot serve /metrics on {a.metrics_listen}: {exc.strerror or exc}") from None
        self.runner = Runner(self.ctx, specs, encode_records, self.spool,
                             BatchPolicy(a.batch_max_records, a.batch_max_bytes, a.batch_max_delay_seconds,
                                         a.queue_max_records), observers,
                             Governor(GovernorSettings(a.governor, a.cpu_budget_fraction,
                                                       a.deep_cpu_budget_fraction)))
        self.deep = DeepModeScheduler(self.runner.set_mode, lambda recs: self.runner.emit("agent", recs))
        self.ctx.mode = lambda: self.runner.mode
        tls = conn.TlsFiles(a.tls_ca, a.tls_cert, a.tls_key)
        self.transport = StreamClient(
            TransportConfig(a.collector, a.node_id, a.insecure, tls, a.window_batches, a.status_interval_seconds,
                            a.reconnect_min_seconds, a.reconnect_max_seconds),
            self.spool, self.status, CommandHandler(self.deep, a.state_dir, self.ctx.workloads,
                                                        self.runner.refresh),
            hostname=conn.hostname(),
            boot_id=_boot_id(a.proc_root))
        self.runner.on_source_started = self.transport.status_soon  # `steplens nodes` sees a source up at once
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()

    def start(self) -> None:
        self.runner.start()
        self.transport.start()
        log.info("agent %s started; collector %s; state %s", self.config.agent.node_id,
                 self.config.agent.collector, self.config.agent.state_dir)

    def stop(self) -> bool:
        """Idempotent. Returns True when everything produced reached the collector."""
        with self._stop_lock:
            if self._stopped.is_set():
                return True
            timeout = self.config.agent.flush_timeout_seconds
            self.runner.stop(timeout=min(2.0, timeout))
            drained = self.transport.drain_and_stop(timeout)
            if self.exporter_handle is not None:
                self.exporter_handle.close()
            self.spool.close()
            self._stopped.set()
            if not drained:
                log.warning("stopped with undelivered batches in the spool; they are sent on the next start")
            return drained

    # -- reporting -------------------------------------------------------------------------
    def health(self) -> dict:
        self.runner.stalled_check()
        st = self.spool.stats()
        return {
            "sources": {n: s.as_dict() for n, s in self.runner.states.items()},
            "records_produced": st.records_produced, "records_acked": st.records_acked,
            "records_dropped": st.records_dropped, "queue_dropped": self.runner.queue.dropped_total,
            "spool_backlog_batches": st.backlog_batches, "spool_backlog_bytes": st.backlog_bytes,
            "connected": self.transport.connected,
            "mode": "deep" if self.runner.mode is Mode.DEEP else "sentinel",
        }

    def status(self, final: bool) -> ipb.AgentStatus:
        self.runner.stalled_check()
        st = self.spool.stats()
        msg = ipb.AgentStatus(
            mono_ns=time.monotonic_ns(), spool_backlog_batches=st.backlog_batches,
            spool_backlog_records=st.backlog_records, spool_backlog_bytes=st.backlog_bytes,
            records_produced=st.records_produced, records_acked=st.records_acked,
            records_dropped=st.records_dropped,
            mode=rpb.MODE_DEEP if self.runner.mode is Mode.DEEP else rpb.MODE_SENTINEL,
            mode_until_mono_ns=self.deep.until_mono_ns if self.runner.mode is Mode.DEEP else 0, final=final)
        for name, s in self.runner.states.items():
            msg.sources.add(name=name, up=s.up, reason=s.reason, last_duration_seconds=s.last_duration_seconds,
                            steps=s.steps, errors=s.errors, records=s.records, cpu_cores=s.cpu_cores,
                            rate_scale=s.rate_scale)
        gov = self.runner.governor
        msg.agent_cpu_cores, msg.cpu_budget_cores = gov.agent_cores, gov.budget_cores if gov.settings.enabled else 0.0
        return msg
