"""host source: real steps on this machine, plus a small fixture tree for the disk and frequency parsers."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import psutil
import pytest

from procutil import start_ticks as _start_ticks

from steplens.agent.records import Metric, ProcessInfo
from steplens.agent.sources.base import ConfigError, HostContext, build_config
from steplens.agent.sources.host import HostConfig, HostSource


@pytest.fixture(autouse=True)
def _restore_procfs_path():
    saved = psutil.PROCFS_PATH
    yield
    psutil.PROCFS_PATH = saved


def _by(records, name):
    return {m.entity: m.value for m in records if isinstance(m, Metric) and m.name == name}


def _source(**ctx_kw) -> HostSource:
    ctx = HostContext(node_id="t", **ctx_kw)
    src = HostSource(ctx, build_config(HostConfig, {}, "sources.host"))
    assert HostSource.probe(ctx).ok
    src.start()
    return src




def test_cpu_memory_load_values_are_sane():
    src = _source()
    first = src.step()
    assert _by(first, "cpu_utilization_percent") == {}  # needs two samples
    end = time.monotonic() + 0.3
    while time.monotonic() < end:  # keep a core busy so there is something to measure
        pass
    second = src.step()
    util = _by(second, "cpu_utilization_percent")
    assert set(util) == {f"cpu{i}" for i in range(psutil.cpu_count())}
    assert all(0.0 <= v <= 100.0 for v in util.values())
    assert max(util.values()) > 20.0  # the busy loop above shows up on some core

    vm = psutil.virtual_memory()
    mem = {m.name: m.value for m in second if m.entity == "" and m.name.startswith(("memory_", "swap_"))}
    assert mem["memory_total_bytes"] == vm.total
    assert 0 < mem["memory_available_bytes"] <= vm.total
    assert 0 < mem["memory_used_bytes"] < vm.total
    assert mem["swap_total_bytes"] == psutil.swap_memory().total

    load = {m.name: m.value for m in second if m.name.startswith("load")}
    assert set(load) == {"load1", "load5", "load15"}
    assert abs(load["load1"] - os.getloadavg()[0]) < 1.0

    freq = _by(first, "cpu_frequency_mhz")   # the first step reads them, then every 10 s (the default)
    assert freq and all(v > 100 for v in freq.values()) and _by(second, "cpu_frequency_mhz") == {}
    assert all(isinstance(m.mono_ns, int) and m.mono_ns > 0 for m in second)
    assert all(not m.name.endswith("_total") or m.value >= 0 for m in second)


def test_loopback_counters_follow_real_traffic():
    src = _source()
    before = src.step()
    payload = b"x" * 200_000
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    cli.sendall(payload)
    got = 0
    while got < len(payload):
        got += len(conn.recv(65536))
    for s in (cli, conn, srv):
        s.close()
    after = src.step()
    for name in ("network_receive_bytes_total", "network_transmit_bytes_total"):
        assert _by(after, name)["lo"] - _by(before, name)["lo"] >= len(payload)
    for name in ("network_receive_packets_total", "network_transmit_packets_total"):
        assert _by(after, name)["lo"] > _by(before, name)["lo"]
    assert "lo" in _by(after, "network_receive_drops_total")


def test_workload_process_figures(tmp_path):
    burner = subprocess.Popen([sys.executable, "-c", "import threading,time\n"
                               "t=threading.Thread(target=time.sleep,args=(60,));t.start()\n"
                               "x=bytearray(64<<20)\n"
                               "while True: pass"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        time.sleep(0.3)
        ctx = HostContext(node_id="t")
        key = (burner.pid, _start_ticks(burner.pid))
        reused = (burner.pid, key[1] - 1)  # same pid, other start time: must not be reported as the burner
        ctx.workloads.replace({
            key: ProcessInfo(0, *key),
            (gone.pid, 12345): ProcessInfo(0, gone.pid, 12345),
            reused: ProcessInfo(0, *reused),
        })
        src = HostSource(ctx, HostConfig())
        src.start()
        first = src.step()
        entity = f"pid:{key[0]}:{key[1]}"
        ents = {m.entity for m in first if m.name.startswith("process_")}
        assert ents == {entity}  # the vanished and the mismatched process are skipped, silently
        assert _by(first, "process_cpu_percent") == {}
        time.sleep(0.5)
        second = src.step()
        pct = _by(second, "process_cpu_percent")[entity]
        assert 50.0 < pct <= 110.0  # one spinning thread: about one core
        assert _by(second, "process_cpu_seconds_total")[entity] > _by(first, "process_cpu_seconds_total")[entity]
        rss = _by(second, "process_resident_memory_bytes")[entity]
        assert rss >= 64 << 20
        assert _by(second, "process_threads")[entity] == 2
        assert _by(second, "process_voluntary_context_switches_total")[entity] >= 0
        assert _by(second, "process_involuntary_context_switches_total")[entity] >= 0
        assert rss == pytest.approx(psutil.Process(burner.pid).memory_info().rss, rel=0.05)
        allowed = os.sched_getaffinity(burner.pid)
        assert _by(second, "process_cpus_allowed")[entity] == len(allowed)
        os.sched_setaffinity(burner.pid, {min(allowed)})   # pinned to one core (the inference bed's `slow` fault)
        assert _by(src.step(), "process_cpus_allowed")[entity] == 1
    finally:
        burner.kill()
        burner.wait()


def test_fixture_tree_disks_and_sysfs_frequency(tmp_path):
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    for name in ("stat", "meminfo", "vmstat", "loadavg"):
        shutil.copy(f"/proc/{name}", proc / name)
    shutil.copy("/proc/net/dev", proc / "net" / "dev")
    # fields: major minor name reads merged sectors_read ms writes merged sectors_written ms in_flight io_ms ...
    (proc / "diskstats").write_text(
        "   8       0 sda 100 0 2048 10 50 0 4096 20 0 1500 30 0 0 0 0\n"
        "   8       1 sda1 90 0 2000 9 40 0 4000 19 0 1400 28 0 0 0 0\n"
        " 259       0 nvme0n1 7 0 8 1 3 0 16 1 0 250 2 0 0 0 0\n"
        " 259       1 nvme0n1p1 7 0 8 1 3 0 16 1 0 250 2 0 0 0 0\n"
        "   7       0 loop0 1 0 2 0 0 0 0 0 0 0 0 0 0 0 0\n"
    )
    sys_root = tmp_path / "sys"
    for dev in ("sda", "nvme0n1", "loop0"):
        (sys_root / "block" / dev).mkdir(parents=True)
    for cpu, khz in ((0, 2400000), (1, 3100000)):
        d = sys_root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "cpufreq"
        d.mkdir(parents=True)
        (d / "scaling_cur_freq").write_text(f"{khz}\n")

    src = _source(proc_root=str(proc), sys_root=str(sys_root))
    out = src.step()
    assert _by(out, "disk_read_bytes_total") == {"sda": 2048 * 512, "nvme0n1": 8 * 512}
    assert _by(out, "disk_written_bytes_total") == {"sda": 4096 * 512, "nvme0n1": 16 * 512}
    assert _by(out, "disk_reads_completed_total")["sda"] == 100
    assert _by(out, "disk_writes_completed_total")["nvme0n1"] == 3
    assert _by(out, "disk_io_time_seconds_total")["sda"] == 1.5
    assert _by(out, "cpu_frequency_mhz") == {"cpu0": 2400.0, "cpu1": 3100.0}
    with open(proc / "loadavg") as f:
        assert _by(out, "load15")[""] == float(f.read().split()[2])


def test_config_validation():
    with pytest.raises(ConfigError, match="nic_exclude_regex"):
        build_config(HostConfig, {"nic_exclude_regex": "["}, "sources.host")
    with pytest.raises(ConfigError, match="interval_seconds"):
        build_config(HostConfig, {"interval_seconds": 0}, "sources.host")


def test_nic_exclusion():
    src = HostSource(HostContext(node_id="t"), build_config(HostConfig, {"nic_exclude_regex": "^lo$"}, "sources.host"))
    src.start()
    assert "lo" not in _by(src.step(), "network_receive_bytes_total")


def test_step_cost():
    """CPU per step at steady state; the figure goes into the module docstring."""
    ctx = HostContext(node_id="t")
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in range(2)]
    try:
        ctx.workloads.replace({(p.pid, _start_ticks(p.pid)): ProcessInfo(0, p.pid, _start_ticks(p.pid)) for p in procs})
        src = HostSource(ctx, HostConfig())
        src.start()
        src.step()
        n = 100
        t0 = time.process_time()
        for _ in range(n):
            src.step()
        per_step = (time.process_time() - t0) / n
        print(f"host step: {per_step * 1e6:.0f} us CPU ({psutil.cpu_count()} cpus, 2 workload processes)")
        assert per_step < 0.005
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_swap_figures_equal_psutils_on_a_host_with_swap(tmp_path):
    """The host source reads swap from meminfo and vmstat itself (psutil's swap_memory parsed every line of both);
    on a fixture tree with swap in use and swapping, the figures are psutil's, and a vmstat without the swap
    counters falls back to psutil's own handling."""
    import warnings
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    for name in ("stat", "loadavg"):
        shutil.copy(f"/proc/{name}", proc / name)
    shutil.copy("/proc/net/dev", proc / "net" / "dev")
    mem = open("/proc/meminfo").read()
    mem = "".join(("SwapTotal:       8388604 kB\n" if ln.startswith("SwapTotal:") else
                   "SwapFree:        6291452 kB\n" if ln.startswith("SwapFree:") else ln + "\n")
                  for ln in mem.splitlines())
    (proc / "meminfo").write_text(mem)
    (proc / "vmstat").write_text("nr_free_pages 1000\npswpin 1234\npswpout 56789\npswpin_extra 1\n")
    old = psutil.PROCFS_PATH   # the source points psutil at its proc_root (module-wide)
    try:
        src = _source(proc_root=str(proc), sys_root=str(tmp_path / "sys"))
        got = {m.name: m.value for m in src.step() if m.name.startswith("swap_")}
        psutil.PROCFS_PATH = str(proc)
        sw = psutil.swap_memory()
        assert got == {"swap_total_bytes": sw.total, "swap_used_bytes": sw.used, "swap_in_bytes_total": sw.sin,
                       "swap_out_bytes_total": sw.sout}
        assert (sw.total, sw.used, sw.sin, sw.sout) == (8388604 * 1024, 2097152 * 1024, 1234 * 4096, 56789 * 4096)
        (proc / "vmstat").write_text("nr_free_pages 1000\n")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # psutil warns that sin/sout are unknown (0)
            got = {m.name: m.value for m in src.step() if m.name.startswith("swap_")}
        assert got["swap_in_bytes_total"] == 0 and got["swap_total_bytes"] == 8388604 * 1024
    finally:
        psutil.PROCFS_PATH = old


def test_memory_and_network_figures_equal_psutils(tmp_path):
    """The host source picks memory and NIC counters out of meminfo and /proc/net/dev itself (psutil's
    virtual_memory and net_io_counters parsed every line into named tuples, ~60 % of the source's step): on a copy
    of this host's files the figures are psutil's, exactly; a meminfo without MemAvailable falls back to psutil."""
    import warnings
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    for name in ("stat", "loadavg", "meminfo", "vmstat"):
        shutil.copy(f"/proc/{name}", proc / name)
    dev = open("/proc/net/dev").read().rstrip("\n")
    # a NIC with every counter distinct, so that a column taken for another shows
    dev += "\n  eth9: " + " ".join(str(1000 + i) for i in range(16)) + "\n"
    (proc / "net" / "dev").write_text(dev)
    old = psutil.PROCFS_PATH
    try:
        src = _source(proc_root=str(proc), sys_root=str(tmp_path / "sys"))
        got = {(m.name, m.entity): m.value for m in src.step()}
        psutil.PROCFS_PATH = str(proc)
        vm = psutil.virtual_memory()
        assert {k: got[(k, "")] for k in ("memory_total_bytes", "memory_available_bytes", "memory_used_bytes",
                                          "memory_cached_bytes", "memory_buffers_bytes")} == \
            {"memory_total_bytes": vm.total, "memory_available_bytes": vm.available, "memory_used_bytes": vm.used,
             "memory_cached_bytes": vm.cached, "memory_buffers_bytes": vm.buffers}
        nics = psutil.net_io_counters(pernic=True, nowrap=False)
        assert "eth9" in nics
        for nic, c in nics.items():
            if src._nic_exclude.search(nic):
                assert ("network_receive_bytes_total", nic) not in got
                continue
            assert [got[(m, nic)] for m in ("network_receive_bytes_total", "network_transmit_bytes_total",
                                            "network_receive_packets_total", "network_transmit_packets_total",
                                            "network_receive_errors_total", "network_transmit_errors_total",
                                            "network_receive_drops_total", "network_transmit_drops_total")] == \
                [c.bytes_recv, c.bytes_sent, c.packets_recv, c.packets_sent, c.errin, c.errout, c.dropin, c.dropout]
        (proc / "meminfo").write_text("".join(ln + "\n" for ln in open("/proc/meminfo").read().splitlines()
                                              if not ln.startswith("MemAvailable:")))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got = {m.name: m.value for m in src.step()}
            vm = psutil.virtual_memory()
        assert got["memory_available_bytes"] == vm.available and got["memory_total_bytes"] == vm.total
    finally:
        psutil.PROCFS_PATH = old


def test_cpu_frequency_every_interval_and_every_step_in_deep_mode():
    from steplens.agent.records import Mode
    ctx = HostContext(node_id="t")
    src = HostSource(ctx, build_config(HostConfig, {"cpu_frequency_interval_seconds": 3600.0}, "sources.host"))
    src.start()
    try:
        counts = [len(_by(src.step(), "cpu_frequency_mhz")) for _ in range(3)]
        assert counts[0] > 0 and counts[1:] == [0, 0]   # once an hour: the first step only
        src.set_mode(Mode.DEEP)
        assert len(_by(src.step(), "cpu_frequency_mhz")) == counts[0]
        src.set_mode(Mode.SENTINEL)
        assert _by(src.step(), "cpu_frequency_mhz") == {}
    finally:
        src.stop()
    with pytest.raises(ConfigError, match="cpu_frequency_interval_seconds"):
        build_config(HostConfig, {"cpu_frequency_interval_seconds": -1.0}, "sources.host")


def test_infiniband_ports_from_a_recorded_sysfs_tree(tmp_path):
    # tests/fixtures/sysfs-infiniband: node_exporter's sysfs test tree (its README): an iWARP device whose counters
    # all read "N/A (no PMA)", and a ConnectX-3 with two QDR ports, port 1 holding a saturated port_xmit_wait
    from conftest import REPO
    from steplens.agent.sources.host import ib_ports, read_ib_port
    sys_root = os.path.join(REPO, "tests", "fixtures", "sysfs-infiniband")
    ports = ib_ports(sys_root)
    assert [e for e, _ in ports] == ["i40iw0/1", "mlx4_0/1", "mlx4_0/2"]
    got = {e: {m.name: m.value for m in read_ib_port(p, e, 7)} for e, p in ports}
    assert got["i40iw0/1"] == {"ib_port_up": 1.0, "ib_port_rate_gbps": 10.0}   # nothing of "N/A (no PMA)"
    m1 = got["mlx4_0/1"]
    assert m1["ib_port_up"] == 1.0 and m1["ib_port_rate_gbps"] == 40.0
    assert m1["ib_port_transmit_discards_total"] == 5 and m1["ib_port_link_downed_total"] == 0
    assert m1["ib_port_transmit_wait_ticks_total"] == 4294967295 and m1["ib_port_counters_saturated"] == 1
    assert "ib_port_symbol_errors_total" not in m1            # mlx4's ports have no symbol_error file here
    assert m1["ib_port_receive_bytes_total"] == 4 * 4631917   # counters_ext/port_rcv_data_64, 4-byte words
    assert got["mlx4_0/2"]["ib_port_transmit_bytes_total"] == 4 * 3733440
    assert got["mlx4_0/2"]["ib_port_counters_saturated"] == 0

    # through the source: found at start, read every infiniband_interval_seconds, every step in deep mode
    t = [10**9]
    ctx = HostContext(node_id="t", sys_root=sys_root, mono_ns=lambda: t[0])
    src = HostSource(ctx, build_config(HostConfig, {"infiniband_interval_seconds": 2.0, "processes": False},
                                       "sources.host"))
    src.start()
    assert set(_by(src.step(), "ib_port_rate_gbps")) == {"i40iw0/1", "mlx4_0/1", "mlx4_0/2"}
    t[0] += 10**9
    assert _by(src.step(), "ib_port_rate_gbps") == {}
    t[0] += 10**9
    assert len(_by(src.step(), "ib_port_rate_gbps")) == 3
    from steplens.agent.records import Mode
    src.set_mode(Mode.DEEP)
    t[0] += 10**8
    assert len(_by(src.step(), "ib_port_rate_gbps")) == 3


def test_infiniband_state_rate_and_bad_files(tmp_path):
    from steplens.agent.sources.host import ib_ports, read_ib_port
    port = tmp_path / "class" / "infiniband" / "mlx5_3" / "ports" / "1"
    (port / "counters").mkdir(parents=True)
    (port / "state").write_text("1: DOWN\n")
    (port / "phys_state").write_text("3: Disabled\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    (port / "counters" / "symbol_error").write_text("65535\n")      # a 16-bit field at its maximum
    (port / "counters" / "link_downed").write_text("garbage\n")
    (port / "counters" / "port_xmit_data").write_text("12\n")
    (tmp_path / "class" / "infiniband" / "mlx5_9").mkdir()          # a device without ports/
    assert [e for e, _ in ib_ports(str(tmp_path))] == ["mlx5_3/1"]
    got = {m.name: m.value for m in read_ib_port(str(port), "mlx5_3/1", 1)}
    assert got == {"ib_port_up": 0.0, "ib_port_rate_gbps": 400.0, "ib_port_symbol_errors_total": 65535.0,
                   "ib_port_transmit_bytes_total": 48.0, "ib_port_counters_saturated": 1.0}
    assert ib_ports(str(tmp_path / "nowhere")) == []
    with pytest.raises(ConfigError, match="infiniband_interval_seconds"):
        build_config(HostConfig, {"infiniband_interval_seconds": -1}, "sources.host")
