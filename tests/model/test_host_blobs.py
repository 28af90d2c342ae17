"""Pinned host rows of offloaded experts (`host_blobs`) stay registered while any view lives.

The expert pool and the offload store keep only views of the blob (rows, dtype views); when
the registration hung off the blob's own Python object, it ended as soon as that object went
out of scope, and on the GPU the pool's copy kernel refused the host rows ("cannot be accessed
from Triton (cpu tensor?)").
"""

from __future__ import annotations

import gc

import pytest
import torch

from dsv4.model.offload_load import host_blobs


def test_unpinned_blobs_are_plain_host_tensors() -> None:
    blobs = host_blobs(3, 40, pin=False)
    assert blobs.shape == (3, 40) and blobs.dtype == torch.uint8 and blobs.device.type == "cpu"
    assert host_blobs(0, 40, pin=True).shape == (0, 40)  # nothing to pin: no CUDA call


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_view_outliving_the_blob_is_still_read_by_a_kernel() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def _read(x_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(o_ptr + i, tl.load(x_ptr + i))

    torch.zeros(1, device="cuda")  # a context before registering
    blobs = host_blobs(4, 1024, pin=True, mapped=True)
    rows = blobs.view(torch.float32).view(4, 256)
    rows.copy_(torch.arange(1024, dtype=torch.float32).view(4, 256))
    del blobs
    gc.collect()
    row = rows[2]
    out = torch.empty(256, device="cuda")
    _read[(1,)](row, out, N=256)  # the device reads the host row through its mapped address
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), row)
