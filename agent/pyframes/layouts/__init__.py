"""One layout per CPython minor version, chosen once per process by `for_version`.

3.9-3.12: tables generated from each version's headers (pyXY.py). 3.13+: the interpreter's own
_Py_DebugOffsets, read from the target's memory with the field order of that minor (py313.py,
py314.py), and refused unless fields whose values cannot differ read back right.
"""

from __future__ import annotations

import importlib
import struct
from dataclasses import dataclass


class LayoutError(ValueError):
    pass


@dataclass
class Layout:
    version: tuple[int, int]
    runtime_interpreters_head: int
    interp_next: int
    interp_tstate_head: int
    tstate_next: int
    tstate_interp: int
    tstate_thread_id: int
    tstate_native_thread_id: int | None
    tstate_read_size: int
    # how to find the innermost frame from a thread state
    tstate_frame: int | None            # direct pointer (3.9/3.10 frame, 3.13+ current_frame)
    tstate_cframe: int | None           # 3.11/3.12: _PyCFrame* ...
    cframe_current_frame: int | None    # ... and its current_frame
    frame_kind: str                     # "object" (PyFrameObject) or "interp" (_PyInterpreterFrame)
    frame_back: int
    frame_code: int
    frame_lasti: int | None
    frame_instr: int | None
    frame_owner: int | None
    frame_read_size: int
    code_tag_mask: int
    instr_is_prev: bool                 # 3.11/3.12 prev_instr points at the last executed instruction
    code_filename: int
    code_name: int
    code_qualname: int | None
    code_firstlineno: int
    code_linetable: int
    code_code_adaptive: int | None
    code_code: int | None
    code_read_size: int
    linetable: str
    pyobject_ob_type: int
    varobject_ob_size: int
    bytes_ob_sval: int
    unicode_state: int
    unicode_length: int
    unicode_ascii_size: int
    unicode_compact_size: int
    gil_mode: str                       # "runtime" (3.9-3.11), "interp_ptr" (3.12+)
    gil_last_holder: int
    gil_locked: int
    interp_ceval_gil: int | None = None


def _max_off(*offsets) -> int:
    return max(o for o in offsets if o is not None) + 8


def for_table(version: tuple[int, int]) -> Layout:
    try:
        mod = importlib.import_module(f"steplens.agent.pyframes.layouts.py{version[0]}{version[1]}")
    except ImportError:
        raise LayoutError(f"CPython {version[0]}.{version[1]} is not supported (3.9-3.14 are)") from None
    if not hasattr(mod, "OFFSETS"):
        raise LayoutError(f"CPython {version[0]}.{version[1]} describes itself; use for_debug_offsets")
    o = mod.OFFSETS
    minor = version[1]
    interp_frames = minor >= 11
    code_fields = [o["code_filename"], o["code_name"], o.get("code_qualname"), o["code_firstlineno"],
                   o["code_linetable"], o.get("code_code_adaptive"), o.get("code_code")]
    return Layout(
        version=version, runtime_interpreters_head=o["runtime_interpreters_head"], interp_next=o["interp_next"],
        interp_tstate_head=o["interp_tstate_head"], tstate_next=o["tstate_next"], tstate_interp=o["tstate_interp"],
        tstate_thread_id=o["tstate_thread_id"], tstate_native_thread_id=o.get("tstate_native_thread_id"),
        tstate_read_size=o["tstate_size"],
        tstate_frame=o.get("tstate_frame"), tstate_cframe=o.get("tstate_cframe"),
        cframe_current_frame=o.get("cframe_current_frame"),
        frame_kind="interp" if interp_frames else "object", frame_back=o["frame_back"], frame_code=o["frame_code"],
        frame_lasti=o.get("frame_lasti"), frame_instr=o.get("frame_instr"), frame_owner=o.get("frame_owner"),
        frame_read_size=_max_off(o["frame_back"], o["frame_code"], o.get("frame_lasti"), o.get("frame_instr"),
                                 o.get("frame_owner")),
        code_tag_mask=0, instr_is_prev=interp_frames,
        code_filename=o["code_filename"], code_name=o["code_name"], code_qualname=o.get("code_qualname"),
        code_firstlineno=o["code_firstlineno"], code_linetable=o["code_linetable"],
        code_code_adaptive=o.get("code_code_adaptive"), code_code=o.get("code_code"),
        code_read_size=_max_off(*code_fields, o["varobject_ob_size"]),
        linetable="lnotab39" if minor == 9 else "linetable310" if minor == 10 else "locations311",
        pyobject_ob_type=o["pyobject_ob_type"], varobject_ob_size=o["varobject_ob_size"],
        bytes_ob_sval=o["bytes_ob_sval"], unicode_state=o["unicode_state"], unicode_length=o["unicode_length"],
        unicode_ascii_size=o["unicode_ascii_size"], unicode_compact_size=o["unicode_compact_size"],
        gil_mode="interp_ptr" if minor >= 12 else "runtime", gil_last_holder=o["gil_last_holder"],
        gil_locked=o["gil_locked"], interp_ceval_gil=o.get("interp_ceval_gil"))


def parse_debug_offsets(blob: bytes, version: tuple[int, int]) -> dict[str, int]:
    """The raw _Py_DebugOffsets at the start of _PyRuntime -> {"section.field": value}."""
    try:
        mod = importlib.import_module(f"steplens.agent.pyframes.layouts.py{version[0]}{version[1]}")
        fields = mod.FIELDS
    except (ImportError, AttributeError):
        raise LayoutError(f"no _Py_DebugOffsets field list for CPython {version[0]}.{version[1]}") from None
    if blob[:8] != b"xdebugpy":
        raise LayoutError("_PyRuntime does not start with the _Py_DebugOffsets cookie 'xdebugpy'")
    out: dict[str, int] = {}
    pos = 8
    for entry in fields:
        names = [entry[0]] if len(entry) == 1 else [f"{entry[0]}.{f}" for f in entry[1]]
        for name in names:
            if pos + 8 > len(blob):
                raise LayoutError("_Py_DebugOffsets is shorter than the field list")
            out[name] = struct.unpack_from("<Q", blob, pos)[0]
            pos += 8
    return out


def field_position(version: tuple[int, int], name: str) -> int:
    """Byte position of "section.field" inside _Py_DebugOffsets for this minor's field list."""
    mod = importlib.import_module(f"steplens.agent.pyframes.layouts.py{version[0]}{version[1]}")
    pos = 8
    for entry in mod.FIELDS:
        for field_name in ([entry[0]] if len(entry) == 1 else [f"{entry[0]}.{f}" for f in entry[1]]):
            if field_name == name:
                return pos
            pos += 8
    raise KeyError(name)


def debug_offsets_size(version: tuple[int, int]) -> int:
    mod = importlib.import_module(f"steplens.agent.pyframes.layouts.py{version[0]}{version[1]}")
    return 8 + 8 * sum(1 if len(e) == 1 else len(e[1]) for e in mod.FIELDS)


def for_debug_offsets(d: dict[str, int], version: tuple[int, int]) -> Layout:
    # values that are the same in every CPython build on x86-64: a wrong field list cannot pass
    invariants = {"pyobject.size": 16, "pyobject.ob_type": 8, "bytes_object.ob_size": 16,
                  "bytes_object.ob_sval": 32, "float_object.ob_fval": 16, "tuple_object.ob_item": 24,
                  "unicode_object.length": 16, "unicode_object.state": 32}
    bad = {k: (d.get(k), v) for k, v in invariants.items() if d.get(k) != v}
    if bad:
        raise LayoutError(f"_Py_DebugOffsets of CPython {version[0]}.{version[1]} does not match the known field "
                          f"order (expected/got {bad}); this minor version's layout is not supported")
    if (d["version"] >> 24, (d["version"] >> 16) & 0xFF) != version:
        raise LayoutError(f"_Py_DebugOffsets says version {d['version']:#x}, expected {version}")
    if d.get("free_threaded"):
        raise LayoutError("free-threaded (no-GIL) CPython builds are not supported")
    mod = importlib.import_module(f"steplens.agent.pyframes.layouts.py{version[0]}{version[1]}")
    ascii_size = d["unicode_object.asciiobject_size"]
    f = "interpreter_frame."
    c = "code_object."
    return Layout(
        version=version, runtime_interpreters_head=d["runtime_state.interpreters_head"],
        interp_next=d["interpreter_state.next"], interp_tstate_head=d["interpreter_state.threads_head"],
        tstate_next=d["thread_state.next"], tstate_interp=d["thread_state.interp"],
        tstate_thread_id=d["thread_state.thread_id"], tstate_native_thread_id=d["thread_state.native_thread_id"],
        tstate_read_size=_max_off(d["thread_state.next"], d["thread_state.interp"], d["thread_state.current_frame"],
                                  d["thread_state.thread_id"], d["thread_state.native_thread_id"]),
        tstate_frame=d["thread_state.current_frame"], tstate_cframe=None, cframe_current_frame=None,
        frame_kind="interp", frame_back=d[f + "previous"], frame_code=d[f + "executable"], frame_lasti=None,
        frame_instr=d[f + "instr_ptr"], frame_owner=d[f + "owner"],
        frame_read_size=_max_off(d[f + "previous"], d[f + "executable"], d[f + "instr_ptr"], d[f + "owner"]),
        code_tag_mask=mod.EXECUTABLE_TAG_MASK, instr_is_prev=False,
        code_filename=d[c + "filename"], code_name=d[c + "name"], code_qualname=d[c + "qualname"],
        code_firstlineno=d[c + "firstlineno"], code_linetable=d[c + "linetable"],
        code_code_adaptive=d[c + "co_code_adaptive"], code_code=None,
        code_read_size=_max_off(d[c + "filename"], d[c + "name"], d[c + "qualname"], d[c + "firstlineno"],
                                d[c + "linetable"], d[c + "co_code_adaptive"]),
        linetable="locations311", pyobject_ob_type=8, varobject_ob_size=16, bytes_ob_sval=32,
        unicode_state=d["unicode_object.state"], unicode_length=d["unicode_object.length"],
        unicode_ascii_size=ascii_size, unicode_compact_size=ascii_size + 16,
        gil_mode="interp_ptr", interp_ceval_gil=d["interpreter_state.ceval_gil"],
        gil_last_holder=d["interpreter_state.gil_runtime_state_holder"] - d["interpreter_state.gil_runtime_state"],
        gil_locked=d["interpreter_state.gil_runtime_state_locked"] - d["interpreter_state.gil_runtime_state"])
