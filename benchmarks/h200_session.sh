#!/usr/bin/env bash
# One device call (issues 6, 7 and 12). PARTS picks, run in this order:
#   fijit   only the JIT of FlashInfer's sampling module (what the served workers use);
#   fi      FlashInfer's sampling and hash_topk modules JIT-compile in the background (CPU) while
#           the GPU parts run; after e2e, the sampling and hash-routing benchmarks against them;
#   mhc     the GPU tests of the mHC, norm/rope and sampler paths, and the benchmarks of the
#           first two (bench_kernels --only hc_, --only rope);
#   fresh   the GPU tests of the indexer, metadata and moe_align kernels, moe_align's benchmark;
#   decode  the decode TPOT benchmark (graphs, switches, MTP);
#   formats the served weight formats: the FP8 linear and MoE GPU tests, the FP8 GEMV, MoE tile
#           and MoE dequantise sweeps (~6 min);
#   fdecode the decode step with bf16 / FP8 linears / FP8 linears + MXFP4 experts (A/B, ~5 min);
#   e2e     the end-to-end run (disaggregated, colocated, transformers);
#   tests   the GPU tests of the captured decode passes;
#   newtests   the GPU tests of the kernels and paths changed since the last card run (the
#           step tables, the one-launch workspace, the MoE combine, the pool's in-place re-pack,
#           the decode graphs' int32 input fields);
#   pool    the expert pool (issue 22): its GPU tests (registered host rows, the copy kernel and
#           the prefetch stream inside captured graphs), then offload_serve_check on the
#           4-layer slice (paged, paged + prefetch, reference; uniform and zipf1).
#   pooltests  the pool part's GPU tests alone;
#   cand    issue 21's candidates: GPU parity tests of the MXFP4 and FP8 kernels, then the MXFP4
#           MoE candidates and the FP8 linear candidates against bf16 (one process each);
#   attn    issue 25's attention / indexer variants: GPU parity tests, then their A/B;
#   probes  issue 25's e2e_probe records (benchmarks.e2e, both modes), in the formats `dsv4 up`
#           serves on a GPU (MXFP4 experts, FP8 linears; PROBE_ARGS replaces them: two bf16
#           copies of the slice do not fit one H100 for the disaggregated mode);
#   halves  the halves128 GEMV (issue 21): its GPU parity test, then "stored" against
#           "gemv_halves128" and "halves128_served" (bench_kernels_moe_mxfp4 --paths);
#   full    issue 22 at full depth: offload_serve_check --layers 43, timing only, the card
#           deciding the offload (FULL_ARGS picks runs / routings / batches), written to
#           full-depth-<card>.json after each timed run.
#   w8a8    issue 21: the GPU tests of the cuBLASLt block-scaled W8A8 path, then exact / Triton
#           W8A8 / cuBLASLt W8A8 against bf16 at 1-8192 rows (bench_fp8_linear_vs_bf16 --paths);
#   w4a8    issue 21: the GPU tests of the W4A8 experts (kernels/moe_w4a8.py), then W4A8 against
#           bf16 and the halves128 MMA kernel above the GEMV's sizes (bench_kernels_moe_mxfp4);
#   pattr   issues 25/22: where ONE fresh prompt's prefill step spends its time, 1024 and 8192
#           tokens, bf16 then MXFP4 experts + FP8 linears (benchmarks.prefill_attribution: kernel
#           time per component, gaps, launches, host syncs, top kernels), to
#           prefill-attribution-<card>.json; PATTR_ARGS replaces its --prompt-len 1024,8192.
# Result files of the parts below that name the card say h100 or h200, from nvidia-smi.
# DECODE_ARGS and E2E_ARGS add arguments to the decode and end-to-end benchmarks.
# Each part has its own time limit and writes under $OUT, so a failing part leaves the others'.
#   pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl .whl-fi/*.whl \
#     && export PYTHONPATH=/tmp/site
#   PARTS="fi e2e" bash benchmarks/h200_session.sh
# Carry .triton-cache.tgz (a copy of an earlier call's $OUT/triton-cache.tgz) to skip compiles.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
out=${OUT:-benchmarks/results/session}
# under $OUT when the device tool gives one: a call killed at its limit still returns its logs
logs=${OUT:+$OUT/logs}
logs=${logs:-/tmp/h200-logs}
mkdir -p "$out" "$logs"
# Triton's compiled kernels from an earlier call (its $OUT/triton-cache.tgz, carried in as
# .triton-cache.tgz): a 43-layer start-up otherwise compiles every kernel again (tens of seconds)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton-cache.tgz ] && tar xzf .triton-cache.tgz -C "$TRITON_CACHE_DIR"
save_triton_cache() { [ -n "${OUT:-}" ] && tar czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" .; }
trap save_triton_cache EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$logs/gpu.txt"
python3 -c "import torch, triton, grpc, google.protobuf as pb; print(torch.__version__, triton.__version__, grpc.__version__, pb.__version__)" >> "$logs/gpu.txt" 2>&1
card=h100; grep -q H200 "$logs/gpu.txt" && card=h200
parts=" ${PARTS:-decode e2e tests} "
has() { [[ $parts == *" $1 "* ]]; }
# run_into T LOG CMD...: CMD under `timeout T`, its output appended to LOG; prints its status
run_into() { local t=$1 log=$2; shift 2; timeout "$t" "$@" >> "$log" 2>&1; echo "rc=$? ${*:1:4}"; }
jit_pid=
if has fi || has fijit; then  # nvcc runs on the CPU cores while the GPU parts below use the card
    hash_jit=""; has fi && hash_jit="from flashinfer.fused_moe.hash_topk import get_hash_topk_module; get_hash_topk_module()"
    (timeout "${T_JIT:-400}" python3 -c "
import flashinfer.sampling as s; s.get_sampling_module()
$hash_jit
print('flashinfer modules built')" > "$logs/fi-jit.log" 2>&1) &
    jit_pid=$!
fi
has mhc && {
run_into "${T_MHC:-100}" "$logs/mhc-tests.txt" python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/kernels/test_mhc.py tests/kernels/test_norm_rope.py tests/kernels/test_ring_offsets.py \
    tests/unit/test_sampler.py
tail -3 "$logs/mhc-tests.txt"
for pair in hc_:mhc rope:rope; do
    run_into "${T_MHC:-100}" "$logs/mhc-bench.log" python3 -m benchmarks.bench_kernels \
        --only "${pair%%:*}" --out "$out/kernels-${pair##*:}-h200.json"
done
grep -E "^hc_|^norm_rope|^rope|Error" "$logs/mhc-bench.log" | cut -c1-200
}
has fresh && {  # the GPU tests of the last kernel changes, and the one-launch moe_align
run_into "${T_FRESH:-100}" "$logs/fresh-tests.txt" python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/kernels/test_moe_align.py tests/kernels/test_indexer.py tests/kernels/test_metadata.py
tail -3 "$logs/fresh-tests.txt"
run_into 60 "$logs/align-bench.log" python3 -m benchmarks.bench_kernels_moe --only moe_align \
    --out "$out/kernels-align-h200.json"
grep -E "^moe_align|Error" "$logs/align-bench.log" | cut -c1-200
}
has cand && {
run_into "${T_CAND_TESTS:-120}" "$logs/cand-tests.txt" python3 -m pytest -q -p no:cacheprovider \
    -m gpu tests/kernels/test_moe_mxfp4.py tests/kernels/test_fp8_w8a8.py tests/kernels/test_fp8_linear.py
tail -3 "$logs/cand-tests.txt"
run_into "${T_MXFP4:-230}" "$logs/cand-bench.log" python3 -m benchmarks.bench_kernels_moe_mxfp4 \
    --limit-s "${MXFP4_LIMIT_S:-170}" --out "$out/moe-mxfp4-candidates-h200.json"
run_into "${T_FP8:-260}" "$logs/cand-bench.log" python3 -m benchmarks.bench_fp8_linear_vs_bf16 \
    --deadline-s "${FP8_DEADLINE_S:-200}" --out "$out/fp8-linear-candidates-h200.json"
grep -E "^(deadline|moe_mxfp4_vs_bf16)|Error|rc=" "$logs/cand-bench.log" | cut -c1-200
}
has attn && {
run_into "${T_ATTN_TESTS:-100}" "$logs/attn-tests.txt" python3 -m pytest -q -p no:cacheprovider \
    -m gpu tests/kernels/test_sparse_attention_heads.py tests/kernels/test_indexer_fused.py
tail -3 "$logs/attn-tests.txt"
run_into "${T_ATTN:-240}" "$logs/attn-bench.log" python3 -m benchmarks.bench_kernels_attention \
    --variants --out "$out/attention-variants-h200.json"
tail -25 "$logs/attn-bench.log" | cut -c1-200
}
has probes && {
run_into "${T_PROBES:-330}" "$logs/probes.log" python3 -m benchmarks.e2e \
    --out "$out/e2e-probes-$card.json" --work-dir /tmp/e2e \
    ${PROBE_ARGS:---expert-weights checkpoint --linear-weights checkpoint}
tail -8 "$logs/probes.log" | cut -c1-300
}
has halves && {
run_into "${T_HALVES_TESTS:-150}" "$logs/halves-tests.txt" python3 -m pytest -q -p no:cacheprovider \
    -m gpu tests/kernels/test_moe_gemv_halves.py
tail -3 "$logs/halves-tests.txt"
run_into "${T_HALVES:-200}" "$logs/halves-bench.log" python3 -m benchmarks.bench_kernels_moe_mxfp4 \
    --paths stored,gemv_halves128,halves128_served --limit-s "${HALVES_LIMIT_S:-120}" \
    --out "$out/moe-mxfp4-halves-$card.json"
grep -E "^\||Error|rc=" "$logs/halves-bench.log" | cut -c1-200
}
has w8a8 && {  # issue 21: W8A8 through torch's block-scaled FP8 GEMM (cuBLASLt) against the others
run_into "${T_W8A8_TESTS:-90}" "$logs/w8a8-tests.txt" python3 -m pytest -q -p no:cacheprovider \
    -m gpu tests/kernels/test_fp8_linear_cublas.py
tail -3 "$logs/w8a8-tests.txt"
run_into "${T_W8A8:-200}" "$logs/w8a8-bench.log" python3 -m benchmarks.bench_fp8_linear_vs_bf16 \
    --rows 1,16,64,1024,8192 --paths exact,w8a8,w8a8_cublas --deadline-s "${W8A8_LIMIT_S:-150}" \
    --out "$out/fp8-linear-w8a8-cublas-$card.json"
grep -E "^\||speedup|Error|rc=" "$logs/w8a8-bench.log" | tail -40 | cut -c1-200
}
has w4a8 && {  # issue 21: e4m3 activations x MXFP4 (halves128) experts on the FP8 MMA
run_into "${T_W4A8_TESTS:-120}" "$logs/w4a8-tests.txt" python3 -m pytest -q -p no:cacheprovider \
    -m gpu tests/kernels/test_moe_w4a8.py
tail -3 "$logs/w4a8-tests.txt"
run_into "${T_W4A8:-200}" "$logs/w4a8-bench.log" python3 -m benchmarks.bench_kernels_moe_mxfp4 \
    --paths w4a8,halves128,halves128_served --limit-s "${W4A8_LIMIT_S:-150}" \
    --out "$out/moe-w4a8-$card.json"
grep -E "^\||Error|rc=" "$logs/w4a8-bench.log" | cut -c1-200
}
has full && {
run_into "${T_FULL:-400}" "$logs/full.log" python3 -m benchmarks.offload_serve_check --layers 43 \
    --no-check --offload-share 0 --host-memory-gib "${FULL_HOST_GIB:-108}" --warm-up powers \
    --out "$out/full-depth-$card.json" ${FULL_ARGS:-}
grep -E "loaded in|warm-up|timed|Error|error|short|rc=" "$logs/full.log" | cut -c1-300
tail -4 "$logs/full.log" | cut -c1-300
}
has pattr && {  # the step summaries and their components (top kernels: in the JSON)
run_into "${T_PATTR:-240}" "$logs/prefill-attribution.log" python3 -m benchmarks.prefill_attribution \
    --out "$out/prefill-attribution-$card.json" ${PATTR_ARGS:---prompt-len 1024,8192}
grep -E "^prefill |^  [a-z]|Error|wrote" "$logs/prefill-attribution.log" | cut -c1-220
grep -q "^wrote" "$logs/prefill-attribution.log" || tail -12 "$logs/prefill-attribution.log" | cut -c1-300
}
has decode && {
timeout "${T_DECODE:-200}" python3 -m benchmarks.bench_decode_graphs --out "$out/decode-graphs-h200.json" \
    ${DECODE_ARGS:-} > "$logs/decode-graphs.log" 2>&1
rc=$?; echo "decode rc=$rc"; grep -E "^decode_tpot|k=. B=|FAILED|Error" "$logs/decode-graphs.log" | cut -c1-160
[ $rc -ne 0 ] && tail -12 "$logs/decode-graphs.log" | cut -c1-300
}
has formats && {
run_into "${T_FORMATS:-150}" "$logs/formats-tests.txt" python3 -m pytest -q -p no:cacheprovider \
    -m gpu tests/kernels/test_fp8_linear.py tests/kernels/test_moe.py tests/kernels/test_moe_dequant.py
tail -3 "$logs/formats-tests.txt"
run_into 150 "$logs/formats-bench.log" python3 -m benchmarks.bench_kernels_linear --only fp8_linear_gemv \
    --out "$out/kernels-linear-gemv-h200.json"
run_into 150 "$logs/formats-bench.log" python3 -m benchmarks.bench_kernels_moe --only moe_tile \
    --out "$out/kernels-moe-tile-h200.json"
run_into 150 "$logs/formats-bench.log" python3 -m benchmarks.bench_kernels_moe_dequant \
    --out "$out/kernels-moe-dequant-h200.json"
grep -E "^(fp8_linear_gemv|moe_tile|moe_experts_dequant)|Error" "$logs/formats-bench.log" | cut -c1-200
}
has fdecode && {
for fmt in "bf16 bf16" "checkpoint bf16" "checkpoint checkpoint"; do
    set -- $fmt
    run_into 150 "$logs/formats-decode.log" python3 -m benchmarks.bench_decode_graphs --only plain \
        --variants '' --batches 1,16,64 --contexts 4096 --linear-weights "$1" \
        --expert-weights "$2" --out "$out/decode-formats-$1-$2.json"
done
grep -E "^decode_tpot_graphs |Error" "$logs/formats-decode.log" | cut -c1-200
}
# the served workers sample with FlashInfer: let its JIT finish first, or its nvcc processes
# share the CPU cores with the workers' start-up and the load test (a skewed run, seen once)
if [ -n "$jit_pid" ] && has e2e; then wait "$jit_pid"; echo "flashinfer jit rc=$?"; jit_pid=; fi
has e2e && {
timeout "${T_E2E:-450}" python3 -m benchmarks.bench_e2e --out-dir /tmp/e2e ${E2E_ARGS:-} > "$logs/e2e.log" 2>&1
rc=$?; echo "e2e rc=$rc"; [ $rc -ne 0 ] && tail -12 "$logs/e2e.log" | cut -c1-300
cp /tmp/e2e/e2e-summary.json /tmp/e2e/e2e-probes.json "$out/" 2>/dev/null
}
if has fi; then
    [ -n "$jit_pid" ] && { wait "$jit_pid"; echo "flashinfer jit rc=$?"; }
    tail -3 "$logs/fi-jit.log" | cut -c1-300
    run_into "${T_FI:-120}" "$logs/fi-bench.log" python3 -m benchmarks.bench_kernels_moe --only sample \
        --out "$out/kernels-sampling-h200.json"
    run_into "${T_FI:-120}" "$logs/fi-bench.log" python3 -m benchmarks.bench_kernels --only hash_route \
        --out "$out/kernels-hash-h200.json"
    grep -E "^(sample|hash_route)|Error|error" "$logs/fi-bench.log" | cut -c1-220
fi
if has pool || has pooltests; then
run_into "${T_POOL_TESTS:-150}" "$logs/pool-tests.txt" python3 -m pytest -q -p no:cacheprovider \
    -m gpu tests/engine/test_expert_pool.py tests/engine/test_expert_staging.py tests/kernels/test_expert_slots.py \
    tests/engine/test_capture_collector.py
tail -3 "$logs/pool-tests.txt"
fi
has pool && {
run_into "${T_POOL:-420}" "$logs/pool-serve.log" python3 -m benchmarks.offload_serve_check \
    --out "$out/offload-serve-h200.json" ${POOL_ARGS:-}
grep -E '"(equal|name|time_us|expert_prefetch)"|Error' "$logs/pool-serve.log" | head -40 | cut -c1-160
}
has tests && {
timeout "${T_TESTS:-80}" python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/engine/test_decode_graphs.py tests/engine/test_paged_speculative.py > "$logs/gpu-tests.txt" 2>&1
echo "gpu tests rc=$?" | tee -a "$logs/gpu-tests.txt"
tail -5 "$logs/gpu-tests.txt"
}
has newtests && {  # kernels and paths changed since the last card run (sessions 21-22)
run_into "${T_NEW_TESTS:-240}" "$logs/new-tests.txt" python3 -m pytest -q -p no:cacheprovider \
    -m gpu tests/kernels/test_step_tables.py tests/kernels/test_kv_workspace.py \
    tests/kernels/test_kv_store.py tests/kernels/test_moe.py tests/engine/test_paged_forward.py \
    tests/engine/test_chunk_invariance.py tests/engine/test_decode_graphs.py \
    tests/engine/test_expert_pool.py
tail -5 "$logs/new-tests.txt"
}
# the end-to-end part's workers logs and summary (only when it ran)
if has e2e; then
tar czf "$out/logs.tgz" -C /tmp --exclude=e2e/model e2e 2>/dev/null
python3 - "$out" <<'PY'
import json, sys
try:
    s = json.load(open(f"{sys.argv[1]}/e2e-summary.json"))
except Exception as exc:
    print("no e2e summary", exc); raise SystemExit
for mode in ("disaggregated", "colocated"):
    r = s.get(mode, {})
    print(mode, r.get("error", "")[:300], "start", r.get("start_s"))
    for key in ("probe_ttft_1024", "probe_tpot_b1"):
        p = r.get(key, {})
        print(" ", key, p.get("mean_ttft_ms"), p.get("mean_tpot_ms"), p.get("error", "")[:200])
    for x in r.get("sweep", []):
        print("  rate", x.get("request_rate"), "ok", x.get("completed"), "fail", x.get("failed"),
              "ttft", x.get("median_ttft_ms"), "tpot", x.get("median_tpot_ms"),
              "goodput", x.get("request_goodput"), x.get("handoff"))
print("transformers", s.get("transformers"))
PY
fi
