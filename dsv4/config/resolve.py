"""Resolve "auto" and 0-means-derive values into concrete ones, returning a new ServeConfig.

Pure: facts about the machine (is there a GPU? the host name) are arguments, so tests pin them
and the control plane never imports torch to find out.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from dsv4.config.sections import ServeConfig
from dsv4.types import RequestLimits

if TYPE_CHECKING:
    from dsv4.config.model import ModelConfig

_LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]", ""}


def model_dtype(dtype: str, on_cuda: bool) -> str:
    """`model.dtype` resolved: auto is bf16 on CUDA, fp32 on CPU."""
    return dtype if dtype != "auto" else ("bf16" if on_cuda else "fp32")


def resolve_auto(
    config: ServeConfig,
    *,
    has_cuda: bool,
    hostname: str,
    pid: int,
    model: ModelConfig | None = None,
) -> ServeConfig:
    """A copy with model.device/dtype/kernels, cache.kv_dtype, transfer.transport,
    worker.worker_id and (given `model`) model.max_model_len made concrete.

    - device auto: cuda when `has_cuda`, else cpu; dtype auto: bf16 on cuda, fp32 on cpu.
    - kernels auto: ref on cpu, triton on cuda (per-op overrides still pick flashinfer).
    - kv_dtype auto: fp8 on cuda for the production head_dim 512 (fp8_ds_mla), else bf16.
    - transport auto: cuda_ipc on cuda when every static peer is on this host and no Redis is
      configured, else nixl (NIXL also runs on CPU memory). Set it explicitly in production.
    - worker_id empty: "<role>-<hostname>-<pid>".
    - features.forward auto: the paged forward on cuda (each rank on its shard), else the
      reference.
    """
    m, c, t, w = config.model, config.cache, config.transfer, config.worker
    device = m.device if m.device != "auto" else ("cuda" if has_cuda else "cpu")
    on_cuda = device.startswith("cuda")
    model_section = dataclasses.replace(
        m,
        device=device,
        dtype=model_dtype(m.dtype, on_cuda),
        kernels=m.kernels if m.kernels != "auto" else ("triton" if on_cuda else "ref"),
        max_model_len=m.max_model_len or (model.max_position_embeddings if model else 0),
    )
    kv_dtype = c.kv_dtype
    if kv_dtype == "auto":
        production_heads = model is not None and model.head_dim == 512
        kv_dtype = "fp8" if on_cuda and production_heads else "bf16"
    transport = t.transport
    if transport == "auto":
        transport = "cuda_ipc" if on_cuda and _peers_all_local(config) else "nixl"
    worker_id = w.worker_id or f"{w.role}-{hostname}-{pid}"
    f = config.features
    forward = f.forward
    if forward == "auto":
        forward = "paged" if on_cuda else "reference"
    return dataclasses.replace(
        config,
        model=model_section,
        cache=dataclasses.replace(c, kv_dtype=kv_dtype),
        transfer=dataclasses.replace(t, transport=transport),
        worker=dataclasses.replace(w, worker_id=worker_id),
        features=dataclasses.replace(f, forward=forward),
    )


def _peers_all_local(config: ServeConfig) -> bool:
    d = config.discovery
    if d.redis_url:
        return False
    hosts = [urlsplit(f"//{a}").hostname or "" for a in (*d.prefill_addresses, *d.decode_addresses)]
    return all(h in _LOOPBACK for h in hosts)


def request_limits(config: ServeConfig, *, vocab_size: int, max_model_len: int) -> RequestLimits:
    """The RequestLimits dsv4.wire enforces, from the model's facts and the router section."""
    limit = config.router.max_new_tokens_limit
    return RequestLimits(
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        max_new_tokens_limit=min(limit, max_model_len) if limit else 0,
        default_max_new_tokens=config.router.default_max_new_tokens,
    )
