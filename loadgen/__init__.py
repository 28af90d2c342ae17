"""dsv4 loadtest: an async load generator for `dsv4.v1.Router` (gRPC) and any OpenAI-compatible
HTTP server, modelled on `vllm bench serve` (same metric names, formulas and flag spellings).
Reading path: workloads -> arrivals -> target -> client (grpc_client / openai_client) -> runner
(+ progress) -> metrics -> report / plot; cli wires them together."""

from loadgen.cli import add_loadtest_args, run_loadtest
from loadgen.client import RequestRecord, StreamingClient
from loadgen.workloads import LoadRequest

__all__ = ["LoadRequest", "RequestRecord", "StreamingClient", "add_loadtest_args", "run_loadtest"]
