"""The deep dive's root-cause ranking (analysis/suspicion.py): LatencyPrism's suspicion score against role peers and
the rank's own reference window, resources and functions, the zero-std erratum, role detection; and the shares it
reads from stored counters, stop events and connections."""

from __future__ import annotations

import random

from steplens.collector.analysis import suspicion as sp

FILE = "/job/train.py"
DIST = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def _frames(*names_files):
    return [{"function": n, "qualname": n, "file": f, "line": 1} for n, f in reversed(names_files)]  # innermost 1st


def _cycles(rng, compute: float, n: int = 12, extra: dict | None = None) -> list[dict]:
    out = []
    for _ in range(n):
        c = max(0.0, min(1.0, compute + rng.gauss(0, 0.02)))
        d = {f"step (train.py)\x00{FILE}": 1.0, f"compute (train.py)\x00{FILE}": c,
             f"all_reduce (distributed_c10d.py)\x00{DIST}": 1 - c}
        for k, v in (extra or {}).items():
            d[k] = v
        out.append(d)
    return out


def _bed(rng, faulty: int, **res) -> dict[int, sp.RankData]:
    ranks = {}
    for r in range(4):
        d = sp.RankData(r, f"h{r}")
        bad = r == faulty
        d.cycles = _cycles(rng, 0.75 if bad else 0.5)
        d.ref_cycles = _cycles(rng, 0.5)
        for name in ("runqueue", "throttled", "gc", "stopped", "memory", "network"):
            base = {"network": 0.05}.get(name, 0.01)
            d.resources[name] = [max(0.0, (res.get(name, base) if bad else base) + rng.gauss(0, 0.005))
                                 for _ in range(20)]
            d.ref_resources[name] = [max(0.0, base + rng.gauss(0, 0.005)) for _ in range(30)]
        ranks[r] = d
    return ranks


def test_each_fault_kind_ranks_its_rank_and_cause_first():
    rng = random.Random(7)
    for faulty, res, cause in ((2, {"runqueue": 0.35}, "cpu-contention"), (1, {"throttled": 0.5}, "cpu-throttled"),
                               (3, {"gc": 0.3}, "gc"), (0, {"stopped": 0.8}, "stopped"),
                               (2, {"memory": 0.4}, "memory-pressure"), (1, {"network": 0.6}, "network")):
        out = sp.rank_causes(_bed(rng, faulty, **res))
        top = out["causes"][0]
        assert (top["rank"], top["cause"]) == (faulty, cause), (res, out["causes"][:3])
        assert max(out["ranks"].items(), key=lambda kv: kv[1])[0] == str(faulty)


def test_a_slower_function_without_a_resource_is_compute_and_names_the_function():
    rng = random.Random(3)
    ranks = _bed(rng, 2)   # rank 2 computes longer, no resource moved
    top = sp.rank_causes(ranks)["causes"][0]
    assert top["rank"] == 2 and top["kind"] == "function" and top["cause"] == "compute"
    assert top["id"] in ("compute (train.py)", "all_reduce (distributed_c10d.py)")
    assert top["evidence"]["peers"]["d_beta_pp"] != 0


def test_a_function_only_one_rank_runs_is_not_silenced_by_a_zero_std_reference():
    """The paper's Z = 0 for a reference std < 1e-9 would score this 0; the floored std keeps it."""
    rng = random.Random(5)
    ranks = _bed(rng, -1)
    key = f"collect (gc_storm.py)\x00/job/gc_storm.py"
    for c in ranks[1].cycles:
        c[key] = 0.3
    out = sp.rank_causes(ranks)
    hit = [c for c in out["causes"] if c["id"] == "collect (gc_storm.py)"]
    assert hit and hit[0]["rank"] == 1 and hit[0]["score"] > 100
    assert out["causes"][0]["id"] == "collect (gc_storm.py)"


def test_resources_count_only_when_they_rise():
    rng = random.Random(11)
    ranks = _bed(rng, 3, runqueue=0.0)   # rank 3 waits less than its peers: not a cause
    assert not [c for c in sp.rank_causes(ranks)["causes"] if c["kind"] == "resource" and c["rank"] == 3
                and c["id"] == "runqueue"]


def test_roles_come_from_innermost_frames_not_the_loop_every_rank_runs():
    ranks = {}
    for r in range(4):
        leaf = ("send", "fwd0") if r < 2 else ("recv", "fwd1")
        samples = [{"ts_ns": i, "tid": 1, "frames": _frames(("main", FILE), ("step", FILE), (leaf[i % 2], FILE))}
                   for i in range(40)]
        ranks[r] = sp.RankData(r, f"h{r}", profile=sp.leaf_profile(samples),
                               ref_cycles=sp.cycle_shares(samples, [(0, 40)], 48))
    assert sp.roles(ranks, 0.9) == {0: [1], 1: [0], 2: [3], 3: [2]}


def test_roles_from_communicators_short_of_the_whole_job():
    ranks = {r: sp.RankData(r, f"h{r}", comms={"pg:0", "pg:1" if r < 2 else "pg:2"}) for r in range(4)}
    assert sp.comm_roles(ranks) == {0: [1], 1: [0], 2: [3], 3: [2]}
    assert sp.comm_roles({r: sp.RankData(r, "h", comms={"pg:0"}) for r in range(4)}) is None   # one world group


def test_roles_pair_ranks_alike_in_the_reference_window():
    a = {f"fwd0 (m.py)\x00/m.py": 0.9, f"send (c.py)\x00{DIST}": 0.1}
    b = {f"fwd1 (m.py)\x00/m.py": 0.8, f"recv (c.py)\x00{DIST}": 0.2}
    ranks = {r: sp.RankData(r, f"h{r}", ref_cycles=[dict(a if r < 2 else b)] * 5) for r in range(4)}
    assert sp.roles(ranks, 0.9) == {0: [1], 1: [0], 2: [3], 3: [2]}
    ranks[3].ref_cycles = [{"other (x.py)\x00/x.py": 1.0}]
    assert sp.roles(ranks, 0.9)[3] == [0, 1, 2]   # alike to none: the whole job


def test_cycle_shares_are_inclusive_per_cycle():
    samples = [{"ts_ns": t, "tid": 1, "frames": _frames(("step", FILE), ("compute", FILE))} for t in (0, 10, 20)]
    samples += [{"ts_ns": t, "tid": 1, "frames": _frames(("step", FILE), ("all_reduce", DIST))} for t in (30,)]
    got = sp.cycle_shares(samples, [(0, 40), (40, 80)], 48)
    assert len(got) == 1   # the empty cycle has no shares
    assert got[0][f"step (train.py)\x00{FILE}"] == 1.0 and got[0][f"compute (train.py)\x00{FILE}"] == 0.75
    assert sp.function_class(DIST) == "comm" and sp.function_class(FILE) == "compute"
    assert sp.main_thread(samples + [{"ts_ns": 5, "tid": 2, "frames": []}])[0]["tid"] == 1


def test_shares_from_counters_stops_and_connections():
    S = 10**9
    assert sp.interval_shares([(0, 0.0), (S, 0.5), (2 * S, 0.5), (3 * S, 0.1)], 0, 3 * S) == [0.5, 0.0]
    assert sp.stopped_shares([(S // 2, 2 * S)], 0, 3 * S) == [0.5, 1.0, 0.0]
    rows = [{"start_ns": 0, "end_ns": S, "net_limited_us": 250_000, "src": "10.0.0.1", "dst": "10.0.0.2"},
            {"start_ns": 0, "end_ns": S, "net_limited_us": 900_000, "src": "10.0.0.2", "dst": "10.0.0.3"},
            {"start_ns": 3 * S, "end_ns": 4 * S, "net_limited_us": 0, "src": "10.0.0.1", "dst": "10.0.0.2"}]
    assert sp.network_shares(rows, 0, 2 * S) == [0.25, 0.9]
    # a node is judged on the connections with its address at either end: its own and its peers' to it
    assert sp.network_shares(rows, 0, 2 * S, {"10.0.0.1"}) == [0.25]
    assert sp.network_shares(rows, 0, 2 * S, {"10.0.0.3"}) == [0.9]


def test_network_links_name_both_ends_most_limited_first():
    S = 10**9
    rows = [{"start_ns": 0, "end_ns": S, "net_limited_us": 800_000, "src": "10.0.0.1", "dst": "10.0.0.2"},
            {"start_ns": 0, "end_ns": S, "net_limited_us": 600_000, "src": "10.0.0.2", "dst": "10.0.0.1"},
            {"start_ns": 0, "end_ns": S, "net_limited_us": 10_000, "src": "10.0.0.2", "dst": "10.0.0.4"},
            {"start_ns": 0, "end_ns": S, "net_limited_us": 900_000, "src": "10.0.0.3", "dst": "10.0.0.5"}]
    got = sp.network_links(rows, 0, 2 * S, {"10.0.0.2"})
    assert got == [{"a": "10.0.0.1", "b": "10.0.0.2", "net_limited_share": 0.7},
                   {"a": "10.0.0.2", "b": "10.0.0.4", "net_limited_share": 0.01}]


def test_a_resource_that_fell_lifts_no_function():
    """The training testbed's shaped link (h0-h1): every rank's compute takes more of each slower step, and rank 3,
    the PP stage that had waited for a CPU before (run-queue 0.40 of its reference), now waits for none (0.01):
    a fall of ~40 sigma of its own log1p. With LatencyPrism's |Z_logmu| that fall lifted rank 3's compute function
    (S ~232) over the network both ends of the link show (~118); only a rise counts for a function's resource too."""
    rng = random.Random(13)
    ranks = _bed(rng, 1, network=0.45)
    ranks[0].resources["network"] = [0.43 + rng.gauss(0, 0.02) for _ in range(20)]   # the link's other end
    for d in ranks.values():
        d.cycles, d.ref_cycles = _cycles(rng, 0.8), _cycles(rng, 0.3)
        for c in d.ref_cycles + d.cycles:
            for k in c:
                c[k] = max(0.0, min(1.0, c[k] + rng.gauss(0, 0.08)))
        d.ref_resources["network"] = [max(0.0, 0.08 + rng.gauss(0, 0.06)) for _ in range(30)]   # a shared host
    ranks[3].ref_resources["runqueue"] = [0.4 + rng.gauss(0, 0.01) for _ in range(30)]
    ranks[3].resources["runqueue"] = [0.01 + rng.gauss(0, 0.002) for _ in range(20)]
    causes = sp.rank_causes(ranks)["causes"]
    assert (causes[0]["rank"], causes[0]["cause"]) == (1, "network"), causes[:3]
    r3 = [c for c in causes if c["rank"] == 3 and c["kind"] == "function"]
    assert all(c["score"] < causes[0]["score"] / 2 and c["evidence"]["own"]["z_logmu"] >= 0 for c in r3), r3


def _module_level_straggler(rng, late: int, gc: float = 0.0, runqueue: float = 0.0) -> dict[int, sp.RankData]:
    """collector/demo.py's shape: every stack holds the loop's <module> frame, the straggler's extra work is a busy
    loop at module level (no function of its own), so the only function that tells the ranks apart is the
    all_reduce the others wait in for it (peers ~0.39 of their time, the straggler ~0.10)."""
    module = f"<module> (job.py)\x00{FILE}"
    ranks = {}
    for r in range(4):
        d = sp.RankData(r, "vm")
        share = 0.10 if r == late else 0.39
        d.cycles = [{module: 1.0, f"all_reduce (distributed_c10d.py)\x00{DIST}": max(0.0, share + rng.gauss(0, .02))}
                    for _ in range(12)]
        d.ref_cycles = [{module: 1.0, f"all_reduce (distributed_c10d.py)\x00{DIST}": max(0.0, .10 + rng.gauss(0, .02))}
                        for _ in range(10)]
        for name in ("runqueue", "gc", "network"):
            base = {"network": 0.05}.get(name, 0.01)
            rise = {"gc": gc, "runqueue": runqueue}.get(name, 0.0) if r == late else 0.0
            noise = 0.0005 if runqueue else 0.005
            d.resources[name] = [max(0.0, base + rise + rng.gauss(0, noise)) for _ in range(20)]
            d.ref_resources[name] = [max(0.0, base + rng.gauss(0, noise)) for _ in range(30)]
        ranks[r] = d
    return ranks


def test_a_collective_the_others_wait_in_names_the_late_rank_and_its_own_work():
    """Seen live in `make run`'s demo (rank 1 computing 50 % longer in a loop at module level): the deep dive named
    `rank 1 function all_reduce (waiting)`, the right rank with the wrong reason (rank 1 waits least there). A
    collective a rank spends less time in than its peers marks it late; the cause is its own work's."""
    rng = random.Random(13)
    top = sp.rank_causes(_module_level_straggler(rng, 1))["causes"][0]
    assert (top["rank"], top["id"], top["cause"]) == (1, "all_reduce (distributed_c10d.py)", "compute")
    assert top["evidence"]["late"] is True and top["evidence"]["peers"]["d_beta_pp"] < -20
    waiting = [c for c in sp.rank_causes(_module_level_straggler(rng, 1))["causes"]
               if c["rank"] != 1 and c["id"].startswith("all_reduce")]
    assert waiting and all(c["cause"] == "waiting" and "late" not in c["evidence"] for c in waiting)
    # what slowed its work, where a compute resource of its own rose: named instead of `compute`
    top = sp.rank_causes(_module_level_straggler(rng, 1, gc=0.3))["causes"][0]
    assert (top["rank"], top["cause"]) == (1, "gc")


def test_of_a_wrapper_and_what_it_wraps_the_inner_function_is_named():
    """torch wraps every c10d collective in _exception_logger's wrapper: the two share nearly every sample, so they
    scored alike and the deep dive of `make run`'s demo named the wrapper. Only the deeper one is a candidate."""
    rng = random.Random(17)
    ranks = _module_level_straggler(rng, 1)
    wrapper = f"_exception_logger.<locals>.wrapper (c10d_logger.py)\x00/venv/torch/distributed/c10d_logger.py"
    inner = f"all_reduce (distributed_c10d.py)\x00{DIST}"
    module = f"<module> (job.py)\x00{FILE}"
    for d in ranks.values():
        for i, c in enumerate(d.cycles + d.ref_cycles):   # the wrapper's own code in a sample now and then
            c[wrapper] = min(1.0, c[inner] + (0.4 if i % 5 == 0 else 0.0))
        d.depth = {module: 0.0, wrapper: 1.0, inner: 2.0}
        d.within = {module: frozenset(), wrapper: frozenset({module}), inner: frozenset({module, wrapper})}
        d.held = {module: 1000, wrapper: 300, inner: 290}
    out = sp.rank_causes(ranks)["causes"]
    assert out[0]["rank"] == 1 and out[0]["id"] == "all_reduce (distributed_c10d.py)"
    assert not [c for c in out if c["id"].startswith("_exception_logger")]
    for d in ranks.values():   # alike in share but not nested (siblings): both stay candidates
        d.within = {}
    assert [c for c in sp.rank_causes(ranks)["causes"] if c["id"].startswith("_exception_logger")]
    for d in ranks.values():   # nested, but a tenth of the outer's time is elsewhere: it does work of its own
        d.within = {module: frozenset(), wrapper: frozenset({module}), inner: frozenset({module, wrapper})}
        d.held = {module: 1000, wrapper: 330, inner: 290}
    assert [c for c in sp.rank_causes(ranks)["causes"] if c["id"].startswith("_exception_logger")]


def test_frame_nesting_depths_and_what_encloses_a_function_in_every_stack():
    main, wrapper = f"main (train.py)\x00{FILE}", f"wrapper (train.py)\x00{FILE}"
    ar, fwd = f"all_reduce (distributed_c10d.py)\x00{DIST}", f"forward (train.py)\x00{FILE}"
    smp = [{"frames": _frames(("main", FILE), ("wrapper", FILE), ("all_reduce", DIST))},
           {"frames": _frames(("main", FILE), ("wrapper", FILE), ("all_reduce", DIST))},
           {"frames": _frames(("main", FILE), ("forward", FILE), ("forward", FILE))}]
    depth, within, held = sp.frame_nesting(smp, 48)
    assert depth == {main: 0.0, wrapper: 1.0, ar: 2.0, fwd: 1.0}   # recursion: its outermost position
    assert within[ar] == {main, wrapper} and within[wrapper] == {main} and within[fwd] == {main}
    assert held == {main: 3, wrapper: 2, ar: 2, fwd: 1}
    smp.append({"frames": _frames(("main", FILE), ("all_reduce", DIST))})   # once called without the wrapper
    assert sp.frame_nesting(smp, 48)[1][ar] == {main}


def test_a_resource_rise_too_small_to_matter_names_no_cause():
    """The demo's next dive: rank 1's run-queue wait went from ~0.2 % to 0.66 % of its time (busy now, on a shared
    2-core VM), 3.8 sigma of its quiet reference, and the late all_reduce was put down to cpu-contention. Half a
    percentage point explains nothing of a 30-point shift: compute. A real contention (+30 points) still names it."""
    rng = random.Random(19)
    top = sp.rank_causes(_module_level_straggler(rng, 1, runqueue=0.005))["causes"][0]
    assert (top["rank"], top["cause"]) == (1, "compute")
    top = sp.rank_causes(_module_level_straggler(rng, 1, runqueue=0.30))["causes"][0]
    assert (top["rank"], top["cause"]) == (1, "cpu-contention")
