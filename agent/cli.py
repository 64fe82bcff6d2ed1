"""steplens-agent: run | check | print-config | stack | record | env. A thin layer over steplens.agent.main."""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import sys
import threading

from steplens import cliout, conn, stackfmt
from steplens.agent import config as agent_config
from steplens.agent.sources import all_source_classes
from steplens.agent.sources.base import ConfigError, HostContext


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help=f"TOML config (default {agent_config.DEFAULT_CONFIG_PATH} when present)")
    p.add_argument("--collector", help="collector HOST:PORT, or several of one cluster: HOST:PORT,HOST:PORT,... "
                   "(one stream at a time, the first chosen by node id, the next when it goes away)")
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


def tune_gc(young_threshold: int) -> None:
    """The agent's cyclic garbage collector, once its sources are up: what start-up made (modules, code, the
    configuration: ~40,000 tracked objects) is frozen out of every later collection (gc.freeze), and a young
    collection runs every `young_threshold` container allocations instead of every 700. The comm-op source makes
    ~15 containers per op it parses, and at 700 a young collection ran every ~50 ops and an older one every ~500,
    each walking what had survived: ~1.2-1.5 us of the ~7.5 us an op costs (bench/flightrec_ops.py, --python-gc).
    Almost all the agent's objects die by reference count before a collection sees them; the few cycles wait
    longer (a young generation of 20,000 containers is a few MB at most). 0 leaves Python's thresholds."""
    import gc
    gc.freeze()
    if young_threshold:
        gc.set_threshold(young_threshold, *gc.get_threshold()[1:])


def cmd_run(args) -> int:
    import faulthandler

    from steplens.agent.main import Agent
    # a crash inside a C library (bcc, sqlite, grpc) leaves every thread's Python stack in the log (journal)
    faulthandler.enable()
    cfg = agent_config.load(args.config, _overrides(args))
    logging.basicConfig(level=cfg.agent.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    agent = Agent(cfg)
    done = threading.Event()

    def on_signal(signum, frame):
        done.set()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agent.start()
    tune_gc(cfg.agent.gc_young_threshold)
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
        # sources with more than one build (eBPF: BTF program types or a classic fallback) say which one
        # they will get here and why; "" for the others
        mode, mode_reason = "", ""
        if hasattr(cls, "planned_mode"):
            mode, mode_reason = "none", reason
            if ok:
                try:
                    mode, mode_reason = cls.planned_mode(ctx, cfg.sources[name])
                except Exception as exc:
                    mode, mode_reason = "unknown", f"mode probe failed: {type(exc).__name__}: {exc}"
        report[name] = {"available": ok, "enabled": enabled, "reason": reason, "description": cls.description,
                        "mode": mode, "mode_reason": mode_reason}
    if args.json:
        print(json.dumps({"node_id": cfg.agent.node_id, "sources": report}, indent=2))
    else:
        width = max(len(n) for n in report)
        for name, r in report.items():
            state = "up" if r["available"] else "unavailable"
            print(f"{name:<{width}}  {state:<11}  {r['reason']}")
            if r["available"] and r["mode"]:
                print(f"{'':<{width}}  mode {r['mode']}: {r['mode_reason']}")
    return 0


def cmd_print_config(args) -> int:
    cfg = agent_config.load(args.config, _overrides(args), check_transport=False)
    sys.stdout.write(cfg.as_toml())
    return 0


def _print_stack(sample, pid: int) -> None:
    print(f"Process {pid}")
    for t in sample.threads:
        flags = ", ".join(x for x in (t.state, "holds GIL" if t.gil else "") if x)
        print(f"\nThread {t.tid} \"{t.name}\" ({flags})")
        for f in t.frames:
            print(f"    {f.qualname} {stackfmt.location(f.file, f.line)}")
        if not t.frames:
            print(f"    {stackfmt.NO_PYTHON_FRAME} ({stackfmt.NO_PYTHON_FRAME_WHY})")


def _patient_sample(proc, stop: bool, seconds: float = 2.0):
    """One consistent sample for a one-shot dump. A read is torn when a target thread was descheduled in the
    middle of pushing or freeing a frame: retried back to back it stays torn until that thread runs again (on a
    loaded machine, 4 immediate tries all failed: CI, python 3.13), so the tries are spread over `seconds`."""
    import time as _time

    from steplens.agent.pyframes import memory
    deadline, pause = _time.monotonic() + seconds, 0.001
    while True:
        try:
            return proc.sample(stop_threads=stop)
        except memory.ProcessGone:
            raise
        except memory.PyFramesError:
            if _time.monotonic() + pause > deadline:
                raise
            _time.sleep(pause)
            pause = min(pause * 2, 0.05)


def cmd_stack(args) -> int:
    from steplens.agent.pyframes import memory, reader
    try:
        proc = reader.attach(args.pid, args.proc_root or "/proc")
        try:
            sample = _patient_sample(proc, args.stop)
        finally:
            proc.close()
    except memory.PyFramesError as exc:
        print(f"steplens-agent: stack {args.pid}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"pid": args.pid, "python": ".".join(map(str, proc.version)), "mono_ns": sample.mono_ns,
                          "threads": [t.as_dict() for t in sample.threads]}, indent=2, ensure_ascii=False))
    else:
        _print_stack(sample, args.pid)
    return 0


def cmd_record(args) -> int:
    import time as _time

    from steplens.agent.pyframes import formats, memory, reader
    if not (0 < args.rate <= 10000) or args.duration <= 0:
        print("steplens-agent: record: --rate must be within 0..10000 Hz and --duration > 0", file=sys.stderr)
        return 2
    try:
        proc = reader.attach(args.pid, args.proc_root or "/proc", thread_states=True)
    except memory.PyFramesError as exc:
        print(f"steplens-agent: record {args.pid}: {exc}", file=sys.stderr)
        return 1
    samples, errors, ended = [], 0, ""
    period = 1.0 / args.rate
    import gc
    gc_was_enabled = gc.isenabled()
    gc.disable()  # samples are acyclic: collections over a growing list only cost time
    cpu0, t0 = _time.process_time(), _time.monotonic()
    deadline = t0 + args.duration
    next_at = t0
    try:
        while True:
            now = _time.monotonic()
            if now >= deadline:
                break
            if now < next_at:
                _time.sleep(next_at - now)
            next_at += period
            if next_at < _time.monotonic() - period:  # fell behind: skip, never burst
                next_at = _time.monotonic() + period
            try:
                samples.append(proc.sample(stop_threads=args.stop))
            except memory.ProcessGone:
                ended = "the process exited"
                break
            except memory.PyFramesError:
                errors += 1
    except KeyboardInterrupt:
        ended = "interrupted"
    finally:
        proc.close()
        if gc_was_enabled:
            gc.enable()
    wall = _time.monotonic() - t0
    cpu = _time.process_time() - cpu0
    with open(args.output, "w", encoding="utf-8") as fh:
        formats.write(samples, fh, args.format, name=f"steplens pid {args.pid}", interval_ns=int(period * 1e9),
                      include_idle=args.idle)
    n = len(samples)
    cpu_write = _time.process_time() - cpu0 - cpu
    print(f"steplens-agent: {n} samples in {wall:.2f}s ({n / wall:.0f} Hz achieved of {args.rate:g}), "
          f"{errors} failed, {cpu / max(n, 1) * 1e6:.0f} µs CPU per sample "
          f"(+{cpu_write / max(n, 1) * 1e6:.0f} µs writing them); wrote {args.output}"
          + (f"; stopped early: {ended}" if ended else ""), file=sys.stderr)
    return 0


def cmd_parse(args) -> int:
    import json

    from steplens.agent import parse
    try:
        res = parse.parse_file(args.file, args.kind)
    except parse.ParseError as exc:
        print(f"steplens-agent: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(res.to_json()) if args.json else parse.summary(res, args.limit))
    return 0


def cmd_env(args) -> int:
    import os

    from steplens.agent import bootstrap
    from steplens.agent.config import load
    # the agent's own config decides where its kineto endpoint listens: the job must poll the same socket
    cfg = load(args.config, check_transport=False)
    kineto_dir = getattr(cfg.sources.get("kineto"), "socket_dir", "")
    if args.runtime_dir is None:  # where the flightrec source looks: its first socket_dirs entry without a glob
        dirs = [d for d in getattr(cfg.sources.get("flightrec"), "socket_dirs", []) if "*" not in d]
        args.runtime_dir = dirs[0] if dirs else "/run/steplens/fr"
    env = bootstrap.launch_env(kineto=args.kineto, flightrec=args.flightrec, nccl_log=args.nccl_log,
                               cupti=args.cupti, runtime_dir=args.runtime_dir, fr_buffer_size=args.fr_buffer_size,
                               nccl_log_dir=args.nccl_log_dir,
                               pythonpath=os.environ.get("PYTHONPATH", "") if args.keep_pythonpath else "")
    if args.kineto and kineto_dir:
        env.insert(1, ("KINETO_IPC_SOCKET_DIR", kineto_dir,
                       "kineto: the agent's [sources.kineto] socket_dir (filesystem socket instead of the abstract one)"))
    return _print_env(env, args.format, args.explain)


# what `env $(steplens-agent env) CMD` and `export $(...)` pass through unharmed: no word splitting (IFS),
# no pathname expansion (*?[), nothing a shell would otherwise treat specially
_ENV_SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./-]*")


def _print_env(env: list[tuple[str, str, str]], fmt: str, explain: bool) -> int:
    """env: bare KEY=VALUE lines (for `env $(...)`, `export $(...)`, EnvironmentFile=, --env-file); shell: `export
    KEY='value'` lines for eval; json: one object. --explain notes go to stderr, except in shell format where
    they are `#` lines (harmless to eval)."""
    from steplens.agent import bootstrap
    head = ["steplens launch environment: put these in the job's environment (export, srun --export, torchrun env)"]
    notes = head + list(bootstrap.ATTACH_NOTES) if explain else []
    if fmt == "env":
        bad = [key for key, value, _ in env if not _ENV_SAFE.fullmatch(value)]
        if bad:
            print(f"steplens-agent: env: the value of {', '.join(bad)} has characters (space, quote, glob) that "
                  "`env $(steplens-agent env)` would split or expand; use --format shell "
                  "(eval \"$(steplens-agent env --format shell)\") or --format json", file=sys.stderr)
            return 1
    if fmt == "shell":
        import shlex
        lines = [f"# {n}" for n in notes]
        for key, value, why in env:
            lines += ([f"# {why}"] if explain else []) + [f"export {key}={shlex.quote(value)}"]
        print("\n".join(lines))
        return 0
    for n in notes:
        print(f"# {n}", file=sys.stderr)
    if explain:
        for key, _, why in env:
            print(f"# {key}: {why}", file=sys.stderr)
    sys.stderr.flush()
    if fmt == "json":
        print(json.dumps({key: value for key, value, _ in env}, indent=2))
    else:
        print("\n".join(f"{key}={value}" for key, value, _ in env))
    return 0


@cliout.quiet_on_closed_pipe
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
    p = sub.add_parser("stack", help="dump the Python stacks of a process once (like py-spy dump)")
    p.add_argument("pid", type=int)
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("--stop", action="store_true", help="stop the Python threads for the read (consistent snapshot)")
    p.add_argument("--proc-root", help="procfs mount (default /proc)")
    p.set_defaults(func=cmd_stack)
    p = sub.add_parser("record", help="sample a process's Python stacks at a rate into a profile file")
    p.add_argument("pid", type=int)
    p.add_argument("--rate", type=float, default=100.0, help="samples per second (default 100)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds (default 10)")
    p.add_argument("--format", choices=["collapsed", "speedscope", "chrome"], default="collapsed")
    p.add_argument("-o", "--output", required=True, help="output file")
    p.add_argument("--idle", action="store_true", help="include idle threads")
    p.add_argument("--stop", action="store_true", help="stop the Python threads for each read")
    p.add_argument("--proc-root", help="procfs mount (default /proc)")
    p.set_defaults(func=cmd_record)
    p = sub.add_parser("env", help="the job's launch environment (Kineto, Flight Recorder bootstrap, NCCL logs): "
                                   "KEY=VALUE lines, shell exports or JSON")
    p.add_argument("--kineto", action=argparse.BooleanOptionalAction, default=True, help="KINETO_USE_DAEMON=1 (default on)")
    p.add_argument("--flightrec", action=argparse.BooleanOptionalAction, default=True,
                   help="the bootstrap on PYTHONPATH + Flight Recorder (default on)")
    p.add_argument("--nccl-log", action=argparse.BooleanOptionalAction, default=True,
                   help="NCCL_DEBUG=INFO init/coll logs for the NCCL topology (default on)")
    p.add_argument("--cupti", action=argparse.BooleanOptionalAction, default=False,
                   help="cupti-python kernel records in the bootstrap (GPU hosts; default off)")
    p.add_argument("--runtime-dir", default=None, help="where the per-process sockets go (default: the agent "
                                                           "config's [sources.flightrec] socket_dirs[0], /run/steplens/fr)")
    p.add_argument("--fr-buffer-size", type=int, default=2000, help="Flight Recorder entries kept per process")
    p.add_argument("--nccl-log-dir", default="/var/log/steplens/nccl", help="directory of the NCCL logs")
    p.add_argument("--keep-pythonpath", action="store_true", help="append the current $PYTHONPATH after the bootstrap")
    p.add_argument("--format", choices=["env", "shell", "json"], default="env",
                   help="env (default): bare KEY=VALUE lines for `env $(steplens-agent env) CMD` or `export $(...)` "
                        "(refused, exit 1, when a value would not survive word splitting); shell: `export KEY='value'` "
                        "lines for `eval \"$(steplens-agent env --format shell)\"`; json: one object")
    p.add_argument("--explain", action="store_true",
                   help="what each variable is for and which sources need them: on stderr (as `#` lines in shell format)")
    p.add_argument("--config", help="the agent's config file (default /etc/steplens/agent.toml if present): "
                                    "its [sources.kineto] socket_dir is passed on")
    p.set_defaults(func=cmd_env)
    p = sub.add_parser("parse", help="what steplens extracts from one recorded file (Kineto trace, Flight Recorder "
                                     "dump, NCCL_DEBUG=INFO log; .gz too): ops, kernels, steps")
    p.add_argument("file")
    p.add_argument("--kind", choices=("kineto", "flightrec", "nccl-log"), help="default: guessed from the content")
    p.add_argument("--json", action="store_true", help='one object {"kind", "ops", "kernels", "steps", "skipped"}; '
                                                       "times in the file's own clock, ns")
    p.add_argument("--limit", type=int, default=40, help="ops listed in the human table (default 40)")
    p.set_defaults(func=cmd_parse)
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
