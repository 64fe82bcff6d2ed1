"""Safety target: starts a worker thread, then forks; parent and child each park at a known line.

Prints "ready {"parent": pid, "child": pid, "worker": tid}" once both are in place (the child signals
through a pipe)."""

import json
import os
import threading
import time


def worker(ev, tids):
    tids["worker"] = threading.get_native_id()
    ev.set()
    time.sleep(3600)  # @fork_worker


def kind(w):
    os.write(w, b"x")
    os.close(w)
    time.sleep(3600)  # @fork_child


def eltern(r, child):
    os.read(r, 1)
    time.sleep(0.2)  # let the child reach its sleep
    print("ready " + json.dumps({"parent": os.getpid(), "child": child, "worker": tids["worker"]}), flush=True)
    time.sleep(3600)  # @fork_parent


tids = {}
ev = threading.Event()
threading.Thread(target=worker, args=(ev, tids), daemon=True).start()
ev.wait(30)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    kind(w)  # @fork_child_call
else:
    os.close(w)
    eltern(r, pid)  # @fork_parent_call
