"""The engine's scheduler (pure Python): requests, per-step batches, policies.

Reading path: `request.py` (token accounting), `batch.py` (what crosses to the runner),
`scheduler.py` (schedule / update), `policy.py` (chunk planning, spec budget, preemption).
"""

from dsv4.scheduler.batch import (
    ChunkPlan,
    PrefillChunk,
    RequestOutput,
    RequestStepOutput,
    ScheduledBatch,
    ScheduledRequest,
    StepOutput,
)
from dsv4.scheduler.config import SchedulerConfig
from dsv4.scheduler.policy import spec_token_reservation
from dsv4.scheduler.request import FinishCause, Request, RequestStatus, StopChecker
from dsv4.scheduler.scheduler import Scheduler

__all__ = [
    "ChunkPlan",
    "FinishCause",
    "PrefillChunk",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "RequestStepOutput",
    "ScheduledBatch",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "StepOutput",
    "StopChecker",
    "spec_token_reservation",
]
