"""Frozen dataclasses that cross module and process boundaries.

Between processes these travel as `dsv4.v1` protos; `dsv4.wire` is the only converter. Inside
a process every module passes these types, never `_pb2` objects or `dict[str, Any]`.
Enum values equal the strings used in `ServeConfig` (`TransportKind(cfg.transfer.transport)`).
Times are wall-clock Unix epoch milliseconds (`*_unix_ms`) or durations (`*_ms`, `*_s`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dsv4.logits_rules import LogitsRules


class FinishReason(enum.Enum):
    """Why a stream ended normally (errors end it with a status instead)."""

    STOP = "stop"  # end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens reached or the context is full
    ABORT = "abort"  # cancelled through an Abort call


class WorkerRole(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # one engine doing both: the single-engine baseline


class TransportKind(enum.Enum):
    """How KV bytes move from a prefill to a decode worker."""

    NIXL = "nixl"  # UCX: RDMA READ between hosts, CMA/shared memory on CPU
    CUDA_IPC = "cuda_ipc"  # CUDA IPC memory handles on one host
    LOCAL = "local"  # in-process copy (tests, colocated engine)


class PullFailurePolicy(enum.Enum):
    """What a decode worker does when pulling KV fails."""

    RECOMPUTE = "recompute"  # prefill the prompt locally and continue
    FAIL = "fail"  # end the stream with UNAVAILABLE


# The most top logprobs a request may ask per generated (or prompt) token (vLLM's default
# max_logprobs, OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams(LogitsRules):
    """Sampling and stopping controls with every default filled in (validated by dsv4.wire)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]; 1 = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256
    seed: int | None = None  # None = random
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # off
    frequency_penalty: float = 0.0  # off
    repetition_penalty: float = 1.0  # off
    # (token id, bias) pairs by token id, added to those logits before sampling; () = off
    logit_bias: tuple[tuple[int, float], ...] = ()
    # each generated token's logprob and the N most likely at its position (`TokenLogprobs`),
    # N in [0, MAX_LOGPROBS]; None = off
    logprobs: int | None = None
    # each prompt token's logprob given the tokens before it and the N most likely there, for
    # positions 1.. (`PromptLogprobs`), N in [0, MAX_LOGPROBS]; None = off. The prefill runs
    # the head over every prompt position for it: it never shifts or needs the sampled row.
    prompt_logprobs: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One generated token's log-probabilities: log_softmax of the model's raw logits at its
    position (before temperature, penalties, logit_bias, top-k and top-p: vLLM's default
    `raw_logprobs`)."""

    logprob: float  # the generated token's
    top: tuple[tuple[int, float], ...] = ()  # the N most likely (token id, logprob), best first
    rank: int | None = None  # 1 = the most likely (tokens at least as likely); prompt tokens'


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """A prompt's log-probabilities (`SamplingParams.prompt_logprobs`), sent once with the first
    generated token: position p's token given the tokens before it, for p >= 1 (position 0 has
    no context, so none: vLLM's null first entry)."""

    token_ids: tuple[int, ...]  # the prompt, position 0 first
    positions: tuple[TokenLogprobs, ...]  # one per position from 1: len(token_ids) - 1


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A validated, tokenized request: what the router forwards and engines schedule."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    priority: int = 0  # larger is scheduled first
    deadline_unix_ms: int | None = None  # None = no deadline

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class Usage:
    """Accounting for one request, sent with the last StreamChunk (fields as in common.proto)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0  # includes the first token
    time_to_first_token_ms: float = 0.0
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    kv_transfer_bytes: int = 0
    kv_transfer_ms: float = 0.0
    prefill_queue_ms: float = 0.0
    prefill_compute_ms: float = 0.0
    num_prefill_retries: int = 0
    prefill_was_recomputed: bool = False
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """One message of a Generate (router) or Decode (worker) stream."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: FinishReason | None = None  # set on the last chunk only
    usage: Usage | None = None  # set on the last chunk only
    # one per token_ids entry when the request asked (SamplingParams.logprobs), else ()
    logprobs: tuple[TokenLogprobs, ...] = ()
    # when the request asked (SamplingParams.prompt_logprobs): on the first token's chunk only
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class KVLayoutInfo:
    """Summary of a worker's packed KV layout; P and D pair only when compat_hash is equal."""

    version: int
    compat_hash: str
    block_stride_bytes: int  # bytes of one packed block, all layers
    block_size_tokens: int


@dataclass(frozen=True, slots=True)
class KVHandle:
    """Where a prompt's KV lives on a prefill worker and the lease that keeps it alive."""

    request_id: str
    prefill_worker_id: str
    transport_kind: TransportKind
    transport_endpoint: str  # where D reaches P's transport agent, e.g. "10.0.0.5:5600"
    block_ids: tuple[int, ...]  # P's blocks, in token order
    layout_hash: str  # KVLayoutInfo.compat_hash of P's cache
    num_tokens: int
    lease_id: str
    lease_expires_at_unix_ms: int  # P's clock
    prefill_address: str = ""  # P's gRPC host:port, where D sends Release after the pull
    # Opaque, possibly large: NIXL agent metadata / CUDA IPC handles, serialized descriptors.
    transport_metadata: bytes = field(default=b"", repr=False)
    serialized_descriptors: bytes = field(default=b"", repr=False)

    def pull_window_s(self, pull_timeout_s: float, now_unix_s: float) -> float:
        """Seconds left to start a pull of up to `pull_timeout_s` that ends before the lease
        expires (negative: too late)."""
        return self.lease_expires_at_unix_ms / 1000.0 - now_unix_s - pull_timeout_s


@dataclass(frozen=True, slots=True)
class PrefillTimings:
    queue_ms: float = 0.0
    compute_ms: float = 0.0  # all chunks plus sampling the first token
    num_chunks: int = 0


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What PrefillWorker.Prefill answers: the first token and the KV under a lease."""

    first_token_id: int
    handle: KVHandle
    timings: PrefillTimings = PrefillTimings()
    first_token_text: str = ""  # empty when the worker does not detokenize
    first_token_logprobs: TokenLogprobs | None = None  # when the request asked for logprobs
    prompt_logprobs: PromptLogprobs | None = None  # when the request asked for them


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """Input of DecodeWorker.Decode. Without a handle (and first token) D prefills itself."""

    request: GenerateRequest
    first_token_id: int | None = None
    handle: KVHandle | None = None
    pull_failure_policy: PullFailurePolicy = PullFailurePolicy.RECOMPUTE

    @property
    def needs_local_prefill(self) -> bool:
        return self.handle is None


@dataclass(frozen=True, slots=True)
class ReleaseRequest:
    lease_id: str
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    was_found: bool
    num_freed_blocks: int = 0


@dataclass(frozen=True, slots=True)
class DrainStatus:
    """What a draining worker still has."""

    num_running_requests: int = 0
    num_leases: int = 0

    @property
    def is_idle(self) -> bool:
        return self.num_running_requests == 0 and self.num_leases == 0


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Identity and load of one worker: Info's answer and what discovery publishes."""

    worker_id: str
    role: WorkerRole
    address: str  # "host:port" the router dials
    transport_kind: TransportKind = TransportKind.LOCAL
    transport_endpoint: str = ""
    layout: KVLayoutInfo | None = None
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_queued_tokens: int = 0
    num_running_requests: int = 0
    num_leases: int = 0
    is_draining: bool = False
    model_name: str = ""
    vocab_size: int = 0
    max_model_len: int = 0
    updated_at_unix_ms: int = 0
    speculative_method: str = ""  # "none" | "mtp"; "" from workers that do not report it

    @property
    def layout_hash(self) -> str:
        return self.layout.compat_hash if self.layout is not None else ""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a deployment serves (Router.GetModelInfo)."""

    model_name: str
    vocab_size: int
    max_model_len: int
    max_new_tokens_limit: int
    eos_token_id: int
    bos_token_id: int = 0
    num_prefill_workers: int = 0
    num_decode_workers: int = 0
    speculative_method: str = "none"


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds that dsv4.wire enforces on incoming requests (from the model and the config)."""

    vocab_size: int
    max_model_len: int  # prompt + generated tokens
    max_new_tokens_limit: int = 0  # 0 = max_model_len
    default_max_new_tokens: int = 256  # used when the client leaves max_new_tokens unset
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_logit_bias: int = 300  # logit_bias entries (OpenAI's limit)
    max_logprobs: int = MAX_LOGPROBS  # top logprobs per generated or prompt token
    max_request_id_chars: int = 128

    @property
    def effective_max_new_tokens(self) -> int:
        return self.max_new_tokens_limit or self.max_model_len
