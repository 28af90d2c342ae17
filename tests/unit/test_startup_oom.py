"""A worker whose card runs out of memory at start-up exits with one line naming the figures and
what to lower, not "internal error ... (a bug)".

Seen on an H100 (session 23): the disaggregated e2e probe started a prefill worker beside a decode
worker holding 53.65 GiB, and the prefill's KV allocation failed with torch's OutOfMemoryError,
which the CLI reported as a bug with a paragraph of allocator advice. A CPU host cannot run out of
CUDA memory, so the engine build raises torch's own exception with the text torch wrote there.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.commands import cli
from dsv4.config import load_config
from dsv4.config.model import tiny_config
from dsv4.errors import DeviceOutOfMemory
from dsv4.model.tiny import write_model_spec
from dsv4.worker import build

TORCH_TEXT = (
    "CUDA out of memory. Tried to allocate 8.03 GiB. GPU 0 has a total capacity of 79.18 GiB of "
    "which 936.62 MiB is free. Process 1688 has 53.65 GiB memory in use. Including non-PyTorch "
    "memory, this process has 24.60 GiB memory in use. Of the allocated memory 24.09 GiB is "
    "allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
    "to avoid fragmentation.  See documentation for Memory Management "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)


def test_startup_oom_is_one_resource_line(tmp_path, monkeypatch) -> None:
    spec = write_model_spec(tmp_path / "model", tiny_config())
    config = load_config({"model.path": f"random:{spec}", "model.device": "cpu"})

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(TORCH_TEXT)

    monkeypatch.setattr(build, "_build", out_of_memory)
    with pytest.raises(DeviceOutOfMemory) as caught:
        build.build_worker_runtime(config, with_transport=False)
    exc = caught.value
    assert isinstance(exc.__cause__, torch.OutOfMemoryError)
    line = cli._one_line(exc)
    assert not cli._is_bug(exc) and "internal error" not in line and "\n" not in line
    assert "Tried to allocate 8.03 GiB" in line and "Process 1688 has 53.65 GiB" in line
    assert "--memory-fraction" in line and "Including non-PyTorch" not in line
    assert exc.grpc_code == "RESOURCE_EXHAUSTED"
