from steplens.v1 import ingest_pb2 as _ingest_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RelayRequest(_message.Message):
    __slots__ = ("node_id", "command", "timeout_seconds", "from_collector")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FROM_COLLECTOR_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    command: _ingest_pb2.Command
    timeout_seconds: float
    from_collector: str
    def __init__(self, node_id: _Optional[str] = ..., command: _Optional[_Union[_ingest_pb2.Command, _Mapping]] = ..., timeout_seconds: _Optional[float] = ..., from_collector: _Optional[str] = ...) -> None: ...

class AgentClock(_message.Message):
    __slots__ = ("offset_ns", "drift_ppm", "ref_mono_ns", "uncertainty_ns", "best_rtt_ns", "samples")
    OFFSET_NS_FIELD_NUMBER: _ClassVar[int]
    DRIFT_PPM_FIELD_NUMBER: _ClassVar[int]
    REF_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    UNCERTAINTY_NS_FIELD_NUMBER: _ClassVar[int]
    BEST_RTT_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    offset_ns: int
    drift_ppm: float
    ref_mono_ns: int
    uncertainty_ns: int
    best_rtt_ns: int
    samples: int
    def __init__(self, offset_ns: _Optional[int] = ..., drift_ppm: _Optional[float] = ..., ref_mono_ns: _Optional[int] = ..., uncertainty_ns: _Optional[int] = ..., best_rtt_ns: _Optional[int] = ..., samples: _Optional[int] = ...) -> None: ...

class RelayReply(_message.Message):
    __slots__ = ("connected", "clock", "result", "message", "collector_id")
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    COLLECTOR_ID_FIELD_NUMBER: _ClassVar[int]
    connected: bool
    clock: AgentClock
    result: _ingest_pb2.CommandResult
    message: str
    collector_id: str
    def __init__(self, connected: _Optional[bool] = ..., clock: _Optional[_Union[AgentClock, _Mapping]] = ..., result: _Optional[_Union[_ingest_pb2.CommandResult, _Mapping]] = ..., message: _Optional[str] = ..., collector_id: _Optional[str] = ...) -> None: ...
