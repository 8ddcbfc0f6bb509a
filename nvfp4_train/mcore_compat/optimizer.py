"""megatron-core's optimizers: the gradients of the norm, and the Adam state of the distributed optimizer
around a checkpoint load."""

from __future__ import annotations

__all__ = ["grads_for_grad_norm", "init_optimizer_state", "restore_adam_steps", "load_optimizer_state"]


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
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p.data)
                    st["exp_avg_sq"] = torch.zeros_like(p.data)


def restore_adam_steps(optimizer) -> None:
    """Give each parameter its own Adam ``step`` tensor, with the checkpoint's value, after a load.

    megatron-core 0.16.1 ... 0.19.2: ``DistributedOptimizer.load_state_dict`` (torch-Adam path) keeps the saved
    step in each param group's ``step`` and writes ONE shared tensor into the parameters' states (or, when the
    states already exist, leaves their old value: 0 from :func:`init_optimizer_state`). torch's foreach
    Adam increments each state's step in place, so a shared tensor would advance by the number of parameters
    per update. Either way the bias correction after a resume would differ from an uninterrupted run.
    """
    import torch

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
                st["step"] = torch.tensor(value, dtype=torch.float32)


def load_optimizer_state(optimizer, osd: dict, optim_format: str) -> None:
    """``optimizer.load_state_dict(osd)``, working around the ``fully_reshardable`` load with torch's Adam.

    megatron-core 0.16.1 ... 0.19.2: ``load_state_dict`` first writes the saved ``step`` into every parameter's
    state, then ``load_parameter_state_from_fully_reshardable`` copies every state key, ``step`` included, from
    per-parameter tensors that have none (``KeyError: 'step'``). So: load the common part, drop ``step`` from
    the states, load the parameter state, then restore ``step`` from the param groups."""
    if optim_format != "fully_reshardable":
        optimizer.load_state_dict(osd)
        restore_adam_steps(optimizer)
        return
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(subs) != 1 or "param_state" not in osd:
        raise NotImplementedError("fully_reshardable optimizer checkpoints of several chained optimizers")
    sub = subs[0]
    common = {k: v for k, v in osd.items() if k not in ("param_state", "param_state_sharding_type")}
    sub.load_state_dict(common)
    for st in sub.optimizer.state.values():
        st.pop("step", None)
    sub.load_parameter_state_from_fully_reshardable(osd["param_state"])
    restore_adam_steps(optimizer)
