"""The native FP4 GEMM's operand layouts against torchao (an implementation nobody here wrote): our packed codes
and scales equal torchao's NVFP4 / MX quantization bitwise where the two recipes agree, our swizzled scales
equal torchao's ``to_blocked``, and the reference quantizers' ``swizzled=True`` is that layout.

torchao 0.18's compiled extensions are CUDA-only and do not load on CPU ("Failed to load ..." on import); the
functions used here are its pure-PyTorch ones: ``nvfp4_quantize``, ``per_tensor_amax_to_scale``, ``to_mx``,
``to_blocked``, ``from_blocked``, ``unpack_uint4``, ``f4_unpacked_to_f32``.
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():  # CPU tests; the GPU machines carry no torchao (on CPU a missing one is an error)
    pytest.importorskip("torchao")

from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
from torchao.prototype.mx_formats.mx_tensor import to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
from torchao.prototype.mx_formats.utils import from_blocked as ao_from_blocked
from torchao.prototype.mx_formats.utils import to_blocked as ao_to_blocked

from nvfp4_train.kernels.fp4_layout import as_float4_x2, blocked_numel, blocked_offset, from_blocked, to_blocked
from nvfp4_train.kernels.fp4_reference import e2m1_decode, unpack_nibbles
from nvfp4_train.kernels.mxfp4 import quantize_mxfp4_ref, quantize_mxfp4_rowcol_ref
from nvfp4_train.kernels.nvfp4 import quantize_nvfp4_ref, quantize_nvfp4_rowcol_ref

# (rows, cols) of scale matrices: exact tiles, and every kind of padding (rows past 128, cols past 4)
SCALE_SHAPES = [(128, 4), (256, 8), (1, 1), (37, 3), (130, 5), (300, 9), (129, 12)]
# (M, K) of quantized tensors; K/16 (NVFP4) and K/32 (MXFP4) not multiples of 4, M not of 128
QUANT_SHAPES = [(37, 112), (130, 160), (128, 256), (16, 96)]
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("rows,cols", SCALE_SHAPES)
def test_to_blocked_equals_torchao(gen, rows, cols):
    s = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=gen)
    ours = to_blocked(s)
    assert ours.shape == (blocked_numel(rows, cols),)
    assert torch.equal(ours, ao_to_blocked(s).flatten())
    assert torch.equal(from_blocked(ours, rows, cols), s)
    assert torch.equal(ao_from_blocked(ours, rows, cols), s)
    # the padding is zero
    filled = torch.zeros_like(ours, dtype=torch.bool)
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    filled[blocked_offset(r, c, cols).flatten()] = True
    assert not ours[~filled].any()
    # 1-byte float dtypes keep their dtype and bits
    e = s.view(torch.float8_e4m3fn)
    assert to_blocked(e).dtype == torch.float8_e4m3fn and torch.equal(_u8(to_blocked(e)), ours)


def test_blocked_offset_formula():
    """The documented formula on hand-picked scales: tile 128 rows x 4 cols, 32x16 inside a tile."""
    assert blocked_offset(0, 0, 4) == 0
    assert blocked_offset(1, 0, 4) == 16
    assert blocked_offset(32, 0, 4) == 4
    assert blocked_offset(0, 3, 4) == 3
    assert blocked_offset(127, 3, 4) == 31 * 16 + 3 * 4 + 3
    assert blocked_offset(0, 4, 8) == 512  # the second tile of a row of tiles
    assert blocked_offset(128, 0, 8) == 1024  # the first tile of the second row of tiles
    assert blocked_offset(128, 0, 5) == 1024  # 5 block columns pad to 2 tiles a row


def test_layout_errors():
    with pytest.raises(ValueError, match="rows, cols"):
        to_blocked(torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="512 elements"):
        from_blocked(torch.zeros(100, dtype=torch.uint8), 4, 4)
    with pytest.raises(TypeError, match="uint8"):
        as_float4_x2(torch.zeros(2, 2))


def test_packed_codes_are_float4_e2m1fn_x2(gen):
    """Our packing (element 2j in the low nibble) decodes to the same values as torchao's unpacking of the
    same bytes as float4_e2m1fn_x2, and the view is the same bytes."""
    codes = torch.randint(0, 16, (9, 64), dtype=torch.uint8, generator=gen)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    fp4 = as_float4_x2(packed)
    assert fp4.dtype == torch.float4_e2m1fn_x2 and fp4.shape == packed.shape
    assert fp4.data_ptr() == packed.data_ptr() and torch.equal(_u8(fp4), packed)
    ao_codes = unpack_uint4(_u8(fp4))
    assert torch.equal(ao_codes, codes) and torch.equal(unpack_nibbles(packed), codes)
    assert torch.equal(f4_unpacked_to_f32(ao_codes), e2m1_decode(codes))


def _e4m3_normal(gen, n: int) -> torch.Tensor:
    """n random normal E4M3 values in [2^-6, 416] (bytes 0x08 .. 0x7D)."""
    return torch.randint(0x08, 0x7E, (n,), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn).float()


def nvfp4_agreeing_input(gen, m: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, amax): an input on which our NVFP4 recipe and torchao's ``nvfp4_quantize`` agree by construction.

    The recipes differ in how they round the block scale (ours ``fl(blk_amax * fl(S_enc * fl(1/6)))``, torchao
    ``fl(fl(blk_amax / 6) / per_tensor_scale)``), in the encode scale (ours ``fl(1 / (sdec * S_dec))``, torchao
    ``fl(fl(1 / pts) / sdec)``), in clamping the block scale below at 2^-6 (we keep subnormals and 0) and in the
    sign of an exact -0.0 (code 0 here, code 8 there). So: the tensor amax is 2688 * 2^t (S_enc = 2^-t and the
    per-tensor scale 2^t are exact powers of two, both encode scales are ``2^-t * fl(1/sdec)``); each block's
    amax is ``6 * s * 2^t * (1 + d)`` with s a normal E4M3 value >= 2^-6 and |d| < 1/64, so both fp32 block
    scales lie within 1/64 + 4 * 2^-24 (+ 2^-9 for bf16 input) of s, while the nearest E4M3 rounding boundary
    is at least 1/32 of s away (3 mantissa bits): both round to s. No element is -0.0. One block in four is
    all E2M1 ties (s a power of two, d = 0, elements = ties * s * 2^t exactly) so RNE's tie rule is compared too.
    """
    t = int(torch.randint(-20, 21, (), generator=gen))
    nb = m * k // 16
    s = _e4m3_normal(gen, nb)
    d = (torch.rand(nb, generator=gen) * 2 - 1) / 64
    ties = torch.rand(nb, generator=gen) < 0.25
    s = torch.where(ties, torch.exp2(torch.floor(torch.log2(s))), s)
    d = torch.where(ties, torch.zeros_like(d), d)
    blk = 6 * s * 2.0**t * (1 + d)
    u = torch.rand(nb, 16, generator=gen) * 2 - 1
    x = u * blk[:, None]
    pick = torch.randint(0, 16, (nb,), generator=gen)
    sign = torch.where(torch.rand(nb, generator=gen) < 0.5, -1.0, 1.0)
    x[torch.arange(nb), pick] = sign * blk  # the block amax itself
    tie_vals = torch.tensor(E2M1_TIES + tuple(-v for v in E2M1_TIES) + (6.0, -6.0))
    tv = tie_vals[torch.randint(0, len(tie_vals), (nb, 16), generator=gen)]
    tv[:, 0] = 6.0  # block amax 6 * s * 2^t
    x = torch.where(ties[:, None], tv * (s * 2.0**t)[:, None], x)
    x = x.view(m, k).to(dtype)
    return x.contiguous(), torch.tensor(2688.0 * 2.0**t)


@pytest.mark.parametrize("m,k", QUANT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_quantize_equals_torchao(gen, m, k, dtype):
    x, amax = nvfp4_agreeing_input(gen, m, k, dtype)
    ao_scales, ao_codes = nvfp4_quantize(x, 16, per_tensor_amax_to_scale(amax))
    q = quantize_nvfp4_ref(x, amax=amax)
    assert torch.equal(_u8(as_float4_x2(q.codes)), ao_codes), "codes"
    assert torch.equal(_u8(q.scales), _u8(ao_scales)), "block scales"
    # the same tensor scale: torchao's per-tensor scale is our decode scale amax / 2688
    assert float(per_tensor_amax_to_scale(amax)) == float(amax) / 2688.0
    qs = quantize_nvfp4_ref(x, amax=amax, swizzled=True)
    assert qs.swizzled and torch.equal(qs.codes, q.codes)
    assert torch.equal(_u8(qs.scales), _u8(ao_to_blocked(ao_scales)).flatten()), "swizzled scales"


def test_nvfp4_agreement_domain_is_needed():
    """Outside the agreement domain the recipes do differ (so the construction above is not vacuous): an
    exact -0.0 is code 0 here and code 8 in torchao; a zero block has scale 0 here, 2^-6 there."""
    x = torch.zeros(1, 32)
    x[0, 1] = -0.0
    x[0, 16:] = 1.0
    amax = torch.tensor(1.0)
    ao_scales, ao_codes = nvfp4_quantize(x, 16, per_tensor_amax_to_scale(amax))
    q = quantize_nvfp4_ref(x, amax=amax)
    assert int(q.codes[0, 0]) >> 4 == 0 and int(ao_codes[0, 0]) >> 4 == 8
    assert float(q.scales[0, 0].float()) == 0.0 and float(ao_scales[0, 0].float()) == 2.0**-6


def mx_agreeing_input(gen, m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """An input on which our MXFP4 recipe and torchao's ``to_mx(..., FLOOR)`` agree: both take the E8M0
    exponent floor(log2(block amax)) - 2 and scale by an exact power of two; they differ for block amaxes
    below ~2^-124 (torchao clamps the divisor to the smallest normal, we scale by 2^(127 - code)), on exact
    -0.0 and on non-finite blocks. Blocks get amaxes in [2^e, 2^(e+1)], e in [-100, 100]; one block in four is
    all E2M1 ties times 2^e."""
    nb = m * k // 32
    e = torch.randint(-100, 101, (nb, 1), generator=gen).float()
    x = (torch.rand(nb, 32, generator=gen) * 2 - 1) * torch.exp2(e)
    x[:, 0] = (1 + torch.rand(nb, generator=gen)) * torch.exp2(e[:, 0])  # block amax in [2^e, 2^(e+1)]
    ties = torch.rand(nb, generator=gen) < 0.25
    tie_vals = torch.tensor(E2M1_TIES + tuple(-v for v in E2M1_TIES) + (6.0, -6.0))
    tv = tie_vals[torch.randint(0, len(tie_vals), (nb, 32), generator=gen)]
    tv[:, 0] = 6.0  # amax 6 * 2^X: exponent X + 2
    x = torch.where(ties[:, None], tv * torch.exp2(e), x)
    return x.view(m, k).to(dtype).contiguous()


@pytest.mark.parametrize("m,k", [(37, 96), (130, 160), (128, 256), (32, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_quantize_equals_torchao(gen, m, k, dtype):
    x = mx_agreeing_input(gen, m, k, dtype)
    ao_scales, ao_codes = to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
    q = quantize_mxfp4_ref(x)
    assert torch.equal(_u8(as_float4_x2(q.codes)), _u8(ao_codes)), "codes"
    assert torch.equal(q.scales, _u8(ao_scales).view(m, k // 32)), "E8M0 scales"
    qs = quantize_mxfp4_ref(x, swizzled=True)
    assert qs.swizzled and torch.equal(qs.codes, q.codes)
    assert torch.equal(qs.scales, ao_to_blocked(_u8(ao_scales).view(m, k // 32)).flatten()), "swizzled scales"


@pytest.mark.parametrize("block_2d", [False, True])
def test_rowcol_ref_swizzled(gen, block_2d):
    """The row + column references with ``swizzled=True``: the same codes, amaxes and values, the scales
    ``to_blocked`` of the row-major ones (both copies); dequantization reads either layout."""
    from nvfp4_train.kernels.nvfp4 import dequantize_nvfp4_ref

    x = torch.randn(144, 80, generator=gen)
    for sw, plain in zip(quantize_nvfp4_rowcol_ref(x, block_2d=block_2d, col_rht=not block_2d, swizzled=True),
                         quantize_nvfp4_rowcol_ref(x, block_2d=block_2d, col_rht=not block_2d)):
        assert sw.swizzled and not plain.swizzled
        assert torch.equal(sw.codes, plain.codes) and torch.equal(sw.amax, plain.amax)
        assert torch.equal(_u8(sw.scales), _u8(to_blocked(plain.scales)))
        assert torch.equal(dequantize_nvfp4_ref(sw), dequantize_nvfp4_ref(plain))
    xm = torch.randn(96, 160, generator=gen)
    for sw, plain in zip(quantize_mxfp4_rowcol_ref(xm, block_2d=block_2d, swizzled=True),
                         quantize_mxfp4_rowcol_ref(xm, block_2d=block_2d)):
        assert sw.swizzled and torch.equal(sw.codes, plain.codes)
        assert torch.equal(sw.scales, to_blocked(plain.scales))
