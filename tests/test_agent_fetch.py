"""FetchDetail on the agent (agent/control.py CommandHandler): raw stack samples asked by rank are found for
workloads that already exited (their detail outlives them), and for the pids the collector names."""

from __future__ import annotations

import time

from steplens.agent.control import CommandHandler
from steplens.agent.detail import DetailStore
from steplens.agent.records import ProcessInfo
from steplens.agent.sources.base import WorkloadRegistry
from steplens.collector.ingest.decode import detail_json
from steplens.v1 import ingest_pb2 as ipb


def _info(pid: int, rank: int) -> ProcessInfo:
    return ProcessInfo(0, pid, 1000 + pid, job_key="j", rank=rank)


def _pids(handler: CommandHandler, **fetch) -> dict[int, int]:
    res = handler(ipb.Command(command_id="c", fetch=ipb.FetchDetail(kinds=["stacks"], **fetch)))
    assert res.ok, res.message
    out: dict[int, int] = {}
    for r in detail_json(res.payload, lambda m: m):
        out[r["pid"]] = out.get(r["pid"], 0) + 1
    return out


def test_registry_remembers_exited_workloads_bounded():
    reg = WorkloadRegistry(history=2)
    a, b, c, d = (_info(p, r) for p, r in ((10, 0), (11, 1), (12, 2), (13, 3)))
    reg.replace({(10, 1010): a, (11, 1011): b})
    reg.replace({(11, 1011): b})                      # rank 0 exited
    assert [p.pid for p in reg.known()] == [10, 11] and list(reg.snapshot()) == [(11, 1011)]
    reg.replace({(12, 1012): c, (13, 1013): d})       # rank 1 exited, two new
    assert [p.pid for p in reg.known()] == [10, 11, 12, 13]
    reg.replace({})                                   # everything exited: only the last two are kept
    assert [p.pid for p in reg.known()] == [12, 13] and reg.snapshot() == {}
    reg.replace({(12, 1012): c})                      # back (same key): not both running and exited
    assert [p.pid for p in reg.known()] == [13, 12]


def test_fetch_by_rank_finds_workloads_that_exited(tmp_path):
    store = DetailStore(str(tmp_path / "detail.db"), 1000, 1000)
    frames = (("f", "f", "x.py", 1),)
    for i in range(5):
        for pid in (10, 11, 12):
            store.add_stack_sample(1_000 + i, pid, pid, frames, True, "running")
    store.flush()
    store.close()
    reg = WorkloadRegistry()
    reg.replace({(10, 1010): _info(10, 0), (11, 1011): _info(11, 1), (12, 1012): _info(12, 2)})
    reg.replace({(12, 1012): _info(12, 2)})           # ranks 0 and 1 ended before the fetch
    handler = CommandHandler(None, str(tmp_path), reg)
    assert _pids(handler, ranks=[0, 1, 2]) == {10: 5, 11: 5, 12: 5}
    assert _pids(handler, ranks=[1]) == {11: 5}
    # an agent that restarted knows none of them: the collector's pids still find their samples
    fresh = CommandHandler(None, str(tmp_path), WorkloadRegistry())
    res = fresh(ipb.Command(command_id="c", fetch=ipb.FetchDetail(kinds=["stacks"], ranks=[0])))
    assert res.ok and "no workload with those ranks" in res.message
    assert _pids(fresh, ranks=[0, 1], pids=[10, 11]) == {10: 5, 11: 5}


def test_a_comm_op_fetch_reads_the_rings_first(tmp_path):
    """With the Flight Recorder read schedule a ring can be up to max_interval_seconds behind: a FetchDetail of
    comm ops has the rings read first (Runner.refresh). An open window (no end, or one in the future) once per second
    at most (a paged fetch asks many times); a window that ended is passed on with its end and processes, for the
    source to skip the read where every ring asked about was read after it."""
    DetailStore(str(tmp_path / "detail.db"), 1000, 1000).close()
    asked = []
    handler = CommandHandler(None, str(tmp_path), WorkloadRegistry(), lambda *a: asked.append(a) or True)
    fetch = {"kinds": ["stacks"]}
    assert handler(ipb.Command(command_id="c", fetch=ipb.FetchDetail(**fetch))).ok and asked == []
    future = time.monotonic_ns() + 60_000_000_000
    for until in (0, 0, future):
        assert handler(ipb.Command(command_id="c", fetch=ipb.FetchDetail(kinds=["commops"], until_mono_ns=until))).ok
    assert asked == [("flightrec", 3.0, 0, None)]
    past = time.monotonic_ns() - 1_000
    for _ in range(2):
        assert handler(ipb.Command(command_id="c", fetch=ipb.FetchDetail(kinds=["commops"], until_mono_ns=past,
                                                                         ranks=[3], pids=[77]))).ok
    assert asked[1:] == [("flightrec", 3.0, past, {77})] * 2
