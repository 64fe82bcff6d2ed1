from steplens.v1 import records_pb2 as _records_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SchemaVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEMA_VERSION_UNSPECIFIED: _ClassVar[SchemaVersion]
    SCHEMA_VERSION_CURRENT: _ClassVar[SchemaVersion]
SCHEMA_VERSION_UNSPECIFIED: SchemaVersion
SCHEMA_VERSION_CURRENT: SchemaVersion

class Hello(_message.Message):
    __slots__ = ("schema_version", "agent_id", "spool_id", "hostname", "agent_version", "boot_id", "mono_ns")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SPOOL_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    MONO_NS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    agent_id: str
    spool_id: str
    hostname: str
    agent_version: str
    boot_id: str
    mono_ns: int
    def __init__(self, schema_version: _Optional[int] = ..., agent_id: _Optional[str] = ..., spool_id: _Optional[str] = ..., hostname: _Optional[str] = ..., agent_version: _Optional[str] = ..., boot_id: _Optional[str] = ..., mono_ns: _Optional[int] = ...) -> None: ...

class HelloAck(_message.Message):
    __slots__ = ("schema_version", "last_seq", "collector_id")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    COLLECTOR_ID_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    last_seq: int
    collector_id: str
    def __init__(self, schema_version: _Optional[int] = ..., last_seq: _Optional[int] = ..., collector_id: _Optional[str] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("agent_id", "spool_id", "seq", "n_records", "sent_mono_ns", "payload")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SPOOL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    N_RECORDS_FIELD_NUMBER: _ClassVar[int]
    SENT_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    spool_id: str
    seq: int
    n_records: int
    sent_mono_ns: int
    payload: bytes
    def __init__(self, agent_id: _Optional[str] = ..., spool_id: _Optional[str] = ..., seq: _Optional[int] = ..., n_records: _Optional[int] = ..., sent_mono_ns: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq", "rejected_records", "note")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REJECTED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    rejected_records: int
    note: str
    def __init__(self, seq: _Optional[int] = ..., rejected_records: _Optional[int] = ..., note: _Optional[str] = ...) -> None: ...

class ClockProbe(_message.Message):
    __slots__ = ("probe_id", "t1_ns")
    PROBE_ID_FIELD_NUMBER: _ClassVar[int]
    T1_NS_FIELD_NUMBER: _ClassVar[int]
    probe_id: int
    t1_ns: int
    def __init__(self, probe_id: _Optional[int] = ..., t1_ns: _Optional[int] = ...) -> None: ...

class ClockReply(_message.Message):
    __slots__ = ("probe_id", "t1_ns", "t2_mono_ns", "t3_mono_ns")
    PROBE_ID_FIELD_NUMBER: _ClassVar[int]
    T1_NS_FIELD_NUMBER: _ClassVar[int]
    T2_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    T3_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    probe_id: int
    t1_ns: int
    t2_mono_ns: int
    t3_mono_ns: int
    def __init__(self, probe_id: _Optional[int] = ..., t1_ns: _Optional[int] = ..., t2_mono_ns: _Optional[int] = ..., t3_mono_ns: _Optional[int] = ...) -> None: ...

class SourceState(_message.Message):
    __slots__ = ("name", "up", "reason", "last_duration_seconds", "steps", "errors", "records", "cpu_cores", "rate_scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LAST_DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    RATE_SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    up: bool
    reason: str
    last_duration_seconds: float
    steps: int
    errors: int
    records: int
    cpu_cores: float
    rate_scale: float
    def __init__(self, name: _Optional[str] = ..., up: _Optional[bool] = ..., reason: _Optional[str] = ..., last_duration_seconds: _Optional[float] = ..., steps: _Optional[int] = ..., errors: _Optional[int] = ..., records: _Optional[int] = ..., cpu_cores: _Optional[float] = ..., rate_scale: _Optional[float] = ...) -> None: ...

class AgentStatus(_message.Message):
    __slots__ = ("mono_ns", "sources", "spool_backlog_batches", "spool_backlog_records", "spool_backlog_bytes", "records_produced", "records_acked", "records_dropped", "mode", "mode_until_mono_ns", "final", "agent_cpu_cores", "cpu_budget_cores")
    MONO_NS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    SPOOL_BACKLOG_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SPOOL_BACKLOG_RECORDS_FIELD_NUMBER: _ClassVar[int]
    SPOOL_BACKLOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECORDS_PRODUCED_FIELD_NUMBER: _ClassVar[int]
    RECORDS_ACKED_FIELD_NUMBER: _ClassVar[int]
    RECORDS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODE_UNTIL_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    AGENT_CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    CPU_BUDGET_CORES_FIELD_NUMBER: _ClassVar[int]
    mono_ns: int
    sources: _containers.RepeatedCompositeFieldContainer[SourceState]
    spool_backlog_batches: int
    spool_backlog_records: int
    spool_backlog_bytes: int
    records_produced: int
    records_acked: int
    records_dropped: int
    mode: _records_pb2.Mode
    mode_until_mono_ns: int
    final: bool
    agent_cpu_cores: float
    cpu_budget_cores: float
    def __init__(self, mono_ns: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[SourceState, _Mapping]]] = ..., spool_backlog_batches: _Optional[int] = ..., spool_backlog_records: _Optional[int] = ..., spool_backlog_bytes: _Optional[int] = ..., records_produced: _Optional[int] = ..., records_acked: _Optional[int] = ..., records_dropped: _Optional[int] = ..., mode: _Optional[_Union[_records_pb2.Mode, str]] = ..., mode_until_mono_ns: _Optional[int] = ..., final: _Optional[bool] = ..., agent_cpu_cores: _Optional[float] = ..., cpu_budget_cores: _Optional[float] = ...) -> None: ...

class DeepMode(_message.Message):
    __slots__ = ("enable", "start_ns", "start_mono_ns", "duration_ns", "sources")
    ENABLE_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    START_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    DURATION_NS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    enable: bool
    start_ns: int
    start_mono_ns: int
    duration_ns: int
    sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, enable: _Optional[bool] = ..., start_ns: _Optional[int] = ..., start_mono_ns: _Optional[int] = ..., duration_ns: _Optional[int] = ..., sources: _Optional[_Iterable[str]] = ...) -> None: ...

class FetchDetail(_message.Message):
    __slots__ = ("kinds", "ranks", "since_ns", "until_ns", "since_mono_ns", "until_mono_ns", "limit", "pids")
    KINDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_NS_FIELD_NUMBER: _ClassVar[int]
    SINCE_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    kinds: _containers.RepeatedScalarFieldContainer[str]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    since_ns: int
    until_ns: int
    since_mono_ns: int
    until_mono_ns: int
    limit: int
    pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kinds: _Optional[_Iterable[str]] = ..., ranks: _Optional[_Iterable[int]] = ..., since_ns: _Optional[int] = ..., until_ns: _Optional[int] = ..., since_mono_ns: _Optional[int] = ..., until_mono_ns: _Optional[int] = ..., limit: _Optional[int] = ..., pids: _Optional[_Iterable[int]] = ...) -> None: ...

class SetSourceConfig(_message.Message):
    __slots__ = ("source", "toml")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TOML_FIELD_NUMBER: _ClassVar[int]
    source: str
    toml: str
    def __init__(self, source: _Optional[str] = ..., toml: _Optional[str] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("command_id", "deep", "fetch", "config")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    DEEP_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    deep: DeepMode
    fetch: FetchDetail
    config: SetSourceConfig
    def __init__(self, command_id: _Optional[str] = ..., deep: _Optional[_Union[DeepMode, _Mapping]] = ..., fetch: _Optional[_Union[FetchDetail, _Mapping]] = ..., config: _Optional[_Union[SetSourceConfig, _Mapping]] = ...) -> None: ...

class CommandResult(_message.Message):
    __slots__ = ("command_id", "ok", "message", "payload")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    ok: bool
    message: str
    payload: bytes
    def __init__(self, command_id: _Optional[str] = ..., ok: _Optional[bool] = ..., message: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("hello", "batch", "clock", "status", "result")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    batch: Batch
    clock: ClockReply
    status: AgentStatus
    result: CommandResult
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., batch: _Optional[_Union[Batch, _Mapping]] = ..., clock: _Optional[_Union[ClockReply, _Mapping]] = ..., status: _Optional[_Union[AgentStatus, _Mapping]] = ..., result: _Optional[_Union[CommandResult, _Mapping]] = ...) -> None: ...

class CollectorMessage(_message.Message):
    __slots__ = ("hello_ack", "ack", "probe", "command")
    HELLO_ACK_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    hello_ack: HelloAck
    ack: Ack
    probe: ClockProbe
    command: Command
    def __init__(self, hello_ack: _Optional[_Union[HelloAck, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., probe: _Optional[_Union[ClockProbe, _Mapping]] = ..., command: _Optional[_Union[Command, _Mapping]] = ...) -> None: ...
