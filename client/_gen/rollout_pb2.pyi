from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop_token_ids", "ignore_eos", "top_logprobs", "raw_logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RAW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    top_logprobs: int
    raw_logprobs: bool
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., raw_logprobs: _Optional[bool] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "prompt_text", "params", "n", "request_id", "group_id", "metadata", "return_text", "final_only")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    RETURN_TEXT_FIELD_NUMBER: _ClassVar[int]
    FINAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    params: SamplingParams
    n: int
    request_id: str
    group_id: str
    metadata: _containers.ScalarMap[str, str]
    return_text: bool
    final_only: bool
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., n: _Optional[int] = ..., request_id: _Optional[str] = ..., group_id: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., return_text: _Optional[bool] = ..., final_only: _Optional[bool] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "raw_logprobs", "top_logprobs", "policy_version", "drafter_version")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RAW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    raw_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    policy_version: str
    drafter_version: str
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., raw_logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., policy_version: _Optional[str] = ..., drafter_version: _Optional[str] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("policy_version", "drafter_version", "start", "end")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    policy_version: str
    drafter_version: str
    start: int
    end: int
    def __init__(self, policy_version: _Optional[str] = ..., drafter_version: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class SpecStats(_message.Message):
    __slots__ = ("num_steps", "tokens_per_step", "strategy")
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    num_steps: int
    tokens_per_step: float
    strategy: str
    def __init__(self, num_steps: _Optional[int] = ..., tokens_per_step: _Optional[float] = ..., strategy: _Optional[str] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("index", "rollout_id", "finish_reason", "num_prompt_tokens", "num_output_tokens", "version_spans", "spec", "text")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    index: int
    rollout_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    spec: SpecStats
    text: str
    def __init__(self, index: _Optional[int] = ..., rollout_id: _Optional[str] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., spec: _Optional[_Union[SpecStats, _Mapping]] = ..., text: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: TokenChunk
    final: Final
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "all")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    all: bool
    def __init__(self, request_id: _Optional[str] = ..., all: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted: _Optional[_Iterable[str]] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    def __init__(self, mode: _Optional[str] = ...) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("paused", "aborted")
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    aborted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, paused: _Optional[bool] = ..., aborted: _Optional[_Iterable[str]] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("paused",)
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    def __init__(self, paused: _Optional[bool] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "sha256", "digest", "encoding")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    sha256: str
    digest: str
    encoding: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., sha256: _Optional[str] = ..., digest: _Optional[str] = ..., encoding: _Optional[str] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("role", "version", "dtype", "tensors", "mode", "cast", "checksum", "base_version")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CAST_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    role: str
    version: str
    dtype: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    mode: str
    cast: bool
    checksum: str
    base_version: str
    def __init__(self, role: _Optional[str] = ..., version: _Optional[str] = ..., dtype: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., mode: _Optional[str] = ..., cast: _Optional[bool] = ..., checksum: _Optional[str] = ..., base_version: _Optional[str] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: WeightManifest
    chunk: WeightChunk
    def __init__(self, manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., chunk: _Optional[_Union[WeightChunk, _Mapping]] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("role", "version", "path", "mode", "cast")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CAST_FIELD_NUMBER: _ClassVar[int]
    role: str
    version: str
    path: str
    mode: str
    cast: bool
    def __init__(self, role: _Optional[str] = ..., version: _Optional[str] = ..., path: _Optional[str] = ..., mode: _Optional[str] = ..., cast: _Optional[bool] = ...) -> None: ...

class WeightsReply(_message.Message):
    __slots__ = ("role", "version", "bytes", "seconds", "swap_seconds", "wait_seconds", "aborted")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    role: str
    version: str
    bytes: int
    seconds: float
    swap_seconds: float
    wait_seconds: float
    aborted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, role: _Optional[str] = ..., version: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., swap_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., aborted: _Optional[_Iterable[str]] = ...) -> None: ...

class ReportRewardsRequest(_message.Message):
    __slots__ = ("rewards",)
    class RewardsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    rewards: _containers.ScalarMap[str, float]
    def __init__(self, rewards: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ReportRewardsResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("model", "model_path", "policy_version", "drafter_version", "num_running", "num_waiting", "paused", "spec_strategy", "mean_accepted_length", "ready", "vocab_size", "max_model_len", "dtype", "drafter", "eos_token_id", "max_waiting_seqs", "max_pending_tokens", "num_pending_tokens", "backend", "capabilities")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    SPEC_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_path: str
    policy_version: str
    drafter_version: str
    num_running: int
    num_waiting: int
    paused: bool
    spec_strategy: str
    mean_accepted_length: float
    ready: bool
    vocab_size: int
    max_model_len: int
    dtype: str
    drafter: str
    eos_token_id: int
    max_waiting_seqs: int
    max_pending_tokens: int
    num_pending_tokens: int
    backend: str
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., model_path: _Optional[str] = ..., policy_version: _Optional[str] = ..., drafter_version: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., paused: _Optional[bool] = ..., spec_strategy: _Optional[str] = ..., mean_accepted_length: _Optional[float] = ..., ready: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., dtype: _Optional[str] = ..., drafter: _Optional[str] = ..., eos_token_id: _Optional[int] = ..., max_waiting_seqs: _Optional[int] = ..., max_pending_tokens: _Optional[int] = ..., num_pending_tokens: _Optional[int] = ..., backend: _Optional[str] = ..., capabilities: _Optional[_Iterable[str]] = ...) -> None: ...

class RolloutPayload(_message.Message):
    __slots__ = ("rollout_id", "request_id", "index", "group_id", "prompt_token_ids", "output_token_ids", "logprobs", "raw_logprobs", "version_spans", "finish_reason", "policy_version", "drafter_version", "metadata", "created_at", "finished_at", "params", "top_k", "top_token_ids", "top_logprobs")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RAW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    request_id: str
    index: int
    group_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    raw_logprobs: _containers.RepeatedScalarFieldContainer[float]
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    finish_reason: str
    policy_version: str
    drafter_version: str
    metadata: _containers.ScalarMap[str, str]
    created_at: float
    finished_at: float
    params: SamplingParams
    top_k: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rollout_id: _Optional[str] = ..., request_id: _Optional[str] = ..., index: _Optional[int] = ..., group_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., raw_logprobs: _Optional[_Iterable[float]] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., policy_version: _Optional[str] = ..., drafter_version: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., created_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., top_k: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class RewardRecord(_message.Message):
    __slots__ = ("rollout_id", "reward", "reported_at")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REPORTED_AT_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    reward: float
    reported_at: float
    def __init__(self, rollout_id: _Optional[str] = ..., reward: _Optional[float] = ..., reported_at: _Optional[float] = ...) -> None: ...

class SpoolRecord(_message.Message):
    __slots__ = ("rollout", "reward")
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    rollout: RolloutPayload
    reward: RewardRecord
    def __init__(self, rollout: _Optional[_Union[RolloutPayload, _Mapping]] = ..., reward: _Optional[_Union[RewardRecord, _Mapping]] = ...) -> None: ...
