"""Stacks target: Python called back from C in several ways, on busy threads, so samples land in the frames
CPython puts around such calls (entry frames, 3.12+ shim frames, C-stack frames) and in threads that hold a
thread state but no Python frame (starting or ending), and on instructions without a line (exception
cleanup). Prints "ready" once every thread runs."""

import ctypes
import ctypes.util
import functools
import sys
import threading

stop = threading.Event()
running = threading.Semaphore(0)


def key(x):
    return -x  # @key


def sorted_with_key():
    running.release()
    data = list(range(200))
    while not stop.is_set():
        sorted(data, key=key)


def mapped():
    running.release()
    while not stop.is_set():
        list(map(key, range(200)))
        functools.reduce(lambda a, b: a + b, range(100))


CMP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))


def compare(a, b):
    return a[0] - b[0]  # @compare


def qsort_callback():
    # PyDLL keeps the GIL through qsort, so the callback runs at once (under CDLL it queued for the GIL on every
    # call and ran ~1 µs per switch interval: 42k samples on a loaded CI host never caught it)
    libc = ctypes.PyDLL(ctypes.util.find_library("c"))
    cmp = CMP(compare)
    init = list(range(4096, 0, -1))
    arr = (ctypes.c_int * len(init))()
    running.release()
    while not stop.is_set():
        arr[:] = init
        libc.qsort(arr, len(arr), ctypes.sizeof(ctypes.c_int), cmp)


def raising():
    running.release()
    while not stop.is_set():
        try:
            raise ValueError("x")
        except ValueError:
            pass
        finally:
            pass


def short_lived():
    return sum(range(10))


def churn():
    running.release()
    while not stop.is_set():
        t = threading.Thread(target=short_lived)
        t.start()
        t.join()


workers = [sorted_with_key, mapped, qsort_callback, raising, churn]
for fn in workers:
    threading.Thread(target=fn, name=fn.__name__, daemon=True).start()
for _ in workers:
    running.acquire()
print("ready {}", flush=True)
try:
    stop.wait(float(sys.argv[1]) if len(sys.argv) > 1 else 60)
finally:
    stop.set()
