from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_SENTINEL: _ClassVar[Mode]
    MODE_DEEP: _ClassVar[Mode]
MODE_UNSPECIFIED: Mode
MODE_SENTINEL: Mode
MODE_DEEP: Mode

class Metric(_message.Message):
    __slots__ = ("name", "entity", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENTITY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    entity: str
    value: float
    def __init__(self, name: _Optional[str] = ..., entity: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...

class GpuInfo(_message.Message):
    __slots__ = ("index", "uuid", "name", "pci_bus_id", "memory_total_bytes", "driver_version", "cuda_driver_version", "nvlink_count", "serial")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    NVLINK_COUNT_FIELD_NUMBER: _ClassVar[int]
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_total_bytes: int
    driver_version: str
    cuda_driver_version: str
    nvlink_count: int
    serial: str
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., pci_bus_id: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., driver_version: _Optional[str] = ..., cuda_driver_version: _Optional[str] = ..., nvlink_count: _Optional[int] = ..., serial: _Optional[str] = ...) -> None: ...

class ProcessInfo(_message.Message):
    __slots__ = ("pid", "ppid", "start_ticks", "exe", "cmdline", "framework", "job_key", "rank", "local_rank", "world_size", "master_addr", "master_port", "env", "container_id", "uid")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PID_FIELD_NUMBER: _ClassVar[int]
    PPID_FIELD_NUMBER: _ClassVar[int]
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
    ENV_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    ppid: int
    start_ticks: int
    exe: str
    cmdline: _containers.RepeatedScalarFieldContainer[str]
    framework: str
    job_key: str
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    env: _containers.ScalarMap[str, str]
    container_id: str
    uid: int
    def __init__(self, pid: _Optional[int] = ..., ppid: _Optional[int] = ..., start_ticks: _Optional[int] = ..., exe: _Optional[str] = ..., cmdline: _Optional[_Iterable[str]] = ..., framework: _Optional[str] = ..., job_key: _Optional[str] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., env: _Optional[_Mapping[str, str]] = ..., container_id: _Optional[str] = ..., uid: _Optional[int] = ...) -> None: ...

class ProcessExit(_message.Message):
    __slots__ = ("pid", "start_ticks")
    PID_FIELD_NUMBER: _ClassVar[int]
    START_TICKS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    start_ticks: int
    def __init__(self, pid: _Optional[int] = ..., start_ticks: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("kind", "entity", "message", "value")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ENTITY_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    entity: str
    message: str
    value: float
    def __init__(self, kind: _Optional[str] = ..., entity: _Optional[str] = ..., message: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...

class Gap(_message.Message):
    __slots__ = ("dropped_records", "dropped_batches", "first_seq", "last_seq", "reason")
    DROPPED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    dropped_records: int
    dropped_batches: int
    first_seq: int
    last_seq: int
    reason: str
    def __init__(self, dropped_records: _Optional[int] = ..., dropped_batches: _Optional[int] = ..., first_seq: _Optional[int] = ..., last_seq: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ModeChange(_message.Message):
    __slots__ = ("mode", "command_id", "until_mono_ns", "reason")
    MODE_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    UNTIL_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    mode: Mode
    command_id: str
    until_mono_ns: int
    reason: str
    def __init__(self, mode: _Optional[_Union[Mode, str]] = ..., command_id: _Optional[str] = ..., until_mono_ns: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class StackFrame(_message.Message):
    __slots__ = ("id", "function", "qualname", "file", "line")
    ID_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    QUALNAME_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    id: int
    function: str
    qualname: str
    file: str
    line: int
    def __init__(self, id: _Optional[int] = ..., function: _Optional[str] = ..., qualname: _Optional[str] = ..., file: _Optional[str] = ..., line: _Optional[int] = ...) -> None: ...

class StackCount(_message.Message):
    __slots__ = ("frame_ids", "count", "gil", "running")
    FRAME_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    GIL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    frame_ids: _containers.RepeatedScalarFieldContainer[int]
    count: int
    gil: int
    running: int
    def __init__(self, frame_ids: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., gil: _Optional[int] = ..., running: _Optional[int] = ...) -> None: ...

class StackSummary(_message.Message):
    __slots__ = ("pid", "start_ticks", "tid", "thread_name", "start_mono_ns", "samples", "errors", "python", "last_state", "frames", "stacks")
    PID_FIELD_NUMBER: _ClassVar[int]
    START_TICKS_FIELD_NUMBER: _ClassVar[int]
    TID_FIELD_NUMBER: _ClassVar[int]
    THREAD_NAME_FIELD_NUMBER: _ClassVar[int]
    START_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    LAST_STATE_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    start_ticks: int
    tid: int
    thread_name: str
    start_mono_ns: int
    samples: int
    errors: int
    python: str
    last_state: str
    frames: _containers.RepeatedCompositeFieldContainer[StackFrame]
    stacks: _containers.RepeatedCompositeFieldContainer[StackCount]
    def __init__(self, pid: _Optional[int] = ..., start_ticks: _Optional[int] = ..., tid: _Optional[int] = ..., thread_name: _Optional[str] = ..., start_mono_ns: _Optional[int] = ..., samples: _Optional[int] = ..., errors: _Optional[int] = ..., python: _Optional[str] = ..., last_state: _Optional[str] = ..., frames: _Optional[_Iterable[_Union[StackFrame, _Mapping]]] = ..., stacks: _Optional[_Iterable[_Union[StackCount, _Mapping]]] = ...) -> None: ...

class ConnStats(_message.Message):
    __slots__ = ("start_mono_ns", "src", "sport", "dst", "dport", "tx_bytes", "rx_bytes", "tx_packets", "rx_packets", "tx_payload_bytes", "rx_payload_bytes", "retransmits", "srtt_us", "pid", "comm", "net_limited_us")
    START_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    SPORT_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    DPORT_FIELD_NUMBER: _ClassVar[int]
    TX_BYTES_FIELD_NUMBER: _ClassVar[int]
    RX_BYTES_FIELD_NUMBER: _ClassVar[int]
    TX_PACKETS_FIELD_NUMBER: _ClassVar[int]
    RX_PACKETS_FIELD_NUMBER: _ClassVar[int]
    TX_PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    RX_PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    RETRANSMITS_FIELD_NUMBER: _ClassVar[int]
    SRTT_US_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    COMM_FIELD_NUMBER: _ClassVar[int]
    NET_LIMITED_US_FIELD_NUMBER: _ClassVar[int]
    start_mono_ns: int
    src: str
    sport: int
    dst: str
    dport: int
    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int
    tx_payload_bytes: int
    rx_payload_bytes: int
    retransmits: int
    srtt_us: int
    pid: int
    comm: str
    net_limited_us: int
    def __init__(self, start_mono_ns: _Optional[int] = ..., src: _Optional[str] = ..., sport: _Optional[int] = ..., dst: _Optional[str] = ..., dport: _Optional[int] = ..., tx_bytes: _Optional[int] = ..., rx_bytes: _Optional[int] = ..., tx_packets: _Optional[int] = ..., rx_packets: _Optional[int] = ..., tx_payload_bytes: _Optional[int] = ..., rx_payload_bytes: _Optional[int] = ..., retransmits: _Optional[int] = ..., srtt_us: _Optional[int] = ..., pid: _Optional[int] = ..., comm: _Optional[str] = ..., net_limited_us: _Optional[int] = ...) -> None: ...

class Flow(_message.Message):
    __slots__ = ("start_mono_ns", "src", "sport", "dst", "dport", "bytes", "packets", "pid")
    START_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    SPORT_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    DPORT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PACKETS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    start_mono_ns: int
    src: str
    sport: int
    dst: str
    dport: int
    bytes: int
    packets: int
    pid: int
    def __init__(self, start_mono_ns: _Optional[int] = ..., src: _Optional[str] = ..., sport: _Optional[int] = ..., dst: _Optional[str] = ..., dport: _Optional[int] = ..., bytes: _Optional[int] = ..., packets: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class CommOp(_message.Message):
    __slots__ = ("timing", "pid", "start_ticks", "tid", "device", "comm_id", "comm_desc", "rank", "group_rank", "nranks", "members", "op", "peer", "root", "count", "dtype", "bytes", "seq", "p2p_seq", "stream", "issue_mono_ns", "start_mono_ns", "end_mono_ns", "job_key", "seq_source")
    TIMING_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    START_TICKS_FIELD_NUMBER: _ClassVar[int]
    TID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    COMM_ID_FIELD_NUMBER: _ClassVar[int]
    COMM_DESC_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    NRANKS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    P2P_SEQ_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    ISSUE_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    START_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    END_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    SEQ_SOURCE_FIELD_NUMBER: _ClassVar[int]
    timing: str
    pid: int
    start_ticks: int
    tid: int
    device: int
    comm_id: str
    comm_desc: str
    rank: int
    group_rank: int
    nranks: int
    members: _containers.RepeatedScalarFieldContainer[int]
    op: str
    peer: int
    root: int
    count: int
    dtype: str
    bytes: int
    seq: int
    p2p_seq: int
    stream: int
    issue_mono_ns: int
    start_mono_ns: int
    end_mono_ns: int
    job_key: str
    seq_source: str
    def __init__(self, timing: _Optional[str] = ..., pid: _Optional[int] = ..., start_ticks: _Optional[int] = ..., tid: _Optional[int] = ..., device: _Optional[int] = ..., comm_id: _Optional[str] = ..., comm_desc: _Optional[str] = ..., rank: _Optional[int] = ..., group_rank: _Optional[int] = ..., nranks: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., op: _Optional[str] = ..., peer: _Optional[int] = ..., root: _Optional[int] = ..., count: _Optional[int] = ..., dtype: _Optional[str] = ..., bytes: _Optional[int] = ..., seq: _Optional[int] = ..., p2p_seq: _Optional[int] = ..., stream: _Optional[int] = ..., issue_mono_ns: _Optional[int] = ..., start_mono_ns: _Optional[int] = ..., end_mono_ns: _Optional[int] = ..., job_key: _Optional[str] = ..., seq_source: _Optional[str] = ...) -> None: ...

class KernelRec(_message.Message):
    __slots__ = ("pid", "start_ticks", "tid", "device", "stream", "name", "grid", "block", "start_mono_ns", "end_mono_ns", "correlation_id", "launch_api", "launch_start_mono_ns", "launch_end_mono_ns", "graph_id", "rank")
    PID_FIELD_NUMBER: _ClassVar[int]
    START_TICKS_FIELD_NUMBER: _ClassVar[int]
    TID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    START_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    END_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_API_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_START_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_END_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    pid: int
    start_ticks: int
    tid: int
    device: int
    stream: int
    name: str
    grid: _containers.RepeatedScalarFieldContainer[int]
    block: _containers.RepeatedScalarFieldContainer[int]
    start_mono_ns: int
    end_mono_ns: int
    correlation_id: int
    launch_api: str
    launch_start_mono_ns: int
    launch_end_mono_ns: int
    graph_id: int
    rank: int
    def __init__(self, pid: _Optional[int] = ..., start_ticks: _Optional[int] = ..., tid: _Optional[int] = ..., device: _Optional[int] = ..., stream: _Optional[int] = ..., name: _Optional[str] = ..., grid: _Optional[_Iterable[int]] = ..., block: _Optional[_Iterable[int]] = ..., start_mono_ns: _Optional[int] = ..., end_mono_ns: _Optional[int] = ..., correlation_id: _Optional[int] = ..., launch_api: _Optional[str] = ..., launch_start_mono_ns: _Optional[int] = ..., launch_end_mono_ns: _Optional[int] = ..., graph_id: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class CommSummary(_message.Message):
    __slots__ = ("pid", "start_ticks", "job_key", "rank", "comm_id", "op", "step", "start_mono_ns", "calls", "bytes", "busy_ns", "max_ns", "seq_first", "seq_last", "timing", "issue_latency_ns_sum", "kernels")
    PID_FIELD_NUMBER: _ClassVar[int]
    START_TICKS_FIELD_NUMBER: _ClassVar[int]
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    COMM_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    START_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUSY_NS_FIELD_NUMBER: _ClassVar[int]
    MAX_NS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIRST_FIELD_NUMBER: _ClassVar[int]
    SEQ_LAST_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    ISSUE_LATENCY_NS_SUM_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    start_ticks: int
    job_key: str
    rank: int
    comm_id: str
    op: str
    step: int
    start_mono_ns: int
    calls: int
    bytes: int
    busy_ns: int
    max_ns: int
    seq_first: int
    seq_last: int
    timing: str
    issue_latency_ns_sum: int
    kernels: int
    def __init__(self, pid: _Optional[int] = ..., start_ticks: _Optional[int] = ..., job_key: _Optional[str] = ..., rank: _Optional[int] = ..., comm_id: _Optional[str] = ..., op: _Optional[str] = ..., step: _Optional[int] = ..., start_mono_ns: _Optional[int] = ..., calls: _Optional[int] = ..., bytes: _Optional[int] = ..., busy_ns: _Optional[int] = ..., max_ns: _Optional[int] = ..., seq_first: _Optional[int] = ..., seq_last: _Optional[int] = ..., timing: _Optional[str] = ..., issue_latency_ns_sum: _Optional[int] = ..., kernels: _Optional[int] = ...) -> None: ...

class StepComm(_message.Message):
    __slots__ = ("comm_id", "op", "calls", "bytes", "busy_ns", "wait_ns", "seq_first", "issue_offsets_ns", "offsets_dropped")
    COMM_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUSY_NS_FIELD_NUMBER: _ClassVar[int]
    WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIRST_FIELD_NUMBER: _ClassVar[int]
    ISSUE_OFFSETS_NS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    comm_id: str
    op: str
    calls: int
    bytes: int
    busy_ns: int
    wait_ns: int
    seq_first: int
    issue_offsets_ns: _containers.RepeatedScalarFieldContainer[int]
    offsets_dropped: int
    def __init__(self, comm_id: _Optional[str] = ..., op: _Optional[str] = ..., calls: _Optional[int] = ..., bytes: _Optional[int] = ..., busy_ns: _Optional[int] = ..., wait_ns: _Optional[int] = ..., seq_first: _Optional[int] = ..., issue_offsets_ns: _Optional[_Iterable[int]] = ..., offsets_dropped: _Optional[int] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("pid", "start_ticks", "job_key", "rank", "step", "start_mono_ns", "end_mono_ns", "evidence", "period_ops", "ops", "comms")
    PID_FIELD_NUMBER: _ClassVar[int]
    START_TICKS_FIELD_NUMBER: _ClassVar[int]
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    START_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    END_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    PERIOD_OPS_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    COMMS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    start_ticks: int
    job_key: str
    rank: int
    step: int
    start_mono_ns: int
    end_mono_ns: int
    evidence: str
    period_ops: int
    ops: int
    comms: _containers.RepeatedCompositeFieldContainer[StepComm]
    def __init__(self, pid: _Optional[int] = ..., start_ticks: _Optional[int] = ..., job_key: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., start_mono_ns: _Optional[int] = ..., end_mono_ns: _Optional[int] = ..., evidence: _Optional[str] = ..., period_ops: _Optional[int] = ..., ops: _Optional[int] = ..., comms: _Optional[_Iterable[_Union[StepComm, _Mapping]]] = ...) -> None: ...

class Iteration(_message.Message):
    __slots__ = ("pid", "start_ticks", "job_key", "rank", "seq", "start_mono_ns", "end_mono_ns", "anchor", "phase", "batch_size", "prefill_requests", "prefill_tokens", "decode_requests", "kv_tokens", "input_tokens", "output_tokens", "tokens", "micro_batches")
    PID_FIELD_NUMBER: _ClassVar[int]
    START_TICKS_FIELD_NUMBER: _ClassVar[int]
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    START_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    END_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    pid: int
    start_ticks: int
    job_key: str
    rank: int
    seq: int
    start_mono_ns: int
    end_mono_ns: int
    anchor: str
    phase: str
    batch_size: int
    prefill_requests: int
    prefill_tokens: int
    decode_requests: int
    kv_tokens: int
    input_tokens: int
    output_tokens: int
    tokens: int
    micro_batches: int
    def __init__(self, pid: _Optional[int] = ..., start_ticks: _Optional[int] = ..., job_key: _Optional[str] = ..., rank: _Optional[int] = ..., seq: _Optional[int] = ..., start_mono_ns: _Optional[int] = ..., end_mono_ns: _Optional[int] = ..., anchor: _Optional[str] = ..., phase: _Optional[str] = ..., batch_size: _Optional[int] = ..., prefill_requests: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., decode_requests: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., tokens: _Optional[int] = ..., micro_batches: _Optional[int] = ...) -> None: ...

class CommMember(_message.Message):
    __slots__ = ("comm_id", "rank", "nranks", "host", "pid", "cuda_dev", "nvml_dev", "bus_id", "global_rank", "job_key", "via")
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
    def __init__(self, comm_id: _Optional[str] = ..., rank: _Optional[int] = ..., nranks: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., cuda_dev: _Optional[int] = ..., nvml_dev: _Optional[int] = ..., bus_id: _Optional[str] = ..., global_rank: _Optional[int] = ..., job_key: _Optional[str] = ..., via: _Optional[str] = ...) -> None: ...

class CommProgress(_message.Message):
    __slots__ = ("pid", "comm_id", "start_ticks", "job_key", "rank", "last_enqueued", "last_started", "last_completed", "pending_op", "pending_seq", "pending_p2p", "pending_peer", "pending_since_mono_ns", "nranks")
    PID_FIELD_NUMBER: _ClassVar[int]
    COMM_ID_FIELD_NUMBER: _ClassVar[int]
    START_TICKS_FIELD_NUMBER: _ClassVar[int]
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAST_ENQUEUED_FIELD_NUMBER: _ClassVar[int]
    LAST_STARTED_FIELD_NUMBER: _ClassVar[int]
    LAST_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    PENDING_OP_FIELD_NUMBER: _ClassVar[int]
    PENDING_SEQ_FIELD_NUMBER: _ClassVar[int]
    PENDING_P2P_FIELD_NUMBER: _ClassVar[int]
    PENDING_PEER_FIELD_NUMBER: _ClassVar[int]
    PENDING_SINCE_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    NRANKS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    comm_id: str
    start_ticks: int
    job_key: str
    rank: int
    last_enqueued: int
    last_started: int
    last_completed: int
    pending_op: str
    pending_seq: int
    pending_p2p: bool
    pending_peer: int
    pending_since_mono_ns: int
    nranks: int
    def __init__(self, pid: _Optional[int] = ..., comm_id: _Optional[str] = ..., start_ticks: _Optional[int] = ..., job_key: _Optional[str] = ..., rank: _Optional[int] = ..., last_enqueued: _Optional[int] = ..., last_started: _Optional[int] = ..., last_completed: _Optional[int] = ..., pending_op: _Optional[str] = ..., pending_seq: _Optional[int] = ..., pending_p2p: _Optional[bool] = ..., pending_peer: _Optional[int] = ..., pending_since_mono_ns: _Optional[int] = ..., nranks: _Optional[int] = ...) -> None: ...

class Record(_message.Message):
    __slots__ = ("mono_ns", "source", "metric", "gpu", "process", "process_exit", "event", "gap", "mode", "stacks", "conn", "flow", "commop", "kernel", "comm_summary", "comm_member", "step", "comm_progress", "iteration")
    MONO_NS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    PROCESS_EXIT_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    CONN_FIELD_NUMBER: _ClassVar[int]
    FLOW_FIELD_NUMBER: _ClassVar[int]
    COMMOP_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    COMM_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    COMM_MEMBER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMM_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    mono_ns: int
    source: str
    metric: Metric
    gpu: GpuInfo
    process: ProcessInfo
    process_exit: ProcessExit
    event: Event
    gap: Gap
    mode: ModeChange
    stacks: StackSummary
    conn: ConnStats
    flow: Flow
    commop: CommOp
    kernel: KernelRec
    comm_summary: CommSummary
    comm_member: CommMember
    step: Step
    comm_progress: CommProgress
    iteration: Iteration
    def __init__(self, mono_ns: _Optional[int] = ..., source: _Optional[str] = ..., metric: _Optional[_Union[Metric, _Mapping]] = ..., gpu: _Optional[_Union[GpuInfo, _Mapping]] = ..., process: _Optional[_Union[ProcessInfo, _Mapping]] = ..., process_exit: _Optional[_Union[ProcessExit, _Mapping]] = ..., event: _Optional[_Union[Event, _Mapping]] = ..., gap: _Optional[_Union[Gap, _Mapping]] = ..., mode: _Optional[_Union[ModeChange, _Mapping]] = ..., stacks: _Optional[_Union[StackSummary, _Mapping]] = ..., conn: _Optional[_Union[ConnStats, _Mapping]] = ..., flow: _Optional[_Union[Flow, _Mapping]] = ..., commop: _Optional[_Union[CommOp, _Mapping]] = ..., kernel: _Optional[_Union[KernelRec, _Mapping]] = ..., comm_summary: _Optional[_Union[CommSummary, _Mapping]] = ..., comm_member: _Optional[_Union[CommMember, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., comm_progress: _Optional[_Union[CommProgress, _Mapping]] = ..., iteration: _Optional[_Union[Iteration, _Mapping]] = ...) -> None: ...

class RecordList(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[Record]
    def __init__(self, records: _Optional[_Iterable[_Union[Record, _Mapping]]] = ...) -> None: ...
