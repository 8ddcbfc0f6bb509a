"""Our checkpoints in and out of one process on one device, at TP = PP = 1.

:func:`load_checkpoint_model` reads a training checkpoint (``nvfp4_train.checkpoint``: a megatron-core
distributed checkpoint of any TP/PP layout) into the hybrid model built at TP = PP = 1 (megatron reshards on
load) and returns the run's config and the model's plain state dict (bf16, as trained). Only the model part is
read; the optimizer state is not needed.

:func:`write_training_checkpoint` is the way back: a state dict into a complete step-0 checkpoint that
``train.py`` resumes from (``checkpoint.resume=PATH``): the model weights, a fresh optimizer state (Adam moments
zero, the FP32 master weights copied from the weights), the RNG files and the manifest, written by the
trainer's own ``save_checkpoint``.

:func:`build_model_single` builds the model of a config in this process (TP = PP = 1) in a chosen dtype and
precision; it is what generation, evaluation, the export's logit checks and the calibration run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from nvfp4_train.models.config import ModelConfig

__all__ = ["RunInfo", "read_run_info", "build_model_single", "load_checkpoint_model", "write_training_checkpoint",
           "check_new_checkpoint_root", "shape_problems"]


@dataclasses.dataclass(kw_only=True)
class RunInfo:
    """What a checkpoint says about its run."""

    path: Path
    """The checkpoint directory (``.../step_XXXXXXX``)."""
    model: ModelConfig
    """The architecture it was written for."""
    config: dict
    """The run's resolved config (``config.yaml``), as plain data."""
    step: int
    """Training step of the checkpoint."""


def _resolve_checkpoint_dir(path: str | Path) -> Path:
    """A checkpoint directory, or a checkpoint root / run directory (its newest complete checkpoint)."""
    from nvfp4_train.checkpoint import MANIFEST, list_checkpoints

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    if (p / MANIFEST).is_file():
        return p
    for root in (p, p / "checkpoints"):
        found = [c for c in list_checkpoints(root) if (c / MANIFEST).is_file()]
        if found:
            return found[-1]
    raise ValueError(f"{p} is not a checkpoint: no {MANIFEST} in it, and no step_XXXXXXX checkpoint under it or "
                     f"its checkpoints/ folder; give a directory written by train.py")


def read_run_info(path: str | Path) -> RunInfo:
    """The checkpoint's model config, run config and step (verified against its manifest: sizes)."""
    from omegaconf import OmegaConf

    from nvfp4_train.checkpoint import verify_checkpoint

    ckpt = _resolve_checkpoint_dir(path)
    problems = verify_checkpoint(ckpt, checksums=False)
    if problems:
        raise ValueError(f"checkpoint {ckpt} is incomplete or damaged: {problems[0]}")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    model = manifest.get("meta", {}).get("model")
    if not model:
        raise ValueError(f"checkpoint {ckpt}: its manifest names no model config (meta.model)")
    config = OmegaConf.to_container(OmegaConf.load(ckpt / "config.yaml"), resolve=True)
    return RunInfo(path=ckpt, model=ModelConfig(**model), config=config, step=int(manifest.get("step", 0)))


def build_model_single(model_cfg: ModelConfig, *, recipe: str = "bf16", dtype: torch.dtype = torch.float32,
                       layer_map=None, seq_length: int = 4096):
    """The hybrid model at TP = PP = 1 in this process (world size 1), parameters in ``dtype`` on the CPU,
    every linear layer running ``recipe`` (or the given ``layer_map``). Weights are megatron's random init:
    load a state dict into it."""
    from nvfp4_train.models.build import build_model, transformer_config
    from nvfp4_train.parallel.setup import init_single_process
    from nvfp4_train.precision.layer_map import LayerPrecisionMap

    init_single_process()
    if layer_map is None:
        layer_map = LayerPrecisionMap(model_cfg.pattern, recipe, keep_first=0, keep_last=0)
    tcfg = transformer_config(model_cfg, params_dtype=dtype, use_cpu_initialization=True)
    model = build_model(model_cfg, layer_map, config=tcfg, seq_length=seq_length)
    return model.eval()


def shape_problems(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Keys missing, unexpected or of another shape in ``got`` (``expected``: the model's own state dict)."""
    out = [f"missing {k} {tuple(v.shape)}" for k, v in expected.items() if k not in got]
    out += [f"unexpected {k}" for k in got if k not in expected]
    out += [f"{k}: shape {tuple(got[k].shape)}, the config needs {tuple(v.shape)}" for k, v in expected.items()
            if k in got and tuple(got[k].shape) != tuple(v.shape)]
    return out


def _weights(model) -> dict[str, torch.Tensor]:
    """The model's learned tensors (no ``_extra_state`` entries)."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def load_checkpoint_model(path: str | Path) -> tuple[RunInfo, dict[str, torch.Tensor]]:
    """(run info, state dict at TP = PP = 1) of a training checkpoint of any layout. The tensors are the
    model's weights as trained (bf16), keyed by megatron's names with global block indices."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    info = read_run_info(path)
    model = build_model_single(info.model, dtype=torch.bfloat16)
    sharded = model.sharded_state_dict()
    try:
        state = dist_checkpointing.load(sharded, str(info.path / "dist"))
    except (Exception, CheckpointException) as e:  # megatron names the first tensor whose shape differs
        raise ValueError(f"checkpoint {info.path} does not fit its model config {info.model.name!r} "
                         f"({type(e).__name__}: {e}); the checkpoint's weights do not have the shapes that config "
                         f"gives") from e
    model.load_state_dict(state, strict=False)
    return info, {k: v.detach().clone() for k, v in _weights(model).items()}


def check_new_checkpoint_root(out: str | Path) -> Path:
    """``out`` as the root of a new checkpoint: a new or empty directory (checked before any work)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a directory: give a new directory for the checkpoint")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty: give a new directory for the checkpoint")
    return out


def write_training_checkpoint(out: str | Path, model_cfg: ModelConfig, state: dict[str, torch.Tensor], *,
                              overrides: tuple[str, ...] = (), meta_extra: dict | None = None) -> Path:
    """Write ``state`` (our keys, TP = PP = 1) as the step-0 checkpoint ``out/step_0000000`` that ``train.py``
    resumes from. ``overrides``: Hydra overrides of the run config recorded with it (``config.yaml``; the
    model section is ``model_cfg``). Returns the checkpoint directory. Refuses a non-empty ``out``."""
    from omegaconf import OmegaConf

    from nvfp4_train.checkpoint import save_checkpoint, start_checkpoint_writer
    from nvfp4_train.checkpoint import _init_optimizer_state  # a fresh Adam state with a 'step', as a load needs
    from nvfp4_train.config import compose_config
    from nvfp4_train.optim import build_ddp, build_optimizer

    out = check_new_checkpoint_root(out)
    cfg = compose_config("train", ["precision=bf16", *overrides])
    cfg.model = model_cfg
    model = build_model_single(model_cfg, dtype=torch.bfloat16, layer_map=cfg.precision.layer_map(model_cfg.pattern))
    expected = _weights(model)
    problems = shape_problems(expected, state)
    if problems:
        raise ValueError(f"the weights do not fit model config {model_cfg.name!r}: " + "; ".join(problems[:6])
                         + (" ..." if len(problems) > 6 else ""))
    with torch.no_grad():
        for k, p in expected.items():
            p.copy_(state[k])
    ddp = build_ddp(model, cfg.optim)
    optimizer = build_optimizer([ddp], cfg.optim, lr=cfg.schedule.lr, min_lr=cfg.schedule.min_lr)
    optimizer.reload_model_params()  # the FP32 master weights from the weights just copied in
    _init_optimizer_state(optimizer)
    start_checkpoint_writer()
    layout = {"tp": 1, "pp": 1, "dp": 1, "world_size": 1}
    trainer_state = {"step": 0, "consumed_samples": 0, "consumed_tokens": 0, "skipped_steps": 0,
                     "skipped_samples": 0, "rollbacks": 0, "layout": layout}
    meta = {"model": dataclasses.asdict(model_cfg), "layout": layout, "step": 0, "consumed_tokens": 0,
            **(meta_extra or {})}
    return save_checkpoint(out, step=0, ddp=ddp, optimizer=optimizer, trainer_state=trainer_state,
                           config_yaml=OmegaConf.to_yaml(OmegaConf.structured(cfg)), meta=meta, keep_last=1,
                           optim_format=cfg.checkpoint.optim_format)
