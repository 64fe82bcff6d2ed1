from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SourceHealth(_message.Message):
    __slots__ = ("name", "up", "reason", "last_duration_seconds", "errors", "cpu_cores", "rate_scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LAST_DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    RATE_SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    up: bool
    reason: str
    last_duration_seconds: float
    errors: int
    cpu_cores: float
    rate_scale: float
    def __init__(self, name: _Optional[str] = ..., up: _Optional[bool] = ..., reason: _Optional[str] = ..., last_duration_seconds: _Optional[float] = ..., errors: _Optional[int] = ..., cpu_cores: _Optional[float] = ..., rate_scale: _Optional[float] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("node_id", "hostname", "agent_version", "connected", "peer", "first_seen_ns", "last_seen_ns", "clock_offset_ns", "clock_uncertainty_ns", "clock_drift_ppm", "clock_rtt_ns", "clock_samples", "sources", "spool_backlog", "records_produced", "records_acked", "records_dropped", "records_stored", "records_rejected", "batches_stored", "batches_duplicate", "gaps", "mode", "mode_until_ns", "agent_cpu_cores", "cpu_budget_cores", "collector")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEEN_NS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_NS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_OFFSET_NS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_UNCERTAINTY_NS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_DRIFT_PPM_FIELD_NUMBER: _ClassVar[int]
    CLOCK_RTT_NS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    SPOOL_BACKLOG_FIELD_NUMBER: _ClassVar[int]
    RECORDS_PRODUCED_FIELD_NUMBER: _ClassVar[int]
    RECORDS_ACKED_FIELD_NUMBER: _ClassVar[int]
    RECORDS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    RECORDS_STORED_FIELD_NUMBER: _ClassVar[int]
    RECORDS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_STORED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    GAPS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODE_UNTIL_NS_FIELD_NUMBER: _ClassVar[int]
    AGENT_CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    CPU_BUDGET_CORES_FIELD_NUMBER: _ClassVar[int]
    COLLECTOR_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    hostname: str
    agent_version: str
    connected: bool
    peer: str
    first_seen_ns: int
    last_seen_ns: int
    clock_offset_ns: int
    clock_uncertainty_ns: int
    clock_drift_ppm: float
    clock_rtt_ns: int
    clock_samples: int
    sources: _containers.RepeatedCompositeFieldContainer[SourceHealth]
    spool_backlog: int
    records_produced: int
    records_acked: int
    records_dropped: int
    records_stored: int
    records_rejected: int
    batches_stored: int
    batches_duplicate: int
    gaps: int
    mode: str
    mode_until_ns: int
    agent_cpu_cores: float
    cpu_budget_cores: float
    collector: str
    def __init__(self, node_id: _Optional[str] = ..., hostname: _Optional[str] = ..., agent_version: _Optional[str] = ..., connected: _Optional[bool] = ..., peer: _Optional[str] = ..., first_seen_ns: _Optional[int] = ..., last_seen_ns: _Optional[int] = ..., clock_offset_ns: _Optional[int] = ..., clock_uncertainty_ns: _Optional[int] = ..., clock_drift_ppm: _Optional[float] = ..., clock_rtt_ns: _Optional[int] = ..., clock_samples: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[SourceHealth, _Mapping]]] = ..., spool_backlog: _Optional[int] = ..., records_produced: _Optional[int] = ..., records_acked: _Optional[int] = ..., records_dropped: _Optional[int] = ..., records_stored: _Optional[int] = ..., records_rejected: _Optional[int] = ..., batches_stored: _Optional[int] = ..., batches_duplicate: _Optional[int] = ..., gaps: _Optional[int] = ..., mode: _Optional[str] = ..., mode_until_ns: _Optional[int] = ..., agent_cpu_cores: _Optional[float] = ..., cpu_budget_cores: _Optional[float] = ..., collector: _Optional[str] = ...) -> None: ...

class GpuSample(_message.Message):
    __slots__ = ("name", "value", "ts_ns")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TS_NS_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    ts_ns: int
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ..., ts_ns: _Optional[int] = ...) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("node_id", "index", "uuid", "name", "pci_bus_id", "memory_total_bytes", "driver_version", "last_seen_ns", "latest")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_NS_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_total_bytes: int
    driver_version: str
    last_seen_ns: int
    latest: _containers.RepeatedCompositeFieldContainer[GpuSample]
    def __init__(self, node_id: _Optional[str] = ..., index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., pci_bus_id: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., driver_version: _Optional[str] = ..., last_seen_ns: _Optional[int] = ..., latest: _Optional[_Iterable[_Union[GpuSample, _Mapping]]] = ...) -> None: ...

class Proc(_message.Message):
    __slots__ = ("node_id", "pid", "start_ticks", "exe", "cmdline", "framework", "job_key", "rank", "local_rank", "world_size", "master_addr", "master_port", "started_ns", "exited_ns", "alive", "cpu_percent", "rss_bytes", "threads")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    START_TICKS_FIELD_NUMBER: _ClassVar[int]
    EXE_FIELD_NUMBER: _ClassVar[int]
    CMDLINE_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    STARTED_NS_FIELD_NUMBER: _ClassVar[int]
    EXITED_NS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    pid: int
    start_ticks: int
    exe: str
    cmdline: str
    framework: str
    job_key: str
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    started_ns: int
    exited_ns: int
    alive: bool
    cpu_percent: float
    rss_bytes: int
    threads: int
    def __init__(self, node_id: _Optional[str] = ..., pid: _Optional[int] = ..., start_ticks: _Optional[int] = ..., exe: _Optional[str] = ..., cmdline: _Optional[str] = ..., framework: _Optional[str] = ..., job_key: _Optional[str] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., started_ns: _Optional[int] = ..., exited_ns: _Optional[int] = ..., alive: _Optional[bool] = ..., cpu_percent: _Optional[float] = ..., rss_bytes: _Optional[int] = ..., threads: _Optional[int] = ...) -> None: ...

class GapRow(_message.Message):
    __slots__ = ("node_id", "ts_ns", "dropped_records", "dropped_batches", "first_seq", "last_seq", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TS_NS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    ts_ns: int
    dropped_records: int
    dropped_batches: int
    first_seq: int
    last_seq: int
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., ts_ns: _Optional[int] = ..., dropped_records: _Optional[int] = ..., dropped_batches: _Optional[int] = ..., first_seq: _Optional[int] = ..., last_seq: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("node_id", "alive_only", "pid", "since_ns", "limit")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ALIVE_ONLY_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    alive_only: bool
    pid: int
    since_ns: int
    limit: int
    def __init__(self, node_id: _Optional[str] = ..., alive_only: _Optional[bool] = ..., pid: _Optional[int] = ..., since_ns: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class StackRow(_message.Message):
    __slots__ = ("node_id", "pid", "start_ticks", "tid", "thread_name", "python", "start_ns", "end_ns", "samples", "errors", "last_state", "stacks_json")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    START_TICKS_FIELD_NUMBER: _ClassVar[int]
    TID_FIELD_NUMBER: _ClassVar[int]
    THREAD_NAME_FIELD_NUMBER: _ClassVar[int]
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    LAST_STATE_FIELD_NUMBER: _ClassVar[int]
    STACKS_JSON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    pid: int
    start_ticks: int
    tid: int
    thread_name: str
    python: str
    start_ns: int
    end_ns: int
    samples: int
    errors: int
    last_state: str
    stacks_json: str
    def __init__(self, node_id: _Optional[str] = ..., pid: _Optional[int] = ..., start_ticks: _Optional[int] = ..., tid: _Optional[int] = ..., thread_name: _Optional[str] = ..., python: _Optional[str] = ..., start_ns: _Optional[int] = ..., end_ns: _Optional[int] = ..., samples: _Optional[int] = ..., errors: _Optional[int] = ..., last_state: _Optional[str] = ..., stacks_json: _Optional[str] = ...) -> None: ...

class FlowRow(_message.Message):
    __slots__ = ("node_id", "start_ns", "end_ns", "src", "sport", "dst", "dport", "bytes", "packets", "pid", "origin", "switches", "flows")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    SPORT_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    DPORT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PACKETS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    FLOWS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    start_ns: int
    end_ns: int
    src: str
    sport: int
    dst: str
    dport: int
    bytes: int
    packets: int
    pid: int
    origin: str
    switches: _containers.RepeatedScalarFieldContainer[str]
    flows: int
    def __init__(self, node_id: _Optional[str] = ..., start_ns: _Optional[int] = ..., end_ns: _Optional[int] = ..., src: _Optional[str] = ..., sport: _Optional[int] = ..., dst: _Optional[str] = ..., dport: _Optional[int] = ..., bytes: _Optional[int] = ..., packets: _Optional[int] = ..., pid: _Optional[int] = ..., origin: _Optional[str] = ..., switches: _Optional[_Iterable[str]] = ..., flows: _Optional[int] = ...) -> None: ...

class FlowQuery(_message.Message):
    __slots__ = ("since_ns", "by", "node_id", "limit")
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    since_ns: int
    by: str
    node_id: str
    limit: int
    def __init__(self, since_ns: _Optional[int] = ..., by: _Optional[str] = ..., node_id: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class FlowList(_message.Message):
    __slots__ = ("flows",)
    FLOWS_FIELD_NUMBER: _ClassVar[int]
    flows: _containers.RepeatedCompositeFieldContainer[FlowRow]
    def __init__(self, flows: _Optional[_Iterable[_Union[FlowRow, _Mapping]]] = ...) -> None: ...

class ImportFlowsRequest(_message.Message):
    __slots__ = ("origin", "flows")
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    FLOWS_FIELD_NUMBER: _ClassVar[int]
    origin: str
    flows: _containers.RepeatedCompositeFieldContainer[FlowRow]
    def __init__(self, origin: _Optional[str] = ..., flows: _Optional[_Iterable[_Union[FlowRow, _Mapping]]] = ...) -> None: ...

class ImportFlowsReply(_message.Message):
    __slots__ = ("imported",)
    IMPORTED_FIELD_NUMBER: _ClassVar[int]
    imported: int
    def __init__(self, imported: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("node_id", "kinds", "since_ns", "until_ns", "ranks", "limit")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_NS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    kinds: _containers.RepeatedScalarFieldContainer[str]
    since_ns: int
    until_ns: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    limit: int
    def __init__(self, node_id: _Optional[str] = ..., kinds: _Optional[_Iterable[str]] = ..., since_ns: _Optional[int] = ..., until_ns: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., limit: _Optional[int] = ...) -> None: ...

class FetchReply(_message.Message):
    __slots__ = ("node_id", "message", "records_json")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RECORDS_JSON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    message: str
    records_json: str
    def __init__(self, node_id: _Optional[str] = ..., message: _Optional[str] = ..., records_json: _Optional[str] = ...) -> None: ...

class CommOpsRequest(_message.Message):
    __slots__ = ("job_key", "ranks", "since_ns", "until_ns", "limit", "kinds")
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_NS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    since_ns: int
    until_ns: int
    limit: int
    kinds: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_key: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., since_ns: _Optional[int] = ..., until_ns: _Optional[int] = ..., limit: _Optional[int] = ..., kinds: _Optional[_Iterable[str]] = ...) -> None: ...

class CommOpsReply(_message.Message):
    __slots__ = ("records_json", "messages", "offline")
    class MessagesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RECORDS_JSON_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_FIELD_NUMBER: _ClassVar[int]
    records_json: str
    messages: _containers.ScalarMap[str, str]
    offline: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, records_json: _Optional[str] = ..., messages: _Optional[_Mapping[str, str]] = ..., offline: _Optional[_Iterable[str]] = ...) -> None: ...

class CommsRequest(_message.Message):
    __slots__ = ("job_key", "comm_id")
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    COMM_ID_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    comm_id: str
    def __init__(self, job_key: _Optional[str] = ..., comm_id: _Optional[str] = ...) -> None: ...

class CommMemberRow(_message.Message):
    __slots__ = ("comm_id", "rank", "nranks", "host", "pid", "cuda_dev", "nvml_dev", "bus_id", "global_rank", "job_key", "via", "node_id", "seen_ns")
    COMM_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NRANKS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEV_FIELD_NUMBER: _ClassVar[int]
    NVML_DEV_FIELD_NUMBER: _ClassVar[int]
    BUS_ID_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    VIA_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEEN_NS_FIELD_NUMBER: _ClassVar[int]
    comm_id: str
    rank: int
    nranks: int
    host: str
    pid: int
    cuda_dev: int
    nvml_dev: int
    bus_id: str
    global_rank: int
    job_key: str
    via: str
    node_id: str
    seen_ns: int
    def __init__(self, comm_id: _Optional[str] = ..., rank: _Optional[int] = ..., nranks: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., cuda_dev: _Optional[int] = ..., nvml_dev: _Optional[int] = ..., bus_id: _Optional[str] = ..., global_rank: _Optional[int] = ..., job_key: _Optional[str] = ..., via: _Optional[str] = ..., node_id: _Optional[str] = ..., seen_ns: _Optional[int] = ...) -> None: ...

class CommList(_message.Message):
    __slots__ = ("members",)
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[CommMemberRow]
    def __init__(self, members: _Optional[_Iterable[_Union[CommMemberRow, _Mapping]]] = ...) -> None: ...

class SummariesRequest(_message.Message):
    __slots__ = ("job_key", "ranks", "since_ns", "limit")
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    since_ns: int
    limit: int
    def __init__(self, job_key: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., since_ns: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class SummariesReply(_message.Message):
    __slots__ = ("rows_json",)
    ROWS_JSON_FIELD_NUMBER: _ClassVar[int]
    rows_json: str
    def __init__(self, rows_json: _Optional[str] = ...) -> None: ...

class NodeList(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ...) -> None: ...

class StackList(_message.Message):
    __slots__ = ("stacks",)
    STACKS_FIELD_NUMBER: _ClassVar[int]
    stacks: _containers.RepeatedCompositeFieldContainer[StackRow]
    def __init__(self, stacks: _Optional[_Iterable[_Union[StackRow, _Mapping]]] = ...) -> None: ...

class GpuList(_message.Message):
    __slots__ = ("gpus",)
    GPUS_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    def __init__(self, gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ...) -> None: ...

class ProcList(_message.Message):
    __slots__ = ("procs",)
    PROCS_FIELD_NUMBER: _ClassVar[int]
    procs: _containers.RepeatedCompositeFieldContainer[Proc]
    def __init__(self, procs: _Optional[_Iterable[_Union[Proc, _Mapping]]] = ...) -> None: ...

class GapList(_message.Message):
    __slots__ = ("gaps",)
    GAPS_FIELD_NUMBER: _ClassVar[int]
    gaps: _containers.RepeatedCompositeFieldContainer[GapRow]
    def __init__(self, gaps: _Optional[_Iterable[_Union[GapRow, _Mapping]]] = ...) -> None: ...

class DeepRequest(_message.Message):
    __slots__ = ("node_ids", "enable", "start_ns", "lead_ms", "duration_ns", "sources", "job_key")
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    LEAD_MS_FIELD_NUMBER: _ClassVar[int]
    DURATION_NS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    enable: bool
    start_ns: int
    lead_ms: int
    duration_ns: int
    sources: _containers.RepeatedScalarFieldContainer[str]
    job_key: str
    def __init__(self, node_ids: _Optional[_Iterable[str]] = ..., enable: _Optional[bool] = ..., start_ns: _Optional[int] = ..., lead_ms: _Optional[int] = ..., duration_ns: _Optional[int] = ..., sources: _Optional[_Iterable[str]] = ..., job_key: _Optional[str] = ...) -> None: ...

class DeepReply(_message.Message):
    __slots__ = ("command_id", "start_ns", "delivered", "offline", "messages", "deep_dive_json")
    class MessagesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    DEEP_DIVE_JSON_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    start_ns: int
    delivered: _containers.RepeatedScalarFieldContainer[str]
    offline: _containers.RepeatedScalarFieldContainer[str]
    messages: _containers.ScalarMap[str, str]
    deep_dive_json: str
    def __init__(self, command_id: _Optional[str] = ..., start_ns: _Optional[int] = ..., delivered: _Optional[_Iterable[str]] = ..., offline: _Optional[_Iterable[str]] = ..., messages: _Optional[_Mapping[str, str]] = ..., deep_dive_json: _Optional[str] = ...) -> None: ...

class DeepDivesRequest(_message.Message):
    __slots__ = ("job_key", "command_id", "limit")
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    command_id: str
    limit: int
    def __init__(self, job_key: _Optional[str] = ..., command_id: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class DeepDivesReply(_message.Message):
    __slots__ = ("deep_dives_json",)
    DEEP_DIVES_JSON_FIELD_NUMBER: _ClassVar[int]
    deep_dives_json: str
    def __init__(self, deep_dives_json: _Optional[str] = ...) -> None: ...

class Suspect(_message.Message):
    __slots__ = ("kind", "id", "score", "cause", "evidence_json")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_JSON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    id: str
    score: float
    cause: str
    evidence_json: str
    def __init__(self, kind: _Optional[str] = ..., id: _Optional[str] = ..., score: _Optional[float] = ..., cause: _Optional[str] = ..., evidence_json: _Optional[str] = ...) -> None: ...

class Finding(_message.Message):
    __slots__ = ("id", "job_key", "kind", "detector", "status", "onset_ns", "last_ns", "resolved_ns", "severity", "peak_severity", "summary", "suspects", "evidence_json", "confirmations", "deep_dive_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETECTOR_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ONSET_NS_FIELD_NUMBER: _ClassVar[int]
    LAST_NS_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_NS_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    PEAK_SEVERITY_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_JSON_FIELD_NUMBER: _ClassVar[int]
    CONFIRMATIONS_FIELD_NUMBER: _ClassVar[int]
    DEEP_DIVE_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    job_key: str
    kind: str
    detector: str
    status: str
    onset_ns: int
    last_ns: int
    resolved_ns: int
    severity: float
    peak_severity: float
    summary: str
    suspects: _containers.RepeatedCompositeFieldContainer[Suspect]
    evidence_json: str
    confirmations: int
    deep_dive_json: str
    def __init__(self, id: _Optional[str] = ..., job_key: _Optional[str] = ..., kind: _Optional[str] = ..., detector: _Optional[str] = ..., status: _Optional[str] = ..., onset_ns: _Optional[int] = ..., last_ns: _Optional[int] = ..., resolved_ns: _Optional[int] = ..., severity: _Optional[float] = ..., peak_severity: _Optional[float] = ..., summary: _Optional[str] = ..., suspects: _Optional[_Iterable[_Union[Suspect, _Mapping]]] = ..., evidence_json: _Optional[str] = ..., confirmations: _Optional[int] = ..., deep_dive_json: _Optional[str] = ...) -> None: ...

class FindingsRequest(_message.Message):
    __slots__ = ("job_key", "since_ns", "open_only", "limit")
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    OPEN_ONLY_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    since_ns: int
    open_only: bool
    limit: int
    def __init__(self, job_key: _Optional[str] = ..., since_ns: _Optional[int] = ..., open_only: _Optional[bool] = ..., limit: _Optional[int] = ...) -> None: ...

class FindingList(_message.Message):
    __slots__ = ("findings",)
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    findings: _containers.RepeatedCompositeFieldContainer[Finding]
    def __init__(self, findings: _Optional[_Iterable[_Union[Finding, _Mapping]]] = ...) -> None: ...

class DiagnoseRequest(_message.Message):
    __slots__ = ("job_key", "since_ns")
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    since_ns: int
    def __init__(self, job_key: _Optional[str] = ..., since_ns: _Optional[int] = ...) -> None: ...

class DiagnoseReply(_message.Message):
    __slots__ = ("findings", "detectors", "errors", "since_ns", "until_ns", "seconds", "ranks_fetched")
    class ErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    DETECTORS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_NS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FETCHED_FIELD_NUMBER: _ClassVar[int]
    findings: _containers.RepeatedCompositeFieldContainer[Finding]
    detectors: _containers.RepeatedScalarFieldContainer[str]
    errors: _containers.ScalarMap[str, str]
    since_ns: int
    until_ns: int
    seconds: float
    ranks_fetched: int
    def __init__(self, findings: _Optional[_Iterable[_Union[Finding, _Mapping]]] = ..., detectors: _Optional[_Iterable[str]] = ..., errors: _Optional[_Mapping[str, str]] = ..., since_ns: _Optional[int] = ..., until_ns: _Optional[int] = ..., seconds: _Optional[float] = ..., ranks_fetched: _Optional[int] = ...) -> None: ...

class WatchFindingsRequest(_message.Message):
    __slots__ = ("job_key", "include_open")
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_OPEN_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    include_open: bool
    def __init__(self, job_key: _Optional[str] = ..., include_open: _Optional[bool] = ...) -> None: ...

class FindingEvent(_message.Message):
    __slots__ = ("event", "finding", "dropped")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    FINDING_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    event: str
    finding: Finding
    dropped: int
    def __init__(self, event: _Optional[str] = ..., finding: _Optional[_Union[Finding, _Mapping]] = ..., dropped: _Optional[int] = ...) -> None: ...

class JobRank(_message.Message):
    __slots__ = ("rank", "node_id", "pid", "local_rank", "alive", "source")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node_id: str
    pid: int
    local_rank: int
    alive: bool
    source: str
    def __init__(self, rank: _Optional[int] = ..., node_id: _Optional[str] = ..., pid: _Optional[int] = ..., local_rank: _Optional[int] = ..., alive: _Optional[bool] = ..., source: _Optional[str] = ...) -> None: ...

class JobComm(_message.Message):
    __slots__ = ("comm_id", "nranks", "ranks", "ops", "via")
    COMM_ID_FIELD_NUMBER: _ClassVar[int]
    NRANKS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    VIA_FIELD_NUMBER: _ClassVar[int]
    comm_id: str
    nranks: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    ops: _containers.RepeatedScalarFieldContainer[str]
    via: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, comm_id: _Optional[str] = ..., nranks: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., ops: _Optional[_Iterable[str]] = ..., via: _Optional[_Iterable[str]] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_key", "world_size", "ranks", "nodes", "comms", "alive", "first_seen_ns", "last_seen_ns", "step_seconds", "baseline_step_seconds", "step_source", "steps", "open_findings", "source", "endpoints", "pairs", "flow_sources")
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    COMMS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEEN_NS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BASELINE_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SOURCE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    OPEN_FINDINGS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    FLOW_SOURCES_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    world_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[JobRank]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    comms: _containers.RepeatedCompositeFieldContainer[JobComm]
    alive: bool
    first_seen_ns: int
    last_seen_ns: int
    step_seconds: float
    baseline_step_seconds: float
    step_source: str
    steps: int
    open_findings: _containers.RepeatedCompositeFieldContainer[Finding]
    source: str
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    pairs: _containers.RepeatedCompositeFieldContainer[JobPair]
    flow_sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_key: _Optional[str] = ..., world_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[JobRank, _Mapping]]] = ..., nodes: _Optional[_Iterable[str]] = ..., comms: _Optional[_Iterable[_Union[JobComm, _Mapping]]] = ..., alive: _Optional[bool] = ..., first_seen_ns: _Optional[int] = ..., last_seen_ns: _Optional[int] = ..., step_seconds: _Optional[float] = ..., baseline_step_seconds: _Optional[float] = ..., step_source: _Optional[str] = ..., steps: _Optional[int] = ..., open_findings: _Optional[_Iterable[_Union[Finding, _Mapping]]] = ..., source: _Optional[str] = ..., endpoints: _Optional[_Iterable[str]] = ..., pairs: _Optional[_Iterable[_Union[JobPair, _Mapping]]] = ..., flow_sources: _Optional[_Iterable[str]] = ...) -> None: ...

class JobPair(_message.Message):
    __slots__ = ("a", "b", "type")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    a: str
    b: str
    type: str
    def __init__(self, a: _Optional[str] = ..., b: _Optional[str] = ..., type: _Optional[str] = ...) -> None: ...

class JobsRequest(_message.Message):
    __slots__ = ("job_key",)
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    def __init__(self, job_key: _Optional[str] = ...) -> None: ...

class TimelineRequest(_message.Message):
    __slots__ = ("job_key", "since_ns", "until_ns")
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_NS_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    since_ns: int
    until_ns: int
    def __init__(self, job_key: _Optional[str] = ..., since_ns: _Optional[int] = ..., until_ns: _Optional[int] = ...) -> None: ...

class TimelineStep(_message.Message):
    __slots__ = ("endpoint", "rank", "step", "start_ns", "end_ns")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    rank: int
    step: int
    start_ns: int
    end_ns: int
    def __init__(self, endpoint: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., start_ns: _Optional[int] = ..., end_ns: _Optional[int] = ...) -> None: ...

class TimelineReply(_message.Message):
    __slots__ = ("job_key", "source", "flow_sources", "since_ns", "until_ns", "steps")
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FLOW_SOURCES_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_NS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    source: str
    flow_sources: _containers.RepeatedScalarFieldContainer[str]
    since_ns: int
    until_ns: int
    steps: _containers.RepeatedCompositeFieldContainer[TimelineStep]
    def __init__(self, job_key: _Optional[str] = ..., source: _Optional[str] = ..., flow_sources: _Optional[_Iterable[str]] = ..., since_ns: _Optional[int] = ..., until_ns: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[TimelineStep, _Mapping]]] = ...) -> None: ...

class JobList(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class ImportTopologyRequest(_message.Message):
    __slots__ = ("origin", "topology_json")
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_JSON_FIELD_NUMBER: _ClassVar[int]
    origin: str
    topology_json: str
    def __init__(self, origin: _Optional[str] = ..., topology_json: _Optional[str] = ...) -> None: ...

class TopologyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TopologyReply(_message.Message):
    __slots__ = ("version", "origin", "imported_ns", "digest", "name", "nodes", "gpus", "nics", "switches", "links", "topology_json")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    IMPORTED_NS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    NICS_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_JSON_FIELD_NUMBER: _ClassVar[int]
    version: int
    origin: str
    imported_ns: int
    digest: str
    name: str
    nodes: int
    gpus: int
    nics: int
    switches: int
    links: int
    topology_json: str
    def __init__(self, version: _Optional[int] = ..., origin: _Optional[str] = ..., imported_ns: _Optional[int] = ..., digest: _Optional[str] = ..., name: _Optional[str] = ..., nodes: _Optional[int] = ..., gpus: _Optional[int] = ..., nics: _Optional[int] = ..., switches: _Optional[int] = ..., links: _Optional[int] = ..., topology_json: _Optional[str] = ...) -> None: ...

class TraceRequest(_message.Message):
    __slots__ = ("job_key", "finding_id", "since_ns", "until_ns", "store_only")
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    FINDING_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_NS_FIELD_NUMBER: _ClassVar[int]
    STORE_ONLY_FIELD_NUMBER: _ClassVar[int]
    job_key: str
    finding_id: str
    since_ns: int
    until_ns: int
    store_only: bool
    def __init__(self, job_key: _Optional[str] = ..., finding_id: _Optional[str] = ..., since_ns: _Optional[int] = ..., until_ns: _Optional[int] = ..., store_only: _Optional[bool] = ...) -> None: ...

class TraceChunk(_message.Message):
    __slots__ = ("data", "summary_json")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_JSON_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    summary_json: str
    def __init__(self, data: _Optional[bytes] = ..., summary_json: _Optional[str] = ...) -> None: ...
