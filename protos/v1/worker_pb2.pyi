from protos.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_STORED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_REMOVED: _ClassVar[KvEventKind]

class KvMedium(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_MEDIUM_UNSPECIFIED: _ClassVar[KvMedium]
    KV_MEDIUM_DEVICE: _ClassVar[KvMedium]
    KV_MEDIUM_STORE: _ClassVar[KvMedium]
KV_EVENT_KIND_UNSPECIFIED: KvEventKind
KV_EVENT_KIND_STORED: KvEventKind
KV_EVENT_KIND_REMOVED: KvEventKind
KV_MEDIUM_UNSPECIFIED: KvMedium
KV_MEDIUM_DEVICE: KvMedium
KV_MEDIUM_STORE: KvMedium

class GetImageDropRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ImageDropInfo(_message.Message):
    __slots__ = ("port",)
    PORT_FIELD_NUMBER: _ClassVar[int]
    port: int
    def __init__(self, port: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("room", "prompt_token_ids", "sampling", "prefill_address", "images", "lora_adapter", "carried_tokens", "image_ticket")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CARRIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TICKET_FIELD_NUMBER: _ClassVar[int]
    room: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    prefill_address: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    lora_adapter: str
    carried_tokens: int
    image_ticket: bytes
    def __init__(self, room: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefill_address: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ..., lora_adapter: _Optional[str] = ..., carried_tokens: _Optional[int] = ..., image_ticket: _Optional[bytes] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("outputs", "finish_reason", "usage", "token_ids", "token_texts")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenOutput]
    finish_reason: _common_pb2.FinishReason
    usage: Usage
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, outputs: _Optional[_Iterable[_Union[_common_pb2.TokenOutput, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., token_texts: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("room",)
    ROOM_FIELD_NUMBER: _ClassVar[int]
    room: str
    def __init__(self, room: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found", "page_checksums", "tp_size")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    PAGE_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    page_checksums: _containers.RepeatedScalarFieldContainer[int]
    tp_size: int
    def __init__(self, found: _Optional[bool] = ..., page_checksums: _Optional[_Iterable[int]] = ..., tp_size: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("room", "prompt_token_ids", "sampling", "dst_page_ids", "dst", "decode_worker_id", "model", "grant", "page_checksums", "skip_pages", "images", "speculative", "lora_adapter", "carried_tokens", "lora_adapter_key")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DST_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    PAGE_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    SKIP_PAGES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CARRIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_KEY_FIELD_NUMBER: _ClassVar[int]
    room: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    dst_page_ids: _containers.RepeatedScalarFieldContainer[int]
    dst: _common_pb2.TransferEndpoint
    decode_worker_id: str
    model: str
    grant: bytes
    page_checksums: bool
    skip_pages: int
    images: _containers.RepeatedScalarFieldContainer[bytes]
    speculative: SpeculativeConfig
    lora_adapter: str
    carried_tokens: int
    lora_adapter_key: str
    def __init__(self, room: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., dst_page_ids: _Optional[_Iterable[int]] = ..., dst: _Optional[_Union[_common_pb2.TransferEndpoint, _Mapping]] = ..., decode_worker_id: _Optional[str] = ..., model: _Optional[str] = ..., grant: _Optional[bytes] = ..., page_checksums: _Optional[bool] = ..., skip_pages: _Optional[int] = ..., images: _Optional[_Iterable[bytes]] = ..., speculative: _Optional[_Union[SpeculativeConfig, _Mapping]] = ..., lora_adapter: _Optional[str] = ..., carried_tokens: _Optional[int] = ..., lora_adapter_key: _Optional[str] = ...) -> None: ...

class SpeculativeConfig(_message.Message):
    __slots__ = ("algorithm", "num_draft_tokens", "num_steps", "eagle_topk")
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    EAGLE_TOPK_FIELD_NUMBER: _ClassVar[int]
    algorithm: str
    num_draft_tokens: int
    num_steps: int
    eagle_topk: int
    def __init__(self, algorithm: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., num_steps: _Optional[int] = ..., eagle_topk: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "num_pages_written", "bytes_transferred", "transfer_seconds", "page_checksums", "tp_size", "num_pages_skipped")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAGE_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    first_token: _common_pb2.TokenOutput
    num_pages_written: int
    bytes_transferred: int
    transfer_seconds: float
    page_checksums: _containers.RepeatedScalarFieldContainer[int]
    tp_size: int
    num_pages_skipped: int
    def __init__(self, first_token: _Optional[_Union[_common_pb2.TokenOutput, _Mapping]] = ..., num_pages_written: _Optional[int] = ..., bytes_transferred: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., page_checksums: _Optional[_Iterable[int]] = ..., tp_size: _Optional[int] = ..., num_pages_skipped: _Optional[int] = ...) -> None: ...

class KvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("kind", "page_hashes", "medium")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    kind: KvEventKind
    page_hashes: _containers.RepeatedScalarFieldContainer[int]
    medium: KvMedium
    def __init__(self, kind: _Optional[_Union[KvEventKind, str]] = ..., page_hashes: _Optional[_Iterable[int]] = ..., medium: _Optional[_Union[KvMedium, str]] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("snapshot", "events", "page_size", "store", "oldest_event_unix_s")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    OLDEST_EVENT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    page_size: int
    store: str
    oldest_event_unix_s: float
    def __init__(self, snapshot: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., page_size: _Optional[int] = ..., store: _Optional[str] = ..., oldest_event_unix_s: _Optional[float] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelFile(_message.Message):
    __slots__ = ("name", "content")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    content: bytes
    def __init__(self, name: _Optional[str] = ..., content: _Optional[bytes] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("served_model_name", "context_length", "files", "files_sha256", "tool_call_parser", "reasoning_parser")
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    FILES_SHA256_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_PARSER_FIELD_NUMBER: _ClassVar[int]
    REASONING_PARSER_FIELD_NUMBER: _ClassVar[int]
    served_model_name: str
    context_length: int
    files: _containers.RepeatedCompositeFieldContainer[ModelFile]
    files_sha256: str
    tool_call_parser: str
    reasoning_parser: str
    def __init__(self, served_model_name: _Optional[str] = ..., context_length: _Optional[int] = ..., files: _Optional[_Iterable[_Union[ModelFile, _Mapping]]] = ..., files_sha256: _Optional[str] = ..., tool_call_parser: _Optional[str] = ..., reasoning_parser: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoraAdapters(_message.Message):
    __slots__ = ("names", "adapters")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.LoraAdapterRef]
    def __init__(self, names: _Optional[_Iterable[str]] = ..., adapters: _Optional[_Iterable[_Union[_common_pb2.LoraAdapterRef, _Mapping]]] = ...) -> None: ...
