from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Trace(_message.Message):
    __slots__ = ("packet",)
    PACKET_FIELD_NUMBER: _ClassVar[int]
    packet: _containers.RepeatedCompositeFieldContainer[TracePacket]
    def __init__(self, packet: _Optional[_Iterable[_Union[TracePacket, _Mapping]]] = ...) -> None: ...

class TracePacket(_message.Message):
    __slots__ = ("timestamp", "trusted_packet_sequence_id", "track_event", "sequence_flags", "track_descriptor")
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    TRUSTED_PACKET_SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TRACK_EVENT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FLAGS_FIELD_NUMBER: _ClassVar[int]
    TRACK_DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    timestamp: int
    trusted_packet_sequence_id: int
    track_event: TrackEvent
    sequence_flags: int
    track_descriptor: TrackDescriptor
    def __init__(self, timestamp: _Optional[int] = ..., trusted_packet_sequence_id: _Optional[int] = ..., track_event: _Optional[_Union[TrackEvent, _Mapping]] = ..., sequence_flags: _Optional[int] = ..., track_descriptor: _Optional[_Union[TrackDescriptor, _Mapping]] = ...) -> None: ...

class TrackDescriptor(_message.Message):
    __slots__ = ("uuid", "name", "parent_uuid", "counter", "child_ordering", "sibling_order_rank", "description")
    class ChildTracksOrdering(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNKNOWN: _ClassVar[TrackDescriptor.ChildTracksOrdering]
        LEXICOGRAPHIC: _ClassVar[TrackDescriptor.ChildTracksOrdering]
        CHRONOLOGICAL: _ClassVar[TrackDescriptor.ChildTracksOrdering]
        EXPLICIT: _ClassVar[TrackDescriptor.ChildTracksOrdering]
    UNKNOWN: TrackDescriptor.ChildTracksOrdering
    LEXICOGRAPHIC: TrackDescriptor.ChildTracksOrdering
    CHRONOLOGICAL: TrackDescriptor.ChildTracksOrdering
    EXPLICIT: TrackDescriptor.ChildTracksOrdering
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARENT_UUID_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    CHILD_ORDERING_FIELD_NUMBER: _ClassVar[int]
    SIBLING_ORDER_RANK_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    uuid: int
    name: str
    parent_uuid: int
    counter: CounterDescriptor
    child_ordering: TrackDescriptor.ChildTracksOrdering
    sibling_order_rank: int
    description: str
    def __init__(self, uuid: _Optional[int] = ..., name: _Optional[str] = ..., parent_uuid: _Optional[int] = ..., counter: _Optional[_Union[CounterDescriptor, _Mapping]] = ..., child_ordering: _Optional[_Union[TrackDescriptor.ChildTracksOrdering, str]] = ..., sibling_order_rank: _Optional[int] = ..., description: _Optional[str] = ...) -> None: ...

class CounterDescriptor(_message.Message):
    __slots__ = ("unit", "unit_name")
    class Unit(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNIT_UNSPECIFIED: _ClassVar[CounterDescriptor.Unit]
        UNIT_TIME_NS: _ClassVar[CounterDescriptor.Unit]
        UNIT_COUNT: _ClassVar[CounterDescriptor.Unit]
        UNIT_SIZE_BYTES: _ClassVar[CounterDescriptor.Unit]
    UNIT_UNSPECIFIED: CounterDescriptor.Unit
    UNIT_TIME_NS: CounterDescriptor.Unit
    UNIT_COUNT: CounterDescriptor.Unit
    UNIT_SIZE_BYTES: CounterDescriptor.Unit
    UNIT_FIELD_NUMBER: _ClassVar[int]
    UNIT_NAME_FIELD_NUMBER: _ClassVar[int]
    unit: CounterDescriptor.Unit
    unit_name: str
    def __init__(self, unit: _Optional[_Union[CounterDescriptor.Unit, str]] = ..., unit_name: _Optional[str] = ...) -> None: ...

class DebugAnnotation(_message.Message):
    __slots__ = ("name", "bool_value", "int_value", "double_value", "string_value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    DOUBLE_VALUE_FIELD_NUMBER: _ClassVar[int]
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    bool_value: bool
    int_value: int
    double_value: float
    string_value: str
    def __init__(self, name: _Optional[str] = ..., bool_value: _Optional[bool] = ..., int_value: _Optional[int] = ..., double_value: _Optional[float] = ..., string_value: _Optional[str] = ...) -> None: ...

class TrackEvent(_message.Message):
    __slots__ = ("debug_annotations", "type", "track_uuid", "categories", "name", "double_counter_value", "flow_ids", "terminating_flow_ids")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TYPE_UNSPECIFIED: _ClassVar[TrackEvent.Type]
        TYPE_SLICE_BEGIN: _ClassVar[TrackEvent.Type]
        TYPE_SLICE_END: _ClassVar[TrackEvent.Type]
        TYPE_INSTANT: _ClassVar[TrackEvent.Type]
        TYPE_COUNTER: _ClassVar[TrackEvent.Type]
    TYPE_UNSPECIFIED: TrackEvent.Type
    TYPE_SLICE_BEGIN: TrackEvent.Type
    TYPE_SLICE_END: TrackEvent.Type
    TYPE_INSTANT: TrackEvent.Type
    TYPE_COUNTER: TrackEvent.Type
    DEBUG_ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TRACK_UUID_FIELD_NUMBER: _ClassVar[int]
    CATEGORIES_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DOUBLE_COUNTER_VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOW_IDS_FIELD_NUMBER: _ClassVar[int]
    TERMINATING_FLOW_IDS_FIELD_NUMBER: _ClassVar[int]
    debug_annotations: _containers.RepeatedCompositeFieldContainer[DebugAnnotation]
    type: TrackEvent.Type
    track_uuid: int
    categories: _containers.RepeatedScalarFieldContainer[str]
    name: str
    double_counter_value: float
    flow_ids: _containers.RepeatedScalarFieldContainer[int]
    terminating_flow_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, debug_annotations: _Optional[_Iterable[_Union[DebugAnnotation, _Mapping]]] = ..., type: _Optional[_Union[TrackEvent.Type, str]] = ..., track_uuid: _Optional[int] = ..., categories: _Optional[_Iterable[str]] = ..., name: _Optional[str] = ..., double_counter_value: _Optional[float] = ..., flow_ids: _Optional[_Iterable[int]] = ..., terminating_flow_ids: _Optional[_Iterable[int]] = ...) -> None: ...
