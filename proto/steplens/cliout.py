"""How the command-line tools end when the reader of their output goes away (`steplens stacks | head`):
quietly, like other Unix tools, with the status a shell reports for a process stopped by SIGPIPE (141),
instead of a traceback or "[Errno 32] Broken pipe".

Python ignores SIGPIPE, so a write to a closed pipe raises BrokenPipeError wherever the program happens to
print, or at the interpreter's final flush of a block-buffered stdout (then as "Exception ignored in
<stdout>", exit 120). `quiet_on_closed_pipe` wraps a CLI's main: it flushes stdout while it can still catch
the error, and when the error is stdout's own (the pipe polls as broken) it points fd 1 at /dev/null so
the final flush has nowhere to fail. A BrokenPipeError from anything else (a socket) still propagates.
"""

from __future__ import annotations

import functools
import os
import select
import sys

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
