"""FP8 GEMM ``C[M, N] = A[M, K] . B[N, K]^T`` on ``FP8Tensor`` operands (scales applied per block).

Backends (``fp8_gemm_backend`` says which one a call takes; each name says what it is):

* ``"scaled_mm_blockwise"`` (CUDA, Hopper sm_90, cuBLASLt >= 12.9): ``torch.nn.functional.scaled_mm``
  with DeepSeek-style scales. The native pairs and the scale layouts torch checks (ATen ScaledBlas.cpp,
  the same in torch 2.11 and 2.13), with ``mat_a = A.data`` [M, K] row-major and ``mat_b = B.data.t()``
  [K, N] column-major, Kb = K/128, Kp = round_up(Kb, 4):
      1x128   x 128x128 (Fprop, Dgrad): scale_a [M, Kb] strides (1, M);  scale_b [Kp, N/128] strides (1, Kp)
      128x128 x 1x128:                  scale_a [Kp, M/128] strides (1, Kp); scale_b [N, Kb] strides (1, N)
      1x128   x 1x128   (Wgrad):        scale_a [M, Kb] strides (1, M);  scale_b [N, Kb] strides (1, N)
  (the 128x128 scale is the transposed, Kb-padded [R/128, Kp] row-major array; padding entries are 1).
  Other pairs are mapped onto these exactly: a 128x128 (or per-tensor) operand is also a 1x128 operand
  whose scales repeat over rows, so e.g. 128x128 x 128x128 runs as 1x128 x 128x128.
* ``"scaled_mm_tensorwise"`` (CUDA sm_89+): ``torch._scaled_mm`` with 0-d fp32 scales, both operands per
  tensor.
* ``"scaled_mm_rowwise_per_kblock"`` (CUDA fallback when blockwise scaling is refused, e.g. another arch
  or an older cuBLAS): one rowwise-scaled ``torch._scaled_mm`` per 128-long K block (scale_a [M, 1] and
  scale_b [1, N] from that block's scales), accumulated in fp32. The same math as the blockwise kernel,
  K/128 launches: slow, for correctness only.
* ``"emulated_fp64"``: ``fp8_gemm_ref`` (exact float64 emulation) on the operands' device: the CPU path,
  and the CUDA path when no scaled_mm form is usable (shape not a multiple of 16, no FP8 tensor cores).

Support for each native blockwise pair is probed once per (device, pair, Kb % 4 == 0, out dtype) with a
tiny GEMM on exactly summable inputs (small integers, power-of-two scales) that must equal the emulation
bit for bit; a refusal or a mismatch (a scale layout read differently) selects the fallback with a warning.

``fp8_gemm_accumulate(a, b, c)`` adds ``A . B^T`` into an fp32 ``c`` in the GEMM's epilogue (cuBLASLt, beta = 1,
``nvfp4_train.kernels.cublaslt.matmul_fp8_scaled``): the Wgrad GEMM into megatron's ``main_grad`` without a bf16
gradient and a second pass. The same scalings and scale layouts as ``scaled_mm_blockwise`` /
``scaled_mm_tensorwise`` (a 128x128 x 128x128 pair runs as 1x128 x 128x128); probed once per (device, pair,
Kb % 4 == 0) with exactly summable operands added into a C of small integers, which must equal C + the emulation
bit for bit. Where the probe fails, the shape is not one Hopper's FP8 GEMM takes, or cuBLASLt has no algorithm for
it, it returns False having written nothing, and the caller computes the gradient as before.

Accuracy against the emulation (the bound the GPU tests use): cuBLAS sums each 128-long K block in the
tensor-core accumulator, multiplies by the two block scales and accumulates in fp32. Taking the Hopper
FP8 accumulator's precision as >= 13 fraction bits (u_tc = 2^-13; DeepSeek-V3 measured ~14 bits) and
fp32 (u = 2^-24) for the rest, recursive summation gives
    |C_gpu - C_exact| <= (128 u_tc + (Kb + 2) u) * sum_k |A_deq[m, k] B_deq[n, k]|  (+ |C| 2^-8 for bf16 out)
Use ``use_fast_accum=False`` (the default here, as Transformer Engine's split accumulator) so partial
sums are promoted to fp32 at least once per block.
"""

from __future__ import annotations

import warnings

import torch

from nvfp4_train.kernels.fp8.reference import BLOCK, FP8Tensor, fp8_gemm_ref, m_major

__all__ = ["BACKENDS", "fp8_gemm", "fp8_gemm_backend", "fp8_gemm_accumulate", "blockwise_supported",
           "native_blockwise_pair", "cublas_scales"]

BACKENDS = ("scaled_mm_blockwise", "scaled_mm_tensorwise", "scaled_mm_rowwise_per_kblock", "emulated_fp64")
_ONE_BY = (1, BLOCK)
_TILE = (BLOCK, BLOCK)
_probe_cache: dict[tuple, bool] = {}


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def _check_operands(a: FP8Tensor, b: FP8Tensor) -> None:
    if not isinstance(a, FP8Tensor) or not isinstance(b, FP8Tensor):
        raise TypeError(f"fp8_gemm takes FP8Tensor operands, got {type(a).__name__} and {type(b).__name__}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"FP8 GEMM: reduction dims differ (A is {a.shape}, B is {b.shape})")
    if a.data.device != b.data.device:
        raise ValueError(f"FP8 GEMM: operands on different devices ({a.data.device}, {b.data.device})")


def native_blockwise_pair(a: FP8Tensor, b: FP8Tensor) -> tuple[str, str]:
    """The cuBLAS scaling pair a blockwise GEMM of these operands runs as."""
    if a.block == _TILE and b.block != _TILE:
        return ("128x128", "1x128")
    if b.block == _TILE:
        return ("1x128", "128x128")
    return ("1x128", "1x128")


def scale_1x128_operand(q: FP8Tensor) -> torch.Tensor:
    """Decode scales of ``q`` [R, K] as a 1x128 scale array [R, K/128], fp32, stored R-major (strides (1, R))."""
    r, k = q.shape
    kb = k // BLOCK
    s = q.scale_inv.to(torch.float32)
    if q.block == _TILE:
        s = s.repeat_interleave(BLOCK, dim=0)
    elif q.block is None:
        s = s.reshape(1, 1).expand(r, kb)
    if s.stride(0) == 1 and (s.stride(1) == r or kb == 1):
        return s
    return m_major(s)


def scale_128x128_operand(q: FP8Tensor) -> torch.Tensor:
    """128x128 decode scales [R/128, Kb] as cuBLAS's [Kp, R/128] array, strides (1, Kp), padding 1."""
    s = q.scale_inv.to(torch.float32)
    rb, kb = s.shape
    kp = _round_up(kb, 4)
    if kp == kb and s.is_contiguous():
        return s.t()
    buf = torch.ones((rb, kp), dtype=torch.float32, device=s.device)
    buf[:, :kb] = s
    return buf.t()


def _scaling_types():
    """torch.nn.functional.ScalingType (torch >= 2.10), or None."""
    import torch.nn.functional as F

    return getattr(F, "ScalingType", None) if hasattr(F, "scaled_mm") else None


def _scaled_mm_blockwise(a: FP8Tensor, b: FP8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    import torch.nn.functional as F

    st = _scaling_types()
    form_a, form_b = native_blockwise_pair(a, b)
    if form_a == "128x128":
        sa, ra = scale_128x128_operand(a), st.BlockWise128x128
    else:
        sa, ra = scale_1x128_operand(a), st.BlockWise1x128
    if form_b == "128x128":
        sb, rb = scale_128x128_operand(b), st.BlockWise128x128
    else:
        sb, rb = scale_1x128_operand(b), st.BlockWise1x128
    return F.scaled_mm(
        a.data.contiguous(), b.data.contiguous().t(), sa, ra, sb, rb, output_dtype=out_dtype, use_fast_accum=False
    )


def _scaled_mm_tensorwise(a: FP8Tensor, b: FP8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return torch._scaled_mm(
        a.data.contiguous(), b.data.contiguous().t(),
        scale_a=a.scale_inv.to(torch.float32).reshape(()), scale_b=b.scale_inv.to(torch.float32).reshape(()),
        out_dtype=out_dtype, use_fast_accum=False,
    )


def _scaled_mm_rowwise_per_kblock(a: FP8Tensor, b: FP8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    (m, k), n = a.shape, b.shape[0]
    sa = scale_1x128_operand(a)
    sb = scale_1x128_operand(b)
    out = torch.zeros((m, n), dtype=torch.float32, device=a.data.device)
    for kb in range(k // BLOCK):
        cols = slice(kb * BLOCK, (kb + 1) * BLOCK)
        out += torch._scaled_mm(
            a.data[:, cols].contiguous(), b.data[:, cols].contiguous().t(),
            scale_a=sa[:, kb].contiguous().view(m, 1), scale_b=sb[:, kb].contiguous().view(1, n),
            out_dtype=torch.float32, use_fast_accum=False,
        )
    return out.to(out_dtype)


_IMPLS = {
    "scaled_mm_blockwise": _scaled_mm_blockwise,
    "scaled_mm_tensorwise": _scaled_mm_tensorwise,
    "scaled_mm_rowwise_per_kblock": _scaled_mm_rowwise_per_kblock,
    "emulated_fp64": fp8_gemm_ref,
}


def _probe_operands(block_a, block_b, m: int, n: int, k: int, device) -> tuple[FP8Tensor, FP8Tensor]:
    """Exactly summable FP8 operands: small integer values, power-of-two block scales (varying per block, so
    a misread scale layout changes the result)."""
    g = torch.Generator().manual_seed(1234)

    def make(r: int, block) -> FP8Tensor:
        data = torch.randint(-4, 5, (r, k), generator=g).to(torch.float32).to(torch.float8_e4m3fn)
        if block is None:
            shape = ()
        elif block == _ONE_BY:
            shape = (r, k // BLOCK)
        else:
            shape = (r // BLOCK, k // BLOCK)
        scale = torch.exp2(torch.randint(-2, 3, shape, generator=g).to(torch.float32))
        if block == _ONE_BY:
            scale = m_major(scale)
        return FP8Tensor(data=data.to(device), scale_inv=scale.to(device), block=block)

    return make(m, block_a), make(n, block_b)


def _probe(name: str, key: tuple, block_a, block_b, k: int, out_dtype: torch.dtype, device) -> bool:
    if key in _probe_cache:
        return _probe_cache[key]
    ok, why = False, ""
    try:
        a, b = _probe_operands(block_a, block_b, 256, 256, k, device)
        got = _IMPLS[name](a, b, out_dtype)
        want = fp8_gemm_ref(a, b, out_dtype)
        ok = bool(torch.equal(got, want))
        if not ok:
            why = "its result differs from the exact emulation on exactly summable inputs (scale layout?)"
    except (RuntimeError, ValueError, TypeError, NotImplementedError, AttributeError) as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if not ok:
        warnings.warn(f"FP8 GEMM: {name} {key[2:]} is not usable on {device} ({why}); falling back", stacklevel=3)
    _probe_cache[key] = ok
    return ok


def blockwise_supported(a: FP8Tensor, b: FP8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``scaled_mm_blockwise`` runs (and is right) for this pair of scalings on a's device."""
    dev = a.data.device
    if dev.type != "cuda" or _scaling_types() is None:
        return False
    if torch.cuda.get_device_capability(dev) != (9, 0):  # torch gates DeepSeek-style scaling to sm_90
        return False
    form_a, form_b = native_blockwise_pair(a, b)
    aligned = (a.shape[1] // BLOCK) % 4 == 0
    k = BLOCK * (4 if aligned else 3)
    ba = _TILE if form_a == "128x128" else _ONE_BY
    bb = _TILE if form_b == "128x128" else _ONE_BY
    key = ("scaled_mm_blockwise", str(dev), form_a, form_b, f"Kb%4=={0 if aligned else 'r'}", out_dtype)
    return _probe("scaled_mm_blockwise", key, ba, bb, k, out_dtype, dev)


def _cuda_fp8_capable(dev: torch.device) -> bool:
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9)


def fp8_gemm_backend(a: FP8Tensor, b: FP8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> str:
    """The backend ``fp8_gemm`` uses for these operands (one of ``BACKENDS``)."""
    _check_operands(a, b)
    dev = a.data.device
    (m, k), n = a.shape, b.shape[0]
    if not _cuda_fp8_capable(dev) or k % 16 != 0 or n % 16 != 0 or m == 0 or n == 0 or k == 0:
        return "emulated_fp64"
    if a.block is None and b.block is None:
        key = ("scaled_mm_tensorwise", str(dev), out_dtype)
        ok = _probe("scaled_mm_tensorwise", key, None, None, 4 * BLOCK, out_dtype, dev)
        return "scaled_mm_tensorwise" if ok else "emulated_fp64"
    if blockwise_supported(a, b, out_dtype):
        return "scaled_mm_blockwise"
    key = ("scaled_mm_rowwise_per_kblock", str(dev), out_dtype)
    if _probe("scaled_mm_rowwise_per_kblock", key, _ONE_BY, _ONE_BY, 4 * BLOCK, out_dtype, dev):
        return "scaled_mm_rowwise_per_kblock"
    return "emulated_fp64"


def fp8_gemm(
    a: FP8Tensor, b: FP8Tensor, out_dtype: torch.dtype = torch.bfloat16, backend: str | None = None
) -> torch.Tensor:
    """``C[M, N] = A[M, K] . B[N, K]^T`` with both operands' per-block (or per-tensor) decode scales applied.

    CPU tensors: the exact emulation. CUDA: ``backend`` (default: ``fp8_gemm_backend``'s choice)."""
    _check_operands(a, b)
    if backend is None:
        backend = fp8_gemm_backend(a, b, out_dtype)
    if backend not in _IMPLS:
        raise ValueError(f"unknown FP8 GEMM backend {backend!r}; choose one of {BACKENDS}")
    if backend == "scaled_mm_tensorwise" and (a.block is not None or b.block is not None):
        raise ValueError("scaled_mm_tensorwise needs both operands scaled per tensor (block=None)")
    return _IMPLS[backend](a, b, out_dtype)


# ------------------------------------------------------------------ accumulate into an fp32 C (Wgrad into main_grad)

_unsupported_shapes: set[tuple] = set()


def cublas_scales(a: FP8Tensor, b: FP8Tensor) -> tuple[torch.Tensor, int, torch.Tensor, int]:
    """(A's scales, A's cuBLASLt scale mode, B's scales, B's mode) of the GEMM ``A . B^T``: per tensor when both
    operands are, else the native blockwise pair (``native_blockwise_pair``) in the layouts of
    ``scaled_mm_blockwise``."""
    from nvfp4_train.kernels.cublaslt import SCALE_BLK128x128_32F, SCALE_SCALAR_32F, SCALE_VEC128_32F

    out = []
    for q, form in zip((a, b), _accumulate_pair(a, b)):
        if form == "tensor":
            out += [q.scale_inv.to(torch.float32).reshape(1), SCALE_SCALAR_32F]
        elif form == "128x128":
            out += [scale_128x128_operand(q), SCALE_BLK128x128_32F]
        else:
            out += [scale_1x128_operand(q), SCALE_VEC128_32F]
    return tuple(out)


def _accumulate_pair(a: FP8Tensor, b: FP8Tensor) -> tuple:
    """The scaling of each operand in the accumulating GEMM: both per tensor, or the native blockwise pair."""
    if a.block is None and b.block is None:
        return ("tensor", "tensor")
    return native_blockwise_pair(a, b)


def _accumulate_probe(key: tuple, pair: tuple, aligned: bool, device) -> bool:
    """Whether cuBLASLt adds this pair's product into an fp32 C exactly as the emulation says (once per key)."""
    if key in _probe_cache:
        return _probe_cache[key]
    from nvfp4_train.kernels.cublaslt import matmul_fp8_scaled

    blocks = {"tensor": None, "1x128": _ONE_BY, "128x128": _TILE}
    ok, why = False, ""
    try:
        a, b = _probe_operands(blocks[pair[0]], blocks[pair[1]], 256, 256, BLOCK * (4 if aligned else 3), device)
        g = torch.Generator().manual_seed(4321)
        c = torch.randint(-64, 65, (256, 256), generator=g).to(torch.float32).to(device)
        want = c + fp8_gemm_ref(a, b, torch.float32)  # small integers and powers of two: every sum exact in fp32
        got = c.clone()
        sa, ma, sb, mb = cublas_scales(a, b)
        matmul_fp8_scaled(a.data, b.data, sa, ma, sb, mb, torch.float32, out=got, accumulate=True)
        ok = bool(torch.equal(got, want))
        if not ok:
            why = "its result differs from C + the exact emulation on exactly summable inputs (scale layout?)"
    except (RuntimeError, ValueError, TypeError, OSError) as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if not ok:
        warnings.warn(f"FP8 GEMM: accumulating {pair} into fp32 is not usable on {device} ({why}); the Wgrad "
                      f"GEMM writes its gradient for megatron to add", stacklevel=4)
    _probe_cache[key] = ok
    return ok


def fp8_gemm_accumulate(a: FP8Tensor, b: FP8Tensor, c: torch.Tensor) -> bool:
    """``c[M, N] += A[M, K] . B[N, K]^T`` (both operands' decode scales applied, fp32 accumulation) in one cuBLASLt
    GEMM whose epilogue adds into ``c`` (a contiguous fp32 CUDA tensor): ``c = fl32(acc) + c``. Returns False, with
    ``c`` untouched, where that GEMM cannot run here (module docstring); the caller then computes the product
    itself. The first call of a scaling pair probes it (a host read: outside CUDA-graph capture, where an unprobed
    pair returns False)."""
    _check_operands(a, b)
    dev = a.data.device
    (m, k), n = a.shape, b.shape[0]
    if (dev.type != "cuda" or c.device != dev or c.dtype != torch.float32 or c.shape != (m, n)
            or not c.is_contiguous() or a.data.dtype != b.data.dtype):
        return False
    pair = _accumulate_pair(a, b)
    k_step = 16 if pair == ("tensor", "tensor") else BLOCK
    if not a.data.is_contiguous() or not b.data.is_contiguous() or k % k_step or m % 16 or n % 16 or m == 0 \
            or n == 0:
        return False
    cap = torch.cuda.get_device_capability(dev)
    if cap < (8, 9) or (pair != ("tensor", "tensor") and cap != (9, 0)):
        return False
    aligned = (k // BLOCK) % 4 == 0
    key = ("accumulate", str(dev), pair, aligned)
    if key not in _probe_cache and torch.cuda.is_current_stream_capturing():
        return False
    if not _accumulate_probe(key, pair, aligned, dev):
        return False
    shape_key = (str(dev), pair, m, n, k)
    if shape_key in _unsupported_shapes:
        return False
    from nvfp4_train.kernels.cublaslt import matmul_fp8_scaled

    sa, ma, sb, mb = cublas_scales(a, b)
    try:
        matmul_fp8_scaled(a.data, b.data, sa, ma, sb, mb, torch.float32, out=c, accumulate=True)
    except RuntimeError as e:  # no algorithm: raised before anything is launched
        _unsupported_shapes.add(shape_key)
        warnings.warn(f"FP8 GEMM: accumulating [{m}, {k}] x [{n}, {k}] ({pair}) into fp32 is not available "
                      f"({str(e).splitlines()[0]}); that Wgrad GEMM writes its gradient", stacklevel=2)
        return False
    return True
