"""The frozen `ServeConfig` tree: one section per concern, each field declared with `setting`.

"auto" and 0-means-derive values are resolved by `dsv4.config.resolve.resolve_auto`, which
returns a new object. Components receive only their section.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dsv4.config.fields import Section, setting

KERNEL_BACKENDS = ("ref", "triton", "flashinfer")
RANDOM_PREFIX = "random:"
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
_ADDRESS = re.compile(r"[^\s:]+:\d{1,5}|\[[0-9a-fA-F:.]+\]:\d{1,5}")
PORT = {"min": 0, "max": 65535}
# Seeds are uint64, as torch generators take them and the wire's SamplingParams.seed holds them.
SEED_LIMIT = 1 << 64
# GiB of one device or host: a PiB is beyond any machine, and its byte counts stay well inside
# the float and int arithmetic of the plan (1e300 GiB overflowed it).
MAX_MEMORY_GIB = 1 << 20


@dataclass(frozen=True)
class ModelSection(Section):
    SECTION = "model"
    path: str = setting(
        "tiny",
        "checkpoint dir; 'tiny' (the random test model); 'random:DIR' (DIR's config.json and "
        "tokenizer, random weights drawn from model.seed on the device)",
        flag="--model",
    )
    tokenizer: str = setting("", "tokenizer.json file or dir; empty: the checkpoint's own")
    dtype: str = setting("auto", "activation dtype", choices=("auto", "bf16", "fp16", "fp32"))
    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    kernels: str = setting("auto", "kernel backend for every op", choices=("auto", "ref", "triton"))
    kernel_overrides: tuple[str, ...] = setting(
        (), "per-op backend, op=ref|triton|flashinfer (repeatable)", flag="--kernel-override"
    )
    max_model_len: int = setting(0, "prompt + output token limit; 0: the model's", min=0)
    tensor_parallel_size: int = setting(
        1, "rank processes per model replica (attention heads split over them; one GPU each "
        "on CUDA: cuda:0..T-1)", min=1, max=64,
    )  # fmt: skip
    expert_parallel: bool = setting(
        False, "with tensor_parallel_size > 1: routed experts live whole on one rank each "
        "(e mod T); off: every expert's intermediate dim is split over the ranks",
    )  # fmt: skip
    distributed_backend: str = setting(
        "auto", "collectives between the ranks; auto: nccl on CUDA, gloo on CPU (gloo on CUDA: "
        "several ranks may share one GPU, for correctness checks)",
        choices=("auto", "gloo", "nccl"),
    )  # fmt: skip
    collective_timeout_s: float = setting(
        60.0, "ranks of a replica: start-up rendezvous and every collective give up after this",
        min=1.0,
    )  # fmt: skip
    seed: int = setting(
        0, "seed of model init ('tiny') and default sampling", min=0, max=SEED_LIMIT - 1
    )
    host_memory_gib: float = setting(
        0.0, "pinned host memory (GiB) for routed experts the device cannot hold: the start-up "
        "plan offloads the fewest experts per layer that fit; 0: never offload", min=0,
        max=MAX_MEMORY_GIB,
    )  # fmt: skip
    device_memory_gib: float = setting(
        0.0, "device memory (GiB) the start-up plan may use; 0: the GPU's total (on CPU: no "
        "plan, unless set)", min=0, max=MAX_MEMORY_GIB,
    )  # fmt: skip
    expert_residency: str = setting(
        "", "with offload: per-layer expert order file (most used first; the first stay on the "
        "device); empty: experts 0..E-1 in order",
    )  # fmt: skip
    random_routing: str = setting(
        "uniform", "random models ('tiny', 'random:DIR'): router biases for uniform expert "
        "popularity, or zipf1 (popularity ~ 1/rank, for offload measurements)",
        choices=("uniform", "zipf1"),
    )  # fmt: skip

    def check(self) -> None:
        if not self.path.removeprefix(RANDOM_PREFIX).strip():  # "" read ./config.json
            self.fail("path", "give a checkpoint dir, random:DIR or tiny")
        if not _DEVICE.fullmatch(self.device):
            self.fail("device", "use auto, cpu, cuda or cuda:N")
        if self.host_memory_gib and self.tensor_parallel_size > 1:
            self.fail("host_memory_gib", "expert offload serves one rank: give 0 with "
                      "tensor_parallel_size > 1")  # fmt: skip
        if self.expert_residency and not Path(self.expert_residency).is_file():
            self.fail("expert_residency", "no such file: give a residency file or leave empty")
        for item in self.kernel_overrides:
            op, _, backend = item.partition("=")
            if not op or backend not in KERNEL_BACKENDS:
                self.fail("kernel_overrides", f"write op=backend, backend in {KERNEL_BACKENDS}")
        if self.random_routing != "uniform" and not self.is_random:
            self.fail("random_routing", "skews only random weights ('tiny', 'random:DIR'): "
                      "a checkpoint routes as trained, leave it uniform")  # fmt: skip

    @property
    def is_random(self) -> bool:
        """Weights drawn at random from `seed` (same in every process), not loaded."""
        return self.path == "tiny" or self.path.startswith(RANDOM_PREFIX)

    @property
    def model_dir(self) -> str:
        """The directory holding config.json / tokenizer.json ("" for "tiny")."""
        return "" if self.path == "tiny" else self.path.removeprefix(RANDOM_PREFIX)

    def backend_for(self, op: str) -> str:
        """The kernel backend of one op: its override if any, else `kernels`."""
        for item in self.kernel_overrides:
            name, _, backend = item.partition("=")
            if name == op:
                return backend
        return self.kernels


@dataclass(frozen=True)
class CacheSection(Section):
    SECTION = "cache"
    block_size: int = setting(256, "tokens per KV block, a multiple of 128", min=128, max=8192)
    kv_dtype: str = setting(
        "auto", "KV entry format; fp32: exact (served = reference)",
        choices=("auto", "fp8", "bf16", "fp32"),
    )  # fmt: skip
    indexer_key_dtype: str = setting(
        "mxfp4", "indexer key rows: mxfp4 (68 B, #48993), fp8 (132 B); bf16/fp32: exact",
        choices=("mxfp4", "fp8", "bf16", "fp32"),
    )  # fmt: skip
    memory_fraction: float = setting(0.9, "share of device memory for weights+KV", min=0.01, max=1)
    memory_budget_bytes: int = setting(0, "KV memory budget; 0: use memory_fraction", min=0)
    num_blocks: int = setting(0, "KV blocks; 0: derive from the memory budget", min=0)

    def check(self) -> None:
        if self.block_size % 128:
            self.fail("block_size", "use a multiple of 128 (whole C128 entries); 256 is standard")


@dataclass(frozen=True)
class SchedulerSection(Section):
    SECTION = "scheduler"
    max_num_batched_tokens: int = setting(16384, "token budget of one engine step", min=1)
    max_num_seqs: int = setting(256, "requests running at once", min=1)
    prefill_chunk_plan: str = setting(
        "area", "prefill attention chunking (#45061); fixed = baseline", choices=("area", "fixed")
    )
    chunk_area_budget: int = setting(0, "area budget per prefill chunk; 0: derived", min=0)
    prefill_chunk_group_size: int = setting(4, "requests per chunk when the plan is fixed", min=1)
    # An offloading worker copies a layer's cold experts in for each warm-up prompt of more than
    # ~100 tokens (they route to nearly all 256): at 43 layers on an H100 ~89 GB a prompt
    warm_up: str = setting(
        "all", "start-up prompt lengths: all = each size class in its four argument "
        "specialisations; powers = powers of two only (a quarter of the prompts; other lengths "
        "compile on first use)", choices=("all", "powers"),
    )  # fmt: skip
    # The longest healthy step is a full 16K-token prefill chunk (a few s on an H200), plus
    # 1.5-3.3 s for a kernel compile the warm-up missed; collectives give up on their own after
    # model.collective_timeout_s (60 s). 120 s never fires on a healthy worker and still ends a
    # hung worker's streams within about two minutes (SGLang's watchdog: 300 s, then it kills
    # the process). docs/operations.md, "Hung steps".
    step_timeout_s: float = setting(
        120.0, "an engine step running longer is hung: live requests end UNAVAILABLE and health "
        "says NOT_SERVING; 0: never", min=0,
    )  # fmt: skip


@dataclass(frozen=True)
class SpeculativeSection(Section):
    SECTION = "speculative"
    method: str = setting(
        "none", "speculative decoding", flag="--spec-method", choices=("none", "mtp")
    )
    num_speculative_tokens: int = setting(1, "draft tokens per step", min=1, max=3)
    budget: str = setting(
        "adaptive",
        "spec token budget (#51725); static = baseline",
        flag="--spec-budget",
        choices=("adaptive", "static"),
    )


@dataclass(frozen=True)
class FeatureSwitches(Section):
    """Every speed feature the engine runs (each reproduces a vLLM PR; docs/BENCHMARKS.md), on by
    default except IndexCache; off = the baseline path, measured against it in benchmarks/.
    `forward` picks the engine path: the paged forward (one flat batch per step on the packed
    cache, every kernel) or the reference (per-request states, the oracle); the other switches
    apply to whichever path has the feature. Still kernels only: packed-vs-unpacked KV and
    q-head padding.

    Elsewhere: scheduler.prefill_chunk_plan (#45061), speculative.budget (#51725),
    cache.indexer_key_dtype (#48993), model.kernels / kernel_overrides (kernel backends).
    """

    SECTION = "features"
    forward: str = setting(
        "auto",
        "engine forward: paged (flat, on the cache, kernels) or reference; auto: paged on CUDA",
        choices=("auto", "paged", "reference"),
    )
    compressor_boundary_only: bool = setting(
        True, "paged forward: compress programs only for window-closing tokens (#48957)"
    )
    index_cache: bool = setting(False, "IndexCache: Shared C4 layers reuse a Full layer's top-k")
    index_topk_freq: int = setting(2, "with index_cache: every Nth C4 layer is Full", min=1)
    index_topk_pattern: str = setting("", "with index_cache: F/S per C4 layer, e.g. FSFS")
    skip_topk: bool = setting(True, "skip indexer top-k and router when not needed (#49486)")
    shared_sparse_metadata: bool = setting(True, "build sparse index metadata once a step (#45863)")
    router_kernel: str = setting(
        "fused", "MoE routing kernel (#47463, #48660)", choices=("fused", "reference")
    )
    cached_token_to_req_indices: bool = setting(True, "cache token->request indices (#47474)")
    fused_mhc: bool = setting(True, "mHC without repeat/copy of the embedding (#48137)")
    skip_redundant_fill: bool = setting(True, "no redundant full() in metadata (#50298)")
    cuda_graphs: bool = setting(
        True, "paged forward on CUDA: replay captured graphs of decode-only steps (eager: off)"
    )
    cuda_graph_max_batch: int = setting(
        128, "largest decode batch captured (larger steps run eagerly)", min=1, max=1024
    )
    fuse_shared_expert: bool = setting(
        False,
        "paged forward: the shared expert joins the grouped MoE GEMM in decode-sized steps "
        "(H200: 1.06x at batch 1; its GEMM rounds unlike cuBLAS's, so tokens may differ; "
        "bf16 weights only: off, with a warning, where auto weights resolve to checkpoint)",
    )
    attention_all_heads: bool = setting(
        False, "paged decode attention: all heads of a token in one program, each fp8 KV row "
        "read once (issue 25; off until timed on the card)",
    )  # fmt: skip
    indexer_variants: bool = setting(
        True, "paged indexer: fp16-dot / bit-decoded key logits (issue 25; on an H100 1.08x "
        "the default with FP8 keys, 1.84x with MXFP4 keys, the same top-k)",
    )  # fmt: skip
    expert_prefetch: bool = setting(
        False, "expert offload on the paged forward: each MoE layer predicts the next layer's "
        "experts (pre-gating; hash layers exactly) and copies them in beside its compute "
        "(issue 22; off until timed on the card)",
    )  # fmt: skip
    expert_staging: int = setting(
        0, "expert offload on the paged forward: a prefill step's cold experts go through one "
        "device buffer of N experts shared by all layers (two halves: one half's copy beside "
        "the other's GEMM; counted by the start-up plan) instead of the layer's cache slots in "
        "rounds; 0: rounds (issue 22; untimed on the card)", min=0, max=256,
    )  # fmt: skip
    expert_weights: str = setting(
        "auto", "routed experts: bf16, checkpoint (MXFP4/FP8 as stored, ~1/4 of the bytes; "
        "faster end to end than bf16 on an H100) or auto (start-up plan: checkpoint on a GPU; "
        "bf16 with no plan, several tensor-parallel ranks, or on a CPU device where bf16 fits)",
        choices=("auto", "bf16", "checkpoint"),
    )  # fmt: skip
    mxfp4_layout: str = setting(
        "halves128", "paged forward, MXFP4 experts: halves128 (re-packed once in place: the "
        "GEMV to 32 tokens, the halves MMA kernel above; H100: 0.96-0.97x the stored layout at "
        "1-16 tokens, 1.2x at 64, 2.0x at 1024, 1.4x at 8192) or stored (as the checkpoint: the "
        "GEMV to 128 tokens, the nibble-decoding MMA kernel, a bf16 scratch from ~2K tokens)",
        choices=("stored", "halves128"))  # fmt: skip
    moe_activations: str = setting(
        "bf16", "with MXFP4 experts in mxfp4_layout halves128: bf16 (exact) or fp8 (W4A8 above "
        "the GEMV's 128 tokens: x and the SwiGLU output rounded to e4m3 per 1x128 group, FP8 "
        "MMA; 1.8 percent of a layer's output on the trained tiny model; 1.06x served TPOT at 64 "
        "streams on an H100)", choices=("bf16", "fp8"),
    )  # fmt: skip
    linear_weights: str = setting(
        "auto", "attention/shared-expert/MTP linears: bf16, checkpoint (FP8 as stored, ~1/2 "
        "of the bytes) or auto (as expert_weights auto decides; "
        "checkpoint with linear_activations fp8)", choices=("auto", "bf16", "checkpoint"),
    )  # fmt: skip
    linear_activations: str = setting(
        "bf16", "with linear_weights checkpoint (or auto, which it then makes checkpoint): "
        "bf16 (exact) or fp8 (W8A8 at 3-64 rows: x rounded to e4m3 per 1x128 group, FP8 x FP8 "
        "MMA; relative error ~2.6 percent of a linear's output, 2.7 of a layer's)",
        choices=("bf16", "fp8"),
    )  # fmt: skip
    batched_sampling: bool = setting(
        True, "CUDA: sample a step's unseeded rows together on the GPU (off: row by row on CPU)"
    )
    greedy_in_graph: bool = setting(
        True, "with cuda_graphs: the decode graph also takes argmax(logits); an all-greedy "
        "step copies back B token ids instead of launching the sampler (same tokens)",
    )  # fmt: skip
    async_scheduling: bool = setting(
        True, "schedule and launch the next all-greedy decode step while the current one "
        "runs, its tokens fed on the GPU (vLLM's async scheduling; one rank, decode graphs "
        "with greedy_in_graph, no MTP: elsewhere steps run one after another)",
    )  # fmt: skip

    def check(self) -> None:
        pattern = self.index_topk_pattern
        if pattern and (set(pattern) - {"F", "S"} or pattern[0] != "F"):
            self.fail("index_topk_pattern", "use only F and S, starting with F (e.g. FSFS)")
        if self.fuse_shared_expert and self.expert_weights == "checkpoint":
            self.fail("fuse_shared_expert", "the grouped GEMM takes one format per launch "
                      "(the shared expert is bf16): off with expert_weights checkpoint")  # fmt: skip
        if self.fuse_shared_expert and self.linear_weights == "checkpoint":
            self.fail("fuse_shared_expert", "the grouped GEMM takes one format per launch "
                      "(the shared expert is FP8): off with linear_weights checkpoint")  # fmt: skip
        if self.linear_activations == "fp8" and self.linear_weights == "bf16":
            self.fail("linear_activations", "fp8 activations need linear_weights checkpoint")
        if self.moe_activations == "fp8" and self.mxfp4_layout != "halves128":
            self.fail("moe_activations", "fp8 (W4A8) reads MXFP4 experts in mxfp4_layout "
                      "halves128: set it too")  # fmt: skip
        if self.moe_activations == "fp8" and self.expert_weights == "bf16":
            self.fail("moe_activations", "fp8 (W4A8) needs MXFP4 experts: expert_weights "
                      "checkpoint or auto")  # fmt: skip
        if self.expert_staging == 1:
            self.fail("expert_staging", "0 (off) or at least 2: the buffer is used in two halves")


@dataclass(frozen=True)
class TransferSection(Section):
    SECTION = "transfer"
    transport: str = setting(
        "auto", "KV transport P->D", choices=("auto", "nixl", "cuda_ipc", "local")
    )
    transport_port: int = setting(0, "port of the transport listener; 0: pick one", **PORT)
    lease_ttl_s: float = setting(30.0, "P frees unpulled KV after this", min=0.1)
    pull_timeout_s: float = setting(10.0, "D gives up a KV pull after this", min=0.1)
    pull_failure_policy: str = setting(
        "recompute", "after a failed pull", choices=("recompute", "fail")
    )
    ucx_net_devices: str = setting(
        "auto", "network devices UCX may use (UCX_NET_DEVICES, e.g. lo or eth0,mlx5_0:1); "
        "auto: the interface of worker.host (lo for loopback, every one for 0.0.0.0); all",
    )  # fmt: skip

    def check(self) -> None:
        if self.pull_timeout_s >= self.lease_ttl_s:
            self.fail("pull_timeout_s", f"must be below lease_ttl_s ({self.lease_ttl_s:g})")


@dataclass(frozen=True)
class DiscoverySection(Section):
    SECTION = "discovery"
    prefill_addresses: tuple[str, ...] = setting((), "static prefill host:port", flag="--prefill")
    decode_addresses: tuple[str, ...] = setting((), "static decode host:port", flag="--decode")
    redis_url: str = setting("", "Redis registry, e.g. redis://host:6379/0", flag="--redis")
    redis_key_prefix: str = setting("dsv4", "namespace of the registry keys")
    heartbeat_s: float = setting(1.0, "workers publish their info this often", min=0.05)
    ttl_s: float = setting(5.0, "a worker silent this long is dropped", flag="--discovery-ttl-s")

    def check(self) -> None:
        for name in ("prefill_addresses", "decode_addresses"):
            for address in getattr(self, name):
                if not _ADDRESS.fullmatch(address):
                    self.fail(name, f"{address!r} is not host:port")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            self.fail("redis_url", "start with redis://, rediss:// or unix://")
        if self.ttl_s < 2 * self.heartbeat_s:
            self.fail("ttl_s", f"must be >= 2 x heartbeat_s ({self.heartbeat_s:g} s)")


@dataclass(frozen=True)
class RouterSection(Section):
    SECTION = "router"
    host: str = setting("127.0.0.1", "router bind address (0.0.0.0 in containers)")
    port: int = setting(50051, "router gRPC port", **PORT)
    request_timeout_s: float = setting(600.0, "deadline when the client sets none", min=0.1)
    prefill_timeout_s: float = setting(60.0, "one prefill attempt's deadline", min=0.1)
    max_prefill_retries: int = setting(2, "retries of the prefill leg on another P", min=0)
    max_message_bytes: int = setting(16 << 20, "largest gRPC message", min=1024)
    max_inflight_requests: int = setting(
        1024, "admission limit; more get RESOURCE_EXHAUSTED", min=1
    )
    rate_limit_rps: float = setting(0.0, "requests/s per client; 0: off", min=0)
    rate_limit_burst: int = setting(0, "burst per client; 0: ceil(rate_limit_rps)", min=0)
    api_keys: tuple[str, ...] = setting(
        (), "accepted API keys; none: open", flag="--api-key", secret=True
    )
    default_max_new_tokens: int = setting(256, "max_new_tokens when unset", min=1)
    max_new_tokens_limit: int = setting(0, "largest max_new_tokens; 0: max_model_len", min=0)
    migrate_on_decode_failure: bool = setting(False, "re-run on another pair when D dies")
    decode_full_wait_s: float = setting(
        30.0, "every decode worker full: wait this long for room (bounded by P's lease)", min=0.0
    )
    http_port: int = setting(0, "OpenAI-compatible HTTP port (/v1/...); 0: off", **PORT)

    def check(self) -> None:
        if self.max_new_tokens_limit and self.default_max_new_tokens > self.max_new_tokens_limit:
            self.fail("default_max_new_tokens", "must not exceed max_new_tokens_limit")


@dataclass(frozen=True)
class WorkerSection(Section):
    SECTION = "worker"
    role: str = setting(
        "colocated", "what this worker does", choices=("prefill", "decode", "colocated")
    )
    host: str = setting("127.0.0.1", "worker bind address", flag="--worker-host")
    port: int = setting(0, "worker gRPC port; 0: pick a free one", flag="--worker-port", **PORT)
    worker_id: str = setting("", "unique id; empty: role-host-pid")
    advertise_address: str = setting("", "host:port peers dial; empty: host:bound port")
    drain_timeout_s: float = setting(30.0, "graceful drain limit on shutdown", min=0)
    # The engine thread waits on the GPU with the GIL released; the gRPC/asyncio side then
    # holds it up to this interval before the next step may start (CPython's default is 5 ms,
    # the length of a whole decode step). 0: keep the interpreter's default.
    gil_switch_interval_ms: float = setting(
        0.5, "sys.setswitchinterval for the worker process; 0: the default", min=0
    )


@dataclass(frozen=True)
class SecuritySection(Section):
    SECTION = "security"
    tls_cert_path: str = setting(
        "", "server certificate (PEM); empty: plaintext", flag="--tls-cert"
    )
    tls_key_path: str = setting("", "server private key (PEM)", flag="--tls-key")
    tls_ca_path: str = setting("", "CA bundle to verify peers (PEM)", flag="--tls-ca")
    require_client_cert: bool = setting(False, "mutual TLS on the worker APIs")
    shared_secret: str = setting("", "token the router sends to workers", secret=True)

    def check(self) -> None:
        if bool(self.tls_cert_path) != bool(self.tls_key_path):
            self.fail("tls_key_path", "set tls_cert_path and tls_key_path together")
        if self.require_client_cert and not (self.tls_ca_path and self.tls_cert_path):
            self.fail("require_client_cert", "mutual TLS needs tls_cert/key_path and tls_ca_path")
        for name in ("tls_cert_path", "tls_key_path", "tls_ca_path"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                self.fail(name, "no such file: fix the path or mount the secret")


@dataclass(frozen=True)
class MetricsSection(Section):
    """Prometheus metrics and logs."""

    SECTION = "metrics"
    prometheus_port: int = setting(
        -1,
        "port of /metrics; -1: the role's (router 9400, prefill 9401, decode 9402; a free one "
        "when taken); 0: off",
        flag="--metrics-port",
        min=-1,
        max=65535,
    )
    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error"))
    log_format: str = setting("text", "log line format", choices=("text", "json"))
    routing_stats: bool = setting(
        False,
        "count routed expert selections per MoE layer on the device: dsv4_expert_* series, "
        "residency files (docs/operations.md#10b-expert-residency-from-routing-statistics)",
    )
    routing_stats_out: str = setting(
        "",
        "with routing_stats: dump the counts to this JSON file (dsv4 plan --routing-stats) "
        "every routing_stats_interval_s and at shutdown; empty: no dumps",
    )
    routing_stats_interval_s: float = setting(300.0, "seconds between routing stats dumps", min=1)

    def check(self) -> None:
        if self.routing_stats_out and not self.routing_stats:
            self.fail("routing_stats_out", "dumps need counts: set metrics.routing_stats too")


@dataclass(frozen=True)
class ServeConfig:
    """The whole configuration, built once per process by `load_config` / `config_from_args`."""

    model: ModelSection = ModelSection()
    cache: CacheSection = CacheSection()
    scheduler: SchedulerSection = SchedulerSection()
    speculative: SpeculativeSection = SpeculativeSection()
    features: FeatureSwitches = FeatureSwitches()
    transfer: TransferSection = TransferSection()
    discovery: DiscoverySection = DiscoverySection()
    router: RouterSection = RouterSection()
    worker: WorkerSection = WorkerSection()
    security: SecuritySection = SecuritySection()
    metrics: MetricsSection = MetricsSection()
