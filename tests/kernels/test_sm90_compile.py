"""Every kernel launch the CPU tests ran also compiles for Hopper (tests/kernels/sm90_build.py).

The interpreter accepts kernels Triton's compiler rejects (a type mismatch between two
constexpr branches cost one H200 call). The conftest records each kernel's launches during the
kernel tests and moves this test after them; it compiles those launches for sm_90 on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.ops.expert_slots import COUNTERS
from tests.kernels.sm90_build import RECORDED, Launch, compile_recorded, launch_of


# every recorded constexpr set of every kernel through Triton's compiler and ptxas: minutes on a
# 2-core machine (~300 s on a slow one), so past the suite's per-test default
@pytest.mark.timeout(1200)
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels compile as they run")
def test_recorded_launches_compile_for_sm90(request):
    launches = [launch for kept in RECORDED.values() for launch in kept]
    if not launches:
        pytest.skip("no kernel launches recorded: run it together with tests/kernels")
    kernel_tests = sum("tests/kernels/" in item.nodeid for item in request.session.items)
    if kernel_tests > 300:  # the whole directory ran: its tests reach most of the package
        assert len({name for _, name in RECORDED}) >= 20, sorted(RECORDED)
    failures = compile_recorded(launches)
    assert not failures, "\n".join(failures)


def test_a_rejected_kernel_is_reported():
    """The check itself: a kernel with mismatched constexpr-branch returns fails to compile."""
    bad = Launch("tests.kernels.sm90_bad_kernel", "_mismatched_returns_kernel",
                 (("x_ptr", "*u8"), ("o_ptr", "*fp32"), ("AS_FLOAT", "constexpr")),
                 (("AS_FLOAT", True),), (("num_warps", 1),))  # fmt: skip
    failures = compile_recorded([bad])
    assert len(failures) == 1 and "fp32 and uint8" in failures[0], failures  # the two returns


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels compile as they run")
def test_the_clock_kernels_the_interpreter_cannot_run_compile_for_sm90():
    """The expert pool's `copy_wait_start` / `copy_wait_end` read the GPU's timer (inline PTX),
    which the interpreter cannot execute, so no CPU test records them: their launches (the end
    with and without a fetch list, at V4-Flash's 256-expert bound of slots) compile here."""
    from kernels.expert_slots import clock_launches

    counters = torch.zeros(COUNTERS, dtype=torch.int64)
    fetch = torch.full((256,), -1, dtype=torch.int32)
    pairs = (*clock_launches(counters), clock_launches(counters, fetch)[1])
    launches = [launch_of(kernel, args, keywords) for kernel, args, keywords in pairs]
    assert None not in launches and len({launch.name for launch in launches}) == 2
    failures = compile_recorded(launches)
    assert not failures, "\n".join(failures)
