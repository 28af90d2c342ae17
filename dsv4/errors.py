"""One error hierarchy for the whole system, and the one place it maps to gRPC status codes.

Raise a `Dsv4Error` subclass for anything caused by input, peers or resources; `assert` only
for internal invariants. Servicers call `to_grpc_status` once, at the boundary.
"""

from __future__ import annotations

from typing import Any


class Dsv4Error(Exception):
    """Base class. `grpc_code` names a `grpc.StatusCode` member; the message says what to fix."""

    grpc_code = "INTERNAL"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class ConfigError(Dsv4Error):
    """A configuration value is wrong: names the field, the value and the fix, and, where the
    user set it, how: the flag (`flag`), the environment variable (`env_var`) or the YAML file
    (`yaml_path`), as typed."""

    grpc_code = "INVALID_ARGUMENT"

    def __init__(
        self,
        field_name: str,
        value: Any,
        fix: str,
        *,
        flag: str = "",
        env_var: str = "",
        yaml_path: str = "",
    ) -> None:
        setting = f" (config field {field_name!r})"
        if flag:  # the value came from the command line: name what the user typed
            message = f"{flag} {value!r}: {fix}{setting}"
        elif env_var:  # ... from the environment: name the variable
            message = f"{env_var}={value!r}: {fix}{setting if env_var != field_name else ''}"
        elif yaml_path:  # ... from a YAML file: name the file and the key in it
            message = f"YAML file {yaml_path}, {field_name} = {value!r}: {fix}"
        else:
            message = f"config field {field_name!r} = {value!r}: {fix}"
        super().__init__(message)
        self.field_name = field_name
        self.value = value
        self.fix = fix
        self.flag, self.env_var, self.yaml_path = flag, env_var, yaml_path


class UsageError(Dsv4Error):
    """A command-line flag's value is wrong: the message names the flag and the fix."""

    grpc_code = "INVALID_ARGUMENT"


class CheckpointError(Dsv4Error):
    """A checkpoint is missing, corrupted, truncated or does not match the config."""

    grpc_code = "FAILED_PRECONDITION"


class InvalidRequest(Dsv4Error):
    grpc_code = "INVALID_ARGUMENT"


class ResourceExhausted(Dsv4Error):
    """Admission is full or a client is over its rate; `retry_after_s` hints when to retry."""

    grpc_code = "RESOURCE_EXHAUSTED"


class OutOfBlocks(ResourceExhausted):
    """The KV block pool cannot satisfy an allocation."""


class DeviceOutOfMemory(ResourceExhausted):
    """The card ran out of memory while a worker started (another process holds memory on it,
    or the start-up asks more than the plan counted): a resource the operator can free, not a
    bug, so one line with torch's figures and what to lower."""

    @classmethod
    def at_startup(cls, exc: BaseException) -> DeviceOutOfMemory:
        # torch's text: "CUDA out of memory. Tried to allocate X. GPU 0 has a total capacity of
        # Y of which Z is free. Process P has W memory in use. Including non-PyTorch memory, ..."
        # (the figures first, then allocator details and advice): the figures are the line
        figures = str(exc).split(" Including non-PyTorch memory")[0].split(" Of the allocated")[0]
        return cls(f"out of device memory while starting: {' '.join(figures.split())} Free the "
                   "card, or lower --memory-fraction, --num-blocks or --max-num-seqs")  # fmt: skip


class Unavailable(Dsv4Error):
    """No healthy worker, a peer died, or a transfer could not be completed."""

    grpc_code = "UNAVAILABLE"


class PortInUse(Unavailable):
    """Another process holds a port this process was told to listen on. Where a launcher
    picked that port itself (free when it looked, then handed over: any process may take it in
    between), it starts the service again on fresh ports. `dsv4` exits with `exit_code`."""

    exit_code = 75  # sysexits' EX_TEMPFAIL: a temporary failure, worth another try

    def __init__(self, host: str, port: int, what: str, fix: str) -> None:
        super().__init__(f"cannot {what} on {host}:{port} (already in use): {fix}")
        self.host, self.port = host, port


class RankFailed(Unavailable):
    """A rank process of this worker's model replica exited or stopped answering: the worker
    cannot step any more and goes down (health NOT_SERVING, then exit)."""


class StepHung(Unavailable):
    """An engine step ran past `scheduler.step_timeout_s` (a kernel or collective that never
    returns, a deadlock): every live request of the worker ends with this and the worker says
    NOT_SERVING. UNAVAILABLE: the fault is this worker's, so a router may retry elsewhere."""


class TransferError(Unavailable):
    """A KV transfer failed or its peer vanished."""


class LayoutMismatch(Dsv4Error):
    """Prefill and decode workers disagree on the KV layout compatibility hash."""

    grpc_code = "FAILED_PRECONDITION"


class NotFound(Dsv4Error):
    """A request id, lease or handle is unknown (already finished, released or expired)."""

    grpc_code = "NOT_FOUND"


class DeadlineExceeded(Dsv4Error):
    grpc_code = "DEADLINE_EXCEEDED"


class Cancelled(Dsv4Error):
    grpc_code = "CANCELLED"


class Unauthenticated(Dsv4Error):
    grpc_code = "UNAUTHENTICATED"


class ExpertPoolError(Dsv4Error):
    """The paged forward's expert pool could not place a step's experts on the device (a stale
    slot table, more misses than cache slots): the step's output is refused, never served."""

    grpc_code = "INTERNAL"


class StepFailed(Dsv4Error):
    """An engine step raised (a bug, a device fault, a request the sampler cannot serve): the
    requests of that step (`request_ids`) end with this error, their blocks freed, and the
    engine goes on. INTERNAL, not UNAVAILABLE: another worker would most likely fail the same
    requests the same way, so a router must not retry them."""

    grpc_code = "INTERNAL"

    def __init__(self, message: str, request_ids: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.request_ids = request_ids


def to_grpc_status(exc: BaseException) -> tuple[Any, str]:
    """Map any exception to `(grpc.StatusCode, message)`; unknown errors become INTERNAL."""
    import grpc

    if isinstance(exc, Dsv4Error):
        message = exc.message
        if exc.retry_after_s is not None:
            message = f"{message}{RETRY_HINT} {exc.retry_after_s:.1f} s)"
        return getattr(grpc.StatusCode, exc.grpc_code), message
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


RETRY_HINT = " (retry after"  # how `to_grpc_status` ends a message with a retry hint


def without_retry_hint(message: str) -> str:
    """A status message without the retry hint `to_grpc_status` appended (to quote another
    service's refusal inside a message that carries its own hint)."""
    return message.partition(RETRY_HINT)[0]
