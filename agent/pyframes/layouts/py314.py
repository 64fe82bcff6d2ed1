"""CPython 3.14: _Py_DebugOffsets field order for 3.14 (every field a uint64 after the 8-byte cookie).

UNTESTED: no 3.14 interpreter was available where this was written. The order below puts
thread_state.current_frame at byte 208, the figure checked on a real 3.14 (shared/FACTS.md), and the
reader refuses the layout unless the invariant fields (PyObject, bytes, unicode, float, tuple)
read back their known values, so a wrong list fails loudly instead of misreading memory."""

VERSION = (3, 14)

FIELDS = [
    ("version",), ("free_threaded",),
    ("runtime_state", ["size", "finalizing", "interpreters_head"]),
    ("interpreter_state", ["size", "id", "next", "threads_head", "threads_main", "gc", "imports_modules", "sysdict",
                           "builtins", "ceval_gil", "gil_runtime_state", "gil_runtime_state_enabled",
                           "gil_runtime_state_locked", "gil_runtime_state_holder", "code_object_generation",
                           "tlbc_generation"]),
    ("thread_state", ["size", "prev", "next", "interp", "current_frame", "thread_id", "native_thread_id",
                      "datastack_chunk", "status", "holds_gil", "gil_requested"]),
    ("interpreter_frame", ["size", "previous", "executable", "instr_ptr", "localsplus", "owner", "stackpointer",
                           "tlbc_index"]),
    ("code_object", ["size", "filename", "name", "qualname", "linetable", "firstlineno", "argcount",
                     "localsplusnames", "localspluskinds", "co_code_adaptive", "co_tlbc"]),
    ("pyobject", ["size", "ob_type"]),
    ("type_object", ["size", "tp_name", "tp_repr", "tp_flags"]),
    ("tuple_object", ["size", "ob_item", "ob_size"]),
    ("list_object", ["size", "ob_item", "ob_size"]),
    ("set_object", ["size", "used", "table", "mask"]),
    ("dict_object", ["size", "ma_keys", "ma_values"]),
    ("float_object", ["size", "ob_fval"]),
    ("long_object", ["size", "lv_tag", "ob_digit"]),
    ("bytes_object", ["size", "ob_size", "ob_sval"]),
    ("unicode_object", ["size", "state", "length", "asciiobject_size"]),
    ("gc", ["size", "collecting"]),
]
# 3.14 frames hold a tagged _PyStackRef to the code object: clear the tag bits
EXECUTABLE_TAG_MASK = 3
