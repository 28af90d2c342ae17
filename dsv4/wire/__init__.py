"""The one place that converts `dsv4.v1` protos to and from the dataclasses of `dsv4.types`.

Servicers call `*_from_proto` on what arrives and `*_to_proto` on what leaves; clients do
the reverse. Conversions of incoming requests validate and raise `dsv4.errors.InvalidRequest`
with a message that says what to fix; limits come from a `RequestLimits` argument.

Reading path: `validate` (the checks), `common` (enums, sampling, usage, stream chunks),
`router` (public API), `worker` (prefill/decode APIs, worker info), `kv` (KV handle, layout).
"""

from dsv4.wire.common import (
    abort_request_from_proto,
    abort_request_to_proto,
    abort_response_from_proto,
    abort_response_to_proto,
    sampling_from_proto,
    sampling_to_proto,
    usage_from_proto,
    usage_to_proto,
)
from dsv4.wire.kv import (
    kv_handle_from_proto,
    kv_handle_to_proto,
    kv_layout_from_proto,
    kv_layout_to_proto,
)
from dsv4.wire.router import (
    generate_request_from_proto,
    generate_request_to_proto,
    generate_response_from_proto,
    generate_response_to_proto,
    model_info_from_proto,
    model_info_request_to_proto,
    model_info_to_proto,
)
from dsv4.wire.worker import (
    decode_request_from_proto,
    decode_request_to_proto,
    decode_response_from_proto,
    decode_response_to_proto,
    decode_worker_info,
    drain_status_from_proto,
    drain_status_to_proto,
    encode_worker_info,
    prefill_request_from_proto,
    prefill_request_to_proto,
    prefill_result_from_proto,
    prefill_result_to_proto,
    release_request_from_proto,
    release_request_to_proto,
    release_result_from_proto,
    release_result_to_proto,
    tokenized_request_from_proto,
    tokenized_request_to_proto,
    worker_info_from_proto,
    worker_info_to_proto,
)

__all__ = [
    "abort_request_from_proto",
    "abort_request_to_proto",
    "abort_response_from_proto",
    "abort_response_to_proto",
    "decode_request_from_proto",
    "decode_request_to_proto",
    "decode_response_from_proto",
    "decode_response_to_proto",
    "decode_worker_info",
    "drain_status_from_proto",
    "drain_status_to_proto",
    "encode_worker_info",
    "generate_request_from_proto",
    "generate_request_to_proto",
    "generate_response_from_proto",
    "generate_response_to_proto",
    "kv_handle_from_proto",
    "kv_handle_to_proto",
    "kv_layout_from_proto",
    "kv_layout_to_proto",
    "model_info_from_proto",
    "model_info_request_to_proto",
    "model_info_to_proto",
    "prefill_request_from_proto",
    "prefill_request_to_proto",
    "prefill_result_from_proto",
    "prefill_result_to_proto",
    "release_request_from_proto",
    "release_request_to_proto",
    "release_result_from_proto",
    "release_result_to_proto",
    "sampling_from_proto",
    "sampling_to_proto",
    "tokenized_request_from_proto",
    "tokenized_request_to_proto",
    "usage_from_proto",
    "usage_to_proto",
    "worker_info_from_proto",
    "worker_info_to_proto",
]
