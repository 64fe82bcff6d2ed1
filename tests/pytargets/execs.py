"""Safety target: a Python process that replaces itself with `/bin/sleep 5` on SIGUSR1."""

import os
import signal
import threading
import time


def to_sleep(signum, frame):
    os.execv("/bin/sleep", ["sleep", "5"])


def nap():
    while True:
        time.sleep(0.01)


signal.signal(signal.SIGUSR1, to_sleep)
threading.Thread(target=nap, daemon=True).start()
print("ready {}", flush=True)
while True:
    time.sleep(0.01)  # @exec_wait
