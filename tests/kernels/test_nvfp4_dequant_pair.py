"""The pair dequantize (kernels/fp4_gemm.py ``dequantize_fp4_blockwise_pair_triton``, ``_dequant_pair_kernel``):
both operands of one GEMM in ONE launch, the same bits as the reference dequantization (raw bits: zero signs
included, NaN at the same places); and the GEMM (both engines) launches it once per GEMM.

``triton`` tests run under TRITON_INTERPRET=1 on CPU (``make test``) and natively on CUDA (``make test-gpu``); the
unmarked one (argument errors) launches nothing.
"""

from __future__ import annotations

import pytest
import torch

import nvfp4_train.kernels.fp4_gemm as fp4_gemm
from nvfp4_train.kernels.fp4_gemm import dequantize_fp4_blockwise_pair_triton, gemm_alpha_cublas, gemm_alpha_triton
from nvfp4_train.kernels.fp4_reference import e2m1_decode, unpack_nibbles
from nvfp4_train.kernels.mxfp4.reference import e8m0_to_float32
from nvfp4_train.kernels.nvfp4.gemm import _alpha, nvfp4_gemm_predequant
from nvfp4_train.kernels.nvfp4.reference import NVFP4Tensor, _blockwise_values
from tests.kernels.test_nvfp4_gemm import assert_bitwise, make, on, random_operand, to_cpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def same_bits(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Raw bit equality, zero signs included; NaN at the same positions (its payload is the device's)."""
    got, ref = got.cpu(), ref.cpu()
    if got.dtype != ref.dtype or got.shape != ref.shape or not torch.equal(got.isnan(), ref.isnan()):
        return False
    keep = ~ref.isnan()
    return torch.equal(got[keep].view(_BITS[got.dtype]), ref[keep].view(_BITS[ref.dtype]))


def dequant_ref(codes: torch.Tensor, scales: torch.Tensor, block: int, scale_format: str,
                dtype: torch.dtype) -> torch.Tensor:
    """``e2m1 * scale`` in fp32 (exact) from packed codes and scale bytes, then ``dtype`` (exact too: at most
    6 significant bits, in range): the reference of the pair kernel."""
    codes, scales = codes.cpu(), scales.cpu().view(torch.uint8)
    if scale_format == "e4m3":
        sc = scales.view(torch.float8_e4m3fn).float()
    else:
        sc = e8m0_to_float32(scales)
    return (e2m1_decode(unpack_nibbles(codes)) * sc.repeat_interleave(block, dim=1)).to(dtype)


def every_byte_operand(rows: int, K: int, gen: torch.Generator, device: str, offset: int = 0) -> NVFP4Tensor:
    """Random codes (all 16) and scale bytes cycling through all 256 E4M3 bytes (+-0, the subnormals 0x01-0x07,
    448, negatives, both NaN bytes 0x7F / 0xFF), starting at ``offset``."""
    codes = torch.randint(0, 16, (rows, K), generator=gen)
    sc = (torch.arange(rows * (K // 16)) + offset).remainder(256).view(rows, K // 16)
    return make(codes, sc, 1.0, device)


# (M, N, K): operands of different shapes; K a multiple of 16 but not of the K tile; M, N not multiples of
# the row tile; a single row; an empty operand
SHAPES = [(37, 5, 16 * 9), (1, 70, 48), (65, 129, 16 * 11), (0, 20, 32), (20, 0, 32)]


@pytest.mark.triton
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tiles", [dict(), dict(block_m=16, block_k=32)])
def test_pair_equals_reference(triton_device, gen, shape, tiles):
    M, N, K = shape
    a = every_byte_operand(M, K, gen, triton_device)
    b = every_byte_operand(N, K, gen, triton_device, offset=101)
    ref_a, ref_b = _blockwise_values(to_cpu(a)), _blockwise_values(to_cpu(b))
    for dt in DTYPES:
        kw = dict(block=16, scale_format="e4m3", dtype=dt, **tiles)
        da, db = dequantize_fp4_blockwise_pair_triton(a.codes, a.scales, b.codes, b.scales, **kw)
        assert da.shape == (M, K) and db.shape == (N, K) and da.dtype == db.dtype == dt
        assert da.is_contiguous() and db.is_contiguous()
        assert same_bits(da, dequant_ref(a.codes, a.scales, 16, "e4m3", dt)), f"A {dt}"
        assert same_bits(db, dequant_ref(b.codes, b.scales, 16, "e4m3", dt)), f"B {dt}"
        assert_bitwise(da.float(), ref_a, f"A {dt}")
        assert_bitwise(db.float(), ref_b, f"B {dt}")


@pytest.mark.triton
def test_pair_zero_and_subnormal_scales(triton_device, gen):
    """Blocks with scale +-0 (all values exact zeros) and every E4M3 subnormal scale (2^-9 .. 7 * 2^-9), the
    smallest products (code 1 = 0.5 times 2^-9 = 2^-10) included, in fp16 (fp16 normals) and bf16/fp32."""
    M, N, K = 9, 17, 16 * 3
    sub = torch.tensor([0x00, 0x80, 0x01, 0x81, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x87])
    a = make(torch.randint(0, 16, (M, K), generator=gen), sub[torch.randint(0, len(sub), (M, K // 16),
                                                                            generator=gen)], 1.0, triton_device)
    b_codes = torch.ones(N, K, dtype=torch.int64)  # code 1 = 0.5 everywhere
    b = make(b_codes, sub[torch.arange(N * K // 16) % len(sub)].view(N, K // 16), 1.0, triton_device)
    for dt in DTYPES:
        kw = dict(block=16, scale_format="e4m3", dtype=dt)
        da, db = dequantize_fp4_blockwise_pair_triton(a.codes, a.scales, b.codes, b.scales, **kw)
        assert same_bits(da, dequant_ref(a.codes, a.scales, 16, "e4m3", dt))
        assert same_bits(db, dequant_ref(b.codes, b.scales, 16, "e4m3", dt))
        assert_bitwise(da.float(), _blockwise_values(to_cpu(a)))
        assert_bitwise(db.float(), _blockwise_values(to_cpu(b)))
        assert (db.float().abs().cpu()[db.float().cpu() != 0] >= 2.0**-10).all()


@pytest.mark.triton
def test_pair_strided_inputs_and_e8m0(triton_device, gen):
    """Codes and scales given as non-contiguous views (row strides wider than the row): the strides are
    passed per operand. And the MXFP4 scale format (E8M0, block 32, bytes 0 and 0xFF included)."""
    M, N, K = 23, 41, 16 * 5
    wide_a = torch.randint(0, 256, (M, K // 2 + 7), generator=gen, dtype=torch.uint8).to(triton_device)
    wide_b = torch.randint(0, 256, (N, K), generator=gen, dtype=torch.uint8).to(triton_device)
    sa = torch.randint(0, 256, (M, K // 16 + 3), generator=gen, dtype=torch.uint8).to(triton_device)[:, 1:1 + K // 16]
    sb = torch.randint(0, 256, (K // 16, N), generator=gen, dtype=torch.uint8).to(triton_device).t()
    ac, bc = wide_a[:, :K // 2], wide_b[:, 3:3 + K // 2]
    assert not (ac.is_contiguous() or bc.is_contiguous() or sa.is_contiguous() or sb.is_contiguous())
    for dt in DTYPES:
        kw = dict(block=16, scale_format="e4m3", dtype=dt, block_m=16, block_k=32)
        da, db = dequantize_fp4_blockwise_pair_triton(ac, sa, bc, sb, **kw)
        assert same_bits(da, dequant_ref(ac, sa, 16, "e4m3", dt))
        assert same_bits(db, dequant_ref(bc, sb, 16, "e4m3", dt))
    Kx = 32 * 3
    ac = torch.randint(0, 256, (M, Kx // 2), generator=gen, dtype=torch.uint8).to(triton_device)
    bc = torch.randint(0, 256, (N, Kx // 2), generator=gen, dtype=torch.uint8).to(triton_device)
    sa = torch.randint(0, 250, (M, Kx // 32), generator=gen, dtype=torch.uint8)  # 6 * 2^(250-127): finite
    sa[0, 0], sa[1, 1] = 0, 255
    sa = sa.to(triton_device)
    sb = torch.randint(100, 150, (N, Kx // 32), generator=gen, dtype=torch.uint8).to(triton_device)
    for dt in (torch.bfloat16, torch.float32):
        kw = dict(block=32, scale_format="e8m0", dtype=dt, block_m=16, block_k=32)
        da, db = dequantize_fp4_blockwise_pair_triton(ac, sa, bc, sb, **kw)
        assert same_bits(da, dequant_ref(ac, sa, 32, "e8m0", dt))
        assert same_bits(db, dequant_ref(bc, sb, 32, "e8m0", dt))


class _CountLaunches:
    """Stands in for a Triton kernel object in nvfp4_train.kernels.fp4_gemm: counts ``kernel[grid]`` launches."""

    def __init__(self, kernel):
        self.kernel, self.n = kernel, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.kernel[grid]


@pytest.mark.triton
@pytest.mark.parametrize("engine", ["cublas", "triton"])
def test_predequant_gemm_one_dequant_launch(triton_device, gen, monkeypatch, engine):
    """One GEMM launches the pair kernel once; its result is the same bits as the engine's GEMM over the
    reference's dequantized operands."""
    M, N, K = 37, 48, 16 * 7
    a = on(random_operand(gen, M, K), triton_device)
    b = on(random_operand(gen, N, K, block_2d=True), triton_device)
    dt = torch.bfloat16 if engine == "cublas" else torch.float16
    kw = dict(block=16, scale_format="e4m3", dtype=dt)
    # the reference's operands laid out as the pair kernel lays them out (one [M + N, K] buffer): cuBLAS picks its
    # algorithm, and so its summation order, by the operands' alignment too
    both = torch.cat([dequant_ref(a.codes, a.scales, **kw), dequant_ref(b.codes, b.scales, **kw)]).to(triton_device)
    da, db = both[:M], both[M:]
    pair = _CountLaunches(fp4_gemm._dequant_pair_kernel)
    monkeypatch.setattr(fp4_gemm, "_dequant_pair_kernel", pair)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = nvfp4_gemm_predequant(a, b, out_dtype, engine=engine)
        if engine == "cublas":
            want = gemm_alpha_cublas(da, db, None, out_dtype, amax=(a.amax, b.amax))
        else:
            want = gemm_alpha_triton(da, db, _alpha(a, b), out_dtype)
        assert same_bits(got, want), f"{engine} {out_dtype}"
    assert pair.n == 2


@pytest.mark.triton
def test_pair_forms_alpha_from_amax(triton_device, gen):
    """Given the amax pair, the same launch also writes ``nvfp4_alpha``'s bits (the cuBLAS engine's epilogue reads
    them on CUDA), for random amaxes and the edge values (0, subnormal, huge, Inf, NaN); the operands are the same
    bits as without it."""
    from nvfp4_train.kernels.nvfp4.reference import nvfp4_alpha

    a = on(random_operand(gen, 19, 64), triton_device)
    b = on(random_operand(gen, 32, 64, block_2d=True), triton_device)
    kw = dict(block=16, scale_format="e4m3", dtype=torch.float16)
    da0, db0, none = fp4_gemm._dequant_pair(a.codes, a.scales, b.codes, b.scales, **kw)
    assert none is None
    rnd = (torch.rand(8, generator=gen) * 10.0 ** torch.randint(-30, 31, (8,), generator=gen)).tolist()
    edges = [0.0, 1e-45, 3.4e38, float("inf"), float("nan"), 2688.0]
    for x, y in list(zip(rnd, rnd[::-1])) + [(e, r) for e, r in zip(edges, rnd)] + [(r, e) for e, r in zip(edges, rnd)]:
        ta, tb = (torch.tensor([v], dtype=torch.float32, device=triton_device) for v in (x, y))
        da, db, alpha = fp4_gemm._dequant_pair(a.codes, a.scales, b.codes, b.scales, amax=(ta, tb), **kw)
        want = nvfp4_alpha(ta.cpu(), tb.cpu()).reshape(1)
        assert alpha.shape == (1,) and alpha.dtype == torch.float32
        assert same_bits(alpha, want), f"amax ({x}, {y}): {alpha.item()} vs {want.item()}"
        assert same_bits(da, da0) and same_bits(db, db0)


def test_pair_argument_checks():
    c = torch.zeros(4, 16, dtype=torch.uint8)
    s = torch.zeros(4, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="K differ"):
        dequantize_fp4_blockwise_pair_triton(c, s, torch.zeros(4, 8, dtype=torch.uint8), s[:, :1], block=16,
                                             scale_format="e4m3", dtype=torch.float16)
    with pytest.raises(ValueError, match="multiple of the scale block"):
        dequantize_fp4_blockwise_pair_triton(c[:, :12], s, c[:, :12], s, block=16, scale_format="e4m3",
                                             dtype=torch.float16)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        dequantize_fp4_blockwise_pair_triton(c, s, c, s, block=16, scale_format="e4m3", dtype=torch.int8)
    with pytest.raises(ValueError, match="E8M0"):
        dequantize_fp4_blockwise_pair_triton(c, s[:, :1], c, s[:, :1], block=32, scale_format="e8m0",
                                             dtype=torch.float16)

