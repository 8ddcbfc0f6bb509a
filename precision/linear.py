"""The quantized linear layer: ONE autograd Function for the three GEMMs of ``y = x Wᵀ`` (RECIPE §3).

    fprop   y  [M,N] = x  · Wᵀ       A = x rowwise,        B = W rowwise
    dgrad   dx [M,K] = dy · W        A = dy rowwise,       B = Wᵀ (W columnwise)
    wgrad   dW [N,K] = dyᵀ · x       A = dyᵀ (dy columnwise), B = xᵀ (x columnwise)

Each operand is cast as the recipe says (``QuantRecipe``: format, block, rounding, Hadamard per operand per
GEMM). The forward pass casts x into BOTH its copies in one fused pass (fprop's rowwise copy, and wgrad's
columnwise copy, Hadamard-mixed) and saves only the quantized wgrad copy of x and the quantized dgrad copy
of W for backward: packed 4-bit codes, scales and amax, never a bf16 copy (unless that GEMM runs in bf16).

An x or dy that carries its raw amax (``operand.attach_amax``: the squared ReLU of ``fusion.activation`` computes
fc2's input amax and fc1's output-gradient amax in its own pass) is quantized with it: the same bits, without the
quantizer's amax pass.

The weight's two copies (fprop's W, dgrad's Wᵀ) are computed once per optimizer step: ``WeightCache``
keys them on the parameter's version counter, which changes exactly when the optimizer writes the weight, so
micro-batches of one step reuse them. With 2-D tiles the two copies are the same values.

Stochastic rounding draws its bits from the layer's stream (``LinearContext.seed``), the call counter and the
operand, through the one key function of ``kernels/sr_key.py``: a run is reproducible. The counter is a host
int (``LinearContext.calls``); with ``LinearContext.call_counter`` set (CUDA graphs, ``nvfp4_train.cuda_graph``)
a 0-d int64 device tensor counts too, and each forward advances it and computes its operand seeds on the
device (``nvfp4_train.kernels.sr_key.next_call_seeds``, one launch), so that a replayed graph draws fresh, and the same,
bits as the host ints would give.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nvfp4_train.kernels.sr_key import CALL_OPERANDS, OPERANDS, call_seed, next_call_seeds, operand_seed
from nvfp4_train.precision.operand import Operand, attached_amax, cast_pair, operand_nbytes, qgemm
from nvfp4_train.precision.recipe import QuantRecipe

__all__ = ["QuantLinearFunction", "quantized_linear", "WeightCache", "LinearContext", "pad_weight"]


def pad_weight(weight: torch.Tensor, pad: tuple[int, int]) -> torch.Tensor:
    """``weight`` (N, K) zero-padded to (N + pad[0], K + pad[1]) (itself when there is nothing to pad)."""
    pn, pk = pad
    return F.pad(weight, (0, pk, 0, pn)) if (pn or pk) else weight


@dataclass
class WeightCache:
    """The quantized copies of one weight, valid while the weight's version counter is unchanged.

    The key is the PARAMETER (its storage, version, shape), never a padded copy of it: a padded copy is a new
    tensor at every call, and whether the allocator reuses its address differs between ranks, so a key on it
    would hit on one tensor-parallel rank and miss on another, and the miss's amax all-reduce would wait
    forever for the rank that hit. Padding happens on a miss, inside the cache."""

    key: tuple | None = None
    row: Operand | None = None
    col: Operand | None = None

    def get(self, weight: torch.Tensor, recipe: QuantRecipe, seed, amax_group,
            pad: tuple[int, int] = (0, 0)) -> tuple[Operand, Operand]:
        """``seed``: the call's ``call_seed``, or its device seeds (``LinearContext.next_seed``; used on a miss)."""
        key = (weight.data_ptr(), weight._version, tuple(weight.shape), pad, recipe)
        if key != self.key:
            w = pad_weight(weight.detach(), pad)
            self.row, self.col = cast_pair(w, recipe.fprop.b, recipe.dgrad.b, _seeds(seed, "W"), amax_group,
                                            recipe.gemm_engine)
            self.key = key
        return self.row, self.col

    def clear(self) -> None:
        self.key = self.row = self.col = None


@dataclass
class LinearContext:
    """Per-layer state the Function needs besides tensors: the recipe, the SR stream and call counter, the TP
    group whose amaxes are all-reduced, the weight cache and telemetry hooks."""

    recipe: QuantRecipe
    seed: int = 0  # the layer's stochastic-rounding stream (nvfp4_train.kernels.sr_key.layer_stream)
    amax_group: dist.ProcessGroup | None = None
    # zeros appended to the weight's (rows, columns) so both are multiples of the recipe's blocks; the input
    # arrives padded by the caller (see quantized_linear)
    weight_pad: tuple[int, int] = (0, 0)
    weight_cache: WeightCache = field(default_factory=WeightCache)
    calls: int = 0
    # None, or a 0-d int64 tensor on the layer's device counting the calls as ``calls`` does (see next_seed)
    call_counter: torch.Tensor | None = None
    saved_bytes: int = 0  # bytes saved for backward by the last forward (for memory accounting)
    # when set (every N steps), called as telemetry.record(operand_name, source, cast, operand) for each
    # quantized operand (see nvfp4_train.precision.telemetry); None costs nothing
    telemetry: Any = None
    # megatron's gradient-accumulation fusion (``gradient_accumulation_fusion``, set by the layer at each forward):
    # where the Wgrad GEMM can add into the weight's fp32 ``main_grad`` in its epilogue, it does so
    # (``_wgrad_into_main_grad``) and the weight gets megatron's dummy gradient
    wgrad_fusion: bool = False

    def next_seed(self) -> int | torch.Tensor:
        """The ``call_seed`` of the next forward (its backward reuses it). With ``call_counter`` set: the call's
        operand seeds computed on the device from the counter (int64 [6], ``nvfp4_train.kernels.sr_key.next_call_seeds``,
        which advances it in place); the host count advances too, so the two stay equal when the device runs
        what the host launched (a captured graph's launches count once at capture: ``nvfp4_train.cuda_graph``
        adds each replay's calls to ``calls``)."""
        self.calls += 1
        if self.call_counter is not None:
            return next_call_seeds(self.call_counter, self.seed)
        return call_seed(self.seed, self.calls)


_SEED_INDEX = {t: (CALL_OPERANDS.index((t, "row")), CALL_OPERANDS.index((t, "col"))) for t in ("W", "x", "dy")}


def _seeds(seed, tensor: str) -> tuple:
    """The quantizers' seeds of the rowwise and columnwise copies of ``tensor`` (W, x, dy) in the call whose
    ``call_seed`` is ``seed`` (ints), or whose device seeds are ``seed`` (``LinearContext.next_seed``: 0-d
    views of it)."""
    if isinstance(seed, int):
        return operand_seed(seed, OPERANDS[(tensor, "row")]), operand_seed(seed, OPERANDS[(tensor, "col")])
    r, c = _SEED_INDEX[tensor]
    return seed[r], seed[c]


class QuantLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lctx: LinearContext):
        recipe = lctx.recipe
        x2 = x.reshape(-1, x.shape[-1])
        seed = lctx.next_seed()
        w_row, w_col = lctx.weight_cache.get(weight, recipe, seed, lctx.amax_group, lctx.weight_pad)
        need_col_x = weight.requires_grad
        x_row, x_col = cast_pair(x2, recipe.fprop.a, recipe.wgrad.b if need_col_x else None, _seeds(seed, "x"),
                                 lctx.amax_group, recipe.gemm_engine, amax=attached_amax(x))
        tel = lctx.telemetry
        if tel is not None:
            tel.record("fprop.x", x2, recipe.fprop.a, x_row)
            tel.record("fprop.W", pad_weight(weight.detach(), lctx.weight_pad), recipe.fprop.b, w_row)
            if x_col is not None:
                tel.record("wgrad.x_col", x2.t(), recipe.wgrad.b, x_col)
        y = qgemm(x_row, w_row, out_dtype=x.dtype, engine=recipe.gemm_engine)
        if bias is not None:
            y = y + bias
        ctx.lctx = lctx
        ctx.seed = seed
        ctx.x_shape = x.shape
        ctx.has_bias = bias is not None
        # save only what backward needs: the quantized wgrad copy of x and the dgrad copy of W
        ctx.x_col = x_col
        ctx.w_col = w_col
        ctx.weight_dtype = weight.dtype
        ctx.weight_shape = weight.shape
        # the parameter itself (no copy: backward may add its gradient into the parameter's main_grad)
        ctx.weight = weight if lctx.wgrad_fusion else None
        lctx.saved_bytes = operand_nbytes(x_col)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        recipe: QuantRecipe = ctx.lctx.recipe
        dy2 = dy.reshape(-1, dy.shape[-1])
        need_dx = ctx.needs_input_grad[0]
        need_dw = ctx.needs_input_grad[1]
        dy_row, dy_col = cast_pair(
            dy2, recipe.dgrad.a if need_dx else None, recipe.wgrad.a if need_dw else None,
            _seeds(ctx.seed, "dy"), ctx.lctx.amax_group, recipe.gemm_engine, amax=attached_amax(dy),
        )
        tel = ctx.lctx.telemetry
        if tel is not None:
            if dy_row is not None:
                tel.record("dgrad.dy", dy2, recipe.dgrad.a, dy_row)
            if dy_col is not None:
                tel.record("wgrad.dy_col", dy2.t(), recipe.wgrad.a, dy_col)
        dx = dw = db = None
        if need_dx:
            dx = qgemm(dy_row, ctx.w_col, out_dtype=dy.dtype, engine=recipe.gemm_engine).view(ctx.x_shape)
        if need_dw:
            if ctx.weight is not None and _wgrad_into_main_grad(dy_col, ctx.x_col, ctx.weight, recipe.gemm_engine):
                dw = _dummy_wgrad(ctx.weight)
            else:
                dw = qgemm(dy_col, ctx.x_col, out_dtype=ctx.weight_dtype, engine=recipe.gemm_engine)
                n, k = ctx.weight_shape
                if dw.shape != (n, k):  # a padded weight: its gradient is the unpadded block
                    dw = dw[:n, :k]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        ctx.x_col = ctx.w_col = ctx.weight = None
        return dx, dw, db, None


def _wgrad_into_main_grad(a: Operand, b: Operand, weight: torch.Tensor, engine: str) -> bool:
    """Add the Wgrad GEMM ``a . b^T`` into ``weight.main_grad`` in the GEMM's epilogue when one GEMM can (a CUDA
    weight with megatron's gradient buffer; bf16 operands, NVFP4 on the cuBLASLt engine, or FP8 where cuBLASLt's
    scaled FP8 GEMM takes the pair (``fp8_gemm_accumulate``); an unpadded weight);
    returns whether it did. Otherwise the caller computes the gradient and megatron's DDP hook adds it."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None or not main_grad.is_cuda or a.format != b.format:
        return False
    rows, cols = a.shape[0], b.shape[0]
    if main_grad.shape != (rows, cols) or not main_grad.is_contiguous():
        return False  # a padded weight: the product is larger than the gradient
    if a.format == "bf16":
        from nvfp4_train.mcore_compat.wgrad import wgrad_accumulate

        wgrad_accumulate(a.data.t(), b.data.t(), main_grad)
        return True
    if a.format == "nvfp4":
        from nvfp4_train.kernels.gemm_engine import resolve_gemm_engine

        if resolve_gemm_engine(engine, main_grad.device) != "cublas" or a.data.swizzled or b.data.swizzled:
            return False
        from nvfp4_train.kernels.nvfp4.gemm import nvfp4_gemm_accumulate

        nvfp4_gemm_accumulate(a.data, b.data, main_grad)
        return True
    if a.format == "fp8_e4m3":
        from nvfp4_train.kernels.fp8 import fp8_gemm_accumulate

        return fp8_gemm_accumulate(a.data, b.data, main_grad)  # False where cuBLASLt cannot (kernels/fp8/gemm.py)
    return False


def _dummy_wgrad(weight: torch.Tensor) -> torch.Tensor:
    """What megatron's fused layers return as the weight's gradient once it is in ``main_grad``: an
    uninitialised tensor of the weight's shape (no kernel) and ``grad_added_to_main_grad`` set, so that the DDP
    hook drops it instead of adding it (an all-zero one where megatron asks for ``zero_out_wgrad``)."""
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight)
    return torch.empty_like(weight)


def quantized_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lctx: LinearContext
) -> torch.Tensor:
    """``y = x Wᵀ (+ b)`` under ``lctx.recipe``; an all-bf16 recipe is exactly ``F.linear``.

    With ``lctx.weight_pad = (pn, pk)`` the weight is used as if zero-padded to (N + pn, K + pk): ``x`` must
    then have K + pk columns (padded by the caller) and the result has N + pn columns."""
    if lctx.recipe.is_bf16:
        return F.linear(x, weight, bias)
    return QuantLinearFunction.apply(x, weight, bias, lctx)
