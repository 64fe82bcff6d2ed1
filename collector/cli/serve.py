"""steplens-collector: serve | allinone. A thin layer over steplens.collector.server."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys

from steplens import conn
from steplens.collector.server import Collector, CollectorSettings
from steplens.collector.store.schema import StoreError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG_PATH = "/etc/steplens/collector.toml"
_KEYS = {"db", "store", "listen", "control_listen", "insecure", "tls_ca", "tls_cert", "tls_key", "token_file",
         "operator_cns", "retention", "log_level", "metrics_listen", "peer_cns", "peer_tls_cert", "peer_tls_key"}
_TABLES = {"collector", "analysis", "detectors", "deep_dive"}


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*", str(text))
    if not m:
        raise ValueError(f"bad duration {text!r}: expected e.g. 500ms, 30s, 10m, 2h, 7d")
    return float(m.group(1)) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}[m.group(2)]


def _settings(args) -> tuple[CollectorSettings, str]:
    table: dict = {}
    doc: dict = {}
    path = args.config or (DEFAULT_CONFIG_PATH if os.path.exists(DEFAULT_CONFIG_PATH) else None)
    if path:
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"cannot read config {path!r}: {exc}") from None
        table = doc.get("collector", {})
        unknown = set(table) - _KEYS
        if unknown:
            raise ValueError(f"{path}: unknown key(s) in [collector]: {', '.join(sorted(unknown))}")
        unknown = set(doc) - _TABLES
        if unknown:
            raise ValueError(f"{path}: unknown table(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(_TABLES))})")
    analysis, detector_configs = analysis_config(doc, path or "config")
    deep_dive = deep_dive_config(doc, path or "config")
    for key in _KEYS:
        value = getattr(args, key, None)
        if value not in (None, ""):
            table[key] = value
    if not table.get("db"):
        raise ValueError("--db PATH is required (or db in the config file)")
    s = CollectorSettings(
        db=table["db"], store=table.get("store", ""), listen=table.get("listen", "127.0.0.1:7707"),
        control_listen=table.get("control_listen", ""),
        insecure=bool(table.get("insecure", False)),
        tls=conn.TlsFiles(table.get("tls_ca", ""), table.get("tls_cert", ""), table.get("tls_key", "")),
        token=conn.read_token(table.get("token_file", "")),
        operator_cns=tuple(table.get("operator_cns", ["steplens-operator"])),
        retention_seconds=parse_duration(table.get("retention", "7d")), metrics_listen=table.get("metrics_listen", ""),
        analysis=analysis, detector_configs=detector_configs, deep_dive=deep_dive,
        peer_cns=tuple(table.get("peer_cns", ["steplens-collector"])),
        peer_tls=conn.TlsFiles(table.get("tls_ca", ""), table.get("peer_tls_cert", ""), table.get("peer_tls_key", ""))
        if table.get("peer_tls_cert") or table.get("peer_tls_key") else None)
    return s, table.get("log_level", "info")


def deep_dive_config(doc: dict, where: str):
    """[deep_dive] of a collector config (analysis/deepdive.py): unknown keys and bad values are errors."""
    from steplens.collector.analysis.base import build_config
    from steplens.collector.analysis.deepdive import DeepDiveConfig
    return build_config(DeepDiveConfig, doc.get("deep_dive", {}), f"{where}: [deep_dive]")


def analysis_config(doc: dict, where: str):
    """[analysis] and [detectors.<name>] of a collector config: unknown keys or detectors are errors."""
    import dataclasses

    from steplens.collector.analysis import DETECTORS, load_spec
    from steplens.collector.analysis.base import AnalysisSettings, build_config
    table = doc.get("analysis", {})
    known = {f.name for f in dataclasses.fields(AnalysisSettings)}
    if set(table) - known:
        raise ValueError(f"{where}: unknown key(s) in [analysis]: {', '.join(sorted(set(table) - known))}")
    try:
        analysis = AnalysisSettings(**table)
        analysis.validate()
    except TypeError as exc:
        raise ValueError(f"{where}: [analysis]: {exc}") from None
    configs = {}
    for name, sub in doc.get("detectors", {}).items():
        if name not in DETECTORS:
            raise ValueError(f"{where}: [detectors.{name}]: no such detector (registered: "
                             f"{', '.join(sorted(DETECTORS)) or 'none yet'})")
        configs[name] = build_config(load_spec(name).config_class, sub, f"{where}: [detectors.{name}]")
    return analysis, configs


async def _serve(settings: CollectorSettings, ready_line: bool) -> int:
    collector = Collector(settings)
    try:
        port = await collector.start()
    except StoreError as exc:
        print(f"steplens-collector: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"steplens-collector: {exc}", file=sys.stderr)
        await collector.stop(0)
        return 1
    if ready_line:
        print(f"steplens-collector: listening on port {port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await collector.stop()
    return 0


def cmd_serve(args) -> int:
    settings, level = _settings(args)
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(_serve(settings, True))


def _allinone_agent_config(state_dir: str) -> str:
    """The all-in-one agent's config: the Flight Recorder sockets of jobs started with its `env` (the demo's) under
    the state directory (the default, /run/steplens/fr, needs root)."""
    path = os.path.join(state_dir, "agent.toml")
    fr = os.path.abspath(os.path.join(state_dir, "fr"))
    os.makedirs(fr, exist_ok=True)
    with open(path, "w") as fh:
        fh.write(f"# written by steplens-collector allinone\n[sources.flightrec]\nsocket_dirs = [{json.dumps(fr)}]\n")
    return path


def cmd_allinone(args) -> int:
    """Collector in this process, one local agent as a child, and (where torch is installed) the demo job with
    its fault (collector/demo.py); Ctrl-C stops them all cleanly."""
    from steplens.collector import demo as demo_mod
    os.makedirs(args.state_dir, exist_ok=True)
    db = args.db or os.path.join(args.state_dir, "steplens.db")
    settings = CollectorSettings(db=db, store=args.store, listen=args.listen, insecure=True)
    settings.validate()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    agent_bin = [os.path.join(os.path.dirname(sys.executable), "steplens-agent")]
    if not os.path.exists(agent_bin[0]):
        agent_bin = [sys.executable, "-m", "steplens.agent.cli"]
    agent_config = _allinone_agent_config(args.state_dir)
    agent_cmd = agent_bin + ["run", "--config", agent_config, "--collector", args.listen, "--insecure",
                             "--state-dir", os.path.join(args.state_dir, "agent"), "--metrics-listen",
                             args.metrics_listen]
    why_no_demo = "--demo off" if args.demo == "off" else demo_mod.torch_missing()
    if why_no_demo and args.demo == "on":
        print(f"steplens-collector: --demo on: {why_no_demo}", file=sys.stderr)
        return 2
    demo = None if why_no_demo else demo_mod.Demo(args.state_dir, agent_bin, agent_config, ranks=args.demo_ranks,
                                                  fault_after=args.demo_fault_after)

    async def main() -> int:
        collector = Collector(settings)
        await collector.start()
        agent = subprocess.Popen(agent_cmd)
        cli = os.path.join(os.path.dirname(sys.executable), "steplens")
        cli = os.path.relpath(cli) if cli.startswith(os.getcwd() + os.sep) else cli
        cli = f"{cli} --collector {args.listen} --insecure"
        where = collector.store_url.describe() + f", state {db}" if args.store else db
        print(f"\nsteplens all-in-one: collector on {args.listen} (store {where}), agent pid {agent.pid}"
              f"{', /metrics on ' + args.metrics_listen if args.metrics_listen else ''}.\n"
              f"Look with:\n  {cli} nodes\n  {cli} gpus\n  {cli} procs\n"
              "Ctrl-C stops everything.\n", flush=True)
        if demo is None:
            print(f"demo job skipped: {why_no_demo}\n", flush=True)
        else:
            try:
                demo.start()
            except (OSError, RuntimeError, ValueError) as exc:
                print(f"demo job not started: {exc}\n", flush=True)
            else:
                print(demo.intro(cli), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        reader, told, demo_ok = collector.make_reader(), {}, demo is not None and bool(demo.procs)
        while not stop.is_set() and agent.poll() is None:
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
            if demo_ok:
                failed = demo.failed()
                if failed:
                    print(f"demo job stopped: {failed}\n", flush=True)
                    demo_ok = False
                try:
                    found = reader.findings(job_key=demo.job, open_only=True)
                except Exception:  # the store busy for a moment: look again next time
                    found = []
                for f in found:  # each finding when it opens, and again when its top suspect or cause changes
                    top = (f.suspects[0].kind, f.suspects[0].id, f.suspects[0].cause) if f.suspects else None
                    if told.get(f.id, "") != top:
                        print(demo.finding_text(cli, f, f.id in told), flush=True)
                        told[f.id] = top
        if demo is not None:
            await asyncio.to_thread(demo.stop)
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)  # the agent flushes to us before we stop
            try:
                await asyncio.to_thread(agent.wait, 15)
            except subprocess.TimeoutExpired:
                agent.kill()
        await collector.stop()
        return 0 if agent.returncode in (0, -signal.SIGTERM, -signal.SIGINT, 3) else 1
    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="steplens-collector", description="steplens central collector")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="serve Ingest (agents) and Control (operators)")
    p.add_argument("--config", help=f"TOML with a [collector] table (default {DEFAULT_CONFIG_PATH} when present)")
    p.add_argument("--db", help="SQLite store path (with --store clickhouse: the collector's state only)")
    p.add_argument("--store", help="clickhouse://[USER[:PASS]@]HOST[:PORT]/DB or chdb:///DIR?database=DB: telemetry "
                                   "in ClickHouse (default: all in the SQLite file)")
    p.add_argument("--listen", help="HOST:PORT or unix:PATH (default 127.0.0.1:7707)")
    p.add_argument("--control-listen", dest="control_listen", help="extra TLS port for token-authenticated operators")
    p.add_argument("--insecure", action="store_true", default=None, help="plaintext, loopback/unix only")
    p.add_argument("--tls-ca", dest="tls_ca", help="CA that signs agent and operator client certificates")
    p.add_argument("--tls-cert", dest="tls_cert", help="server certificate")
    p.add_argument("--tls-key", dest="tls_key", help="server key")
    p.add_argument("--token-file", dest="token_file", help="bearer token accepted on Control")
    p.add_argument("--retention", help="keep data this long (e.g. 7d, 12h; default 7d)")
    p.add_argument("--metrics-listen", dest="metrics_listen",
                   help="serve Prometheus /metrics on HOST:PORT (findings open per job and kind, analysis latency)")
    p.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("allinone", help="collector + one local agent on loopback (what `make run` starts)")
    p.add_argument("--state-dir", default="run", help="where the store and the agent's spool go (default ./run)")
    p.add_argument("--db", help="store path (default STATE_DIR/steplens.db)")
    p.add_argument("--store", default="", help="as serve's --store (default: all in the SQLite file)")
    p.add_argument("--listen", default="127.0.0.1:7707")
    p.add_argument("--metrics-listen", default="127.0.0.1:9464", help="agent /metrics ('' disables)")
    p.add_argument("--demo", choices=["auto", "on", "off"], default="auto",
                   help="the demo training job with a fault (collector/demo.py); auto: where torch is installed")
    p.add_argument("--demo-ranks", type=int, default=4, help="ranks of the demo job (gloo on loopback)")
    p.add_argument("--demo-fault-after", type=float, default=60.0,
                   help="seconds until the demo's rank 1 becomes a straggler")
    p.set_defaults(func=cmd_allinone)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, conn.SecurityError, StoreError) as exc:
        print(f"steplens-collector: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
