"""gpu source: on a host without NVML, probe and start say why; on a GPU host (marker `gpu`), real NVML reads
checked against what CUDA (torch) reports. No fake pynvml: the values must come from a real driver."""

from __future__ import annotations

import re
import time

import pytest

from steplens.agent.records import Event, GpuInfo, Metric
from steplens.agent.sources.base import ConfigError, HostContext, build_config
from steplens.agent.sources.gpu import DCGM_NAMES, GpuConfig, GpuSource


def _nvml_init_error() -> str | None:
    """What nvmlInit says here, asked directly of pynvml (None when NVML works)."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return str(exc)
    pynvml.nvmlShutdown()
    return None


def test_probe_and_start_explain_missing_nvml():
    error = _nvml_init_error()
    if error is None:
        pytest.skip("NVML works on this host; see the gpu-marked test")
    ctx = HostContext(node_id="t")
    avail = GpuSource.probe(ctx)
    assert not avail.ok
    assert avail.reason == f"NVML unavailable: {error}"
    src = GpuSource(ctx, build_config(GpuConfig, {}, "sources.gpu"))
    with pytest.raises(RuntimeError, match=f"^NVML unavailable: {re.escape(error)}$"):
        src.start()
    with pytest.raises(RuntimeError, match="not started"):
        src.step()
    src.stop()
    src.stop()


def test_config_validation_and_dcgm_names():
    with pytest.raises(ConfigError, match="max_events_per_step"):
        build_config(GpuConfig, {"max_events_per_step": 0}, "sources.gpu")
    with pytest.raises(ConfigError, match="unknown key"):
        build_config(GpuConfig, {"nvlinks": True}, "sources.gpu")
    wanted = {f"DCGM_FI_DEV_{n}" for n in (
        "GPU_UTIL", "MEM_COPY_UTIL", "SM_CLOCK", "MEM_CLOCK", "GPU_TEMP", "MEMORY_TEMP", "POWER_USAGE",
        "TOTAL_ENERGY_CONSUMPTION", "FB_FREE", "FB_USED", "XID_ERRORS", "PCIE_REPLAY_COUNTER", "NVLINK_BANDWIDTH_TOTAL")}
    assert {dcgm for dcgm, _ in DCGM_NAMES.values()} == wanted
    assert all(name.startswith("gpu_") for name in DCGM_NAMES)


@pytest.mark.gpu
def test_real_gpu_step_matches_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    import pynvml

    ctx = HostContext(node_id="t")
    avail = GpuSource.probe(ctx)
    assert avail.ok, avail.reason
    src = GpuSource(ctx, GpuConfig())
    src.start()
    try:
        t0 = time.perf_counter()
        out = src.step()
        first_step_s = time.perf_counter() - t0
        infos = {r.index: r for r in out if isinstance(r, GpuInfo)}
        assert len(infos) >= torch.cuda.device_count() > 0
        by_uuid = {i.uuid.removeprefix("GPU-"): i for i in infos.values()}
        metrics = {(m.name, m.entity): m.value for m in out if isinstance(m, Metric)}
        for t in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(t)
            info = by_uuid[str(props.uuid)]
            assert info.name and info.pci_bus_id and info.driver_version
            # CUDA's total leaves out what the driver reserves; NVML v2 says how much that is.
            handle = pynvml.nvmlDeviceGetHandleByIndex(info.index)
            reserved = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).reserved
            diff = info.memory_total_bytes - props.total_memory
            assert diff == 0 or 0 < diff <= reserved, (info.memory_total_bytes, props.total_memory, reserved)
            e = f"gpu{info.index}"
            assert metrics[("gpu_sm_clock_mhz", e)] > 0
            assert metrics[("gpu_memory_clock_mhz", e)] > 0
            assert metrics[("gpu_memory_total_bytes", e)] == info.memory_total_bytes
            used, free = metrics[("gpu_memory_used_bytes", e)], metrics[("gpu_memory_free_bytes", e)]
            assert 0 < used + free <= info.memory_total_bytes
            assert 0 <= metrics[("gpu_utilization_percent", e)] <= 100
            assert 0 < metrics[("gpu_temperature_celsius", e)] < 120
            assert metrics[("gpu_power_watts", e)] > 0
        # this process holds a CUDA context: NVML lists it with some memory
        x = torch.ones(1 << 20, device="cuda:0")
        torch.cuda.synchronize()
        time.sleep(0.5)
        second = src.step()
        assert not [r for r in second if isinstance(r, GpuInfo)]  # unchanged: not re-sent
        assert not [r for r in second if isinstance(r, Event) and r.kind == "xid"]
        import os

        pids = {m.entity.split(":pid:")[1] for m in second if isinstance(m, Metric) and m.name == "gpu_process_memory_used_bytes"}
        assert str(os.getpid()) in pids or not pids  # containers may hide host PIDs
        e = f"gpu{by_uuid[str(torch.cuda.get_device_properties(0).uuid)].index}"
        energy = [m.value for m in second
                  if isinstance(m, Metric) and m.name == "gpu_energy_millijoules_total" and m.entity == e]
        assert energy and energy[0] >= metrics[("gpu_energy_millijoules_total", e)]
        print(f"gpu first step {first_step_s * 1e3:.1f} ms, errors {src.errors}, events "
              f"{[(r.kind, r.message) for r in second if isinstance(r, Event)]}")
        del x
    finally:
        src.stop()
        src.stop()
