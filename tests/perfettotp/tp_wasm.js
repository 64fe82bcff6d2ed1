// Perfetto's own trace processor (its WebAssembly build) as a byte pipe for the tests: trace-processor RPC
// frames (TraceProcessorRpcStream) on stdin, the processor's reply frames on stdout.
// Usage: node tp_wasm.js PATH/trace_processor.wasm
// The wasm is the one the Perfetto UI runs; Emscripten's JS glue is not used: the few host functions it needs
// (clock, heap growth, stderr) are given here, the file-system ones fail with ENOSYS (the RPC never opens files).
'use strict';
const fs = require('fs');

const ENOSYS = 52, EBADF = 8;
const wasmPath = process.argv[2];
if (!wasmPath) { process.stderr.write('usage: node tp_wasm.js trace_processor.wasm\n'); process.exit(2); }
const module_ = new WebAssembly.Module(fs.readFileSync(wasmPath));
let memory = null, exports_ = null;
const u8 = () => new Uint8Array(memory.buffer);
const dv = () => new DataView(memory.buffer);
const cstr = (p) => { const m = u8(); let e = p; while (m[e]) e++; return Buffer.from(m.subarray(p, e)).toString(); };

const env = {
  emscripten_get_now: () => performance.now(),
  emscripten_date_now: () => Date.now(),
  __assert_fail: (c, f, l, fn) => { throw new Error(`assert ${cstr(c)} at ${cstr(f)}:${l} ${cstr(fn)}`); },
  _abort_js: () => { throw new Error('trace processor aborted'); },
  emscripten_err: (p) => process.stderr.write(cstr(p) + '\n'),
  emscripten_get_heap_max: () => 2147483648,
  emscripten_resize_heap: (want) => {
    const have = memory.buffer.byteLength;
    if (want > 2147483648) return 0;
    let size = have;
    while (size < want) size = Math.min(2147483648, Math.max(size * 2, want + 16777216));
    try { memory.grow(Math.ceil((size - have) / 65536)); return 1; } catch (e) { return 0; }
  },
  _tzset_js: (tz, dl, std, dst) => { const d = dv(); d.setInt32(tz, 0, true); d.setInt32(dl, 0, true);
    u8().set([85, 84, 67, 0], std); u8().set([85, 84, 67, 0], dst); },
  _localtime_js: (t, tm) => gmtime(t, tm),
  _gmtime_js: (t, tm) => gmtime(t, tm),
  _timegm_js: (tm) => { const d = dv(); const ms = Date.UTC(d.getInt32(tm + 20, true) + 1900, d.getInt32(tm + 16, true),
    d.getInt32(tm + 12, true), d.getInt32(tm + 8, true), d.getInt32(tm + 4, true), d.getInt32(tm, true));
    return BigInt(Math.floor(ms / 1000)); },
  _mmap_js: () => -ENOSYS,
  _munmap_js: () => -ENOSYS,
};
function gmtime(t, tm) {
  const date = new Date(Number(t) * 1000), d = dv();
  const f = [date.getUTCSeconds(), date.getUTCMinutes(), date.getUTCHours(), date.getUTCDate(), date.getUTCMonth(),
    date.getUTCFullYear() - 1900, date.getUTCDay()];
  f.forEach((v, i) => d.setInt32(tm + 4 * i, v, true));
  d.setInt32(tm + 28, Math.floor((date - Date.UTC(date.getUTCFullYear(), 0, 1)) / 86400000), true);
  d.setInt32(tm + 32, 0, true);
}
const wasi = {
  fd_write: (fd, iov, n, pnum) => { const d = dv(); let total = 0;
    for (let i = 0; i < n; i++) { const p = d.getUint32(iov + 8 * i, true), l = d.getUint32(iov + 8 * i + 4, true);
      if (fd === 1 || fd === 2) process.stderr.write(Buffer.from(u8().subarray(p, p + l))); total += l; }
    d.setUint32(pnum, total, true); return 0; },
  fd_read: () => EBADF, fd_close: () => EBADF, fd_seek: () => EBADF, fd_sync: () => EBADF, fd_fdstat_get: () => EBADF,
  environ_sizes_get: (pc, ps) => { dv().setUint32(pc, 0, true); dv().setUint32(ps, 0, true); return 0; },
  environ_get: () => 0,
  clock_time_get: (id, prec, out) => { dv().setBigUint64(out, process.hrtime.bigint(), true); return 0; },
};
for (const imp of WebAssembly.Module.imports(module_)) {
  const table = imp.module === 'env' ? env : wasi;
  if (!(imp.name in table)) table[imp.name] = () => -ENOSYS;   // file-system syscalls: never reached by the RPC
}
const instance = new WebAssembly.Instance(module_, { env, wasi_snapshot_preview1: wasi });
exports_ = instance.exports;
memory = exports_.memory;
if (exports_.emscripten_stack_init) exports_.emscripten_stack_init();
exports_.__wasm_call_ctors();

// The reply callback is a function-table entry of type (i32, i32) -> void: a JS function exported through a
// five-section module of its own (what Emscripten's addFunction does where WebAssembly.Function is missing).
const shim = new WebAssembly.Instance(new WebAssembly.Module(Uint8Array.from([
  0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00,
  0x01, 0x06, 0x01, 0x60, 0x02, 0x7f, 0x7f, 0x00,
  0x02, 0x07, 0x01, 0x01, 0x65, 0x01, 0x66, 0x00, 0x00,
  0x07, 0x05, 0x01, 0x01, 0x66, 0x00, 0x00])), { e: { f: (ptr, len) => {
    process.stdout.write(Buffer.from(u8().slice(ptr, ptr + len)));
  } } });
const table = exports_.__indirect_function_table;
const slot = table.grow(1);
table.set(slot, shim.exports.f);
const CHUNK = 32 * 1024 * 1024;
const reqBuf = exports_.trace_processor_rpc_init(slot, CHUNK);

process.stdin.on('data', (data) => {
  for (let off = 0; off < data.length; off += CHUNK) {
    const part = data.subarray(off, Math.min(data.length, off + CHUNK));
    u8().set(part, reqBuf);
    exports_.trace_processor_on_rpc_request(part.length);
  }
});
process.stdin.on('end', () => process.exit(0));
