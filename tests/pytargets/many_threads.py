"""Safety target: argv[1] threads (64 KiB stacks) all blocked on one Event, then "ready"."""

import sys
import threading

threading.stack_size(64 * 1024)
n = int(sys.argv[1])
stop = threading.Event()
started = threading.Semaphore(0)


def park():
    started.release()
    stop.wait()  # @park


for _ in range(n):
    threading.Thread(target=park, daemon=True).start()
for _ in range(n):
    started.acquire()
print("ready {\"threads\": %d}" % (n + 1), flush=True)
stop.wait()
