"""gpu: per-GPU NVML telemetry (utilization, memory, clocks, temperatures, power, energy, PCIe, NVLink,
throttle reasons, ECC, XID events, per-process memory), polled at 1 Hz.

Reads NVML through pynvml (nvidia-ml-py), imported inside probe()/start() so the agent runs on hosts
without the driver. Every field is read on its own: NVMLError_NotSupported skips that field for good on
that device (so an unsupported query is not retried every second), any other error is counted in
`errors` and the step goes on. XID errors come from an NVML event set polled with a 0 ms timeout, so a
step never blocks. NVLink traffic comes from the field-values API (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX,
cumulative KiB per link), the same counters DCGM turns into DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL.

Emitted (entity "gpu<index>" unless noted): GpuInfo on the first step and whenever it changes;
metrics named in DCGM_NAMES below plus gpu_pcie_{transmit,receive}_bytes_per_second,
gpu_clocks_event_reasons (bitmask; Event kind "clocks_event_reasons" when it changes),
gpu_ecc_{corrected,uncorrected}_errors_total (volatile), gpu_xid_errors_total,
gpu_nvlink_{transmit,receive}_bytes_total [gpu<i>:nvlink<k>], gpu_process_memory_used_bytes [gpu<i>:pid:<pid>],
and Event(kind="xid", entity="gpu<i>", value=xid).

Privileges: none beyond read access to /dev/nvidia*. Cost: NVML queries are ~10-100 µs each, ~25 per GPU;
not measured here (no GPU on the development VM).
"""

from __future__ import annotations

from dataclasses import dataclass

from steplens.agent.records import Event, GpuInfo, Metric
from steplens.agent.sources.base import Availability, ConfigError, HostContext, Source, SourceConfig

# gpu source metric name -> (dcgm-exporter name, factor from our unit to dcgm-exporter's unit).
# dcgm-exporter: FB in MiB, energy in mJ, power in W, clocks in MHz, temperatures in C, utilization in %,
# NVLINK_BANDWIDTH_TOTAL as DCGM computes it from the same NVML counters: KiB/s divided by 1000.
DCGM_NAMES: dict[str, tuple[str, float]] = {
    "gpu_utilization_percent": ("DCGM_FI_DEV_GPU_UTIL", 1.0),
    "gpu_memory_utilization_percent": ("DCGM_FI_DEV_MEM_COPY_UTIL", 1.0),
    "gpu_sm_clock_mhz": ("DCGM_FI_DEV_SM_CLOCK", 1.0),
    "gpu_memory_clock_mhz": ("DCGM_FI_DEV_MEM_CLOCK", 1.0),
    "gpu_temperature_celsius": ("DCGM_FI_DEV_GPU_TEMP", 1.0),
    "gpu_memory_temperature_celsius": ("DCGM_FI_DEV_MEMORY_TEMP", 1.0),
    "gpu_power_watts": ("DCGM_FI_DEV_POWER_USAGE", 1.0),
    "gpu_energy_millijoules_total": ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 1.0),
    "gpu_memory_free_bytes": ("DCGM_FI_DEV_FB_FREE", 1.0 / (1 << 20)),
    "gpu_memory_used_bytes": ("DCGM_FI_DEV_FB_USED", 1.0 / (1 << 20)),
    "gpu_xid_last": ("DCGM_FI_DEV_XID_ERRORS", 1.0),
    "gpu_pcie_replay_total": ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", 1.0),
    "gpu_nvlink_bytes_per_second": ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", 1.0 / 1024 / 1000),
}


@dataclass
class GpuConfig(SourceConfig):
    per_process_memory: bool = True  # gpu_process_memory_used_bytes per compute process
    nvlink: bool = True  # per-link NVLink byte counters and the total rate
    xid_events: bool = True  # register for XID critical-error events
    max_events_per_step: int = 64  # XID events drained per step at most (a storm cannot stall the step)
    info_refresh_seconds: float = 60.0  # how often GpuInfo (name, UUID, bus id, memory, NVLink count) is re-read


    def validate(self) -> None:
        super().validate()
        if self.max_events_per_step < 1:
            raise ConfigError("max_events_per_step must be >= 1")
        if self.info_refresh_seconds <= 0:
            raise ConfigError("info_refresh_seconds must be > 0")


class _Device:
    def __init__(self, index: int, handle) -> None:
        self.index = index
        self.handle = handle
        self.entity = f"gpu{index}"
        self.info: GpuInfo | None = None
        self.info_checked_ns = 0
        self.unsupported: set[str] = set()
        self.links: list[int] = []
        self.prev_nvlink: tuple[int, int] | None = None  # (sum KiB tx+rx, mono_ns)
        self.reasons: int | None = None
        self.xid_last = 0
        self.xid_count = 0


class GpuSource(Source):
    name = "gpu"
    config_class = GpuConfig
    description = "NVIDIA GPU telemetry through NVML (pynvml): utilization, memory, clocks, power, PCIe, NVLink, ECC, XID"

    config: GpuConfig

    def __init__(self, ctx: HostContext, config: GpuConfig) -> None:
        super().__init__(ctx, config)
        self._nvml = None
        self._devices: list[_Device] = []
        self._event_set = None
        self.errors = 0  # NVML errors other than NotSupported, since start
        self._driver = ""
        self._cuda_driver = ""

    @classmethod
    def probe(cls, ctx: HostContext) -> Availability:
        try:
            import pynvml
        except ImportError as exc:
            return Availability.no(f"NVML unavailable: pynvml not importable ({exc})")
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, NoPermission ...
            return Availability.no(f"NVML unavailable: {exc}")
        try:
            count = pynvml.nvmlDeviceGetCount()
        except Exception as exc:
            return Availability.no(f"NVML unavailable: {exc}")
        finally:
            try:
                pynvml.nvmlShutdown()
            except Exception:
                pass
        if count == 0:
            return Availability.no("NVML found no GPU")
        return Availability.yes(f"{count} GPU(s)")

    def start(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise RuntimeError(f"NVML unavailable: pynvml not importable ({exc})") from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise RuntimeError(f"NVML unavailable: {exc}") from exc
        self._nvml = pynvml
        try:
            self._devices = [_Device(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
            self._driver = _text(self._try(None, "driver", pynvml.nvmlSystemGetDriverVersion) or "")
            cuda = self._try(None, "cuda", pynvml.nvmlSystemGetCudaDriverVersion)
            self._cuda_driver = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else ""
        except Exception:
            self.stop()
            raise
        if self.config.nvlink:
            for dev in self._devices:
                dev.links = self._active_links(dev)
        if self.config.xid_events:
            self._register_xid()

    def stop(self) -> None:
        nvml, self._nvml = self._nvml, None
        if nvml is None:
            return
        if self._event_set is not None:
            try:
                nvml.nvmlEventSetFree(self._event_set)
            except Exception:
                pass
            self._event_set = None
        self._devices = []
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass

    # -- reads -----------------------------------------------------------------------------------

    def _try(self, dev: _Device | None, field: str, fn, *args):
        """One NVML read: NotSupported disables the field on that device, other errors are counted."""
        if dev is not None and field in dev.unsupported:
            return None
        try:
            return fn(*args)
        except self._nvml.NVMLError_NotSupported:
            if dev is not None:
                dev.unsupported.add(field)
            return None
        except self._nvml.NVMLError:
            self.errors += 1
            return None

    def _active_links(self, dev: _Device) -> list[int]:
        nv = self._nvml
        links = []
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                if nv.nvmlDeviceGetNvLinkState(dev.handle, link) == nv.NVML_FEATURE_ENABLED:
                    links.append(link)
            except nv.NVMLError:
                break  # NotSupported / InvalidArgument past the last link
        return links

    def _register_xid(self) -> None:
        nv = self._nvml
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError:
            self._event_set = None
            return
        for dev in self._devices:
            try:
                nv.nvmlDeviceRegisterEvents(dev.handle, nv.nvmlEventTypeXidCriticalError, self._event_set)
            except nv.NVMLError:
                dev.unsupported.add("xid")

    def _gpu_info(self, dev: _Device, now: int) -> GpuInfo:
        nv, h = self._nvml, dev.handle
        pci = self._try(dev, "pci", nv.nvmlDeviceGetPciInfo, h)
        mem = self._try(dev, "memory", nv.nvmlDeviceGetMemoryInfo, h)
        return GpuInfo(
            mono_ns=now,
            index=dev.index,
            uuid=_text(self._try(dev, "uuid", nv.nvmlDeviceGetUUID, h) or ""),
            name=_text(self._try(dev, "name", nv.nvmlDeviceGetName, h) or ""),
            pci_bus_id=_text(pci.busId) if pci is not None else "",
            memory_total_bytes=int(mem.total) if mem is not None else 0,
            driver_version=self._driver,
            cuda_driver_version=self._cuda_driver,
            nvlink_count=len(dev.links),
            serial=_text(self._try(dev, "serial", nv.nvmlDeviceGetSerial, h) or ""),
        )

    def step(self) -> list:
        if self._nvml is None:
            raise RuntimeError("gpu source not started")
        now = self.ctx.mono_ns()
        out: list = []
        refresh_ns = int(self.config.info_refresh_seconds * 1e9)
        for dev in self._devices:
            if dev.info is None or now - dev.info_checked_ns >= refresh_ns:
                info = self._gpu_info(dev, now)
                dev.info_checked_ns = now
                if dev.info is None or _changed(dev.info, info):
                    out.append(info)
                    dev.info = info
            self._device_metrics(dev, now, out)
        if self._event_set is not None:
            self._drain_xid(now, out)
        for dev in self._devices:
            if "xid" not in dev.unsupported:
                out.append(Metric(now, "gpu_xid_last", dev.entity, float(dev.xid_last)))
                out.append(Metric(now, "gpu_xid_errors_total", dev.entity, float(dev.xid_count)))
        return out

    def _device_metrics(self, dev: _Device, now: int, out: list) -> None:
        nv, h, e = self._nvml, dev.handle, dev.entity

        def put(name: str, value) -> None:
            if value is not None:
                out.append(Metric(now, name, e, float(value)))

        util = self._try(dev, "util", nv.nvmlDeviceGetUtilizationRates, h)
        if util is not None:
            put("gpu_utilization_percent", util.gpu)
            put("gpu_memory_utilization_percent", util.memory)
        mem = self._try(dev, "memory", nv.nvmlDeviceGetMemoryInfo, h)
        if mem is not None:
            put("gpu_memory_used_bytes", mem.used)
            put("gpu_memory_free_bytes", mem.free)
            put("gpu_memory_total_bytes", mem.total)
        put("gpu_sm_clock_mhz", self._try(dev, "sm_clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM))
        put("gpu_memory_clock_mhz", self._try(dev, "mem_clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM))
        put("gpu_temperature_celsius", self._try(dev, "temp", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU))
        mem_temp = self._field(dev, "mem_temp", nv.NVML_FI_DEV_MEMORY_TEMP)
        if mem_temp:  # 0 means "no sensor" on boards without HBM temperature
            put("gpu_memory_temperature_celsius", mem_temp)
        power_mw = self._try(dev, "power", nv.nvmlDeviceGetPowerUsage, h)
        if power_mw is not None:
            put("gpu_power_watts", power_mw / 1000.0)
        put("gpu_energy_millijoules_total", self._try(dev, "energy", nv.nvmlDeviceGetTotalEnergyConsumption, h))
        tx = self._try(dev, "pcie_tx", nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_TX_BYTES)
        rx = self._try(dev, "pcie_rx", nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_RX_BYTES)
        if tx is not None:
            put("gpu_pcie_transmit_bytes_per_second", tx * 1024)  # NVML reports KB/s
        if rx is not None:
            put("gpu_pcie_receive_bytes_per_second", rx * 1024)
        put("gpu_pcie_replay_total", self._try(dev, "replay", nv.nvmlDeviceGetPcieReplayCounter, h))
        reasons = self._clock_reasons(dev)
        if reasons is not None:
            put("gpu_clocks_event_reasons", reasons)
            if dev.reasons is not None and reasons != dev.reasons:
                out.append(Event(now, "clocks_event_reasons", e, f"0x{dev.reasons:x} -> 0x{reasons:x}", float(reasons)))
            dev.reasons = reasons
        put("gpu_ecc_corrected_errors_total", self._try(
            dev, "ecc_corr", nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC))
        put("gpu_ecc_uncorrected_errors_total", self._try(
            dev, "ecc_uncorr", nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))
        if self.config.nvlink and dev.links:
            self._nvlink(dev, now, out)
        if self.config.per_process_memory:
            procs = self._try(dev, "procs", nv.nvmlDeviceGetComputeRunningProcesses, h)
            for p in procs or ():
                used = getattr(p, "usedGpuMemory", None)
                if used is not None:  # None: not available (e.g. under some virtualization)
                    out.append(Metric(now, "gpu_process_memory_used_bytes", f"{e}:pid:{p.pid}", float(used)))

    def _clock_reasons(self, dev: _Device):
        nv = self._nvml
        if "reasons" in dev.unsupported:
            return None
        # nvmlDeviceGetCurrentClocksEventReasons replaced ...ThrottleReasons (deprecated) in newer drivers
        for fn_name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            fn = getattr(nv, fn_name, None)
            if fn is None:
                continue
            try:
                return int(fn(dev.handle))
            except nv.NVMLError_FunctionNotFound:
                continue  # older libnvidia-ml: try the older name
            except nv.NVMLError_NotSupported:
                break
            except nv.NVMLError:
                self.errors += 1
                return None
        dev.unsupported.add("reasons")
        return None

    def _field(self, dev: _Device, field: str, field_id: int):
        """One value from the field-values API, or None (the per-field status is checked, not just the call's)."""
        values = self._try(dev, field, self._nvml.nvmlDeviceGetFieldValues, dev.handle, [field_id])
        if values is None:
            return None
        ret, value = _decode_field(self._nvml, values[0])
        if ret == self._nvml.NVML_ERROR_NOT_SUPPORTED:
            dev.unsupported.add(field)
        elif ret != self._nvml.NVML_SUCCESS:
            self.errors += 1
        return value

    def _nvlink(self, dev: _Device, now: int, out: list) -> None:
        nv = self._nvml
        if "nvlink" in dev.unsupported:
            return
        ids = []
        for link in dev.links:
            ids.append((nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, link))
            ids.append((nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, link))
        values = self._try(dev, "nvlink", nv.nvmlDeviceGetFieldValues, dev.handle, ids)
        if values is None:
            return
        total_kib, complete = 0, True
        for i, link in enumerate(dev.links):
            ret_tx, tx = _decode_field(nv, values[2 * i])
            ret_rx, rx = _decode_field(nv, values[2 * i + 1])
            if tx is None or rx is None:
                complete = False
                if nv.NVML_ERROR_NOT_SUPPORTED not in (ret_tx, ret_rx):
                    self.errors += 1
                continue
            ent = f"{dev.entity}:nvlink{link}"
            out.append(Metric(now, "gpu_nvlink_transmit_bytes_total", ent, float(tx) * 1024))
            out.append(Metric(now, "gpu_nvlink_receive_bytes_total", ent, float(rx) * 1024))
            total_kib += int(tx) + int(rx)
        if not complete:
            dev.prev_nvlink = None
            return
        prev, dev.prev_nvlink = dev.prev_nvlink, (total_kib, now)
        if prev is not None and now > prev[1] and total_kib >= prev[0]:
            rate = (total_kib - prev[0]) * 1024 / ((now - prev[1]) / 1e9)
            out.append(Metric(now, "gpu_nvlink_bytes_per_second", dev.entity, rate))

    def _drain_xid(self, now: int, out: list) -> None:
        nv = self._nvml
        by_index = {d.index: d for d in self._devices}
        for _ in range(self.config.max_events_per_step):
            try:
                data = nv.nvmlEventSetWait_v2(self._event_set, 0)
            except nv.NVMLError_Timeout:
                return
            except nv.NVMLError:
                self.errors += 1
                return
            if not data.eventType & nv.nvmlEventTypeXidCriticalError:
                continue
            try:
                index = nv.nvmlDeviceGetIndex(data.device)
            except nv.NVMLError:
                index = -1
            xid = int(data.eventData)
            entity = f"gpu{index}" if index >= 0 else ""
            out.append(Event(now, "xid", entity, f"XID {xid}", float(xid)))
            dev = by_index.get(index)
            if dev is not None:
                dev.xid_last = xid
                dev.xid_count += 1


def _decode_field(nv, v) -> tuple[int, float | int | None]:
    """(per-field NVML return code, value or None) of one nvmlFieldValue_t."""
    if v.nvmlReturn != nv.NVML_SUCCESS:
        return v.nvmlReturn, None
    kind = v.valueType
    if kind == nv.NVML_VALUE_TYPE_DOUBLE:
        return v.nvmlReturn, v.value.dVal
    if kind == nv.NVML_VALUE_TYPE_UNSIGNED_INT:
        return v.nvmlReturn, v.value.uiVal
    if kind == nv.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return v.nvmlReturn, v.value.ulVal
    if kind == nv.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return v.nvmlReturn, v.value.sllVal
    if kind == nv.NVML_VALUE_TYPE_SIGNED_INT:
        return v.nvmlReturn, v.value.siVal
    if kind == getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_SHORT", -1):
        return v.nvmlReturn, v.value.usVal
    return v.nvmlReturn, v.value.ullVal


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _changed(a: GpuInfo, b: GpuInfo) -> bool:
    return (a.uuid, a.name, a.pci_bus_id, a.memory_total_bytes, a.driver_version, a.nvlink_count, a.serial) != (
        b.uuid, b.name, b.pci_bus_id, b.memory_total_bytes, b.driver_version, b.nvlink_count, b.serial)
