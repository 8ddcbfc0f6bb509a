"""The optimizer: megatron-core's distributed optimizer (FP32 master weights and Adam state, sharded over the
data-parallel ranks) behind megatron's ``DistributedDataParallel`` wrapper (FP32 gradient buffers).

AdamW (decoupled weight decay) with betas (0.9, 0.95), weight decay 0.1 on matrices only (megatron's default
parameter groups: no decay on biases and on 1-D parameters such as norm weights), gradient clipping by the
global norm.

Non-finite gradients: the optimizer gets megatron's ``ConstantGradScaler(1.0)`` (``loss_scale=1.0``). For
bf16 that scaler only turns on megatron's found-inf path: before the update every rank checks its main
gradients, the flag is all-reduced (MAX), and ``optimizer.step()`` returns ``(False, None, None)`` without
touching the weights. Multiplying by the inverse scale 1.0 is exact, so the update is bitwise the one without
a scaler. No loss scaling happens (``grad_scale_func`` is not set).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OptimConfig", "build_ddp", "build_optimizer"]


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


def build_optimizer(model_chunks: list, cfg: OptimConfig, *, lr: float, min_lr: float):
    """megatron-core's optimizer over ``model_chunks`` (DDP-wrapped), FP32 master weights for bf16 params."""
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    tcfg = model_chunks[0].config
    bf16 = tcfg.params_dtype == torch.bfloat16 or getattr(tcfg, "bf16", False)
    fp16 = getattr(tcfg, "fp16", False)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        decoupled_weight_decay=True,
        clip_grad=cfg.clip_grad,
        bf16=bf16,
        fp16=fp16,
        params_dtype=tcfg.params_dtype,
        loss_scale=1.0 if bf16 else None,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        overlap_param_gather=cfg.overlap_param_gather,
    )
    return get_megatron_optimizer(opt_config, model_chunks)
