from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightHeader(_message.Message):
    __slots__ = ("version", "base_version", "encoding", "total_bytes", "digest", "format", "recipe", "epoch", "signature", "part", "parts")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    base_version: int
    encoding: str
    total_bytes: int
    digest: str
    format: str
    recipe: str
    epoch: int
    signature: str
    part: int
    parts: int
    def __init__(self, version: _Optional[int] = ..., base_version: _Optional[int] = ..., encoding: _Optional[str] = ..., total_bytes: _Optional[int] = ..., digest: _Optional[str] = ..., format: _Optional[str] = ..., recipe: _Optional[str] = ..., epoch: _Optional[int] = ..., signature: _Optional[str] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ...) -> None: ...

class SharedSegment(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    def __init__(self, token: _Optional[bytes] = ...) -> None: ...

class TcpPart(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    def __init__(self, ticket: _Optional[bytes] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("header", "data", "shared", "tcp")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    TCP_FIELD_NUMBER: _ClassVar[int]
    header: WeightHeader
    data: bytes
    shared: SharedSegment
    tcp: TcpPart
    def __init__(self, header: _Optional[_Union[WeightHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., shared: _Optional[_Union[SharedSegment, _Mapping]] = ..., tcp: _Optional[_Union[TcpPart, _Mapping]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "encoding", "bytes_received", "tensors_updated", "apply_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TENSORS_UPDATED_FIELD_NUMBER: _ClassVar[int]
    APPLY_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    encoding: str
    bytes_received: int
    tensors_updated: int
    apply_s: float
    def __init__(self, version: _Optional[int] = ..., encoding: _Optional[str] = ..., bytes_received: _Optional[int] = ..., tensors_updated: _Optional[int] = ..., apply_s: _Optional[float] = ...) -> None: ...

class WeightTransferJoin(_message.Message):
    __slots__ = ("master_address", "master_port", "rank_offset", "world_size", "backend", "timeout_s")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str
    timeout_s: float
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WeightTransferJoined(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: int
    def __init__(self, ranks: _Optional[int] = ...) -> None: ...

class DeviceUpdate(_message.Message):
    __slots__ = ("header", "plan")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    header: WeightHeader
    plan: bytes
    def __init__(self, header: _Optional[_Union[WeightHeader, _Mapping]] = ..., plan: _Optional[bytes] = ...) -> None: ...

class DeviceUpdateReply(_message.Message):
    __slots__ = ("receiving", "applied")
    RECEIVING_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    receiving: bool
    applied: UpdateWeightsResponse
    def __init__(self, receiving: _Optional[bool] = ..., applied: _Optional[_Union[UpdateWeightsResponse, _Mapping]] = ...) -> None: ...
