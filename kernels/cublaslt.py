"""cuBLASLt's GEMM with alpha read from DEVICE memory: ``D = round_to_D(fl32(alpha * (A @ B^T)))``.

torch calls cuBLAS with alpha as a host float only (``torch.addmm(..., alpha=)``), and the NVFP4 GEMM's
alpha (``amax_A * amax_B / 2688^2``) lives on the device: reading it back would sync the host once per GEMM.
cuBLASLt takes alpha by pointer (``CUBLASLT_POINTER_MODE_DEVICE``) and applies it in the GEMM's own epilogue,
so the fp32 accumulator is scaled and rounded to the output dtype before it leaves the tensor-core kernel:
no fp32 [M, N] round trip and no second pass. This module is the thin ``ctypes`` binding to the handful of
cuBLASLt calls that needs (the library torch itself loaded; nothing is built).

Arithmetic (RECIPE §3; the same as the Triton GEMM's epilogue): fp32 accumulation of exact products (the
operands are dequantized FP4 values, exact in bf16/fp16), then ``fl32(alpha * acc)`` (scale type fp32, beta
zero), then one rounding to the output dtype (RNE). Split-K is allowed only with the partial sums reduced in
fp32 (``CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE``): the "in place" and "output type" schemes would add
partial sums in a bf16 output. tests/kernels/test_nvfp4_gemm_cublas.py checks all of it bit for bit on
exactly-summable inputs at K = 20480 on the GPU.

Layout: A [M, K] and B [N, K], D [M, N] row-major. In cuBLAS's column-major terms that is D^T (N x M) =
op(B) (N x K) . op(A) (K x M): with both operands K-contiguous (row-major) the "TN" GEMM torch runs for
``a @ b.t()``; an operand given as a transposed view (M- or N-contiguous, e.g. ``dy.t()`` of a row-major dy) is
read in place with the other transpose flag, so the three GEMMs of a linear layer (fprop x.W^T, dgrad dy.W,
wgrad dy^T.x) need no copies.

Accumulation (``accumulate=True``, beta = 1 read from the device): ``D = fl32(alpha * acc) + C`` in the same
epilogue, C = D's old contents: the weight-gradient GEMM adds straight into megatron's fp32 ``main_grad``
(``nvfp4_train.mcore_compat.wgrad``) instead of writing a bf16 gradient that a second pass adds.

FP8 operands (:func:`matmul_fp8_scaled`): E4M3/E5M2 A and B, both K-contiguous (Hopper's FP8 tensor cores take
only the "TN" form), each with its decode scales read by the GEMM: one fp32 scalar per tensor
(``SCALE_SCALAR_32F``), one per 128 elements along K (``SCALE_VEC128_32F``, DeepSeek's 1x128) or per 128x128 tile
(``SCALE_BLK128x128_32F``), cuBLASLt 12.9 and later; the scale arrays in the layouts ``torch.nn.functional.scaled_mm``
hands cuBLASLt (``nvfp4_train.kernels.fp8.gemm``). The accumulator is promoted to fp32 per 128-long K block (no fast
accumulation), the scales applied there, and the epilogue adds C (beta = 1): the FP8 Wgrad GEMM adds into the fp32
``main_grad`` as the NVFP4 and bf16 ones do.

Per (device, shape, dtypes, scale modes, leading dimensions, pointer alignments) the descriptors and the algorithm
the heuristic picks are built once and kept; per (device, stream) one 32 MiB workspace. A call then costs one
``cublasLtMatmul`` (and no host-device synchronization); it can be captured in a CUDA graph. The FP8 scale pointers
are the call's own: they are set on the kept descriptor and the GEMM launched under one lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import threading

import torch

__all__ = ["matmul_device_alpha", "matmul_fp8_scaled", "supported_dtypes", "SCALE_SCALAR_32F", "SCALE_VEC128_32F",
           "SCALE_BLK128x128_32F"]

# cublasComputeType_t, cudaDataType_t, cublasOperation_t, cublasLtPointerMode_t (cublas_api.h, library_types.h)
_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF, _R_8F_E4M3, _R_8F_E5M2 = 0, 2, 14, 28, 29
_OP_N, _OP_T = 0, 1
_POINTER_MODE_DEVICE = 1
# cublasLtMatmulDescAttributes_t
_DESC_POINTER_MODE, _DESC_TRANSA, _DESC_TRANSB = 2, 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER, _DESC_FAST_ACCUM = 17, 18, 25
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
# cublasLtMatmulMatrixScale_t: how a scale pointer is read (cublasLt.h, cuBLAS 12.9)
SCALE_SCALAR_32F, SCALE_VEC128_32F, SCALE_BLK128x128_32F = 0, 4, 5
# cublasLtMatmulPreferenceAttributes_t
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_REDUCTION_SCHEME_MASK = 3
_PREF_MIN_ALIGNMENT = {"A": 5, "B": 6, "C": 7, "D": 8}
# cublasLtReductionScheme_t: fp32 partial sums in the workspace (NONE, no split-K, is always allowed)
_REDUCTION_SCHEME_COMPUTE_TYPE = 2

_WORKSPACE_BYTES = 32 * 1024 * 1024
_DTYPE_CODE = {torch.bfloat16: _R_16BF, torch.float16: _R_16F, torch.float32: _R_32F,
               torch.float8_e4m3fn: _R_8F_E4M3, torch.float8_e5m2: _R_8F_E5M2}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_OUT = (torch.bfloat16, torch.float32)
# (A/B dtype, D dtype) pairs cuBLASLt runs with fp32 compute and fp32 scale
_SUPPORTED = {(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
              (torch.float16, torch.float16), (torch.float16, torch.float32)}


class _HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def supported_dtypes(operand_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether ``matmul_device_alpha`` runs A, B of ``operand_dtype`` into D of ``out_dtype``."""
    return (operand_dtype, out_dtype) in _SUPPORTED


class _Lib:
    """The loaded cuBLASLt: its functions with their C signatures, and a status check."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        p, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        pp = ctypes.POINTER(ctypes.c_void_p)
        sigs = {
            "cublasLtCreate": [pp],
            "cublasLtMatmulDescCreate": [pp, i, i],
            "cublasLtMatmulDescSetAttribute": [p, i, p, sz],
            "cublasLtMatrixLayoutCreate": [pp, i, u64, u64, i64],
            "cublasLtMatmulPreferenceCreate": [pp],
            "cublasLtMatmulPreferenceSetAttribute": [p, i, p, sz],
            "cublasLtMatmulPreferenceDestroy": [p],
            "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i, ctypes.POINTER(_HeuristicResult),
                                               ctypes.POINTER(ctypes.c_int)],
            "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(_HeuristicResult), p, sz, p],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
            setattr(self, name, fn)
        self._status_string = getattr(lib, "cublasLtGetStatusString", None)
        if self._status_string is not None:
            self._status_string.argtypes, self._status_string.restype = [ctypes.c_int], ctypes.c_char_p
        self.path = path

    def check(self, status: int, what: str) -> None:
        if status != 0:
            name = self._status_string(status).decode() if self._status_string is not None else ""
            raise RuntimeError(f"cuBLASLt {what} failed: status {status} {name} (library {self.path})")


def _find_library() -> str:
    """The cuBLASLt torch uses: the one mapped into this process (torch loads it with cuBLAS), else the
    loader's."""
    torch.cuda.current_blas_handle()  # makes torch load cuBLAS (and with it cuBLASLt) on the current device
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and "libcublasLt.so" in parts[-1]:
                    return parts[-1]
    except OSError:
        pass
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", ctypes.util.find_library("cublasLt")):
        if name:
            try:
                ctypes.CDLL(name)
                return name
            except OSError:
                continue
    raise RuntimeError("cuBLASLt (libcublasLt.so) was not found in this process or by the dynamic loader; the "
                       "NVFP4 'cublas' GEMM engine needs the cuBLAS that torch's CUDA build ships")


class _State:
    """The library, and per device its handle and constants; per stream a workspace; per problem a plan."""

    def __init__(self):
        self.lock = threading.Lock()
        self.lib: _Lib | None = None
        self.handles: dict[int, ctypes.c_void_p] = {}
        self.zeros: dict[int, torch.Tensor] = {}
        self.ones: dict[int, torch.Tensor] = {}
        self.workspaces: dict[tuple[int, int], torch.Tensor] = {}
        self.plans: dict[tuple, tuple] = {}


_STATE = _State()


def _handle(dev: int) -> ctypes.c_void_p:
    st = _STATE
    if st.lib is None:
        st.lib = _Lib(_find_library())
    if dev not in st.handles:
        h = ctypes.c_void_p()
        with torch.cuda.device(dev):
            st.lib.check(st.lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        st.handles[dev] = h
    return st.handles[dev]


def _constants(dev: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(0.0, 1.0) as fp32 device scalars: beta, and alpha when none is given. Made once per device, outside
    a CUDA-graph capture; under a capture before any eager call, made for this call only (their fill is part
    of the graph, and memory filled only when a graph replays is not kept for eager calls)."""
    st = _STATE
    if dev in st.zeros:
        return st.zeros[dev], st.ones[dev]
    consts = (torch.zeros(1, dtype=torch.float32, device=f"cuda:{dev}"),
              torch.ones(1, dtype=torch.float32, device=f"cuda:{dev}"))
    if not torch.cuda.is_current_stream_capturing():
        st.zeros[dev], st.ones[dev] = consts
    return consts


def _alignment(t: torch.Tensor) -> int:
    """The largest power of two (<= 256) that divides t's address."""
    addr = t.data_ptr()
    return min(256, addr & -addr) if addr else 256


def _set_attr(desc: ctypes.c_void_p, attr: int, v) -> None:
    lib = _STATE.lib
    lib.check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), ctypes.sizeof(v)),
              f"cublasLtMatmulDescSetAttribute({attr})")


def _set_scale_pointers(desc: ctypes.c_void_p, a_scale: torch.Tensor, b_scale: torch.Tensor) -> None:
    """Our A's decode scales are cuBLAS's B scales, our B's its A scales."""
    _set_attr(desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(b_scale.data_ptr()))
    _set_attr(desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(a_scale.data_ptr()))


def _plan(handle: ctypes.c_void_p, dev: int, M: int, N: int, K: int, a_lay: tuple[bool, int],
          b_lay: tuple[bool, int], ab_dtype, d_dtype, aligns: tuple, scaling: tuple | None = None) -> tuple:
    """(desc, layout of cuBLAS's A = our B, of cuBLAS's B = our A, of D, heuristic result), built once.
    ``a_lay``/``b_lay``: (K-contiguous, leading dimension) of our A [M, K] and B [N, K] (see :func:`_layout`).
    ``scaling`` (FP8 operands): (our A's scale mode, our B's, our A's scales, our B's); the modes are part of the
    plan, the scales are this call's (set again by every call)."""
    st = _STATE
    key = (dev, M, N, K, a_lay, b_lay, ab_dtype, d_dtype, aligns, None if scaling is None else scaling[:2])
    plan = st.plans.get(key)
    if plan is not None:
        return plan
    lib = st.lib
    (a_krow, lda), (b_krow, ldb) = a_lay, b_lay
    desc = ctypes.c_void_p()
    lib.check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "cublasLtMatmulDescCreate")
    # column-major: D^T (N x M) = op(cuBLAS A = our B) (N x K) . op(cuBLAS B = our A^T) (K x M). Our B with K
    # contiguous is stored K x N (transposed, ld ldb), with N contiguous N x K (as is); our A with K contiguous is
    # stored K x M (as is), with M contiguous M x K (transposed).
    trans_a, trans_b = (_OP_T if b_krow else _OP_N), (_OP_N if a_krow else _OP_T)
    for attr, value in ((_DESC_POINTER_MODE, _POINTER_MODE_DEVICE), (_DESC_TRANSA, trans_a), (_DESC_TRANSB, trans_b)):
        _set_attr(desc, attr, ctypes.c_int32(value))
    if scaling is not None:
        a_mode, b_mode, a_scale, b_scale = scaling
        _set_attr(desc, _DESC_A_SCALE_MODE, ctypes.c_int32(b_mode))
        _set_attr(desc, _DESC_B_SCALE_MODE, ctypes.c_int32(a_mode))
        _set_attr(desc, _DESC_FAST_ACCUM, ctypes.c_int8(0))  # promote to fp32 per K block (no fast accumulation)
        _set_scale_pointers(desc, a_scale, b_scale)
    layouts = []
    b_rows, b_cols = (K, N) if b_krow else (N, K)
    a_rows, a_cols = (K, M) if a_krow else (M, K)
    for dtype, rows, cols, ld in ((ab_dtype, b_rows, b_cols, ldb), (ab_dtype, a_rows, a_cols, lda), (d_dtype, N, M, N)):
        lay = ctypes.c_void_p()
        lib.check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), _DTYPE_CODE[dtype], rows, cols, ld),
                  "cublasLtMatrixLayoutCreate")
        layouts.append(lay)
    pref = ctypes.c_void_p()
    lib.check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
    try:
        settings = [(_PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(_WORKSPACE_BYTES)),
                    (_PREF_REDUCTION_SCHEME_MASK, ctypes.c_uint32(_REDUCTION_SCHEME_COMPUTE_TYPE))]
        # cuBLAS's A is our B, its B our A; C is D
        for name, align in zip(("B", "A", "D"), aligns):
            settings.append((_PREF_MIN_ALIGNMENT[name], ctypes.c_uint32(align)))
        settings.append((_PREF_MIN_ALIGNMENT["C"], ctypes.c_uint32(aligns[2])))
        for attr, v in settings:
            lib.check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(v), ctypes.sizeof(v)),
                      f"cublasLtMatmulPreferenceSetAttribute({attr})")
        result = _HeuristicResult()
        count = ctypes.c_int(0)
        lib.check(lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, layouts[0], layouts[1], layouts[2], layouts[2],
                                                     pref, 1, ctypes.byref(result), ctypes.byref(count)),
                  "cublasLtMatmulAlgoGetHeuristic")
    finally:
        lib.cublasLtMatmulPreferenceDestroy(pref)
    if count.value < 1 or result.state != 0:
        how = "alpha on the device" if scaling is None else f"scale modes {scaling[:2]}"
        raise RuntimeError(f"cuBLASLt has no algorithm for D[{M}, {N}] = A[{M}, {K}] . B[{N}, {K}]^T with "
                           f"{ab_dtype} operands, {d_dtype} output and {how}")
    plan = (desc, layouts[0], layouts[1], layouts[2], result)
    st.plans[key] = plan
    return plan


def _layout(t: torch.Tensor) -> tuple[torch.Tensor, tuple[bool, int]]:
    """``t`` [R, K] as cuBLAS can read it without a copy: (t, (True, ld)) when K is contiguous (row-major,
    ld = stride(0)), (t, (False, ld)) when R is contiguous (a transposed view, ld = stride(1)); otherwise a
    row-major copy."""
    r, k = t.shape
    if t.stride(1) == 1 and t.stride(0) >= max(k, 1):
        return t, (True, t.stride(0))
    if t.stride(0) == 1 and t.stride(1) >= max(r, 1):
        return t, (False, t.stride(1))
    t = t.contiguous()
    return t, (True, max(k, 1))


def _workspace(dev: int, stream: int) -> torch.Tensor:
    """The workspace of cuBLASLt's calls on ``stream`` (scratch: never read before written, so one made under a
    CUDA-graph capture, from the graph's memory, serves that stream's later captures too)."""
    ws = _STATE.workspaces.get((dev, stream))
    if ws is None:
        ws = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{dev}")
        _STATE.workspaces[(dev, stream)] = ws
    return ws


def matmul_device_alpha(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor | None, out_dtype: torch.dtype,
                        out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """``D[M, N] = round_to_out_dtype(fl32(alpha * sum_k a[m, k] * b[n, k]))`` on the GPU by one cuBLASLt call:
    A [M, K], B [N, K] CUDA tensors of one 16-bit dtype, each either K-contiguous (row-major) or a transposed
    view (M- or N-contiguous: read in place, as cuBLAS's transpose flags allow; any other strides are copied);
    ``alpha`` a 1-element fp32 tensor on their device, read by the GEMM's epilogue (None: 1); ``out_dtype`` per
    ``supported_dtypes``. ``out``: a contiguous [M, N] tensor of ``out_dtype`` to write; else one is allocated.
    ``accumulate=True`` (``out`` required) adds into ``out`` in the same epilogue (beta = 1):
    ``D = round_to_out_dtype(fl32(alpha * acc) + C)`` in fp32 (cuBLASLt's fp32 epilogue; it may fuse the two
    steps into one FMA), C the old contents of ``out``; else ``out``'s contents are not read.
    No host synchronization."""
    if not (a.is_cuda and b.is_cuda and a.device == b.device):
        raise ValueError(f"matmul_device_alpha runs on one CUDA device, got {a.device} and {b.device}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"matmul_device_alpha: A [M, K] and B [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype or not supported_dtypes(a.dtype, out_dtype):
        raise TypeError(f"matmul_device_alpha: operands {a.dtype}, {b.dtype} into {out_dtype} is not one of "
                        f"{sorted((str(x), str(y)) for x, y in _SUPPORTED)}")
    if alpha is not None and (alpha.dtype != torch.float32 or alpha.numel() != 1 or alpha.device != a.device):
        raise ValueError(f"matmul_device_alpha: alpha must be a 1-element float32 tensor on {a.device}")
    M, K = a.shape
    N = b.shape[0]
    out = _output("matmul_device_alpha", out, accumulate, M, N, out_dtype, a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        # an empty sum: fl(alpha * 0) (NaN for a NaN alpha), added to C when accumulating, without a cuBLAS call
        zero = (alpha if alpha is not None else torch.ones(1, device=a.device)) * 0.0
        return out.add_(zero) if accumulate else out.copy_(zero)
    a, a_lay = _layout(a)
    b, b_lay = _layout(b)
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    with _STATE.lock:
        handle = _handle(dev)
        plan = _plan(handle, dev, M, N, K, a_lay, b_lay, a.dtype, out_dtype,
                     (_alignment(b), _alignment(a), _alignment(out)))
        stream = torch.cuda.current_stream(dev).cuda_stream
        ws = _workspace(dev, stream)
        zero, one = _constants(dev)
    _launch(handle, plan, dev, alpha if alpha is not None else one, a, b, one if accumulate else zero, out, ws,
            stream)
    return out


def _output(fn: str, out: torch.Tensor | None, accumulate: bool, M: int, N: int, out_dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """The GEMM's D: ``out`` checked (a contiguous [M, N] tensor of ``out_dtype`` on ``device``), or a new one; with
    ``accumulate`` (C = D's old contents) it must be given."""
    if accumulate and out is None:
        raise ValueError(f"{fn}: accumulate=True adds into out: pass the tensor to add into as out")
    if out is None:
        return torch.empty((M, N), dtype=out_dtype, device=device)
    if out.shape != (M, N) or out.dtype != out_dtype or not out.is_contiguous() or out.device != device:
        raise ValueError(f"{fn}: out must be a contiguous [{M}, {N}] {out_dtype} tensor on {device}")
    return out


def _launch(handle, plan: tuple, dev: int, alpha: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            beta: torch.Tensor, out: torch.Tensor, ws: torch.Tensor, stream: int) -> None:
    """One ``cublasLtMatmul`` of ``plan``: D = out = alpha * (a . b^T) + beta * out."""
    desc, lay_b, lay_a, lay_d, result = plan
    lib = _STATE.lib
    # cuBLASLt launches on the current device: make it the operands' for the call
    with torch.cuda.device(dev) if torch.cuda.current_device() != dev else contextlib.nullcontext():
        lib.check(lib.cublasLtMatmul(handle, desc, alpha.data_ptr(), b.data_ptr(), lay_b, a.data_ptr(), lay_a,
                                     beta.data_ptr(), out.data_ptr(), lay_d, out.data_ptr(), lay_d,
                                     ctypes.byref(result), ws.data_ptr(), _WORKSPACE_BYTES, stream),
                  "cublasLtMatmul")


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def _check_fp8_scale(name: str, s: torch.Tensor, mode: int, rows: int, k: int, device: torch.device) -> None:
    """``s`` must hold the decode scales of a [rows, k] operand as cuBLASLt reads them in ``mode``."""
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.device != device:
        raise ValueError(f"matmul_fp8_scaled: {name}'s scales must be a float32 tensor on {device}")
    kb = k // 128
    if mode == SCALE_SCALAR_32F:
        ok, want = s.numel() == 1, "1 element"
    elif mode == SCALE_VEC128_32F:  # [rows, K/128], rows contiguous
        ok = s.shape == (rows, kb) and (s.stride(0) == 1 or rows == 1) and (s.stride(1) == rows or kb == 1)
        want = f"[{rows}, {kb}] with strides (1, {rows})"
    elif mode == SCALE_BLK128x128_32F:  # [Kp, rows/128], Kp = K/128 rounded up to 4, K blocks contiguous
        kp = _round_up(kb, 4)
        rb = (rows + 127) // 128
        ok = s.shape == (kp, rb) and s.stride(0) == 1 and (s.stride(1) == kp or rb == 1)
        want = f"[{kp}, {rb}] with strides (1, {kp})"
    else:
        raise ValueError(f"matmul_fp8_scaled: unknown scale mode {mode} for {name} (SCALE_SCALAR_32F, "
                         f"SCALE_VEC128_32F or SCALE_BLK128x128_32F)")
    if mode != SCALE_SCALAR_32F and k % 128:
        raise ValueError(f"matmul_fp8_scaled: block scales need K a multiple of 128, got K = {k}")
    if not ok:
        raise ValueError(f"matmul_fp8_scaled: {name}'s scales must be {want} for mode {mode}, got "
                         f"{tuple(s.shape)} with strides {s.stride()}")


def matmul_fp8_scaled(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, a_mode: int, b_scale: torch.Tensor,
                      b_mode: int, out_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                      accumulate: bool = False) -> torch.Tensor:
    """``D[M, N] = round_to_out_dtype(sum_k (a[m, k] sa) (b[n, k] sb) (+ C))`` by one cuBLASLt call: A [M, K] and
    B [N, K] FP8 (one dtype, E4M3 or E5M2), row-major (K contiguous, leading dimensions multiples of 16);
    ``a_scale``/``b_scale`` their fp32 decode scales read in ``a_mode``/``b_mode`` (``SCALE_SCALAR_32F``: one
    element; ``SCALE_VEC128_32F``: [R, K/128] stored R-contiguous; ``SCALE_BLK128x128_32F``: [Kp, R/128] stored
    K-block-contiguous, Kp = K/128 rounded up to 4; R = M for A, N for B). The partial sums are promoted to fp32
    per 128-long K block, where the block scales apply. ``out_dtype`` fp32 or bf16; ``out`` and ``accumulate`` as
    :func:`matmul_device_alpha` (beta = 1: ``D = fl32(acc) + C``, C the old contents of ``out``). Raises
    RuntimeError before anything is launched where cuBLASLt has no algorithm for the problem. No host
    synchronization."""
    if not (a.is_cuda and b.is_cuda and a.device == b.device):
        raise ValueError(f"matmul_fp8_scaled runs on one CUDA device, got {a.device} and {b.device}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"matmul_fp8_scaled: A [M, K] and B [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in _FP8 or b.dtype != a.dtype or out_dtype not in _FP8_OUT:
        raise TypeError(f"matmul_fp8_scaled: operands of one FP8 dtype ({_FP8}) into one of {_FP8_OUT}, got "
                        f"{a.dtype}, {b.dtype} into {out_dtype}")
    M, K = a.shape
    N = b.shape[0]
    for name, t in (("A", a), ("B", b)):
        if t.stride(1) != 1 or t.stride(0) % 16 or K % 16 or K == 0:
            raise ValueError(f"matmul_fp8_scaled: {name} must be row-major with K (= {K}) and its leading dimension "
                             f"multiples of 16 (Hopper's FP8 GEMM reads both operands K-contiguous); got strides "
                             f"{t.stride()}")
    _check_fp8_scale("A", a_scale, a_mode, M, K, a.device)
    _check_fp8_scale("B", b_scale, b_mode, N, K, a.device)
    out = _output("matmul_fp8_scaled", out, accumulate, M, N, out_dtype, a.device)
    if M == 0 or N == 0:
        return out
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    with _STATE.lock:  # the scale pointers live on the kept descriptor: set them and launch as one
        handle = _handle(dev)
        plan = _plan(handle, dev, M, N, K, (True, a.stride(0)), (True, b.stride(0)), a.dtype, out_dtype,
                     (_alignment(b), _alignment(a), _alignment(out)), (a_mode, b_mode, a_scale, b_scale))
        _set_scale_pointers(plan[0], a_scale, b_scale)
        stream = torch.cuda.current_stream(dev).cuda_stream
        ws = _workspace(dev, stream)
        zero, one = _constants(dev)
        _launch(handle, plan, dev, one, a, b, one if accumulate else zero, out, ws, stream)
    return out
