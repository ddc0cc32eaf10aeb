from fp8rl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sample(_message.Message):
    __slots__ = ("prompt_token_ids", "completion_token_ids", "gen_logprobs", "reward", "group_id", "advantage", "routed_experts", "loss_mask")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    gen_logprobs: _containers.RepeatedScalarFieldContainer[float]
    reward: float
    group_id: str
    advantage: float
    routed_experts: _common_pb2.RoutedExperts
    loss_mask: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., gen_logprobs: _Optional[_Iterable[float]] = ..., reward: _Optional[float] = ..., group_id: _Optional[str] = ..., advantage: _Optional[float] = ..., routed_experts: _Optional[_Union[_common_pb2.RoutedExperts, _Mapping]] = ..., loss_mask: _Optional[_Iterable[bool]] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("run_id", "step", "samples", "sampling")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    sampling: _common_pb2.SamplingParams
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class TrainMetrics(_message.Message):
    __slots__ = ("loss", "grad_norm", "learning_rate", "tokens_per_s", "token_mult_prob_error", "gen_kl_error", "is_weight_mean", "is_weight_min", "is_weight_max", "is_clipped_fraction", "max_seq_mult_prob_error", "num_tokens", "num_samples", "train_s", "ppo_clipped_fraction", "reward_mean", "out_of_support_fraction", "abs_log_ratio_counts", "is_weight_counts", "routing_mismatch", "routing_mismatch_positions")
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MULT_PROB_ERROR_FIELD_NUMBER: _ClassVar[int]
    GEN_KL_ERROR_FIELD_NUMBER: _ClassVar[int]
    IS_WEIGHT_MEAN_FIELD_NUMBER: _ClassVar[int]
    IS_WEIGHT_MIN_FIELD_NUMBER: _ClassVar[int]
    IS_WEIGHT_MAX_FIELD_NUMBER: _ClassVar[int]
    IS_CLIPPED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_MULT_PROB_ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRAIN_S_FIELD_NUMBER: _ClassVar[int]
    PPO_CLIPPED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    OUT_OF_SUPPORT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ABS_LOG_RATIO_COUNTS_FIELD_NUMBER: _ClassVar[int]
    IS_WEIGHT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_MISMATCH_FIELD_NUMBER: _ClassVar[int]
    ROUTING_MISMATCH_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    loss: float
    grad_norm: float
    learning_rate: float
    tokens_per_s: float
    token_mult_prob_error: float
    gen_kl_error: float
    is_weight_mean: float
    is_weight_min: float
    is_weight_max: float
    is_clipped_fraction: float
    max_seq_mult_prob_error: float
    num_tokens: int
    num_samples: int
    train_s: float
    ppo_clipped_fraction: float
    reward_mean: float
    out_of_support_fraction: float
    abs_log_ratio_counts: _containers.RepeatedScalarFieldContainer[int]
    is_weight_counts: _containers.RepeatedScalarFieldContainer[int]
    routing_mismatch: float
    routing_mismatch_positions: float
    def __init__(self, loss: _Optional[float] = ..., grad_norm: _Optional[float] = ..., learning_rate: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., token_mult_prob_error: _Optional[float] = ..., gen_kl_error: _Optional[float] = ..., is_weight_mean: _Optional[float] = ..., is_weight_min: _Optional[float] = ..., is_weight_max: _Optional[float] = ..., is_clipped_fraction: _Optional[float] = ..., max_seq_mult_prob_error: _Optional[float] = ..., num_tokens: _Optional[int] = ..., num_samples: _Optional[int] = ..., train_s: _Optional[float] = ..., ppo_clipped_fraction: _Optional[float] = ..., reward_mean: _Optional[float] = ..., out_of_support_fraction: _Optional[float] = ..., abs_log_ratio_counts: _Optional[_Iterable[int]] = ..., is_weight_counts: _Optional[_Iterable[int]] = ..., routing_mismatch: _Optional[float] = ..., routing_mismatch_positions: _Optional[float] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("step", "weight_version", "metrics", "replayed", "skipped")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    step: int
    weight_version: int
    metrics: TrainMetrics
    replayed: bool
    skipped: StepSkipped
    def __init__(self, step: _Optional[int] = ..., weight_version: _Optional[int] = ..., metrics: _Optional[_Union[TrainMetrics, _Mapping]] = ..., replayed: _Optional[bool] = ..., skipped: _Optional[_Union[StepSkipped, _Mapping]] = ...) -> None: ...

class StepSkipped(_message.Message):
    __slots__ = ("reason", "detail")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[StepSkipped.Reason]
        REASON_NON_FINITE_GRADIENT: _ClassVar[StepSkipped.Reason]
    REASON_UNSPECIFIED: StepSkipped.Reason
    REASON_NON_FINITE_GRADIENT: StepSkipped.Reason
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    reason: StepSkipped.Reason
    detail: str
    def __init__(self, reason: _Optional[_Union[StepSkipped.Reason, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("prompt_token_ids", "completion_token_ids")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ComputeLogprobsRequest(_message.Message):
    __slots__ = ("sequences", "sampling")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    sampling: _common_pb2.SamplingParams
    def __init__(self, sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class SequenceLogprobs(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ComputeLogprobsResponse(_message.Message):
    __slots__ = ("results", "weight_version")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SequenceLogprobs]
    weight_version: int
    def __init__(self, results: _Optional[_Iterable[_Union[SequenceLogprobs, _Mapping]]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class PublishTarget(_message.Message):
    __slots__ = ("address", "held_version", "proof")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HELD_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    address: str
    held_version: int
    proof: str
    def __init__(self, address: _Optional[str] = ..., held_version: _Optional[int] = ..., proof: _Optional[str] = ...) -> None: ...

class PublishWeightsRequest(_message.Message):
    __slots__ = ("version", "targets")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    version: int
    targets: _containers.RepeatedCompositeFieldContainer[PublishTarget]
    def __init__(self, version: _Optional[int] = ..., targets: _Optional[_Iterable[_Union[PublishTarget, _Mapping]]] = ...) -> None: ...

class PublishResult(_message.Message):
    __slots__ = ("address", "ok", "encoding", "wire_bytes", "density", "seconds", "error", "plane", "apply_s")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DENSITY_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    APPLY_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    ok: bool
    encoding: str
    wire_bytes: int
    density: float
    seconds: float
    error: str
    plane: str
    apply_s: float
    def __init__(self, address: _Optional[str] = ..., ok: _Optional[bool] = ..., encoding: _Optional[str] = ..., wire_bytes: _Optional[int] = ..., density: _Optional[float] = ..., seconds: _Optional[float] = ..., error: _Optional[str] = ..., plane: _Optional[str] = ..., apply_s: _Optional[float] = ...) -> None: ...

class PublishWeightsResponse(_message.Message):
    __slots__ = ("version", "results")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    results: _containers.RepeatedCompositeFieldContainer[PublishResult]
    def __init__(self, version: _Optional[int] = ..., results: _Optional[_Iterable[_Union[PublishResult, _Mapping]]] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("model", "recipe", "backend", "device", "step", "weight_version", "uptime_s", "run_id", "checkpoint_failures", "checkpoint_pending", "last_checkpoint_step")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PENDING_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    model: str
    recipe: str
    backend: str
    device: str
    step: int
    weight_version: int
    uptime_s: float
    run_id: str
    checkpoint_failures: int
    checkpoint_pending: bool
    last_checkpoint_step: int
    def __init__(self, model: _Optional[str] = ..., recipe: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., uptime_s: _Optional[float] = ..., run_id: _Optional[str] = ..., checkpoint_failures: _Optional[int] = ..., checkpoint_pending: _Optional[bool] = ..., last_checkpoint_step: _Optional[int] = ...) -> None: ...
