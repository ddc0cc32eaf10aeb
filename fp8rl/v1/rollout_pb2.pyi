from fp8rl.v1 import common_pb2 as _common_pb2
from fp8rl.v1 import weights_pb2 as _weights_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("id", "text", "token_ids", "chat")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    def __init__(self, id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "n", "sampling", "weight_version", "request_id", "return_routed_experts", "top_logprobs", "prompt_logprobs")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    n: int
    sampling: _common_pb2.SamplingParams
    weight_version: int
    request_id: str
    return_routed_experts: bool
    top_logprobs: int
    prompt_logprobs: bool
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., n: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., weight_version: _Optional[int] = ..., request_id: _Optional[str] = ..., return_routed_experts: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ...) -> None: ...

class TokenAlternatives(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("prompt_id", "sample_index", "prompt_token_ids", "token_ids", "logprobs", "text", "finish_reason", "weight_version", "routed_experts", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs", "cached_prompt_tokens")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    sample_index: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    finish_reason: str
    weight_version: int
    routed_experts: _common_pb2.RoutedExperts
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenAlternatives]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenAlternatives]
    cached_prompt_tokens: int
    def __init__(self, prompt_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., weight_version: _Optional[int] = ..., routed_experts: _Optional[_Union[_common_pb2.RoutedExperts, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenAlternatives, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[TokenAlternatives, _Mapping]]] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("completions", "weight_version", "usage")
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    weight_version: int
    usage: Usage
    def __init__(self, completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., weight_version: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("model", "recipe", "engine", "device", "weight_version", "requests_in_flight", "tokens_generated", "uptime_s", "weight_format", "needs_keyframe", "registration_proof", "weight_epoch", "http_address", "segment_inbox", "tcp_updates_port", "tcp_updates_tls", "weight_transfer", "weight_transfer_ranks")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    NEEDS_KEYFRAME_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_PROOF_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_INBOX_FIELD_NUMBER: _ClassVar[int]
    TCP_UPDATES_PORT_FIELD_NUMBER: _ClassVar[int]
    TCP_UPDATES_TLS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSFER_RANKS_FIELD_NUMBER: _ClassVar[int]
    model: str
    recipe: str
    engine: str
    device: str
    weight_version: int
    requests_in_flight: int
    tokens_generated: int
    uptime_s: float
    weight_format: str
    needs_keyframe: bool
    registration_proof: str
    weight_epoch: int
    http_address: str
    segment_inbox: str
    tcp_updates_port: int
    tcp_updates_tls: bool
    weight_transfer: str
    weight_transfer_ranks: int
    def __init__(self, model: _Optional[str] = ..., recipe: _Optional[str] = ..., engine: _Optional[str] = ..., device: _Optional[str] = ..., weight_version: _Optional[int] = ..., requests_in_flight: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., uptime_s: _Optional[float] = ..., weight_format: _Optional[str] = ..., needs_keyframe: _Optional[bool] = ..., registration_proof: _Optional[str] = ..., weight_epoch: _Optional[int] = ..., http_address: _Optional[str] = ..., segment_inbox: _Optional[str] = ..., tcp_updates_port: _Optional[int] = ..., tcp_updates_tls: _Optional[bool] = ..., weight_transfer: _Optional[str] = ..., weight_transfer_ranks: _Optional[int] = ...) -> None: ...
