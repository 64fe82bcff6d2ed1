"""Assembles a collector: store writer + Ingest + Control on one grpc.aio server.

Used by `steplens-collector serve`, by `allinone`, and by tests and benchmarks that need a real
collector in-process or as a child process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import sqlite3
from dataclasses import dataclass, field

import grpc

from steplens import conn
from steplens.collector.analysis.base import AnalysisSettings, DetectorConfig
from steplens.collector.analysis.deepdive import DeepDiveConfig, DeepDives
from steplens.collector.analysis.engine import AnalysisEngine
from steplens.collector.control.fetch import DetailCache, thread_fetcher
from steplens.collector.control.service import ControlService
from steplens.collector.ingest.clock import ClusterClock
from steplens.collector.ingest.server import IngestService, IngestSettings
from steplens.collector.store.clickhouse import make_store
from steplens.collector.store.schema import StoreError
from steplens.collector.store.writer import BackendError
from steplens.v1 import control_pb2_grpc as cgrpc

log = logging.getLogger("steplens.collector")


@dataclass
class CollectorSettings:
    db: str                # the SQLite file: the whole store, or the state beside ClickHouse
    store: str = ""        # '' : SQLite at db; clickhouse://HOST:PORT/DB or chdb:///DIR: telemetry there
    listen: str = "127.0.0.1:7707"
    control_listen: str = ""  # TLS port without client certs, for operators with a bearer token
    insecure: bool = False
    tls: conn.TlsFiles = field(default_factory=conn.TlsFiles)
    token: str = ""
    operator_cns: tuple[str, ...] = ("steplens-operator",)
    retention_seconds: float = 7 * 86400
    max_message_bytes: int = conn.MAX_MESSAGE_BYTES
    ingest: IngestSettings = field(default_factory=IngestSettings)
    analysis: AnalysisSettings = field(default_factory=AnalysisSettings)
    detector_configs: dict[str, DetectorConfig] = field(default_factory=dict)  # name -> config ([detectors.*])
    detectors: dict | None = None  # name -> DetectorSpec; None: every registered one (analysis.DETECTORS)
    metrics_listen: str = ""       # HOST:PORT for /metrics ('' : none)
    deep_dive: DeepDiveConfig = field(default_factory=DeepDiveConfig)   # [deep_dive]: findings start deep dives
    # collector to collector on a shared store (control/peers.py): the CNs accepted from other collectors, and
    # this one's client certificate for them ('' : its server certificate, which then needs clientAuth usage)
    peer_cns: tuple[str, ...] = ("steplens-collector",)
    peer_tls: conn.TlsFiles | None = None

    def validate(self) -> None:
        if self.store:
            from steplens.collector.store.clickhouse import parse_store
            parse_store(self.store)
        conn.split_host_port(self.listen)
        self.analysis.validate()
        if self.metrics_listen:
            conn.split_host_port(self.metrics_listen)
        for cfg in self.detector_configs.values():
            cfg.validate()
        if self.peer_tls is not None and bool(self.peer_tls.cert) != bool(self.peer_tls.key):
            raise conn.SecurityError("peer_tls_cert needs peer_tls_key, and the key its certificate")
        if self.insecure:
            conn.require_insecure_allowed(self.listen)
        else:
            conn.server_credentials(self.tls, require_client_cert=True)  # raises with the reason
        if self.control_listen:
            conn.split_host_port(self.control_listen)
            if self.insecure:
                raise conn.SecurityError("--control-listen is for TLS collectors; an insecure one serves Control "
                                         "on --listen")
            if not self.token:
                raise conn.SecurityError("--control-listen needs --token-file: it accepts no client certificates")


class StoreErrors(grpc.aio.ServerInterceptor):
    """A Control call whose store read fails (SQLite busy or gone, a ClickHouse server unreachable) answers
    UNAVAILABLE with the reason, instead of gRPC's bare UNKNOWN; Ingest's stream handles its own."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        async def call(request, context):
            try:
                return await inner(request, context)
            except (BackendError, StoreError, sqlite3.Error) as exc:
                log.warning("%s: store failed: %s", details.method, exc)
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"the collector's store failed: {exc}")
        return grpc.unary_unary_rpc_method_handler(call, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def dial_address(listen: str, port: int) -> str:
    """The address other collectors dial for one listening on `listen` (bound `port`): a wildcard host becomes
    this host's name, port 0 the port bound."""
    if listen.startswith("unix:"):
        return listen
    host, _ = conn.split_host_port(listen)
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.getfqdn()
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class Collector:
    def __init__(self, settings: CollectorSettings) -> None:
        settings.validate()
        self.settings = settings
        self.clock = ClusterClock()
        self.store_url, make_writer, make_reader = make_store(settings.db, settings.store)
        # its id among the collectors of this store (analysis/ownership.py; the writer's id on what it stores)
        collector_id = settings.analysis.collector_id or f"{socket.gethostname()}/{settings.listen}"
        if not settings.analysis.collector_id and settings.listen.endswith(":0"):   # a port chosen at bind: unique
            collector_id += f"/{os.getpid()}"
        self.writer = make_writer(now_ns=self.clock.now_ns, retention_seconds=settings.retention_seconds,
                                  writer_id=collector_id)
        ingest_settings = settings.ingest
        ingest_settings.require_client_cert = not settings.insecure
        self.ingest = IngestService(self.writer, self.clock, ingest_settings)
        self.control = ControlService(make_reader(), self.ingest, self.clock, tls=not settings.insecure,
                                      token=settings.token, operator_cns=settings.operator_cns)
        own = [p for a in (settings.listen, settings.control_listen, settings.metrics_listen) if a
               for p in [conn.split_host_port(a)[1]] if p]
        analysis = dataclasses.replace(
            settings.analysis, flows_ignore_ports=sorted(set(settings.analysis.flows_ignore_ports) | set(own)),
            collector_id=collector_id,
            collector_address=settings.analysis.collector_address or settings.listen)
        self.analysis = AnalysisEngine(make_reader(), self.writer, analysis, settings.detectors,
                                       settings.detector_configs, now_ns=self.clock.now_ns)
        self.control.engine = self.analysis
        self.deepdives = DeepDives(self.ingest, make_reader(), self.writer, self.clock, self.analysis.hub,
                                   settings.deep_dive)
        self.control.deepdives = self.deepdives
        self.peer_service = None
        if self.store_url.kind != "sqlite":   # collectors sharing the store reach each other's agents
            from steplens.collector.control.peers import Peers, PeerService
            self.ingest.peers = Peers(make_reader(), collector_id, settings.insecure,
                                      settings.peer_tls or settings.tls, settings.analysis.collector_ttl_seconds,
                                      settings.max_message_bytes)
            self.peer_service = PeerService(self.ingest, collector_id, not settings.insecure, settings.peer_cns)
        self.make_reader = make_reader
        self.metrics = None
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> int:
        s = self.settings
        opts = [("grpc.max_receive_message_length", s.max_message_bytes),
                ("grpc.max_send_message_length", s.max_message_bytes),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000),
                ("grpc.so_reuseport", 0)]
        self.server = grpc.aio.server(options=opts, interceptors=[StoreErrors()])
        self.server.add_generic_rpc_handlers((self.ingest.generic_handler(),))
        cgrpc.add_ControlServicer_to_server(self.control, self.server)
        if self.peer_service is not None:
            from steplens.v1 import peer_pb2_grpc
            peer_pb2_grpc.add_PeerServicer_to_server(self.peer_service, self.server)
        if s.insecure:
            self.port = self.server.add_insecure_port(s.listen)
        else:
            self.port = self.server.add_secure_port(s.listen, conn.server_credentials(s.tls, require_client_cert=True))
        if self.port == 0 and not s.listen.startswith("unix:"):
            raise OSError(f"cannot listen on {s.listen} (address in use or not local)")
        if s.control_listen:
            # same services, server-side TLS only: Ingest refuses here (no client certificate), Control
            # accepts the bearer token
            self.control_port = self.server.add_secure_port(
                s.control_listen, conn.server_credentials(conn.TlsFiles("", s.tls.cert, s.tls.key), False))
            if self.control_port == 0:
                raise OSError(f"cannot listen on {s.control_listen}")
        own = self.analysis.ownership
        if own is not None and not s.analysis.collector_address:   # where the other collectors reach this one
            own.address = dial_address(s.listen, self.port)
        self.writer.start()
        await self.server.start()
        rows = s.analysis.fetch_cache_rows
        self.analysis.fetch = thread_fetcher(asyncio.get_running_loop(), self.ingest, self.control.reader, self.clock,
                                             cache=DetailCache(max_rows=rows) if rows else None)
        self.analysis.start()
        self.deepdives.start()
        if s.metrics_listen:
            from steplens.collector.metrics import CollectorExporter, MetricsServer
            self.metrics = MetricsServer(CollectorExporter(self.make_reader(), self.analysis, self.ingest,
                                                           self.deepdives).registry,
                                         s.metrics_listen)
        log.info("collector listening on %s (port %d), store %s, %s", s.listen, self.port,
                 self.store_url.describe() + (f" (state {s.db})" if self.store_url.kind != "sqlite" else ""),
                 "insecure (loopback only)" if s.insecure else "mutual TLS")
        return self.port

    async def stop(self, grace: float = 2.0) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        await self.deepdives.stop()
        await asyncio.to_thread(self.analysis.stop)
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None
        await asyncio.to_thread(self.writer.stop)
        if self.ingest.peers is not None:
            await self.ingest.peers.close()
