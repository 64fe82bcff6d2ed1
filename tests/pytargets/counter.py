"""Safety target: a main loop that writes an increasing counter to argv[1] every 10 ms, plus a busy
thread and a few sleeping ones; "ready" once the first value is written."""

import os
import sys
import threading
import time


def spin():
    x = 0
    while True:
        x += 1


def nap():
    while True:
        time.sleep(0.005)


for fn in (spin, nap, nap, nap):
    threading.Thread(target=fn, daemon=True).start()
path = sys.argv[1]
n = 0
while True:
    n += 1
    with open(path + ".tmp", "w") as fh:
        fh.write(str(n))
    os.replace(path + ".tmp", path)
    if n == 1:
        print("ready {}", flush=True)
    time.sleep(0.01)
