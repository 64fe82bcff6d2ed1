"""Safety target: busy and sleeping threads, "ready", then exits on its own after argv[1] seconds.

argv[2] picks how: "normal" (sys.exit from main: finalization runs while threads still run) or "hard"
(os._exit from a worker thread)."""

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
        time.sleep(0.001)


def main():
    delay, mode = float(sys.argv[1]), sys.argv[2]
    for fn in (spin, nap, nap):
        threading.Thread(target=fn, daemon=True).start()
    print("ready {}", flush=True)
    if mode == "hard":
        threading.Timer(delay, os._exit, args=(0,)).start()
        spin()
    time.sleep(delay)
    sys.exit(0)


if __name__ == "__main__":
    main()
