"""Model providers for the reliability tests: the hybrid model (``nvfp4_train.models.build``) or the GPTModel stand-in,
with faults injected through forward hooks, steered by environment variables (so that ``train.py`` in a
subprocess gets them; nothing in megatron-core is patched):

- ``RELIABILITY_NAN_GRAD="<layer name>:<steps>"``: in those optimizer steps (0-based, comma-separated) the
  gradient flowing into the output of the quantized layer ``<layer name>`` (``blocks.3.mlp.fc2``) is NaN;
  its forward, and so the loss, stay finite.
  ``RELIABILITY_NAN_RANK=<r>``: only on rank r (default: every rank).
- ``RELIABILITY_LOSS_SCALE="<factor>:<steps>"``: in those steps the model's per-token loss is multiplied by
  ``factor`` (a loss spike).
- ``RELIABILITY_BATCH_LOG=<file>``: one line per training micro-batch: a hash of its token ids (what data
  the model saw, in order).
- ``RELIABILITY_SIGTERM_IN_BUILD=1``: the process sends itself SIGTERM while the model is being built (a
  preemption before the training loop).

Steps are counted from the process's own training forward calls (``num_micro`` per step), so a step redone
after a rollback is a later call and is not faulted again.

    experiment.model_provider=tests.reliability.providers:hybrid   (or :gpt)
"""

from __future__ import annotations

import hashlib
import os

from tests.trainer.standin import nan_grad


def _parse(var: str) -> tuple[str | None, set[int]]:
    value = os.environ.get(var, "")
    if not value:
        return None, set()
    what, _, steps = value.rpartition(":")
    return what, {int(s) for s in steps.split(",") if s}


def _num_micro(cfg) -> int:
    dp = int(os.environ.get("WORLD_SIZE", "1")) // (cfg.parallel.tp * cfg.parallel.pp)
    return cfg.schedule.global_batch_size // (cfg.schedule.micro_batch_size * dp)


def _with_faults(cfg, base_provider):
    nan_layer, nan_steps = _parse("RELIABILITY_NAN_GRAD")
    scale, scale_steps = _parse("RELIABILITY_LOSS_SCALE")
    batch_log = os.environ.get("RELIABILITY_BATCH_LOG")
    num_micro = _num_micro(cfg)

    def provider(pre_process: bool, post_process: bool):
        if os.environ.get("RELIABILITY_SIGTERM_IN_BUILD"):
            import signal

            os.kill(os.getpid(), signal.SIGTERM)
        model = base_provider(pre_process=pre_process, post_process=post_process)
        calls = {"n": 0}

        def count_and_log(mod, args, kwargs):
            if not mod.training:
                return
            calls["step"] = calls["n"] // num_micro
            calls["n"] += 1
            if batch_log:
                ids = kwargs.get("input_ids", args[0] if args else None)
                digest = hashlib.sha1(ids.detach().cpu().numpy().tobytes()).hexdigest()[:16]
                with open(batch_log, "a") as f:
                    f.write(digest + "\n")

        model.register_forward_pre_hook(count_and_log, with_kwargs=True)
        if scale_steps:
            def spike(mod, _args, output):
                if mod.training and calls["step"] in scale_steps:
                    return output * float(scale)
                return output

            model.register_forward_hook(spike)
        nan_rank = os.environ.get("RELIABILITY_NAN_RANK")
        if nan_steps and (nan_rank is None or int(nan_rank) == int(os.environ.get("RANK", "0"))):
            layers = dict(model.precision_layers()) if hasattr(model, "precision_layers") else {}
            by_name = {getattr(m, "layer_name", ""): m for m in layers.values()}
            if nan_layer not in by_name:
                raise ValueError(f"RELIABILITY_NAN_GRAD: no quantized layer {nan_layer!r} "
                                 f"(have {sorted(by_name)})")

            def nan_grad_hook(mod, _args, output):
                if not (mod.training and calls["step"] in nan_steps):
                    return output
                if isinstance(output, tuple):  # megatron linear layers return (output, bias)
                    return (nan_grad(output[0]), *output[1:])
                return nan_grad(output)

            by_name[nan_layer].register_forward_hook(nan_grad_hook)
        return model

    return provider


def hybrid(cfg):
    """``nvfp4_train.models.build`` (the trainer's default provider) with the faults above."""
    from nvfp4_train.trainer import hybrid_model_provider

    return _with_faults(cfg, hybrid_model_provider(cfg))


def gpt(cfg):
    """The megatron GPTModel stand-in of the trainer tests with the faults above (no quantized layers)."""
    from tests.trainer.standin import gpt_provider

    return _with_faults(cfg, gpt_provider(cfg))
