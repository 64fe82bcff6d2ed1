"""The operators' CLI behaves at a terminal as it should, and stays plain for scripts: progress on stderr only
for a person (a terminal, no --quiet, no NO_COLOR, no --json into a pipe), erased when done; `--watch` on the
listings (a redrawn screen on a terminal, one refresh after the other when piped, Ctrl-C ends it with 0);
completion scripts for bash, zsh and fish walked from the parser; tables cut to the terminal's width, never
when piped.

Everything runs for real: a collector and an agent on loopback watching a real process, the CLI under a
pseudo-terminal (python's pty, with a window size) or on pipes, the completion functions inside real bash,
zsh (zpty) and fish. `visible()` replays what a terminal would show, for the few escape sequences the CLI
writes (\\r, erase line, erase below, cursor home).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import re
import shutil
import signal
import struct
import subprocess
import sys
import termios
import threading
from dataclasses import dataclass

import pytest

from conftest import FAST_AGENT_TOML, STEPLENS, AgentProc, CollectorProc, free_port, wait_for

from steplens.collector.cli.ops import _table, build_parser

JOB = f"habits-{os.getpid()}"  # this run's own: another run's workload on the host is not counted
MARKER = "slhabits-marker"
LONG_ARG = "--with-a-rather-long-argument-that-no-terminal-column-is-wide-enough-for=1"
FLOW_ROWS = 100_000  # enough that an import takes well over the progress line's 0.25 s delay


@dataclass
class Run:
    rc: int
    tty: str      # what the command wrote to the terminal (stdout and/or stderr, as placed)
    stdout: str   # when stdout was a pipe
    stderr: str   # when stderr was a pipe


def run_tty(cmd: list[str], on_tty=("stdout", "stderr"), columns: int = 100, rows: int = 30,
            env: dict | None = None, timeout: float = 120) -> Run:
    """Run cmd with the streams named in on_tty on a pseudo-terminal of columns x rows, the others on pipes."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    full = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR", "TERM")}
    full.update({"TERM": "xterm", **(env or {})})
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=full, text=True,
                            stdout=slave if "stdout" in on_tty else subprocess.PIPE,
                            stderr=slave if "stderr" in on_tty else subprocess.PIPE)
    os.close(slave)
    chunks: list[bytes] = []

    def pump():
        while True:
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer of the terminal is gone
                return
            if not data:
                return
            chunks.append(data)
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        reader.join(10)
        os.close(master)
    return Run(proc.returncode, b"".join(chunks).decode(), out or "", err or "")


def visible(raw: str) -> list[str]:
    """The screen's lines after raw was written to a fresh terminal (trailing blanks dropped)."""
    lines, row, col, i = [""], 0, 0, 0
    escapes = {"\x1b[K": "erase line", "\x1b[J": "erase below", "\x1b[H": "home", "\x1b[2J": "clear"}
    while i < len(raw):
        esc = next((e for e in escapes if raw.startswith(e, i)), None)
        if esc:
            i += len(esc)
            if esc == "\x1b[K":
                lines[row] = lines[row][:col]
            elif esc == "\x1b[J":
                lines[row] = lines[row][:col]
                del lines[row + 1:]
            elif esc == "\x1b[H":
                row = col = 0
            else:
                lines = [""] * len(lines)
            continue
        c = raw[i]
        i += 1
        if c == "\r":
            col = 0
        elif c == "\n":
            row += 1
            if row == len(lines):
                lines.append("")
        else:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + c + line[col + 1:]
            col += 1
    lines = [x.rstrip() for x in lines]
    while lines and not lines[-1]:
        lines.pop()
    return lines


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A collector, an agent, and one workload process of job JOB with a long command line."""
    tmp = tmp_path_factory.mktemp("habits")
    collector = CollectorProc(tmp).start()
    toml = FAST_AGENT_TOML.replace("[sources.procs]\ninterval_seconds = 0.5\n",
                                   f'[sources.procs]\ninterval_seconds = 0.5\npatterns = ["{MARKER}"]\n')
    agent = AgentProc(tmp, "node-a", collector.address, toml=toml).start()
    work = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", MARKER, LONG_ARG],
                            env={**os.environ, "STEPLENS_JOB": JOB, "RANK": "0", "WORLD_SIZE": "1"})
    try:
        wait_for(lambda: any(p["job_key"] == JOB for p in collector.cli("procs")), 60, what="the job in procs")
        flows = tmp / "flows.csv"
        rows = ["start,src,dst,switches,bytes,duration"]
        rows += [f"{1_700_000_000 + i},10.0.{i // 250 % 250}.{i % 250 + 1},10.1.{i // 250 % 250}.{i % 250 + 1},"
                 f"leaf1;spine2,{1000 + i},0.5" for i in range(FLOW_ROWS)]
        flows.write_text("\n".join(rows) + "\n")
        yield {"collector": collector, "base": [STEPLENS, "--collector", collector.address, "--insecure"],
               "flows": str(flows), "tmp": tmp}
    finally:
        work.kill()
        work.wait(5)
        agent.stop()
        collector.stop()


# --- tables that fit the terminal -----------------------------------------------------------------------------

def test_table_cuts_only_the_free_columns_widest_first():
    rows = [["node-a", "12", "x" * 70, "short reason"], ["node-b", "7", "y" * 20, "r" * 40]]
    header = ["NODE", "RANK", "SUMMARY", "REASON"]
    whole = _table(rows, header, free=("SUMMARY", "REASON"), columns=0)  # 0: not a terminal
    assert "x" * 70 in whole and "r" * 40 in whole and "…" not in whole
    fitted = _table(rows, header, free=("SUMMARY", "REASON"), columns=60).splitlines()
    assert all(len(x) <= 60 for x in fitted), fitted
    assert fitted[1].startswith("node-a  12  ") and fitted[2].startswith("node-b  7   ")
    # the widest (SUMMARY) is narrowed to the next (REASON), then both in turn: 22 each, exactly 60 in all
    assert fitted[1] == "node-a  12    " + "x" * 21 + "…  " + "short reason".ljust(22)
    assert fitted[2] == "node-b  7     " + "y" * 20 + "    " + "r" * 21 + "…"
    # key columns are never cut: a table of key columns alone stays as wide as it is
    keys = _table([["a" * 50, "b" * 50]], ["NODE", "RANK"], free=(), columns=40)
    assert "a" * 50 in keys and "b" * 50 in keys


def test_summaries_without_durations_show_none_and_empty_flows_say_why(capsys):
    """Seen in `make run`: gloo's Flight Recorder gives each op its enqueue time only (timing cpu_enqueue), and
    `commops --summary` printed BUSY and MAX as 0µs, which reads as instant; and `flows` said "is the netflows
    source up?" while it was, its ranks talking over lo, which it leaves out by default."""
    from types import SimpleNamespace

    from steplens.collector.cli import ops
    row = {"rank": 0, "comm_id": "pg:0", "op": "all_reduce", "step": -1, "calls": 208, "bytes": 14540032,
           "busy_ns": 0, "max_ns": 0, "seq_first": 1, "seq_last": 208, "issue_latency_ns_sum": 0, "kernels": 0,
           "source": "flightrec", "end_ns": 0, "timing": "cpu_enqueue"}
    timed = dict(row, rank=1, timing="gpu_kernel", busy_ns=2_000_000, max_ns=40_000)
    stub = SimpleNamespace(ListCommSummaries=lambda req, timeout: SimpleNamespace(rows_json=json.dumps([row, timed])),
                           ListFlows=lambda req, timeout: SimpleNamespace(flows=[]))
    args = SimpleNamespace(job="demo", rank=None, limit=100, timeout=5, json=False, show=50, since="", by="pair",
                           node="")
    assert ops._cmd_comm_summaries(stub, args, 0) == 0
    lines = capsys.readouterr().out.splitlines()
    head = lines[0].split()
    busy, mx = head.index("BUSY"), head.index("MAX")
    assert [lines[1].split()[busy], lines[1].split()[mx]] == ["-", "-"]
    assert lines[2].split()[busy] != "-" and lines[2].split()[mx] != "-"
    assert ops.cmd_flows(stub, args) == 0
    assert "include_loopback" in capsys.readouterr().out
    none = SimpleNamespace(ListCommSummaries=lambda req, timeout: SimpleNamespace(rows_json="[]"))
    assert ops._cmd_comm_summaries(none, SimpleNamespace(**{**vars(args), "since": "20s"}), 1) == 0
    said = capsys.readouterr().out
    assert said.startswith("no comm summaries stored for job 'demo' in the last 20s") and "RANK" not in said


def test_tables_fit_the_terminal_and_piped_rows_stay_whole(cluster):
    base = cluster["base"]
    wait_for(lambda: subprocess.run(base + ["nodes"], capture_output=True, text=True).stdout.count("\n") >= 2, 30,
             what="a node row")
    tty = run_tty(base + ["nodes"], columns=130)   # its keys and counters alone take ~110: never cut
    screen = visible(tty.tty)
    assert tty.rc == 0 and len(screen) == 2, tty.tty
    assert all(len(x) <= 130 for x in screen), screen
    assert screen[0].startswith("NODE    CONN  LAST SEEN") and screen[1].startswith("node-a  yes")
    assert "…" in screen[1]
    piped = subprocess.run(base + ["nodes"], capture_output=True, text=True, timeout=30,
                           env={**os.environ, "COLUMNS": "60"})   # COLUMNS alone does not cut piped output
    lines = piped.stdout.splitlines()
    assert piped.returncode == 0 and max(map(len, lines)) > 130 and "…" not in piped.stdout
    assert "(disabled in config)" in lines[1]   # the DOWN (why) column in full

    tty = run_tty(base + ["procs"], columns=90)
    screen = visible(tty.tty)
    row = next(x for x in screen if x.startswith(JOB))
    assert all(len(x) <= 90 for x in screen), screen
    proc = next(p for p in cluster["collector"].cli("procs") if p["job_key"] == JOB)
    assert re.match(rf"{JOB}\s+0\s+1\s+node-a\s+{proc['pid']}\s", row), row   # the key columns intact
    assert row.endswith("…")
    piped = subprocess.run(base + ["procs"], capture_output=True, text=True, timeout=30)
    assert proc["cmdline"][:60] in piped.stdout and "…" not in piped.stdout


# --- --watch --------------------------------------------------------------------------------------------------

def test_watch_piped_prints_one_refresh_after_the_other(cluster):
    base = cluster["base"]
    out = subprocess.run(base + ["procs", "--watch", "0.2", "--count", "3"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    heads = [x for x in out.stdout.splitlines() if x.startswith("Every 0.2s: steplens procs --watch 0.2 --count 3")]
    assert len(heads) == 3, out.stdout
    assert out.stdout.count("\nJOB ") == 3 and out.stdout.count(f"\n{JOB} ") == 3
    assert "\x1b" not in out.stdout   # no terminal control on a pipe

    out = subprocess.run(base + ["procs", "--json", "--watch", "0.2", "--count", "3"], capture_output=True,
                         text=True, timeout=60)
    docs = [json.loads(x) for x in out.stdout.splitlines()]   # one JSON document a line
    assert out.returncode == 0 and len(docs) == 3
    assert all(any(p["job_key"] == JOB for p in d) for d in docs)


def test_watch_on_a_terminal_redraws_the_screen(cluster):
    run = run_tty(cluster["base"] + ["jobs", "--watch", "0.2", "--count", "3"], columns=80, rows=20)
    assert run.rc == 0
    assert run.tty.count("\x1b[2J") == 1 and run.tty.count("\x1b[H") == 3   # cleared once, redrawn in place
    screen = visible(run.tty)
    assert screen[0].startswith("Every 0.2s: steplens jobs --watch 0.2 --count 3")
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d$", screen[0]) and len(screen[0]) == 80
    assert any(x.startswith(JOB) for x in screen) and all(len(x) <= 80 for x in screen)
    assert len(screen) < 20   # a frame never scrolls


def test_watch_ends_quietly_on_ctrl_c(cluster):
    proc = subprocess.Popen(cluster["base"] + ["nodes", "--watch", "0.2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("Every 0.2s: steplens nodes --watch 0.2"), first
        proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and err == "", err


def test_watch_goes_on_while_the_collector_is_away():
    dead = f"127.0.0.1:{free_port()}"
    out = subprocess.run([STEPLENS, "--collector", dead, "--insecure", "--timeout", "1", "gaps", "--watch", "0.2",
                          "--count", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1   # the last refresh's status
    assert out.stdout.count("Every 0.2s: steplens gaps") == 2
    assert [x for x in out.stderr.splitlines() if x.startswith(f"steplens: nothing listens on {dead}")] and \
        len(out.stderr.splitlines()) == 2, out.stderr
    assert "Traceback" not in out.stderr


def test_bad_watch_interval_is_a_usage_error():
    out = subprocess.run([STEPLENS, "nodes", "--watch", "0"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "between 0.1 and 86400 seconds" in out.stderr


# --- progress -------------------------------------------------------------------------------------------------

def test_progress_on_a_terminal_during_a_long_import(cluster):
    run = run_tty(cluster["base"] + ["import", "flows", cluster["flows"]], on_tty=("stderr",))
    assert run.rc == 0, run.tty
    assert run.stdout.strip().startswith(f"imported {FLOW_ROWS} flows")
    drawn = [x for x in re.split(r"[\r\n]", run.tty) if x]
    assert any(re.match(rf"importing flows\.csv: [\d,]+ of {FLOW_ROWS:,} flows \(\d+%\)", x) for x in drawn), drawn
    assert all(len(x.replace("\x1b[K", "")) < 100 for x in drawn)   # never wider than the terminal
    assert visible(run.tty) == []   # erased at the end: nothing left on the screen


@pytest.mark.parametrize("how", ["piped", "--quiet", "NO_COLOR", "--json into a pipe"])
def test_no_progress_for_scripts(cluster, how):
    base, cmd = cluster["base"], ["import", "flows", cluster["flows"]]
    if how == "piped":
        out = subprocess.run(base + cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stderr == "", out.stderr
        return
    if how == "--quiet":
        run = run_tty(base[:1] + ["--quiet"] + base[1:] + cmd, on_tty=("stderr",))
    elif how == "NO_COLOR":
        run = run_tty(base + cmd, on_tty=("stderr",), env={"NO_COLOR": "1"})
    else:
        run = run_tty(base + cmd + ["--json"], on_tty=("stderr",))
        assert json.loads(run.stdout)["imported"] == FLOW_ROWS
    assert run.rc == 0 and run.tty == "", run.tty


def test_trace_and_fetches_leave_the_terminal_clean(cluster):
    base, out = cluster["base"], cluster["tmp"] / "job.pftrace"
    run = run_tty(base + ["trace", JOB, "-o", str(out), "--since", "20s"], on_tty=("stderr",))
    assert run.rc == 0 and out.stat().st_size > 0, run.tty
    assert run.stdout.startswith(f"wrote {out}")
    assert visible(run.tty) == [] and all(x.startswith(f"trace {JOB}") for x in re.split(r"[\r\n]", run.tty)
                                          if x.replace("\x1b[K", ""))
    for cmd in (["commops", JOB, "--since", "20s"], ["detail", "stacks", "--node", "node-a", "--since", "5s"],
                ["diagnose", JOB, "--since", "20s"]):
        run = run_tty(base + cmd, on_tty=("stderr",))
        assert run.rc in (0, 1) and visible(run.tty) == [], (cmd, run.tty)


# --- shell completion -----------------------------------------------------------------------------------------

def _script(shell: str, tmp_path) -> str:
    out = subprocess.run([STEPLENS, "completion", shell], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stderr == ""
    path = tmp_path / f"steplens.{shell}"
    path.write_text(out.stdout)
    return str(path)


def _bash_complete(script: str, lines: list[list[str]]) -> list[list[str]]:
    """COMPREPLY of the script's function in a real bash for each command line (its last word: the one being
    completed)."""
    body = [f"source {script}", "complete -p steplens"]
    for words in lines:
        quoted = " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)
        body += [f"COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; COMPREPLY=(); _steplens",
                 'printf "%s\\n" "${COMPREPLY[*]}"']
    out = subprocess.run(["bash", "--norc", "--noprofile", "-c", "\n".join(body)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    got = out.stdout.splitlines()
    assert got[0] == "complete -F _steplens steplens"
    return [x.split() for x in got[1:]]


def test_bash_completion_offers_subcommands_options_and_values(tmp_path):
    script = _script("bash", tmp_path)
    (tmp_path / "flows.csv").write_text("")
    got = _bash_complete(script, [
        ["steplens", ""], ["steplens", "im"], ["steplens", "nodes", "--"], ["steplens", "import", ""],
        ["steplens", "import", "flows", "--format", ""], ["steplens", "flows", "--by", ""],
        ["steplens", "--collector", "127.0.0.1", ":", "7707", "--insecure", "procs", "--a"],
        ["steplens", "import", "flows", str(tmp_path / "fl")], ["steplens", "completion", ""],
        ["steplens", "deep", "--job", ""]])
    assert {"nodes", "gpus", "procs", "import", "trace", "findings", "completion"} <= set(got[0])
    assert got[1] == ["import"]
    assert set(got[2]) == {"--help", "--json", "--node", "--watch", "--count"}
    assert got[3] == ["flows", "topology"]
    assert got[4] == ["auto", "csv", "json"]
    assert got[5] == ["pair", "connection"]
    assert got[6] == ["--all"]
    assert got[7] == [str(tmp_path / "flows.csv")]
    assert got[8] == ["bash", "fish", "zsh"]
    assert got[9] == []   # a job key: nothing to offer


def test_bash_completion_follows_the_parser(tmp_path):
    """Every subcommand and every option of each, as the parser has them now, is offered."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    names = sorted(sub.choices)
    got = _bash_complete(_script("bash", tmp_path), [["steplens", ""]] + [["steplens", n, "--"] for n in names])
    assert sorted(got[0]) == names
    for name, offered in zip(names, got[1:]):
        want = {f for a in sub.choices[name]._actions for f in a.option_strings if f.startswith("--")}
        assert set(offered) == want, name


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")
def test_fish_completion(tmp_path):
    script = _script("fish", tmp_path)

    def complete(line: str) -> list[str]:
        out = subprocess.run(["fish", "--no-config", "-c", f"source {script}; complete -C '{line}'"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return [x.split("\t")[0] for x in out.stdout.splitlines()]
    assert {"nodes", "import", "trace", "completion"} <= set(complete("steplens "))
    assert complete("steplens import ") == ["flows", "topology"]
    assert set(complete("steplens nodes --")) == {"--count", "--help", "--json", "--node", "--watch"}
    assert complete("steplens flows --by ") == ["connection", "pair"]
    assert complete("steplens deep ") == ["list", "start", "stop"]


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_completion(tmp_path):
    """An interactive zsh on a pseudo-terminal (zpty) with compinit and the script: Tab lists the choices."""
    script = _script("zsh", tmp_path)
    driver = tmp_path / "drive.zsh"
    driver.write_text(f"""
zmodload zsh/zpty
zpty -b z zsh -f -i
zpty -w z 'PS1="%% "; autoload -U compinit; compinit -u -D; source {script}; print ready-$((6 * 7))'
zpty -r -m z out '*ready-42*' || exit 3
try() {{
    local out='' chunk
    zpty -w -n z $'\\x15'"$1"$'\\t'
    integer n=0
    while (( n++ < 100 )); do
        zpty -r -t z chunk && out+=$chunk
        [[ $out == *$2* ]] && {{ print -r -- "ok $1"; return; }}
        sleep 0.1
    done
    print -r -- "missing $2 after $1: $out"
}}
try 'steplens import ' 'topology'
try 'steplens flows --by ' 'connection'
try 'steplens nodes --wa' 'steplens nodes --watch'
zpty -d z
""")
    out = subprocess.run(["zsh", "-f", str(driver)], capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == ["ok steplens import ", "ok steplens flows --by ", "ok steplens nodes --wa"], \
        out.stdout + out.stderr
