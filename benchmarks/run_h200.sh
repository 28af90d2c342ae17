#!/usr/bin/env bash
# `make bench-gpu`: the GPU test suite and every benchmark, on a CUDA host, from the repo root.
# Results land in benchmarks/results/*.json (or $OUT when set); render tables with
# `python -m benchmarks.to_markdown benchmarks/results/<file>.json`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
out=${OUT:-benchmarks/results}
mkdir -p "$out"
python3 -c "import torch; assert torch.cuda.is_available(), 'needs a CUDA GPU'"
python3 -m pytest tests/kernels tests/transfer tests/spec tests/engine -q -p no:cacheprovider -m gpu
python3 -m benchmarks.bench_kernels --out "$out/kernels-h200.json"
python3 -m benchmarks.bench_kernels_attention --out "$out/kernels-attention-h200.json"
python3 -m benchmarks.bench_kernels_moe --out "$out/kernels-moe-h200.json"
python3 -m benchmarks.bench_prefill --lengths 8192,32768 --out "$out/prefill-h200.json"
python3 -m benchmarks.bench_offload --out "$out/offload-h200.json"
python3 -m benchmarks.bench_decode_graphs --out "$out/decode-graphs-h200.json"
python3 -m benchmarks.bench_e2e --out-dir "$out/e2e"
