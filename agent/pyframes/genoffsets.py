"""Generate the CPython 3.9-3.12 layout tables from each interpreter's own headers.

Compiles a tiny C program with offsetof()/sizeof() against the installed interpreter's
(internal) headers and prints a Python dict; `layouts/pyXY.py` hold the committed results and
tests/test_pyframes_layouts.py regenerates and compares them where the headers are installed.
3.13+ need no table: they describe themselves through _Py_DebugOffsets at the start of _PyRuntime.

    python -m steplens.agent.pyframes.genoffsets /root/.pyenv/versions/3.11.7
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile

# (name, C expression) per minor version; every entry is an offset or size in bytes
COMMON = [
    ("pyobject_ob_type", "offsetof(PyObject, ob_type)"),
    ("varobject_ob_size", "offsetof(PyVarObject, ob_size)"),
    ("bytes_ob_sval", "offsetof(PyBytesObject, ob_sval)"),
    ("unicode_state", "offsetof(PyASCIIObject, state)"),
    ("unicode_length", "offsetof(PyASCIIObject, length)"),
    ("unicode_ascii_size", "sizeof(PyASCIIObject)"),
    ("unicode_compact_size", "sizeof(PyCompactUnicodeObject)"),
    ("runtime_interpreters_head", "offsetof(_PyRuntimeState, interpreters.head)"),
    ("interp_next", "offsetof(PyInterpreterState, next)"),
    ("interp_id", "offsetof(PyInterpreterState, id)"),
    ("tstate_next", "offsetof(PyThreadState, next)"),
    ("tstate_interp", "offsetof(PyThreadState, interp)"),
    ("tstate_thread_id", "offsetof(PyThreadState, thread_id)"),
    ("tstate_size", "sizeof(PyThreadState)"),
    ("code_filename", "offsetof(PyCodeObject, co_filename)"),
    ("code_name", "offsetof(PyCodeObject, co_name)"),
    ("code_firstlineno", "offsetof(PyCodeObject, co_firstlineno)"),
]
PER_MINOR = {
    (3, 9): [
        ("interp_tstate_head", "offsetof(PyInterpreterState, tstate_head)"),
        ("tstate_frame", "offsetof(PyThreadState, frame)"),
        ("frame_back", "offsetof(PyFrameObject, f_back)"),
        ("frame_code", "offsetof(PyFrameObject, f_code)"),
        ("frame_lasti", "offsetof(PyFrameObject, f_lasti)"),
        ("frame_size", "sizeof(PyFrameObject)"),
        ("code_linetable", "offsetof(PyCodeObject, co_lnotab)"),
        ("code_code", "offsetof(PyCodeObject, co_code)"),
        ("gil_last_holder", "offsetof(_PyRuntimeState, ceval.gil.last_holder)"),
        ("gil_locked", "offsetof(_PyRuntimeState, ceval.gil.locked)"),
    ],
    (3, 10): [
        ("interp_tstate_head", "offsetof(PyInterpreterState, tstate_head)"),
        ("tstate_frame", "offsetof(PyThreadState, frame)"),
        ("frame_back", "offsetof(PyFrameObject, f_back)"),
        ("frame_code", "offsetof(PyFrameObject, f_code)"),
        ("frame_lasti", "offsetof(PyFrameObject, f_lasti)"),
        ("frame_size", "sizeof(PyFrameObject)"),
        ("code_linetable", "offsetof(PyCodeObject, co_linetable)"),
        ("code_code", "offsetof(PyCodeObject, co_code)"),
        ("gil_last_holder", "offsetof(_PyRuntimeState, ceval.gil.last_holder)"),
        ("gil_locked", "offsetof(_PyRuntimeState, ceval.gil.locked)"),
    ],
    (3, 11): [
        ("interp_tstate_head", "offsetof(PyInterpreterState, threads.head)"),
        ("tstate_native_thread_id", "offsetof(PyThreadState, native_thread_id)"),
        ("tstate_cframe", "offsetof(PyThreadState, cframe)"),
        ("cframe_current_frame", "offsetof(_PyCFrame, current_frame)"),
        ("frame_back", "offsetof(_PyInterpreterFrame, previous)"),
        ("frame_code", "offsetof(_PyInterpreterFrame, f_code)"),
        ("frame_instr", "offsetof(_PyInterpreterFrame, prev_instr)"),
        ("frame_owner", "offsetof(_PyInterpreterFrame, owner)"),
        ("frame_size", "sizeof(_PyInterpreterFrame)"),
        ("code_qualname", "offsetof(PyCodeObject, co_qualname)"),
        ("code_linetable", "offsetof(PyCodeObject, co_linetable)"),
        ("code_code_adaptive", "offsetof(PyCodeObject, co_code_adaptive)"),
        ("gil_last_holder", "offsetof(_PyRuntimeState, ceval.gil.last_holder)"),
        ("gil_locked", "offsetof(_PyRuntimeState, ceval.gil.locked)"),
    ],
    (3, 12): [
        ("interp_tstate_head", "offsetof(PyInterpreterState, threads.head)"),
        ("tstate_native_thread_id", "offsetof(PyThreadState, native_thread_id)"),
        ("tstate_cframe", "offsetof(PyThreadState, cframe)"),
        ("cframe_current_frame", "offsetof(_PyCFrame, current_frame)"),
        ("frame_back", "offsetof(_PyInterpreterFrame, previous)"),
        ("frame_code", "offsetof(_PyInterpreterFrame, f_code)"),
        ("frame_instr", "offsetof(_PyInterpreterFrame, prev_instr)"),
        ("frame_owner", "offsetof(_PyInterpreterFrame, owner)"),
        ("frame_size", "sizeof(_PyInterpreterFrame)"),
        ("code_qualname", "offsetof(PyCodeObject, co_qualname)"),
        ("code_linetable", "offsetof(PyCodeObject, co_linetable)"),
        ("code_code_adaptive", "offsetof(PyCodeObject, co_code_adaptive)"),
        ("interp_ceval_gil", "offsetof(PyInterpreterState, ceval.gil)"),
        ("gil_last_holder", "offsetof(struct _gil_runtime_state, last_holder)"),
        ("gil_locked", "offsetof(struct _gil_runtime_state, locked)"),
    ],
}

_C = """
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
%(includes)s
int main(void) {
%(prints)s
  return 0;
}
"""


def generate(prefix: str) -> tuple[tuple[int, int], dict[str, int]]:
    incs = glob.glob(os.path.join(prefix, "include", "python3.*"))
    if not incs:
        raise FileNotFoundError(f"no include/python3.* under {prefix}")
    inc = incs[0]
    minor = int(os.path.basename(inc).split(".")[1])
    version = (3, minor)
    if version not in PER_MINOR:
        raise ValueError(f"no layout table for {version}; 3.13+ use _Py_DebugOffsets")
    headers = ["internal/pycore_runtime.h", "internal/pycore_interp.h", "internal/pycore_pystate.h",
               "internal/pycore_frame.h", "internal/pycore_code.h", "frameobject.h"]
    includes = "\n".join(f'#include "{h}"' for h in headers if os.path.exists(os.path.join(inc, h)))
    fields = COMMON + PER_MINOR[version]
    prints = "\n".join(f'  printf("%s %%zu\\n", (size_t)({expr}));' % name for name, expr in fields)
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "o.c"), os.path.join(tmp, "o")
        with open(src, "w") as fh:
            fh.write(_C % {"includes": includes, "prints": prints})
        subprocess.run(["cc", "-w", "-I", inc, "-I", os.path.join(inc, "internal"), src, "-o", exe], check=True,
                       capture_output=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    return version, {k: int(v) for k, v in (line.split() for line in out.splitlines())}


if __name__ == "__main__":
    for prefix in sys.argv[1:]:
        v, table = generate(prefix)
        print(f"# {v[0]}.{v[1]} from {prefix}")
        print("OFFSETS = {")
        for k, val in table.items():
            print(f"    {k!r}: {val},")
        print("}")
