"""megatron-core's optimizers: the gradients of the norm, the form of the inner torch AdamW (fused or not), and
its Adam state around a checkpoint load."""

from __future__ import annotations

__all__ = ["grads_for_grad_norm", "set_fused_adam", "adam_is_fused", "adam_params_device", "init_optimizer_state",
           "restore_adam_steps", "load_optimizer_state"]


def grads_for_grad_norm(optimizer) -> list:
    """The gradients megatron-core counts in ``optimizer``'s global norm (no shared parameters, no
    tensor-parallel duplicates).

    megatron-core <= 0.18: ``get_main_grads_for_grad_norm()``.
    megatron-core >= 0.19: ``get_grads_for_grad_norm()``, which leaves out the parameters tagged with a
    separate grad-norm group (ours tag none: the same gradients).
    """
    if hasattr(optimizer, "get_grads_for_grad_norm"):
        return optimizer.get_grads_for_grad_norm()
    return optimizer.get_main_grads_for_grad_norm()


def _inner_adams(optimizer) -> list:
    """The torch Adam/AdamW inside megatron's ``optimizer`` (one, or each of a ``ChainedOptimizer``'s)."""
    import torch

    out = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            out.append(inner)
    return out


def _step_tensor(value: float, group: dict, param):
    """Adam's ``step`` where torch's AdamW keeps it for ``group``: float32 on the parameter's device for the
    fused (and capturable) forms, which read it in their kernels; a float32 CPU scalar otherwise, read on the
    host without a sync."""
    import torch

    on_device = bool(group.get("fused")) or bool(group.get("capturable"))
    return torch.tensor(value, dtype=torch.float32, device=param.device if on_device else "cpu")


def _place_steps(inner) -> None:
    """Move every ``step`` of ``inner`` (a torch Adam) to where its group's form wants it (a host read of a
    device step: only at build and load time)."""
    for group in inner.param_groups:
        for p in group["params"]:
            st = inner.state.get(p)
            if not st or "step" not in st:
                continue
            want = _step_tensor(0.0, group, p)
            step = st["step"]
            if not (hasattr(step, "device") and step.device == want.device and step.dtype == want.dtype):
                st["step"] = _step_tensor(float(step), group, p)


def set_fused_adam(optimizer, fused: bool) -> None:
    """Run the inner torch AdamW of megatron's ``optimizer`` (chained or not) as torch's fused multi-tensor
    kernel (``fused=True``: ``torch._fused_adamw_``, one pass over parameter, gradient and both moments) or in
    torch's default form (``fused=False``: its foreach kernels on CUDA, a loop over the tensors on the CPU).

    megatron-core 0.16.1 ... 0.19.2 construct ``torch.optim.AdamW(params, lr, weight_decay, betas, eps)``
    without ``fused`` when neither Transformer Engine nor Apex is installed, and torch's AdamW reads ``fused``
    and ``foreach`` from each param group at every ``step()``; so they are set there (and in ``defaults``),
    with no change to megatron. The update is the same AdamW: decoupled weight decay, the group's ``lr`` and
    ``weight_decay`` as megatron's scheduler sets them each step, betas, eps, bias correction by the step count.
    The ``step`` states move to where that form keeps them (:func:`_step_tensor`). A checkpoint's param groups
    carry the form they were saved with and replace the run's on a load: :func:`load_optimizer_state` puts the
    run's form back."""
    for inner in _inner_adams(optimizer):
        for d in (inner.defaults, *inner.param_groups):
            # None/None is torch's own default (foreach where supported); fused and foreach exclude each other
            d["fused"] = True if fused else None
            d["foreach"] = False if fused else None
        _place_steps(inner)


def adam_is_fused(optimizer) -> bool:
    """Whether the inner torch AdamW of ``optimizer`` runs in the fused form (:func:`set_fused_adam`)."""
    return any(bool(g.get("fused")) for inner in _inner_adams(optimizer) for g in inner.param_groups)


def adam_params_device(optimizer):
    """The device of the parameters the inner torch AdamW updates (the FP32 master weights), or None when
    this rank has none."""
    for inner in _inner_adams(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                return p.device
    return None


def init_optimizer_state(optimizer) -> None:
    """Give every parameter of the inner torch optimizer an (empty) Adam state with a ``step`` before a load.

    megatron-core 0.16.1 ... 0.19.2: the distributed optimizer reads the Adam ``step`` from the inner torch
    optimizer's state when it builds the sharded state dict to load into; before the first update that state
    is empty and it fails (``assert len(steps) == 1``). The load overwrites all of these values.
    """
    import torch

    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if not st:
                    st["step"] = _step_tensor(0.0, group, p)
                    st["exp_avg"] = torch.zeros_like(p.data)
                    st["exp_avg_sq"] = torch.zeros_like(p.data)


def restore_adam_steps(optimizer) -> None:
    """Give each parameter its own Adam ``step`` tensor, with the checkpoint's value, after a load.

    megatron-core 0.16.1 ... 0.19.2: ``DistributedOptimizer.load_state_dict`` (torch-Adam path) keeps the saved
    step in each param group's ``step`` and writes ONE shared tensor into the parameters' states (or, when the
    states already exist, leaves their old value: 0 from :func:`init_optimizer_state`). torch's foreach
    Adam increments each state's step in place, so a shared tensor would advance by the number of parameters
    per update. Either way the bias correction after a resume would differ from an uninterrupted run. Each
    new tensor sits where the group's form keeps it (:func:`_step_tensor`).
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            step = group.get("step")
            for p in group["params"]:
                st = inner.state.get(p)
                if not st or (step is None and "step" not in st):
                    continue
                value = float(step) if step is not None else float(st["step"])
                st["step"] = _step_tensor(value, group, p)


def load_optimizer_state(optimizer, osd: dict, optim_format: str) -> None:
    """``optimizer.load_state_dict(osd)``, working around the ``fully_reshardable`` load with torch's Adam, and
    keeping the run's AdamW form (:func:`set_fused_adam`).

    megatron-core 0.16.1 ... 0.19.2: ``load_state_dict`` first writes the saved ``step`` into every parameter's
    state, then ``load_parameter_state_from_fully_reshardable`` copies every state key, ``step`` included, from
    per-parameter tensors that have none (``KeyError: 'step'``). So: load the common part, drop ``step`` from
    the states, load the parameter state, then restore ``step`` from the param groups.

    The saved param groups replace the run's, ``fused``/``foreach`` included (a checkpoint written before the
    fused form, or on another device, has None): the form the run was built with is set again before the
    steps are restored, so the steps land where that form keeps them."""
    fused = adam_is_fused(optimizer)
    if optim_format != "fully_reshardable":
        optimizer.load_state_dict(osd)
    else:
        subs = getattr(optimizer, "chained_optimizers", [optimizer])
        if len(subs) != 1 or "param_state" not in osd:
            raise NotImplementedError("fully_reshardable optimizer checkpoints of several chained optimizers")
        sub = subs[0]
        common = {k: v for k, v in osd.items() if k not in ("param_state", "param_state_sharding_type")}
        sub.load_state_dict(common)
        for st in sub.optimizer.state.values():
            st.pop("step", None)
        sub.load_parameter_state_from_fully_reshardable(osd["param_state"])
    set_fused_adam(optimizer, fused)
    restore_adam_steps(optimizer)
