"""Every Prometheus metric of dsv4-serve, and the exporter that serves them on `/metrics`.

One process, one `CollectorRegistry` (never the global default, so tests can run several
services in one process). Each service builds its own family of metrics into it:
`RouterMetrics` (router_svc), `PrefillMetrics` (prefill_svc), `DecodeMetrics` (decode_svc);
both worker families share `WorkerMetrics`. Names carry their unit (`_seconds`, `_bytes`,
`_blocks`, `_requests`, `_tokens`, `_ratio`) and counters end in `_total`.

Where vLLM has a name for a series, the series has vLLM's name and a `model_name` label, so
vLLM dashboards, llm-d's scheduler and autoscalers read it unchanged: the router (what
clients see) exports `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
`vllm:request_time_per_output_token_seconds`, `vllm:e2e_request_latency_seconds`,
`vllm:prompt_tokens_total` (each prompt of a request once, however many choices it asks for,
as vLLM counts it), `vllm:generation_tokens_total`, `vllm:request_success_total` (by
`finished_reason`) and `vllm:num_requests_running` (admitted, unfinished requests); every
worker (an engine) exports `vllm:num_requests_running`, `vllm:num_requests_waiting` and
`vllm:kv_cache_usage_perc` (a fraction in [0, 1], as vLLM's). The `dsv4_*` series are what
vLLM has no name for. prometheus_client appends `_total` to a counter's name, so counters are
declared without it.

Live state (KV blocks, queue depth, leases) is read when Prometheus scrapes, through callbacks
into the services (`Gauge.set_function`, `CallbackCounter`): the callbacks run on the
exporter's thread and read only snapshots (`AsyncEngine.load()`, dict sizes, int counters).
Events (a request finished, a pull failed) are counted where they happen, on the event loop.

`MetricsExporter(registry, host, port, role)` owns the HTTP server thread: `start()` (port 0:
off; `DEFAULT_PORT`, the default: the role's port from `DEFAULT_PORTS`, or a free one when
another process holds it), `stop()` (shuts the server down and joins the thread).
docs/operations.md §10 lists every name.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from dsv4.serving.ports import listen_failure

logger = logging.getLogger(__name__)
disable_created_metrics()  # no `*_created` series: every process of ours starts fresh anyway

# Latency buckets (seconds): token gaps from 1 ms, whole requests up to 10 minutes.
TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                   0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip
REQUEST_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                     160.0, 320.0, 640.0)  # fmt: skip
TRANSFER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                      2.5, 5.0, 10.0)  # fmt: skip
MODEL_LABEL = ("model_name",)  # vLLM's label on every vllm:* series
FINISHED_REASONS = ("stop", "length", "abort")  # vllm:request_success_total's finished_reason
DEFAULT_PORT = -1  # metrics.prometheus_port's default: the role's port below
DEFAULT_PORTS = {"router": 9400, "prefill": 9401, "decode": 9402, "colocated": 9402}


class CallbackCounter(Collector):
    """A counter whose value is read from `read()` at scrape time (a monotonic int kept by a
    service or the engine), so the owner needs no Prometheus dependency."""

    def __init__(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        self._name, self._documentation, self._read = name, documentation, read

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._documentation, value=self._read())


class StepCollector(Collector):
    """`dsv4_engine_steps_total{kind}` and `dsv4_engine_step_seconds_total{kind}` from the
    engine's `StepCounters` (kinds: prefill, graph, eager), copied at scrape time."""

    def __init__(self, counters: object) -> None:
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        steps = dict(self._counters.steps)  # type: ignore[attr-defined]
        seconds = dict(self._counters.seconds)  # type: ignore[attr-defined]
        n = CounterMetricFamily("dsv4_engine_steps", "Engine steps by kind (prefill: any prefill in the batch; graph: a replayed decode pass; eager: a decode-only step that was not)", labels=("kind",))  # fmt: skip
        t = CounterMetricFamily("dsv4_engine_step_seconds", "Host-timed seconds of engine steps by kind (model, sampling, tokens back on the host)", labels=("kind",))  # fmt: skip
        for kind in steps:
            n.add_metric((kind,), steps[kind])
            t.add_metric((kind,), seconds[kind])
        yield n
        yield t


class EngineGauges(Collector):
    """vLLM's engine gauges with `model_name`, read at scrape time from `load()` (an
    `EngineLoad`): requests running in the engine, waiting in its queue, and the fraction of
    KV cache blocks in use."""

    def __init__(self, model_name: str, load: Callable[[], object]) -> None:
        self._model_name, self._load = model_name, load

    def collect(self) -> Iterator[Metric]:
        load = self._load()
        total = load.num_total_blocks  # type: ignore[attr-defined]
        usage = _used_blocks(load) / total if total else 0.0
        for name, documentation, value in (
            ("vllm:num_requests_running", "Requests in the engine's running batch", load.num_running),  # type: ignore[attr-defined]
            ("vllm:num_requests_waiting", "Requests waiting in the engine's queue", load.num_waiting),  # type: ignore[attr-defined]
            ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)", usage),
        ):  # fmt: skip
            family = GaugeMetricFamily(name, documentation, labels=MODEL_LABEL)
            family.add_metric((self._model_name,), float(value))
            yield family


class ExpertCollector(Collector):
    """Expert offload (`dsv4.worker.offload`): the stores' `ExpertStats` or the paged expert
    pool's `PoolStats`, read at scrape time from `stats()` (plain int counters in host memory;
    a worker without offload registers none of these; the copy wait is the pool's alone)."""

    def __init__(self, stats: Callable[[], object]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("dsv4_expert_hit_rate", "Routed expert uses served from device memory (resident or cached), 0 to 1", value=s.hit_rate)  # type: ignore[attr-defined]  # fmt: skip
        yield GaugeMetricFamily("dsv4_expert_cache_hit_rate", "Uses of offloaded experts the device cache slots served, 0 to 1", value=s.cache_hit_rate)  # type: ignore[attr-defined]  # fmt: skip
        for name, documentation, value in (
            ("dsv4_expert_bytes_fetched", "Bytes of offloaded experts copied host -> device", s.bytes_fetched),  # type: ignore[attr-defined]
            ("dsv4_expert_fetches", "Offloaded experts copied into a device cache slot", s.misses),  # type: ignore[attr-defined]
            ("dsv4_expert_prefetches", "Offloaded experts copied ahead of their layer (predicted routing)", s.prefetches),  # type: ignore[attr-defined]
            ("dsv4_expert_cpu_computes", "Offloaded experts computed on the CPU instead (CPU fallbacks)", s.cpu_computes),  # type: ignore[attr-defined]
        ):  # fmt: skip
            yield CounterMetricFamily(name, documentation, value=value)
        # the paged pool's only: its kernels time the compute stream's waits on the device (the
        # reference forward's stores copy synchronously, untimed, and export no such series)
        wait_ns = getattr(s, "copy_wait_ns", None)
        if wait_ns is not None:
            yield CounterMetricFamily("dsv4_expert_copy_wait_seconds", "Time the compute stream waited for expert copies (joining prefetches, copying misses)", value=wait_ns / 1e9)  # fmt: skip


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """One /metrics scrape: {'name{label="v",...}': value} for every sample (labels sorted)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=timeout_s).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def new_registry() -> CollectorRegistry:
    """A registry with the standard `process_*` series (RSS, CPU seconds, open fds)."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    return registry


@dataclass(frozen=True)
class RouterMetrics:
    """The router's view of requests: what clients see."""

    requests: Counter
    rejections: Counter
    ttft: Histogram
    tpot: Histogram
    itl: Histogram
    e2e: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    prefill_retries: Counter
    migrations: Counter
    decode_failures: Counter
    decode_full_retries: Counter
    workers: Gauge
    in_flight: Gauge
    request_success: Mapping[str, Counter]  # finished_reason -> its child

    @classmethod
    def create(cls, registry: CollectorRegistry, model_name: str = "") -> RouterMetrics:
        """Series with a vLLM name carry `model_name`; the fields hold their labelled child,
        so callers observe / inc / set_function without naming the label."""
        r, m = registry, {"model_name": model_name}
        success = Counter("vllm:request_success", "Generate calls finished, by finish reason: stop, length, or abort (an Abort call, or a client that went away)", (*MODEL_LABEL, "finished_reason"), registry=r)  # fmt: skip
        return cls(
            requests=Counter("dsv4_router_requests", "Router RPCs by method and final gRPC status code", ("method", "code"), registry=r),
            rejections=Counter("dsv4_router_admission_rejections", "Generate calls refused before any work, by reason (api_key, rate_limit, max_inflight)", ("reason",), registry=r),
            ttft=Histogram("vllm:time_to_first_token_seconds", "Request received to first token handed to the client", MODEL_LABEL, buckets=REQUEST_BUCKETS_S, registry=r).labels(**m),
            tpot=Histogram("vllm:request_time_per_output_token_seconds", "(E2E - TTFT) / (output tokens - 1), per successful request", MODEL_LABEL, buckets=TOKEN_BUCKETS_S, registry=r).labels(**m),
            itl=Histogram("vllm:inter_token_latency_seconds", "Gap between consecutive streamed messages carrying tokens", MODEL_LABEL, buckets=TOKEN_BUCKETS_S, registry=r).labels(**m),
            e2e=Histogram("vllm:e2e_request_latency_seconds", "Request received to its last message, per successful request", MODEL_LABEL, buckets=REQUEST_BUCKETS_S, registry=r).labels(**m),
            prompt_tokens=Counter("vllm:prompt_tokens", "Prompt tokens of admitted, validated requests", MODEL_LABEL, registry=r).labels(**m),
            generation_tokens=Counter("vllm:generation_tokens", "Tokens streamed to clients", MODEL_LABEL, registry=r).labels(**m),
            prefill_retries=Counter("dsv4_router_prefill_retries", "Prefill attempts repeated on another P", registry=r),
            migrations=Counter("dsv4_router_migrations", "Requests re-run on another pair after D died mid-stream", registry=r),
            decode_failures=Counter("dsv4_router_decode_failures", "Decode calls lost to a failing D (replaced, migrated or failed)", registry=r),
            decode_full_retries=Counter("dsv4_router_decode_full_retries", "Rounds of decode hand-offs tried again after every decode worker refused as full (router.decode_full_wait_s)", registry=r),
            workers=Gauge("dsv4_router_workers", "Workers the router knows, by role and health", ("role", "health"), registry=r),
            in_flight=Gauge("vllm:num_requests_running", "Generate calls admitted and not finished", MODEL_LABEL, registry=r).labels(**m),
            request_success={reason: success.labels(**m, finished_reason=reason) for reason in FINISHED_REASONS},
        )  # fmt: skip


@dataclass(frozen=True)
class WorkerMetrics:
    """What every worker reports (label-free: Prometheus' `instance` tells workers apart)."""

    info: Gauge
    index_cache_hit_ratio: Gauge

    @classmethod
    def create(
        cls,
        registry: CollectorRegistry,
        *,
        worker_id: str,
        role: str,
        load: Callable[[], object],
        num_running: Callable[[], int],
        is_draining: Callable[[], bool],
        index_cache_hit_ratio: Callable[[], float],
        step_counters: object,
        model_name: str = "",
        expert_stats: Callable[[], object] | None = None,
        step_failures: Callable[[], int] = lambda: 0,
        hung_steps: Callable[[], int] = lambda: 0,
    ) -> WorkerMetrics:
        """`load()` returns an `EngineLoad` (dsv4.engine.core); callbacks run at scrape time.
        `expert_stats()`: the offloaded experts' `ExpertStats` (None: no expert offload).
        `step_failures()` / `hung_steps()`: the engine's failed steps (raised, or declared hung
        and then returned) and the steps its watchdog declared hung."""
        r = registry
        info = Gauge(
            "dsv4_worker_info",
            "Always 1; labels name the worker",
            ("worker_id", "role"),
            registry=r,
        )
        info.labels(worker_id=worker_id, role=role).set(1)
        gauges = {
            "dsv4_worker_running_requests": ("Requests this worker is serving (RPCs in progress)", num_running),
            "dsv4_worker_kv_blocks_free": ("KV cache blocks free", lambda: load().num_free_blocks),
            "dsv4_worker_kv_blocks_used": ("KV cache blocks in use (running, held or adopted)", lambda: _used_blocks(load())),
            "dsv4_worker_draining": ("1 while the worker drains (takes nothing new)", lambda: float(is_draining())),
        }  # fmt: skip
        for name, (documentation, read) in gauges.items():
            Gauge(name, documentation, registry=r).set_function(read)
        hit = Gauge(
            "dsv4_worker_index_cache_hit_ratio",
            "IndexCache: share of ratio-4 layers that reused a Full layer's top-k (0 when off)",
            registry=r,
        )
        hit.set_function(index_cache_hit_ratio)
        r.register(StepCollector(step_counters))  # an EngineCore's StepCounters
        r.register(CallbackCounter("dsv4_engine_step_failures_total", "Engine steps that failed their requests (raised, or hung past scheduler.step_timeout_s and then returned)", step_failures))  # fmt: skip
        r.register(CallbackCounter("dsv4_engine_hung_steps_total", "Engine steps the step watchdog declared hung (scheduler.step_timeout_s): the worker went NOT_SERVING", hung_steps))  # fmt: skip
        r.register(EngineGauges(model_name, load))
        if expert_stats is not None:
            r.register(ExpertCollector(expert_stats))
        return cls(info=info, index_cache_hit_ratio=hit)


def _used_blocks(load: object) -> int:
    return load.num_total_blocks - load.num_free_blocks  # type: ignore[attr-defined]


@dataclass(frozen=True)
class PrefillMetrics:
    worker: WorkerMetrics
    exports: Counter
    prefill_time: Histogram

    @classmethod
    def create(
        cls,
        registry: CollectorRegistry,
        worker: WorkerMetrics,
        *,
        queued_tokens: Callable[[], int],
        leases_live: Callable[[], int],
        lease_expiries: Callable[[], int],
    ) -> PrefillMetrics:
        r = registry
        Gauge(
            "dsv4_prefill_queued_tokens", "Prompt tokens not yet prefilled", registry=r
        ).set_function(queued_tokens)
        Gauge(
            "dsv4_prefill_leases_live",
            "KV exports held under a lease, waiting for D's pull",
            registry=r,
        ).set_function(leases_live)
        r.register(
            CallbackCounter(
                "dsv4_prefill_lease_expiries_total",
                "Leases that expired unpulled (blocks freed by the TTL)",
                lease_expiries,
            )
        )
        return cls(
            worker=worker,
            exports=Counter("dsv4_prefill_kv_exports", "Finished prefills whose KV was exported under a lease", registry=r),
            prefill_time=Histogram("dsv4_prefill_time_seconds", "Prefill RPC received to KV exported (queue + compute)", buckets=REQUEST_BUCKETS_S, registry=r),
        )  # fmt: skip


@dataclass(frozen=True)
class DecodeMetrics:
    worker: WorkerMetrics
    transfer_bytes: Counter
    pull_time: Histogram
    pull_failures: Counter
    recomputes: Counter

    @classmethod
    def create(
        cls,
        registry: CollectorRegistry,
        worker: WorkerMetrics,
        *,
        mtp_counts: Callable[[], tuple[int, int]],
    ) -> DecodeMetrics:
        """`mtp_counts()` is (drafted, accepted) tokens from the speculative decoder, or (0, 0)."""
        r = registry
        r.register(
            CallbackCounter(
                "dsv4_decode_mtp_drafted_tokens_total",
                "Draft tokens proposed by MTP",
                lambda: mtp_counts()[0],
            )
        )
        r.register(
            CallbackCounter(
                "dsv4_decode_mtp_accepted_tokens_total",
                "Draft tokens accepted by verification",
                lambda: mtp_counts()[1],
            )
        )
        return cls(
            worker=worker,
            transfer_bytes=Counter("dsv4_decode_kv_transfer_bytes", "KV bytes pulled from prefill workers", registry=r),
            pull_time=Histogram("dsv4_decode_kv_pull_seconds", "Successful KV pulls: start to done", buckets=TRANSFER_BUCKETS_S, registry=r),
            pull_failures=Counter("dsv4_decode_kv_pull_failures", "KV pulls that failed (P gone, lease ended, timeout)", registry=r),
            recomputes=Counter("dsv4_decode_prefill_recomputes", "Prompts prefilled locally after a failed pull", registry=r),
        )  # fmt: skip


class MetricsExporter:
    """Serves `registry` as Prometheus text on http://host:port/metrics from its own thread.
    `port` DEFAULT_PORT: `DEFAULT_PORTS[role]`, or a free port when that one is taken (a second
    worker on the host); `self.port` is the bound port once started."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, role: str = "") -> None:
        self.registry, self.host = registry, host
        self.is_default = port == DEFAULT_PORT
        self.port = DEFAULT_PORTS.get(role, DEFAULT_PORTS["router"]) if self.is_default else port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def is_running(self) -> bool:
        return self._server is not None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def start(self) -> None:
        """Bind and serve (no-op when port is 0). Raises Unavailable when a port set by the
        user is taken; the default port falls back to a free one."""
        if not self.port or self._server is not None:
            return
        try:
            self._server, self._thread = self._bind(self.port)
        except OSError as exc:
            if not self.is_default:
                raise listen_failure(
                    self.host, self.port, "serve metrics",
                    "pick a free metrics.prometheus_port, or 0 to turn metrics off", exc,
                ) from exc  # fmt: skip
            logger.info("metrics: default port %d is taken, using a free one", self.port)
            self._server, self._thread = self._bind(0)
        self.port = self._server.server_port
        logger.info("metrics on %s", self.url)

    def _bind(self, port: int) -> tuple[WSGIServer, threading.Thread]:
        return start_http_server(port, addr=self.host, registry=self.registry)

    def stop(self) -> None:
        """Stop serving and join the thread. Idempotent."""
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)
