"""Torch-free constants shared by the kernels, the runner, the planner and request validation.

Importable without torch (dsv4/plan and the router read it): standard library only.
"""

# The smallest sampling values that still yield a token: below MIN_TEMPERATURE logits /
# temperature leave fp32's range (the samplers clamp to it), below MIN_TOP_P (fp32's smallest
# normal) top_p is 0 or subnormal in fp32 (flushed to 0 on GPUs), so the nucleus filter would
# drop every token. Validation (dsv4/wire/validate.py) refuses smaller values.
MIN_TEMPERATURE = 1e-6
MIN_TOP_P = 2.0**-126

# Weights held as stored (MXFP4 / FP8) make transient bf16 copies in large steps; the planner
# (dsv4/plan/budget.py) counts them with the thresholds the kernels use.
# kernels/moe_dequant.py: the bf16 scratch the routed experts are dequantised into ...
MOE_DEQUANT_SCRATCH_BYTES = 1 << 30
# ... once a step averages this many (token, expert) pairs per expert (MXFP4 experts only).
MOE_DEQUANT_MIN_PAIRS_PER_EXPERT = 48
# kernels/fp8_linear.py: up to this many rows an FP8 linear runs as a GEMV on the stored
# weight; above, the weight is dequantised to bf16 for the GEMM.
FP8_GEMV_MAX_ROWS = 2
