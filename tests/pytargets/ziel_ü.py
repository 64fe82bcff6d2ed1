"""Accuracy target: threads parked at known lines inside known call chains, then "ready <json>" on stdout.

Marker comments (`# @name`) label the lines the tests expect in the stacks; the tests find their line
numbers by parsing this file, so edits here do not break them. Threads:
  main   - <module> -> main -> Klass.method -> busy in C (holds the GIL, runs) when --busy, else sleeps
  gen    - worker_gen: `for x in erzeuge()` while the generator body sleeps
  async  - worker_async: asyncio.run(outer()) -> await inner() -> blocking() sleeps
  utf    - größe_ü -> Klass.statisch sleeps (non-ASCII function name; this file's name is non-ASCII too)
  rek    - worker_rek -> rekursion x DEPTH, the innermost sleeps
The JSON maps each thread to its native id (threading.get_native_id) and gives the pid.
"""

import asyncio
import json
import os
import sys
import threading
import time

DEPTH = 500
LONG = 3600


def erzeuge():
    yield 1
    time.sleep(LONG)  # @gen_leaf
    yield 2


def worker_gen(tids, ev):
    tids["gen"] = threading.get_native_id()
    ev.set()
    for x in erzeuge():  # @gen_for
        pass


def blocking():
    time.sleep(LONG)  # @async_leaf


async def inner():
    await asyncio.sleep(0)
    blocking()  # @async_inner


async def outer():
    await inner()  # @async_outer


def worker_async(tids, ev):
    tids["async"] = threading.get_native_id()
    ev.set()
    asyncio.run(outer())  # @async_run


class Klass:
    def method(self, busy):
        if busy:
            return sum(range(10 ** 15))  # @main_busy
        time.sleep(LONG)  # @main_sleep

    @staticmethod
    def statisch():
        time.sleep(LONG)  # @utf_leaf


def größe_ü(tids, ev):
    tids["utf"] = threading.get_native_id()
    ev.set()
    Klass.statisch()  # @utf_call


def rekursion(n):
    if n <= 1:
        time.sleep(LONG)  # @rek_leaf
    return rekursion(n - 1)  # @rek_call


def worker_rek(tids, ev):
    tids["rek"] = threading.get_native_id()
    ev.set()
    rekursion(DEPTH)  # @rek_start


def main():
    busy = "--busy" in sys.argv
    tids = {"main": threading.get_native_id(), "pid": os.getpid()}
    events = []
    for fn in (worker_gen, worker_async, größe_ü, worker_rek):
        ev = threading.Event()
        threading.Thread(target=fn, args=(tids, ev), daemon=True).start()
        events.append(ev)
    for ev in events:
        ev.wait(30)
    time.sleep(0.3)  # a set event comes a few bytecodes before the sleep: let each thread reach it
    print("ready " + json.dumps(tids), flush=True)
    Klass().method(busy)  # @main_call


if __name__ == "__main__":
    main()  # @module
