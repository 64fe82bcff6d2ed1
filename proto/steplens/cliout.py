"""How the command-line tools behave at a terminal and in pipes, the same in every command: quiet when the
reader of their output goes away, progress and tables sized for a person at a terminal, plain text for scripts.

A closed pipe (`steplens stacks | head`) ends a tool quietly, like other Unix tools, with the status a shell
reports for a process stopped by SIGPIPE (141), instead of a traceback or "[Errno 32] Broken pipe". Python
ignores SIGPIPE, so a write to a closed pipe raises BrokenPipeError wherever the program happens to print, or
at the interpreter's final flush of a block-buffered stdout (then as "Exception ignored in <stdout>", exit
120). `quiet_on_closed_pipe` wraps a CLI's main: it flushes stdout while it can still catch the error, and
when the error is stdout's own (the pipe polls as broken) it points fd 1 at /dev/null so the final flush has
nowhere to fail. A BrokenPipeError from anything else (a socket) still propagates.

`Progress` is one status line on stderr for a long operation, drawn only for a person watching
(`progress_wanted`: stderr a terminal; not with NO_COLOR, TERM=dumb, `--quiet`, or `--json` into a pipe). It
costs nothing when not drawn (no thread; update() sets attributes); when drawn, a daemon thread redraws it
every 0.1 s. `fit_widths`/`ellipsize` fit a table to the terminal's width when stdout is one
(`output_columns`), cutting only the columns a caller names as free text, and never when piped, where scripts
read whole rows. `watch` re-runs a listing like watch(1): on a terminal it redraws the screen in place, piped
it prints each refresh after the last (JSON: one document a line). Only VT100 sequences every terminal
emulator knows are written (\\r, erase line, erase below, cursor home, clear screen).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import select
import shutil
import sys
import threading
import time

EXIT_CLOSED_PIPE = 128 + 13  # 128 + SIGPIPE: what a shell reports for `yes | head`'s yes


def stdout_closed() -> bool:
    """True when stdout is a pipe (or socket) whose reading end has gone away."""
    try:
        p = select.poll()
        p.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in p.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def quiet_on_closed_pipe(main):
    """Decorate a CLI `main(argv) -> int` so that a closed stdout ends it quietly with EXIT_CLOSED_PIPE."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            rc = main(*args, **kwargs)
            sys.stdout.flush()
            return rc
        except BrokenPipeError:
            if not stdout_closed():
                raise
            _silence_stdout()
            return EXIT_CLOSED_PIPE
    return wrapper


ELLIPSIS = "\u2026"  # one character wide on every terminal
ERASE_LINE = "\r\x1b[K"  # to column 0, then erase to the end of the line (VT100; TERM=dumb gets no progress)


def ellipsize(text: str, width: int) -> str:
    """text cut to width characters, its last one an ellipsis when anything was cut."""
    if len(text) <= width:
        return text
    return text[:max(width - 1, 0)] + ELLIPSIS if width > 0 else ""


def output_columns() -> int | None:
    """The terminal's width when stdout is a terminal (COLUMNS wins, as shutil reads it), else None: piped
    output is never cut."""
    try:
        if not sys.stdout.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    return shutil.get_terminal_size().columns


def fit_widths(widths: list[int], free: list[int], columns: int, sep: int = 2, min_width: int = 8) -> list[int]:
    """Column widths that fit `columns` characters (with `sep` between columns): the widest of the `free`
    columns (indexes) is narrowed first, none below min_width (or its own width, if narrower); the other
    columns keep theirs, so the result may still be too wide when the fixed columns alone are."""
    out = list(widths)
    excess = sum(out) + sep * max(len(out) - 1, 0) - columns
    while excess > 0:
        room = [i for i in free if out[i] > min_width]
        if not room:
            break
        room.sort(key=lambda i: out[i], reverse=True)
        widest = room[0]
        runner_up = max([out[i] for i in room[1:]] + [min_width])
        cut = min(excess, out[widest] - runner_up) or 1  # level the widest with the next, then take turns
        out[widest] -= cut
        excess -= cut
    return out


def progress_wanted(quiet: bool = False, json_out: bool = False, stream=None) -> bool:
    """Whether to draw progress: on a terminal for a person, never for a script. json_out: the command prints
    JSON, so progress only when that JSON goes to the terminal too."""
    stream = stream or sys.stderr
    if quiet or os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty() and not (json_out and not sys.stdout.isatty())
    except (AttributeError, ValueError):
        return False


def progress_for(args, label: str, **kw) -> Progress:
    """A Progress for a CLI command: drawn unless its args say --quiet, or --json into a pipe."""
    return Progress(label, enabled=progress_wanted(getattr(args, "quiet", False), getattr(args, "json", False)), **kw)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


class Progress:
    """One status line on stderr for a long operation, `label: 1,200 of 7,000 flows (17%), note · 3.2s`,
    redrawn in place every interval_seconds by a daemon thread while the caller works (so a blocking call
    shows its elapsed time too) and erased when the operation ends (close(), or leaving the `with` block).

    The caller only sets figures (update(), advance()); it never prints while a Progress is open. Nothing is
    drawn for the first delay_seconds, so a quick command leaves no flicker. unit: a noun for the count
    ("flows"), or "bytes" (shown as kB/MB/GB). enabled=None asks progress_wanted(); when not enabled, no thread
    starts and every method returns at once."""

    def __init__(self, label: str, total: int | None = None, unit: str = "", *, note: str = "",
                 enabled: bool | None = None, stream=None, delay_seconds: float = 0.25,
                 interval_seconds: float = 0.1) -> None:
        self.label, self.total, self.unit, self.note = label, total, unit, note
        self.done: int | None = None
        self.stream = stream or sys.stderr
        self.enabled = progress_wanted(stream=self.stream) if enabled is None else enabled
        self.delay_seconds, self.interval_seconds = delay_seconds, interval_seconds
        self._started = time.monotonic()
        self._drawn = ""  # the line on the terminal now
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._thread = threading.Thread(target=self._tick, name="progress", daemon=True)
            self._thread.start()

    def update(self, done: int | None = None, total: int | None = None, note: str | None = None,
               label: str | None = None) -> None:
        """Set what the next redraw shows; arguments left out keep their value."""
        if done is not None:
            self.done = done
        if total is not None:
            self.total = total
        if note is not None:
            self.note = note
        if label is not None:
            self.label = label

    def advance(self, n: int = 1) -> None:
        self.done = (self.done or 0) + n

    def line(self) -> str:
        """The status line as drawn now (without cutting it to the terminal)."""
        parts = []
        if self.done is not None:
            fmt = _human_bytes if self.unit == "bytes" else (lambda n: f"{n:,}")
            unit = "" if self.unit == "bytes" or not self.unit else f" {self.unit}"
            if self.total:
                pct = min(100, 100 * self.done // self.total)
                parts.append(f"{fmt(self.done)} of {fmt(self.total)}{unit} ({pct}%)")
            else:
                parts.append(f"{fmt(self.done)}{unit}")
        if self.note:
            parts.append(self.note)
        elapsed = time.monotonic() - self._started
        text = f"{self.label}: {', '.join(parts)}" if parts else self.label
        return text + (f" \u00b7 {elapsed:.1f}s" if elapsed >= 1 else "")

    def _tick(self) -> None:
        if self._stop.wait(self.delay_seconds):
            return
        while True:
            self._draw()
            if self._stop.wait(self.interval_seconds):
                return

    def _draw(self) -> None:
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, ValueError, AttributeError):
            columns = 80
        text = ellipsize(self.line(), columns - 1)  # a line as wide as the terminal wraps on some: \r redraws below
        if text == self._drawn:
            return
        try:
            self.stream.write("\r" + text + "\x1b[K")
            self.stream.flush()
            self._drawn = text
        except (OSError, ValueError):
            self._stop.set()

    def close(self) -> None:
        """Stop redrawing and erase the line (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._drawn:
            self._drawn = ""
            try:
                self.stream.write(ERASE_LINE)
                self.stream.flush()
            except (OSError, ValueError):
                pass

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


CLEAR_SCREEN = "\x1b[2J"
CURSOR_HOME = "\x1b[H"
ERASE_TO_END = "\x1b[J"


class _Capture(io.StringIO):
    """stdout while one refresh of a watch runs: its text, kept for one frame. isatty() answers as the real
    stdout does, so a table still fits the terminal (output_columns)."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def _screen(title: str, stamp: str, body: str, first: bool) -> str:
    """One watch frame for a terminal: drawn from the top-left corner over the last one (each line erased as
    it is written, the rest of the screen after it), cut to the terminal's width and height so it never
    scrolls."""
    columns, rows = shutil.get_terminal_size()
    gap = columns - len(title) - len(stamp)
    lines = [title + " " * gap + stamp if gap >= 1 else title, ""] + body.splitlines()
    lines = [ellipsize(x.expandtabs(), columns) for x in lines[:max(rows - 1, 1)]]
    return (CLEAR_SCREEN if first else "") + CURSOR_HOME + "".join("\x1b[K" + x + "\n" for x in lines) + ERASE_TO_END


def watch(refresh, seconds: float, count: int = 0, title: str = "", json_lines: bool = False) -> int:
    """Run refresh() -> (status, error text) every `seconds`, start to start, like watch(1), until Ctrl-C
    (status 0) or, with count, for that many refreshes (the last one's status). What refresh() prints is one
    frame: on a terminal the screen is redrawn under a header with the time; piped, each refresh follows the
    last after a header line (json_lines: each JSON document on one line, no header). An error text goes in
    the frame on a terminal, else to stderr."""
    out = sys.stdout
    tty = out.isatty()
    head = f"Every {seconds:g}s: {title}"
    n = rc = 0
    try:
        while True:
            started = time.monotonic()
            buf = _Capture(tty)
            with contextlib.redirect_stdout(buf):
                rc, error = refresh()
            text, stamp = buf.getvalue(), time.strftime("%Y-%m-%d %H:%M:%S")
            if tty:
                out.write(_screen(head, stamp, text + (error + "\n" if error else ""), n == 0))
            else:
                if json_lines:
                    try:
                        text = json.dumps(json.loads(text), ensure_ascii=False) + "\n" if text.strip() else ""
                    except ValueError:
                        pass
                else:
                    text = ("\n" if n else "") + f"{head}  {stamp}\n" + text
                out.write(text)
                if error:
                    print(error, file=sys.stderr, flush=True)
            out.flush()
            n += 1
            if count and n >= count:
                return rc
            time.sleep(max(0.0, seconds - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return 0
