"""steplens-agent: run | check | print-config. A thin layer over steplens.agent.main."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

from steplens import conn
from steplens.agent import config as agent_config
from steplens.agent.sources import all_source_classes
from steplens.agent.sources.base import ConfigError, HostContext


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help=f"TOML config (default {agent_config.DEFAULT_CONFIG_PATH} when present)")
    p.add_argument("--collector", help="collector HOST:PORT")
    p.add_argument("--node-id", help="this node's id (default: host name)")
    p.add_argument("--state-dir", help="spool and state directory")
    p.add_argument("--insecure", action="store_true", default=None, help="plaintext, loopback collectors only")
    p.add_argument("--tls-ca", help="CA bundle that signed the collector's certificate")
    p.add_argument("--tls-cert", help="this agent's client certificate (CN = node id)")
    p.add_argument("--tls-key", help="this agent's client key")
    p.add_argument("--metrics-listen", help="HOST:PORT for /metrics, or '' to disable")
    p.add_argument("--proc-root", help="procfs mount (default /proc)")
    p.add_argument("--disable", action="append", default=[], metavar="SOURCE", help="disable a source")
    p.add_argument("--interval", action="append", default=[], metavar="SOURCE=SECONDS",
                   help="override a source's interval_seconds")


def _overrides(args) -> dict:
    agent = {"collector": args.collector, "node_id": args.node_id, "state_dir": args.state_dir,
             "insecure": args.insecure, "tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key,
             "metrics_listen": args.metrics_listen, "proc_root": args.proc_root}
    sources: dict = {}
    for name in args.disable:
        sources.setdefault(name, {})["enabled"] = False
    for item in args.interval:
        name, _, value = item.partition("=")
        try:
            sources.setdefault(name, {})["interval_seconds"] = float(value)
        except ValueError:
            raise ConfigError(f"--interval {item!r}: expected SOURCE=SECONDS") from None
    return {"agent": agent, "sources": sources}


def cmd_run(args) -> int:
    from steplens.agent.main import Agent
    cfg = agent_config.load(args.config, _overrides(args))
    logging.basicConfig(level=cfg.agent.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    agent = Agent(cfg)
    done = threading.Event()

    def on_signal(signum, frame):
        done.set()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agent.start()
    while not done.wait(1.0):
        pass
    drained = agent.stop()
    return 0 if drained else 3


def cmd_check(args) -> int:
    cfg = agent_config.load(args.config, _overrides(args), check_transport=False)
    ctx = HostContext(node_id=cfg.agent.node_id, proc_root=cfg.agent.proc_root, sys_root=cfg.agent.sys_root,
                      state_dir=cfg.agent.state_dir)
    report = {}
    for name, cls in all_source_classes().items():
        enabled = cfg.sources[name].enabled
        try:
            avail = cls.probe(ctx)
            ok, reason = avail.ok, avail.reason
        except Exception as exc:
            ok, reason = False, f"probe failed: {type(exc).__name__}: {exc}"
        if not enabled:
            ok, reason = False, "disabled in config"
        report[name] = {"available": ok, "enabled": enabled, "reason": reason, "description": cls.description}
    if args.json:
        print(json.dumps({"node_id": cfg.agent.node_id, "sources": report}, indent=2))
    else:
        width = max(len(n) for n in report)
        for name, r in report.items():
            state = "up" if r["available"] else "unavailable"
            print(f"{name:<{width}}  {state:<11}  {r['reason']}")
    return 0


def cmd_print_config(args) -> int:
    cfg = agent_config.load(args.config, _overrides(args), check_transport=False)
    sys.stdout.write(cfg.as_toml())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="steplens-agent", description="steplens per-node agent")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run the agent (sources, spool, stream to the collector)")
    _common(p)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("check", help="which sources can run here, and why not")
    _common(p)
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("print-config", help="the effective config (file + overrides + defaults) as TOML")
    _common(p)
    p.set_defaults(func=cmd_print_config)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, conn.SecurityError) as exc:
        print(f"steplens-agent: config error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"steplens-agent: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
