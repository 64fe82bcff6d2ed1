"""Kineto on demand: the dynolog-compatible IPC endpoint (ipc.py) and the Chrome-trace parser (trace.py)."""
