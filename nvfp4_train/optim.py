"""The optimizer: megatron-core's distributed optimizer (FP32 master weights and Adam state, sharded over the
data-parallel ranks) behind megatron's ``DistributedDataParallel`` wrapper (FP32 gradient buffers).

AdamW (decoupled weight decay) with betas (0.9, 0.95), weight decay 0.1 on matrices only (megatron's default
parameter groups: no decay on biases and on 1-D parameters such as norm weights), gradient clipping by the
global norm.

Non-finite gradients, found by the clipping's global norm rather than a pass of their own: megatron's found-inf
path (a ``ConstantGradScaler(1.0)``: read and write every main gradient, multiplying it by 1.0) is off (no grad
scaler, ``loss_scale=None``), and :func:`optimizer_step` computes the global norm on every step (also without
clipping) and, for the gradients the norm leaves out (tensor-parallel duplicates, shared parameters), their sum of
squares: both are all-reduced over the gradients' group, and a non-finite one means some main gradient on some rank
holds a NaN or an Inf (a square is never negative, so nothing cancels; fp32 squares overflow to Inf only past
~1.8e19, a gradient already diverged). Then, as megatron's ``step()`` on found-inf, it returns ``(False, None,
None)`` without touching the weights. One host synchronization per step, as megatron's flag. The update of a
finite step is bitwise the one with the scaler (its multiply by 1.0 was exact).

Gradient clipping with one host synchronization: megatron's own ``clip_grad`` is set to 0 in the
``OptimizerConfig`` and the optimizer is stepped by :func:`optimizer_step` (megatron's public
``prepare_grads()`` and ``step_with_ready_grads()`` around the norm and the clipping). Without Apex or
Transformer Engine megatron's clipping runs its PyTorch fallbacks: one ``torch.norm`` and one host sync per
gradient tensor, a host-side decision ``clip_coeff < 1.0``, one multiply and copy per tensor. Here the norm
is one ``torch._foreach_norm``, and one host read per step takes both decisions, non-finite (above) and
``clip_coeff < 1.0``; a step that clips multiplies every gradient by the coefficient in one
``torch._foreach_mul_``, a step that does not multiplies nothing: either way bitwise megatron's update.
(:func:`clip_grad_norm_sync_free`, without the host read, multiplies by ``min(1, coefficient)`` always.) The grad
norm comes back as a 0-d device tensor; the trainer reads it on the host only when it logs.

The AdamW kernel, one form per device: on CUDA torch's fused multi-tensor AdamW (``torch._fused_adamw_``:
parameter, gradient and both moments read once and parameter and moments written once, 28 bytes per FP32
parameter; torch's foreach form, megatron's default without Apex or Transformer Engine, makes about eight passes
and moves ~84). Its update differs from the foreach one by a few fp32 roundings per element
(``tests/trainer/test_fused_adam.py`` derives the bound). On the CPU torch's default (a loop over the tensors)
stays, so CPU runs and the tests that pin their numbers keep them; torch's fused CPU kernel rounds differently
(within the same bound). ``mcore_compat.optimizer.set_fused_adam`` sets the form on megatron's inner AdamW; a
checkpoint of either form resumes in the other.

Passes over memory per step and FP32 parameter (``scripts/bench_optimizer.py`` times them): the clipping norm,
which is also the non-finite check (read, 4; megatron's found-inf check, read and write, 8, is no longer run),
the clipping multiply (read and write, 8, only on a step that clips), AdamW (28), megatron's copy of the master
weights into the bf16 parameters (read fp32, write bf16, 6: already one ``copy_`` per tensor, one pass; a
``torch._foreach_copy_`` would save launches, not bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from nvfp4_train.mcore_compat.optimizer import adam_params_device, grads_for_grad_norm, set_fused_adam

__all__ = ["OptimConfig", "build_ddp", "build_optimizer", "check_adam_step_size", "fused_adam_on",
           "megatron_optimizer_config", "optimizer_step", "begin_optimizer_step", "finish_optimizer_step",
           "PendingStep", "clip_grad_norm_sync_free"]

FP32_MAX = 3.4028234663852886e38


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW and its megatron wrappers (the ``optim`` section). The learning rate is in ``schedule``."""

    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay of matrices (biases and 1-D parameters get none)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping)."""
    use_distributed_optimizer: bool = True
    """Shard the FP32 master weights and Adam state over the data-parallel ranks (ZeRO-1)."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and reduce gradients in FP32 buffers."""
    overlap_grad_reduce: bool = False
    """Overlap the gradient reduce-scatter with the backward pass (GPU runs)."""
    overlap_param_gather: bool = False
    """Overlap the parameter all-gather with the next forward pass (GPU runs; needs the distributed optimizer)."""
    max_consecutive_bad_steps: int = 5
    """Stop the run after this many consecutive steps with a non-finite loss or gradient (each is skipped)."""

    def __post_init__(self) -> None:
        if not (0.0 <= self.adam_beta1 < 1.0 and 0.0 <= self.adam_beta2 < 1.0):
            raise ValueError(f"optim: betas must be in [0, 1), got ({self.adam_beta1}, {self.adam_beta2})")
        if self.adam_eps <= 0 or self.weight_decay < 0 or self.clip_grad < 0:
            raise ValueError(f"optim: need adam_eps > 0, weight_decay >= 0, clip_grad >= 0 (got {self.adam_eps}, "
                             f"{self.weight_decay}, {self.clip_grad})")
        if self.max_consecutive_bad_steps < 1:
            raise ValueError(f"optim.max_consecutive_bad_steps={self.max_consecutive_bad_steps} must be >= 1")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("optim.overlap_param_gather needs optim.use_distributed_optimizer=true")


def check_adam_step_size(cfg: OptimConfig, lr: float, *, name: str = "schedule.lr") -> None:
    """Raise ``ValueError`` when the learning rate ``lr`` (the config key ``name``) overflows AdamW's fp32
    arithmetic. Adam's step moves a weight by up to ``lr / (1 - adam_beta1**k)`` at step ``k`` (the bias
    correction), ``lr / (1 - adam_beta1)`` at the first, and the decoupled weight decay multiplies it by
    ``1 - lr * weight_decay``; torch applies both as scalars to fp32 tensors. Beyond fp32's largest value
    torch's CPU AdamW fails with "value cannot be converted to type float without overflow" in the middle of
    a step, and a fused GPU kernel writes infinite weights. A smaller, still absurd learning rate is left to
    the non-finite-step guard (the run stops as diverged)."""
    step = lr / (1.0 - cfg.adam_beta1)
    decay = lr * cfg.weight_decay
    terms = ([f"its first step moves a weight by up to lr / (1 - optim.adam_beta1) = {step:.3g}"] if step > FP32_MAX
             else []) + ([f"its weight decay multiplies a weight by 1 - lr * optim.weight_decay = {1 - decay:.3g}"]
                         if decay > FP32_MAX else [])
    if terms:
        limit = FP32_MAX * min(1.0 - cfg.adam_beta1, 1.0 / cfg.weight_decay if cfg.weight_decay else 1.0)
        raise ValueError(f"{name}={lr:g} overflows AdamW in fp32: {' and '.join(terms)}, beyond fp32's largest "
                         f"value {FP32_MAX:.3g}: set {name} below {limit:.3g} (a sane one is far lower, e.g. 3e-4)")


def build_ddp(module, cfg: OptimConfig):
    """Wrap ``module`` (a MegatronModule with ``.config``) in megatron's DistributedDataParallel."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
        overlap_grad_reduce=cfg.overlap_grad_reduce,
        overlap_param_gather=cfg.overlap_param_gather,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    return DistributedDataParallel(module.config, ddp_config, module)


def megatron_optimizer_config(model_chunks: list, cfg: OptimConfig, *, lr: float, min_lr: float):
    """megatron's ``OptimizerConfig`` for ``cfg``, with megatron's ``clip_grad=0``: the clipping is
    :func:`optimizer_step`'s (``cfg.clip_grad``)."""
    import torch
    from megatron.core.optimizer import OptimizerConfig

    tcfg = model_chunks[0].config
    bf16 = tcfg.params_dtype == torch.bfloat16 or getattr(tcfg, "bf16", False)
    fp16 = getattr(tcfg, "fp16", False)
    return OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        decoupled_weight_decay=True,
        clip_grad=0.0,  # clipped by optimizer_step (no host sync), with cfg.clip_grad
        bf16=bf16,
        fp16=fp16,
        params_dtype=tcfg.params_dtype,
        loss_scale=None,  # no found-inf pass: optimizer_step finds non-finite gradients through the norm
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        overlap_param_gather=cfg.overlap_param_gather,
    )


def build_optimizer(model_chunks: list, cfg: OptimConfig, *, lr: float, min_lr: float):
    """megatron-core's optimizer over ``model_chunks`` (DDP-wrapped), FP32 master weights for bf16 params, its
    AdamW fused where the master weights are on CUDA (:func:`fused_adam_on`). Step it with
    ``optimizer_step(optimizer, cfg.clip_grad)``: its own ``step()`` does not clip."""
    from megatron.core.optimizer import get_megatron_optimizer

    opt = get_megatron_optimizer(megatron_optimizer_config(model_chunks, cfg, lr=lr, min_lr=min_lr), model_chunks)
    device = adam_params_device(opt)
    set_fused_adam(opt, device is not None and fused_adam_on(device))
    return opt


def fused_adam_on(device) -> bool:
    """The AdamW form for master weights on ``device``: torch's fused kernel on CUDA, torch's default
    elsewhere (see the module docstring)."""
    return device.type == "cuda"


def _stats_device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sum_of_squares(grads: list, group, left_out: list = ()):
    """The squared L2 norms of ``grads`` and of ``left_out`` (fp32, shape [2], on the device), summed over
    ``group`` in one all-reduce as megatron's ``get_grad_norm_fp32`` sums the first (over the data-parallel group
    of DTensor gradients first). Always runs the collective, also with no gradients on this rank (the other ranks
    wait for it)."""
    import torch
    import torch.distributed as dist
    from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor

    dp_group = None
    for g in grads:
        dp_group = get_data_parallel_group_if_dtensor(g, dp_group)
    grads = [to_local_if_dtensor(g) for g in grads]

    def sq(ts: list):
        if not ts:
            return torch.zeros(1, dtype=torch.float32, device=_stats_device())
        return torch.stack(torch._foreach_norm(ts)).float().square().sum().reshape(1)

    total = torch.cat([sq(grads), sq(list(left_out))])
    if dp_group:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=dp_group)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def _grads_to_clip(opt) -> list:
    """The gradients megatron's ``clip_grad_by_total_norm_fp32(opt.get_parameters(), ...)`` scales: the
    parameters' ``.grad`` (the distributed optimizer: its FP32 main-parameter shards', views of the FP32
    gradient buffer), or ``.decoupled_grad`` with the precision-aware optimizer."""
    from megatron.core.utils import to_local_if_dtensor

    decoupled = opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    out = []
    for p in opt.get_parameters():
        g = getattr(p, "decoupled_grad", None) if decoupled else p.grad
        if g is not None:
            out.append(to_local_if_dtensor(g).detach())
    return out


def clip_grad_norm_sync_free(optimizers: list, max_norm: float, *, shared_group: bool = True):
    """Megatron's global-norm clipping of the (chained) ``optimizers`` without a host sync; returns the
    total norm as a 0-d float64 device tensor.

    The norm is over ``grads_for_grad_norm(o)`` of each optimizer (no shared parameters, no
    tensor-parallel duplicates), its square summed over ``get_grad_stats_parallel_group()`` (the
    distributed optimizer: every rank of the instance, each holding its shard of the gradients) and over
    the optimizers: one all-reduce for all when they share the group (``shared_group``, as
    ``ChainedOptimizer.get_grad_norm``), else one per optimizer. The coefficient is megatron's,
    ``max_norm / (norm + 1e-6)`` in float64 and applied (in fp32) only when below 1, a device-side
    ``where``: an inf norm gives 0 (megatron zeroes the gradients too), a NaN norm 1 (megatron does not
    clip). ``max_norm <= 0``: the norm only. Stub optimizers and those without parameters are not clipped."""
    import torch

    opts = list(optimizers)
    norm, _ = _global_norm(opts, shared_group)
    if max_norm > 0.0:
        coeff = _clip_coefficient(norm, max_norm)
        _scale_grads(opts, torch.where(coeff < 1.0, coeff, 1.0).float())
    return norm


def _global_norm(opts: list, shared_group: bool, *, with_left_out: bool = False):
    """``(norm, left_out)``: the global norm of :func:`clip_grad_norm_sync_free` (0-d float64) and, with
    ``with_left_out``, the sum of squares of the main gradients ``grads_for_grad_norm`` leaves out
    (tensor-parallel duplicates, shared parameters; 0-d fp32, non-finite when one of them holds a NaN or an Inf
    on some rank), reduced by the norm's own all-reduces; else 0."""
    import torch

    def left_out(o) -> list:
        if not with_left_out or getattr(o, "is_stub_optimizer", False) or not o.get_parameters():
            return []
        counted = {(g.data_ptr(), g.numel()) for g in grads_for_grad_norm(o)}
        return [g for g in _grads_to_clip(o) if (g.data_ptr(), g.numel()) not in counted]

    if shared_group and opts:
        grads = [g for o in opts for g in grads_for_grad_norm(o)]
        total = _sum_of_squares(grads, opts[0].get_grad_stats_parallel_group(), [g for o in opts for g in left_out(o)])
    else:
        total = None
        for o in opts:
            sq = _sum_of_squares(grads_for_grad_norm(o), o.get_grad_stats_parallel_group(), left_out(o))
            total = sq if total is None else total + sq
        if total is None:
            total = torch.zeros(2, dtype=torch.float32, device=_stats_device())
    return total[0].double().sqrt(), total[1]


def _clip_coefficient(norm, max_norm: float):
    """Megatron's ``max_norm / (norm + 1e-6)`` in float64 on the device: a true division (``max_norm / tensor``
    would be ``max_norm * reciprocal``: two roundings); a fill, not a host-to-device copy."""
    import torch

    return torch.full_like(norm, max_norm).div_(norm + 1.0e-6)


def _scale_grads(opts: list, coeff) -> None:
    """Every gradient megatron's clipping scales (``_grads_to_clip``) multiplied by the fp32 ``coeff`` in one
    ``torch._foreach_mul_``; stub optimizers and those without parameters are left alone."""
    grads = [g for o in opts if not getattr(o, "is_stub_optimizer", False) and o.get_parameters()
             for g in _grads_to_clip(o)]
    if grads:
        import torch

        torch._foreach_mul_(grads, coeff.to(grads[0].device).reshape(()))


@dataclass
class PendingStep:
    """An optimizer step whose decisions are on the device, not yet read (:func:`begin_optimizer_step`).

    ``flags``: a float64 device tensor ``[every main gradient finite, the step clips, the global norm]`` (1.0 /
    0.0, 1.0 / 0.0, the norm), the values :func:`finish_optimizer_step` needs from the host (the norm read with
    them, so that nothing after the step's one host read waits for the device); None when megatron's
    ``prepare_grads`` already found a non-finite gradient (fp16's dynamic grad scaler, which reads its flag
    itself)."""

    optimizer: object
    clip_grad: float
    norm: object = None
    coeff: object = None
    flags: object = None


def begin_optimizer_step(optimizer, clip_grad: float) -> PendingStep:
    """The first half of :func:`optimizer_step`, without a host synchronization: megatron's ``prepare_grads``,
    the global norm (also the non-finite check) and the clipping coefficient, their decisions left on the device
    in :attr:`PendingStep.flags`. A caller with values of its own to read (the trainer's loss) reads them with
    the flags in one transfer and passes the flags to :func:`finish_optimizer_step`: the host work in between
    is queued behind the step's forwards and backwards instead of running while the GPU waits."""
    import torch
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    with torch.no_grad():
        if optimizer.prepare_grads():  # a grad scaler's found-inf (fp16's dynamic scaler; none for bf16/fp32)
            return PendingStep(optimizer, clip_grad)
        chained = isinstance(optimizer, ChainedOptimizer)
        opts = optimizer.chained_optimizers if chained else [optimizer]
        shared = not chained or len(opts) <= 1 or optimizer.grads_states_parallel_group_is_shared()
        # the norm is also the non-finite check: computed on every step, with the gradients it leaves out
        norm, left_out = _global_norm(opts, shared, with_left_out=True)
        finite = torch.isfinite(norm) & torch.isfinite(left_out)
        coeff = _clip_coefficient(norm, clip_grad) if clip_grad > 0.0 else None
        clips = coeff < 1.0 if coeff is not None else torch.zeros_like(finite)
        flags = torch.stack([finite.double(), clips.double(), norm.double()])
        return PendingStep(optimizer, clip_grad, norm, coeff, flags)


def finish_optimizer_step(pending: PendingStep, flags) -> tuple:
    """The second half of :func:`optimizer_step`: ``flags`` are ``pending.flags`` read on the host (a sequence
    of three numbers; ignored when ``pending.flags`` is None). A step with a non-finite gradient returns ``(False,
    None, None)`` without touching the weights; a step that clips multiplies every gradient by the coefficient,
    one that does not multiplies nothing (megatron's own ``clip_coeff < 1.0``, decided on the host); then
    megatron's ``step_with_ready_grads``. The returned norm is the host float read with the flags."""
    import torch
    from megatron.core.optimizer.optimizer import ChainedOptimizer, MixedPrecisionOptimizer

    optimizer, clip_grad = pending.optimizer, pending.clip_grad
    if pending.flags is None:
        return False, None, None
    finite, clips, norm = (float(f) for f in flags)
    if not finite:
        return False, None, None
    with torch.no_grad():
        count = getattr(getattr(optimizer, "config", None), "log_num_zeros_in_grad", False)
        chained = isinstance(optimizer, ChainedOptimizer)
        opts = optimizer.chained_optimizers if chained else [optimizer]
        if clips:
            _scale_grads(opts, pending.coeff.float())
        if chained:
            grad_norm = norm
            num_zeros = optimizer.count_zeros() if count else None
        else:
            grad_norm = norm if clip_grad > 0.0 else (0.0 if isinstance(optimizer, MixedPrecisionOptimizer) else None)
            num_zeros = optimizer.count_zeros() if count else (0 if isinstance(optimizer, MixedPrecisionOptimizer)
                                                               else None)
        success = optimizer.step_with_ready_grads()
    return success, grad_norm, num_zeros


def optimizer_step(optimizer, clip_grad: float):
    """One optimizer step, ``optimizer.step()``'s, with :func:`clip_grad_norm_sync_free`'s clipping instead of
    megatron's (built by :func:`build_optimizer`, megatron's ``clip_grad`` is 0): :func:`begin_optimizer_step`,
    the step's one host read of its two decisions and the norm (megatron's found-inf flag had one too), then
    :func:`finish_optimizer_step`. Returns ``(success, grad_norm, num_zeros)`` as megatron's ``step()`` would
    with ``clip_grad``: ``(False, None, None)`` when a main gradient on some rank is non-finite (the global
    norm's check, module docstring), before the weights are touched; ``grad_norm`` a float (a
    ``ChainedOptimizer`` always computes it; a single mixed-precision optimizer returns 0.0 and the FP32 one None
    when ``clip_grad`` is 0); ``num_zeros`` counted when ``log_num_zeros_in_grad`` is set."""
    pending = begin_optimizer_step(optimizer, clip_grad)
    return finish_optimizer_step(pending, pending.flags.tolist() if pending.flags is not None else None)
