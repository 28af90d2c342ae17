"""`sizes_vary(*names)`: the `triton.jit` keywords for integer arguments that change per step.

Triton compiles a kernel once per specialisation key, and by default every integer argument
is in that key twice: "== 1" and "divisible by 16". A token count, a row's visible entries, a
tile count (`num_pid_m` of the MoE GEMMs) each flip those classes from one prompt length to
the next, so a prefill of a length the warm-up never produced compiled new variants inside
its TTFT: on the H200 e2e run, prompts of 2-7K tokens took 1.5-3.3 s the first time and
0.06-0.3 s once compiled (docs/BENCHMARKS.md, end to end). Sizes only bound loops and masks,
where the specialisation buys nothing measurable, so these arguments leave the key: a
kernel's variants then depend on its constexpr block classes alone, which the warm-up's
power-of-two lengths do cover. Strides stay specialised: a row stride divisible by 16 is what
lets loads and stores vectorise (callers that size a row by a count pad it instead).
"""

from __future__ import annotations

import inspect

import triton

# Triton 3.x: "do_not_specialize" drops both classes; newer releases also split the
# divisibility class out as "do_not_specialize_on_alignment". Pass whichever exist.
_KEYWORDS = tuple(k for k in ("do_not_specialize", "do_not_specialize_on_alignment")
                  if k in inspect.signature(triton.jit).parameters)  # fmt: skip


def sizes_vary(*names: str) -> dict[str, list[str]]:
    """`@triton.jit(**sizes_vary("T", "N"))`: T and N stay out of the compile key."""
    return {k: list(names) for k in _KEYWORDS}
