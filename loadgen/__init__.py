"""dsv4 loadtest: an async gRPC load generator for `dsv4.v1.Router`, modelled on
`vllm bench serve` (same metric names and formulas). Reading path: workloads -> arrivals ->
client / grpc_client -> runner -> metrics -> report / plot; cli wires them together."""

from loadgen.cli import add_loadtest_args, run_loadtest
from loadgen.client import RequestRecord, StreamingClient
from loadgen.workloads import LoadRequest

__all__ = ["LoadRequest", "RequestRecord", "StreamingClient", "add_loadtest_args", "run_loadtest"]
