from protos.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("room", "model", "images", "image_rows", "dst_endpoint", "dst_page_ids", "grant")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ROWS_FIELD_NUMBER: _ClassVar[int]
    DST_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DST_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    room: str
    model: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    image_rows: _containers.RepeatedScalarFieldContainer[int]
    dst_endpoint: _common_pb2.TransferEndpoint
    dst_page_ids: _containers.RepeatedScalarFieldContainer[int]
    grant: bytes
    def __init__(self, room: _Optional[str] = ..., model: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ..., image_rows: _Optional[_Iterable[int]] = ..., dst_endpoint: _Optional[_Union[_common_pb2.TransferEndpoint, _Mapping]] = ..., dst_page_ids: _Optional[_Iterable[int]] = ..., grant: _Optional[bytes] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("page_checksums", "embedding_bytes")
    PAGE_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_BYTES_FIELD_NUMBER: _ClassVar[int]
    page_checksums: _containers.RepeatedScalarFieldContainer[int]
    embedding_bytes: int
    def __init__(self, page_checksums: _Optional[_Iterable[int]] = ..., embedding_bytes: _Optional[int] = ...) -> None: ...
