"""Torch references and codecs: the math every kernel in kernels/ is checked against.

Depends only on torch, `dsv4.errors` and the standard library, so both the model (dsv4/model),
the runner and the Triton kernels (kernels/) import from here without importing each other.
This file imports nothing: `dsv4.ops.limits` stays importable without torch (the planner and
the request validation read it).

- `limits`: torch-free constants (sampling floors, kernel thresholds the planner mirrors);
- `quant`, `fp8`: checkpoint weight formats (FP8 blocks, MXFP4) and the FP8 linear references;
- `kv_codec`: the cache's byte formats of KV / indexer-key / state rows;
- `norm`, `rope`, `hyper`: RMSNorm, rotary embedding, manifold hyper-connections (mHC);
- `attention`, `indexer`, `compressor`, `moe`: sparse attention with sink, indexer scores and
  top-k, the compressor's window softmax, routing and SwiGLU experts;
- `sampling`: the sampling spec and its filtered distribution.
"""
