"""agent/transport/client.py quiet_grpc_waits: grpc's sync waits in 1 s slices instead of 0.1 s (an idle agent's
transport thread wakes once a second, not ten times); in a separate process, not to change this one's grpc."""

import subprocess
import sys

CODE = r'''
import threading, time
from grpc import _common
from steplens.agent.transport.client import quiet_grpc_waits
assert _common.MAXIMUM_WAIT_TIMEOUT == 0.1, _common.MAXIMUM_WAIT_TIMEOUT   # grpc's own, as this code knows it
assert quiet_grpc_waits() and _common.MAXIMUM_WAIT_TIMEOUT == 1.0
# a wait in slices still ends when its condition is met, not at a slice's end
done = threading.Event()
threading.Timer(0.2, done.set).start()
t0 = time.monotonic()
_common.wait(done.wait, done.is_set)
assert time.monotonic() - t0 < 0.9, time.monotonic() - t0
# and a timeout shorter than a slice is kept
t0 = time.monotonic()
assert _common.wait(threading.Event().wait, lambda: False, timeout=0.3) is True
assert 0.25 < time.monotonic() - t0 < 0.9
print("ok")
'''


def test_grpc_waits_in_longer_slices_and_still_end_on_time():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
