from protos.v1 import bootstrap_pb2 as _bootstrap_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StoredWorker(_message.Message):
    __slots__ = ("worker", "lease_token", "left_reason")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEFT_REASON_FIELD_NUMBER: _ClassVar[int]
    worker: _bootstrap_pb2.WorkerInfo
    lease_token: str
    left_reason: str
    def __init__(self, worker: _Optional[_Union[_bootstrap_pb2.WorkerInfo, _Mapping]] = ..., lease_token: _Optional[str] = ..., left_reason: _Optional[str] = ...) -> None: ...
