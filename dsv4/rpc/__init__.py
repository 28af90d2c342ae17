"""The wire contract: generated protobuf/gRPC code for the versioned `dsv4.v1` API.

- `dsv4.rpc.v1`: generated modules only (`common_pb2`, `kv_pb2`, `router_pb2`, `worker_pb2`
  and their `_grpc` stubs), committed; `python protos/gen.py` regenerates them and
  tests/unit/test_protos.py fails when they are stale.
- Sources: protos/dsv4/v1/*.proto. Conversion to and from the dataclasses of `dsv4.types`
  happens in `dsv4.wire` only; no `_pb2` object travels past a servicer.

Importing this package does not import torch (tests/unit/test_imports_without_torch.py).
"""
