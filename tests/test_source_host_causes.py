"""host source, the evidence for why a rank is slow: CPU bandwidth throttling of a real cgroup with a 10 % quota
(v1 or v2, whichever this kernel gives the cpu controller; a process moved into it is followed), run-queue delay
of real processes sharing one CPU, host pressure stall information, and fixture trees for what a real kernel
will not produce on demand (a cgroup path that does not exist, garbage in cpu.stat, a kernel without PSI)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from procutil import start_ticks as _start_ticks

from steplens.agent.records import ProcessInfo
from steplens.agent.sources.base import HostContext
from steplens.agent.sources.host import HostConfig, HostSource

BUSY = [sys.executable, "-c", "while True: pass"]


from test_source_host import _by, _restore_procfs_path  # noqa: E402,F401  (the fixture is autouse there)


def _watching(procs, **ctx_kw) -> HostSource:
    ctx = HostContext(node_id="t", **ctx_kw)
    ctx.workloads.replace({(p.pid, _start_ticks(p.pid)): ProcessInfo(0, p.pid, _start_ticks(p.pid)) for p in procs})
    src = HostSource(ctx, HostConfig())
    src.start()
    return src


def _entity(p) -> str:
    return f"pid:{p.pid}:{_start_ticks(p.pid)}"


def _mounts() -> list[tuple[str, str, str, str]]:
    """(fstype, mount point, root, super options) of the cgroup mounts this test process sees."""
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            pre, _, post = line.partition(" - ")
            a, b = pre.split(), post.split()
            if b and b[0] in ("cgroup", "cgroup2"):
                out.append((b[0], a[4], a[3], b[2]))
    return out


def _quota_cgroup() -> tuple[int, str, str]:
    """(version, parent directory to create a cgroup in, "" or why not) for a cgroup with the cpu controller."""
    if os.geteuid() != 0:
        return 0, "", "creating a cgroup needs root"
    mounts = _mounts()
    v1 = [m for m in mounts if m[0] == "cgroup" and "cpu" in m[3].split(",")]
    if v1:
        return 1, v1[0][1], ""
    v2 = [m for m in mounts if m[0] == "cgroup2"]
    if not v2:
        return 0, "", "no cgroup mount with the cpu controller"
    root = v2[0][1]
    try:
        with open(os.path.join(root, "cgroup.controllers")) as fh:
            if "cpu" not in fh.read().split():
                return 0, "", f"cgroup v2 at {root} does not offer the cpu controller"
    except OSError as exc:
        return 0, "", f"{root}/cgroup.controllers: {exc}"
    return 2, root, ""


class QuotaCgroup:
    """A real cgroup with `quota_us` per `period_us` of CPU, removed by close() (its processes must be gone)."""

    def __init__(self, version: int, parent: str, quota_us: int, period_us: int = 100_000) -> None:
        self.version, self.enabled_cpu = version, ""
        if version == 2:
            control = os.path.join(parent, "cgroup.subtree_control")
            with open(control) as fh:
                if "cpu" not in fh.read().split():
                    with open(control, "w") as fh:  # EBUSY where the parent holds processes (a container's root)
                        fh.write("+cpu")
                    self.enabled_cpu = control
        self.path = os.path.join(parent, f"steplens-test-{uuid.uuid4().hex[:8]}")
        os.mkdir(self.path)
        if version == 2:
            self._write("cpu.max", f"{quota_us} {period_us}")
        else:
            self._write("cpu.cfs_period_us", str(period_us))
            self._write("cpu.cfs_quota_us", str(quota_us))

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as fh:
            fh.write(value)

    def add(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))

    def close(self) -> None:
        for _ in range(50):  # a killed process leaves the cgroup a moment after wait() returns
            try:
                os.rmdir(self.path)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
        if self.enabled_cpu:
            try:
                with open(self.enabled_cpu, "w") as fh:
                    fh.write("-cpu")
            except OSError:
                pass  # another cgroup took the controller meanwhile: leave it on


@pytest.mark.privileged
def test_cpu_quota_throttling_of_a_process_moved_into_a_real_cgroup():
    version, parent, why = _quota_cgroup()
    if why:
        pytest.skip(why)
    try:
        cg = QuotaCgroup(version, parent, quota_us=10_000)
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup with a cpu quota under {parent}: {exc}")
    busy = subprocess.Popen(BUSY)
    try:
        src = _watching([busy])
        entity = _entity(busy)
        before = src.step()
        assert entity not in _by(before, "process_cpu_quota_cores")  # not in the quota cgroup yet

        cg.add(busy.pid)  # moved while watched: the next step reads the cgroup it is in now
        first = src.step()
        t0 = time.monotonic()
        time.sleep(2.0)
        second = src.step()
        wall = time.monotonic() - t0

        assert _by(first, "process_cpu_quota_cores")[entity] == pytest.approx(0.1)
        assert _by(second, "process_cpu_quota_cores")[entity] == pytest.approx(0.1)
        throttled = (_by(second, "process_cpu_throttled_seconds_total")[entity]
                     - _by(first, "process_cpu_throttled_seconds_total")[entity])
        periods = _by(second, "process_cpu_periods_total")[entity] - _by(first, "process_cpu_periods_total")[entity]
        throttled_periods = (_by(second, "process_cpu_throttled_periods_total")[entity]
                             - _by(first, "process_cpu_throttled_periods_total")[entity])
        # a spinning process allowed 10 ms per 100 ms period waits ~90 ms of each: ~0.9 s per second of wall time
        assert 0.4 * wall < throttled < 1.5 * wall, (throttled, wall)
        assert 0.5 * wall / 0.1 < periods <= wall / 0.1 + 2, (periods, wall)
        assert 0.5 * periods < throttled_periods <= periods
        assert _by(second, "process_cpu_percent")[entity] < 20.0  # the quota holds it near 10 % of a core
    finally:
        busy.kill()
        busy.wait()
        cg.close()
    assert not os.path.exists(cg.path)


def test_runqueue_delay_of_three_processes_pinned_to_one_cpu():
    cpu = min(os.sched_getaffinity(0))
    procs = [subprocess.Popen(BUSY) for _ in range(3)]
    try:
        for p in procs:
            os.sched_setaffinity(p.pid, {cpu})
        src = _watching(procs)
        time.sleep(0.2)
        first = src.step()
        t0 = time.monotonic()
        time.sleep(2.0)
        second = src.step()
        wall = time.monotonic() - t0
        waited = {e: _by(second, "process_runqueue_seconds_total")[e] - v
                  for e, v in _by(first, "process_runqueue_seconds_total").items()}
        assert set(waited) == {_entity(p) for p in procs}
        # three runnable processes on one CPU: each waits ~2/3 of the time
        assert max(waited.values()) > 0.3 * wall, (waited, wall)
        assert all(0 <= w < 1.05 * wall for w in waited.values()), (waited, wall)
        if os.path.exists("/proc/pressure/cpu"):
            name = "pressure_cpu_some_seconds_total"
            grown = _by(second, name)[""] - _by(first, name)[""]
            assert 0.3 * wall < grown < 1.05 * wall, (grown, wall)  # always someone waiting for that CPU
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.skipif(not os.path.exists("/proc/pressure"), reason="this kernel has no PSI (/proc/pressure)")
def test_pressure_totals_match_the_kernel_files():
    src = _watching([])
    with open("/proc/pressure/memory") as fh:
        before = {ln.split()[0]: int(ln.split("total=")[1]) / 1e6 for ln in fh}
    out = src.step()
    with open("/proc/pressure/memory") as fh:
        after = {ln.split()[0]: int(ln.split("total=")[1]) / 1e6 for ln in fh}
    names = {"pressure_cpu_some_seconds_total", "pressure_memory_some_seconds_total",
             "pressure_memory_full_seconds_total", "pressure_io_some_seconds_total", "pressure_io_full_seconds_total"}
    got = {m.name: m for m in out if m.name.startswith("pressure_")}
    assert set(got) == names and all(m.entity == "" for m in got.values())
    assert before["full"] <= got["pressure_memory_full_seconds_total"].value <= after["full"]
    assert before["some"] <= got["pressure_memory_some_seconds_total"].value <= after["some"]


# -- fixture trees: what a real kernel will not produce on demand -----------------------------------------------

STAT_TAIL = "S 1 1 1 0 -1 4194560 100 0 0 0 {utime} 5 0 0 20 0 1 0 {ticks} 1000000 250 18446744073709551615"


def _fixture_host(tmp_path, mountinfo: str, pids: dict[int, dict[str, str]], cgroups: dict[str, dict[str, str]],
                  pressure: dict[str, str] | None = None) -> HostSource:
    """A proc and sys tree: /proc/<pid>/{stat,cgroup,schedstat,...} per `pids`, cgroup files under sys/fs/cgroup,
    the host files copied from the real /proc."""
    proc, sys_root = tmp_path / "proc", tmp_path / "sys"
    (proc / "net").mkdir(parents=True)
    (proc / "self").mkdir()
    for name in ("stat", "meminfo", "vmstat", "loadavg", "diskstats", "cpuinfo"):
        shutil.copy(f"/proc/{name}", proc / name)
    shutil.copy("/proc/net/dev", proc / "net" / "dev")
    (proc / "self" / "mountinfo").write_text(mountinfo)
    for pid, files in pids.items():
        d = proc / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} (python) " + STAT_TAIL.format(utime=7, ticks=1000 + pid) + "\n")
        for name, text in files.items():
            (d / name).write_text(text)
    for rel, files in cgroups.items():
        d = sys_root / rel
        d.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (d / name).write_text(text)
    if pressure is not None:
        (proc / "pressure").mkdir()
        for name, text in pressure.items():
            (proc / "pressure" / name).write_text(text)
    ctx = HostContext(node_id="t", proc_root=str(proc), sys_root=str(sys_root))
    ctx.workloads.replace({(pid, 1000 + pid): ProcessInfo(0, pid, 1000 + pid) for pid in pids})
    src = HostSource(ctx, HostConfig())
    src.start()
    return src


V2_MOUNTINFO = ("22 27 0:21 / /proc rw - proc proc rw\n"
                "31 23 0:27 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
V2_STAT = "usage_usec 9000\nuser_usec 8000\nsystem_usec 1000\nnr_periods 40\nnr_throttled 30\nthrottled_usec 2500000\n"


def test_fixture_v2_good_unlimited_missing_garbage_and_outside_cgroups(tmp_path):
    src = _fixture_host(tmp_path, V2_MOUNTINFO, pids={
        100: {"cgroup": "0::/job/rank0\n", "schedstat": "123 2500000000 7\n"},
        101: {"cgroup": "0::/job/unlimited\n", "schedstat": "garbage\n"},
        102: {"cgroup": "0::/job/does-not-exist\n"},               # moved to a cgroup removed since
        103: {"cgroup": "0::/job/garbage\n", "schedstat": ""},
        104: {"cgroup": "0::/job/no-cpu-controller\n"},
        105: {"cgroup": "0::/../../outside-this-namespace\n"},
        106: {"cgroup": "not a cgroup file\x00\xff\n"},
        107: {"cgroup": "0::/job/bad-quota\n"},
    }, cgroups={
        "fs/cgroup/job/rank0": {"cpu.stat": V2_STAT, "cpu.max": "50000 100000\n"},
        "fs/cgroup/job/unlimited": {"cpu.stat": V2_STAT, "cpu.max": "max 100000\n"},
        "fs/cgroup/job/garbage": {"cpu.stat": "nr_periods x\nnr_throttled \xff\nthrottled_usec -\n", "cpu.max": "1 2"},
        "fs/cgroup/job/no-cpu-controller": {"cpu.stat": "usage_usec 9000\nuser_usec 8000\nsystem_usec 1000\n"},
        "fs/cgroup/job/bad-quota": {"cpu.stat": V2_STAT, "cpu.max": "lots 0\n"},
    })
    out = src.step()
    e = {pid: f"pid:{pid}:{1000 + pid}" for pid in range(100, 108)}
    assert _by(out, "process_runqueue_seconds_total") == {e[100]: 2.5}
    assert _by(out, "process_cpu_throttled_seconds_total") == {e[100]: 2.5, e[101]: 2.5, e[107]: 2.5}
    assert _by(out, "process_cpu_throttled_periods_total") == {e[100]: 30, e[101]: 30, e[107]: 30}
    assert _by(out, "process_cpu_periods_total") == {e[100]: 40, e[101]: 40, e[107]: 40}
    assert _by(out, "process_cpu_quota_cores") == {e[100]: 0.5}
    assert set(_by(out, "process_cpu_seconds_total")) == set(e.values())  # the rest of each process is there
    assert src.errors == 0
    assert not [m for m in out if m.name.startswith("pressure_")]  # no /proc/pressure here: a kernel without PSI


def test_fixture_v1_cpu_hierarchy_hybrid_and_a_sub_tree_mount(tmp_path):
    """Hybrid host: cpu on a v1 hierarchy (co-mounted with cpuacct) wins over the v2 line; a mount whose root is a
    sub-tree (a container's view) maps paths below it and shows none outside it."""
    mountinfo = ("31 23 0:27 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
                 "32 23 0:28 /kubepods /sys/fs/cgroup/cpu\\040acct rw - cgroup cgroup rw,cpu,cpuacct\n"
                 "33 23 0:29 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
    v1_stat = "nr_periods 10\nnr_throttled 4\nthrottled_time 3000000000\nnr_bursts 0\nburst_time 0\n"
    src = _fixture_host(tmp_path, mountinfo, pids={
        200: {"cgroup": "4:memory:/kubepods/pod1\n2:cpu,cpuacct:/kubepods/pod1/ctr\n0::/\n"},
        201: {"cgroup": "2:cpu,cpuacct:/kubepods/pod2\n0::/\n"},
        202: {"cgroup": "2:cpu,cpuacct:/system.slice\n0::/\n"},       # outside the mount's sub-tree
        203: {"cgroup": "2:cpuacct,cpu:/kubepods\n0::/\n"},
    }, cgroups={
        "fs/cgroup/cpu acct/pod1/ctr": {"cpu.stat": v1_stat, "cpu.cfs_quota_us": "25000\n",
                                        "cpu.cfs_period_us": "100000\n"},
        "fs/cgroup/cpu acct/pod2": {"cpu.stat": v1_stat, "cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"},
        "fs/cgroup/cpu acct": {"cpu.stat": v1_stat.replace("nr_periods 10", "nr_periods 11"),
                               "cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"},
    }, pressure={
        "cpu": "some avg10=1.00 avg60=0.50 avg300=0.10 total=1500000\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=9\n",
        "memory": "some avg10=0.00 avg60=0.00 avg300=0.00 total=250\nfull avg10=0.00 avg300=0.00 total=125\n",
        "io": "some avg10=0.00 avg60=0.00 avg300=0.00 total=not-a-number\nfull avg10=0.00 total=4000000\n",
    })
    out = src.step()
    e = {pid: f"pid:{pid}:{1000 + pid}" for pid in range(200, 204)}
    assert _by(out, "process_cpu_throttled_seconds_total") == {e[200]: 3.0, e[201]: 3.0, e[203]: 3.0}
    assert _by(out, "process_cpu_periods_total") == {e[200]: 10, e[201]: 10, e[203]: 11}
    assert _by(out, "process_cpu_quota_cores") == {e[200]: 0.25}
    assert {m.name: m.value for m in out if m.name.startswith("pressure_")} == {
        "pressure_cpu_some_seconds_total": 1.5, "pressure_memory_some_seconds_total": 0.00025,
        "pressure_memory_full_seconds_total": 0.000125, "pressure_io_full_seconds_total": 4.0}


def test_cgroups_are_found_through_init_when_this_mount_namespace_has_none():
    # `ip netns exec` (how the testbed starts its agents) mounts a fresh /sys without /sys/fs/cgroup: the
    # hierarchies are then read through /proc/1/root, init's view, and a process's cpu cgroup is still found
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1)")
    from steplens.agent.sources.host import CpuCgroups
    here = CpuCgroups.from_mountinfo("/proc", "/sys")
    if here is None:
        pytest.skip("no cgroup hierarchy mounted on this machine")
    code = ("import os, sys; from steplens.agent.sources.host import CpuCgroups as C; "
            "c = C.from_mountinfo('/proc', '/sys'); "
            "print(c.v2, c.v1_cpu, c.directory_of(int(sys.argv[1])))")
    out = subprocess.run(["unshare", "--mount", "--net", "--propagation", "private", "sh", "-c",
                          f"umount -l /sys && mount -t sysfs sysfs /sys && ls /sys/fs/cgroup | wc -l && "
                          f"{sys.executable} -c \"{code}\" {os.getpid()}"], capture_output=True, text=True)
    if out.returncode != 0:
        why = out.stderr.strip()[-300:]
        if not os.access("/proc/1/root/", os.R_OK | os.X_OK) or "Permission denied" in why:
            pytest.skip(f"init's root (/proc/1/root) is not readable here (a sandbox): {why}")
        pytest.fail(f"no cgroup found from a namespace without /sys/fs/cgroup: {why}")
    empty, line = out.stdout.strip().splitlines()
    assert empty == "0"                                                  # no cgroup mount in that namespace
    assert "/proc/1/root/sys/fs/cgroup" in line and line != "None None None"
    want = here.directory_of(os.getpid())
    if want is not None:
        assert line.endswith(f"('/proc/1/root{want[0]}', {want[1]})"), (line, want)
