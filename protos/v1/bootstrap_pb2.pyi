from protos.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_EVENT_TYPE_UNSPECIFIED: _ClassVar[WorkerEventType]
    WORKER_EVENT_TYPE_JOINED: _ClassVar[WorkerEventType]
    WORKER_EVENT_TYPE_UPDATED: _ClassVar[WorkerEventType]
    WORKER_EVENT_TYPE_LEFT: _ClassVar[WorkerEventType]
    WORKER_EVENT_TYPE_SYNCED: _ClassVar[WorkerEventType]
WORKER_EVENT_TYPE_UNSPECIFIED: WorkerEventType
WORKER_EVENT_TYPE_JOINED: WorkerEventType
WORKER_EVENT_TYPE_UPDATED: WorkerEventType
WORKER_EVENT_TYPE_LEFT: WorkerEventType
WORKER_EVENT_TYPE_SYNCED: WorkerEventType

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "model", "kv_layout", "grpc_address", "metrics_address", "transfer_endpoint", "load", "local_prefill", "lora_adapters")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _common_pb2.WorkerRole
    model: str
    kv_layout: _common_pb2.KVLayout
    grpc_address: str
    metrics_address: str
    transfer_endpoint: _common_pb2.TransferEndpoint
    load: _common_pb2.WorkerLoad
    local_prefill: bool
    lora_adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.LoraAdapterRef]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., model: _Optional[str] = ..., kv_layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., grpc_address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., transfer_endpoint: _Optional[_Union[_common_pb2.TransferEndpoint, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., local_prefill: _Optional[bool] = ..., lora_adapters: _Optional[_Iterable[_Union[_common_pb2.LoraAdapterRef, _Mapping]]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "ttl_seconds", "heartbeat_interval_seconds")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_seconds: float
    heartbeat_interval_seconds: float
    def __init__(self, lease_id: _Optional[str] = ..., ttl_seconds: _Optional[float] = ..., heartbeat_interval_seconds: _Optional[float] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("worker_id", "lease")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease: Lease
    def __init__(self, worker_id: _Optional[str] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("lease_id", "load", "lora_adapters")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    load: _common_pb2.WorkerLoad
    lora_adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.LoraAdapterRef]
    def __init__(self, lease_id: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., lora_adapters: _Optional[_Iterable[_Union[_common_pb2.LoraAdapterRef, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("role", "model")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.WorkerRole
    model: str
    def __init__(self, role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., model: _Optional[str] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("role", "model")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.WorkerRole
    model: str
    def __init__(self, role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., model: _Optional[str] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("type", "worker", "reason")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    type: WorkerEventType
    worker: WorkerInfo
    reason: str
    def __init__(self, type: _Optional[_Union[WorkerEventType, str]] = ..., worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...
