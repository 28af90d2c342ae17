"""Settings and shared dependencies of request flows (built once by the RouterServer)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv4.config import ServeConfig
from dsv4.serving.metrics import RouterMetrics, new_registry
from dsv4.serving.tasks import TaskOwner
from dsv4.types import PullFailurePolicy
from router_svc.clients import WorkerClients
from router_svc.pool import WorkerPool
from router_svc.text_model import TextModel


@dataclass(frozen=True, slots=True)
class FlowSettings:
    prefill_timeout_s: float = 60.0
    max_prefill_retries: int = 2  # also bounds D replacements before D's first message
    pull_failure_policy: PullFailurePolicy = PullFailurePolicy.RECOMPUTE
    migrate_on_decode_failure: bool = False
    max_migrations: int = 1
    control_timeout_s: float = 2.0  # background Release / Abort calls
    decode_full_wait_s: float = 30.0  # every D full: wait for room this long at most
    pull_timeout_s: float = 10.0  # a D's pull must start this long before P's lease expires

    @classmethod
    def from_config(cls, cfg: ServeConfig) -> FlowSettings:
        r = cfg.router
        return cls(
            prefill_timeout_s=r.prefill_timeout_s,
            max_prefill_retries=r.max_prefill_retries,
            pull_failure_policy=PullFailurePolicy(cfg.transfer.pull_failure_policy),
            migrate_on_decode_failure=r.migrate_on_decode_failure,
            decode_full_wait_s=r.decode_full_wait_s,
            pull_timeout_s=cfg.transfer.pull_timeout_s,
        )


@dataclass(frozen=True)
class FlowDeps:
    """What every flow shares; built once by the RouterServer."""

    pool: WorkerPool
    clients: WorkerClients
    settings: FlowSettings
    text: TextModel
    cleanup: TaskOwner
    metrics: RouterMetrics = field(default_factory=lambda: RouterMetrics.create(new_registry()))
