"""The random-number keys reach the quantize kernels as ONE compiled signature whatever their value.

Triton compiles a kernel per argument type (a Python int below 2**31 is i32, above is i64) and per
specialization ("divisible by 16", "== 1"). A fresh stochastic-rounding seed every step used to hit every
combination: on the H200 the NVFP4 runs kept compiling new variants for their first dozens of steps.
"""

import pytest

from nvfp4_train.kernels.fp4_reference import seed_key
from nvfp4_train.kernels.fp4_triton import key_arg
from nvfp4_train.kernels.mxfp4.quantize import _mxfp4_quantize_kernel
from nvfp4_train.kernels.nvfp4.quantize import _quantize_grouped_kernel


@pytest.mark.parametrize("key", [0, 1, 16, 2**31 - 1, 2**31, 2**32 - 1, seed_key(0), seed_key(12345)])
def test_key_arg_is_int32_with_the_same_bits(key):
    k = key_arg(key)
    assert -2**31 <= k < 2**31  # Triton types it i32
    assert k % 2**32 == key  # the kernel's .to(tl.uint32) sees the same 32 bits


def test_key_arg_rejects_out_of_range():
    for bad in (-1, 2**32):
        with pytest.raises(ValueError, match="key must be in"):
            key_arg(bad)


@pytest.mark.parametrize("kernel", [_quantize_grouped_kernel, _mxfp4_quantize_kernel])
def test_keys_are_not_specialized(kernel):
    if not hasattr(kernel, "do_not_specialize"):
        pytest.skip("TRITON_INTERPRET=1: the interpreter's kernels compile nothing and keep no specialization list")
    dns = {kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
    assert {"row_key", "col_key"} <= dns
