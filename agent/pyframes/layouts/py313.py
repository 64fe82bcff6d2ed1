"""CPython 3.13: no table of our own. The interpreter describes itself in _Py_DebugOffsets at the
start of _PyRuntime (cookie "xdebugpy"); this is the 3.13 field order of that struct (every field a
uint64 after the 8-byte cookie), from Include/internal/pycore_runtime.h of 3.13.0."""

VERSION = (3, 13)

FIELDS = [
    ("version",), ("free_threaded",),
    ("runtime_state", ["size", "finalizing", "interpreters_head"]),
    ("interpreter_state", ["size", "id", "next", "threads_head", "gc", "imports_modules", "sysdict", "builtins",
                           "ceval_gil", "gil_runtime_state", "gil_runtime_state_enabled",
                           "gil_runtime_state_locked", "gil_runtime_state_holder"]),
    ("thread_state", ["size", "prev", "next", "interp", "current_frame", "thread_id", "native_thread_id",
                      "datastack_chunk", "status"]),
    ("interpreter_frame", ["size", "previous", "executable", "instr_ptr", "localsplus", "owner"]),
    ("code_object", ["size", "filename", "name", "qualname", "linetable", "firstlineno", "argcount",
                     "localsplusnames", "localspluskinds", "co_code_adaptive"]),
    ("pyobject", ["size", "ob_type"]),
    ("type_object", ["size", "tp_name", "tp_repr", "tp_flags"]),
    ("tuple_object", ["size", "ob_item", "ob_size"]),
    ("list_object", ["size", "ob_item", "ob_size"]),
    ("dict_object", ["size", "ma_keys", "ma_values"]),
    ("float_object", ["size", "ob_fval"]),
    ("long_object", ["size", "lv_tag", "ob_digit"]),
    ("bytes_object", ["size", "ob_size", "ob_sval"]),
    ("unicode_object", ["size", "state", "length", "asciiobject_size"]),
    ("gc", ["size", "collecting"]),
]
# frame.executable holds a plain PyObject* in 3.13
EXECUTABLE_TAG_MASK = 0
