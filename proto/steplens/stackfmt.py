"""How the CLIs print a Python stack frame, so `steplens stacks`, `steplens detail stacks` and
`steplens-agent stack` agree.

A thread can hold a Python thread state and run no Python code: a native thread that registered with the
interpreter once and stays in C++ (torch's autograd device threads do, via pybind11's gil_scoped_acquire),
or a Python thread that is starting or ending. Its sample has no frames, and is printed as NO_PYTHON_FRAME
rather than as an empty frame. A pseudo-frame (the "<other stacks>" bucket of a summary) has no file and no
line, and is printed without a location.
"""

from __future__ import annotations

NO_PYTHON_FRAME = "<no Python frame>"
NO_PYTHON_FRAME_WHY = "native code holding a Python thread state, or a thread starting or ending"


def location(file: str, line: int) -> str:
    """ "(file:line)", "(file)" without a line, "" without a file."""
    if not file:
        return ""
    return f"({file}:{line})" if line >= 0 else f"({file})"
