"""What a run reports, from rank 0: a progress bar, ``metrics.jsonl`` in the run directory, TensorBoard and
wandb (offline by default).

``metrics.jsonl`` holds one JSON object per line, told apart by ``type``:

- ``train``: step (1-based: steps done), tokens (consumed), loss (mean over the step's micro-batches and
  DP ranks), lr, grad_norm (before clipping; null on a skipped step), tokens_per_s, mfu (null without a
  known peak), peak_mem_gb, skipped_steps (so far), skipped (this step), time_s (this step);
- ``eval``: step, tokens, val_loss (mean over ``schedule.eval_batches`` fixed validation batches);
- ``telemetry``: step and ``layers``: ``{layer: {operand: stats}}`` from
  ``nvfp4_train.precision.telemetry.collect_telemetry`` (when that module exists);
- ``event``: start, resume, precision_switch, skipped_step, loss_spike, rollback, checkpoint, signal, diverged, end.

A resumed run appends to the same file; ``load_metrics`` keeps, for each step, the record written last
(a step redone after a resume from an older checkpoint replaces the first attempt).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LoggingConfig", "MetricsLogger", "load_metrics", "peak_memory_gb", "peak_flops_per_device"]

METRICS_FILE = "metrics.jsonl"


@dataclass(kw_only=True)
class LoggingConfig:
    """Progress bar, JSONL, TensorBoard, wandb and telemetry (the ``logging`` section)."""

    interval: int = 1
    """Write a ``train`` record every this many steps."""
    progress: str = "auto"
    """``auto`` (tqdm when installed and stderr is a terminal, else lines), ``tqdm``, ``lines``, ``none``."""
    tensorboard: bool = True
    """Write TensorBoard scalars to ``<run_dir>/tensorboard`` (when torch.utils.tensorboard imports)."""
    wandb: str = "offline"
    """``offline`` (files in ``<run_dir>/wandb``, never a login or network), ``online`` or ``disabled``."""
    wandb_project: str = "nvfp4-train"
    telemetry_interval: int = 0
    """Per-layer quantization telemetry every this many steps (0: off)."""
    nonfinite_check: str = "every_step"
    """When the quantized layers check their outputs and input gradients for NaN/inf, so that a skipped step
    names the first non-finite layer: ``every_step`` (default), or ``after_skip``: off until a step is skipped,
    then on until a step succeeds (a run of bad steps is named from its second step on). The check costs 8
    small kernel launches per layer forward + backward: ``after_skip`` is for host-bound runs
    (``docs/training.md``, "Non-finite steps")."""
    peak_tflops: float | None = None
    """Dense bf16 peak of one device for MFU. None: known GPUs (H100/H200 989, B200 2250), else no MFU."""

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"logging.interval={self.interval} must be >= 1")
        if self.progress not in ("auto", "tqdm", "lines", "none"):
            raise ValueError(f"logging.progress={self.progress!r} is not one of auto, tqdm, lines, none")
        if self.wandb not in ("offline", "online", "disabled"):
            raise ValueError(f"logging.wandb={self.wandb!r} is not one of offline, online, disabled")
        if self.telemetry_interval < 0:
            raise ValueError(f"logging.telemetry_interval={self.telemetry_interval} must be >= 0")
        if self.nonfinite_check not in NONFINITE_CHECK_MODES:
            raise ValueError(f"logging.nonfinite_check={self.nonfinite_check!r} is not one of "
                             f"{', '.join(NONFINITE_CHECK_MODES)}")


NONFINITE_CHECK_MODES = ("every_step", "after_skip")

_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "B200": 2250.0, "B100": 1750.0, "GB200": 2500.0,
                "A100": 312.0}


def peak_flops_per_device(cfg: LoggingConfig) -> float | None:
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops * 1e12
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, tflops in _PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def peak_memory_gb() -> float:
    """Peak allocated CUDA memory of this process, or its peak resident set size on CPU, in GB."""
    import torch

    from nvfp4_train.mcore_compat.cuda_on_cpu import cpu_compat_active

    if torch.cuda.is_available() and not cpu_compat_active():
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def _finite_or_none(v):
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


class MetricsLogger:
    """Rank 0's sinks. Other ranks get an instance with ``enabled=False`` (every call does nothing)."""

    def __init__(self, cfg: LoggingConfig, run_dir: Path, *, enabled: bool, total_steps: int, start_step: int,
                 run_name: str, config_dict: dict | None = None) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self.total_steps = total_steps
        self._bar = None
        self._tb = None
        self._wandb = None
        self._file = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / METRICS_FILE, "a", buffering=1)
        mode = cfg.progress
        if mode in ("auto", "tqdm"):
            try:
                from tqdm import tqdm
            except ImportError:
                if mode == "tqdm":
                    self.note("tqdm is not installed: progress as plain lines")
                mode = "lines"
            else:
                if mode == "tqdm" or sys.stderr.isatty():
                    self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
                    mode = "tqdm"
                else:
                    mode = "lines"
        self._lines = mode == "lines"
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except Exception as e:  # tensorboard missing or broken
                self.note(f"TensorBoard is off: torch.utils.tensorboard does not import ({e})")
            else:
                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if cfg.wandb != "disabled":
            try:
                import wandb
            except ImportError:
                self.note("wandb is not installed: wandb logging is off (pip install wandb, or logging.wandb=disabled)")
            else:
                os.environ.setdefault("WANDB_SILENT", "true")
                self._wandb = wandb.init(project=cfg.wandb_project, name=run_name, dir=str(run_dir),
                                         mode=cfg.wandb, config=config_dict, resume="allow", id=_wandb_id(run_dir))

    # -- sinks ----------------------------------------------------------------------------------------------
    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")

    def event(self, name: str, step: int, **fields) -> None:
        if not self.enabled:
            return
        self._write({"type": "event", "event": name, "step": step, "time": time.time(), **fields})

    def train(self, record: dict) -> None:
        if not self.enabled:
            return
        self._write({"type": "train", **record})
        step = record["step"]
        scalars = {k: record[k] for k in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gb",
                                          "skipped_steps") if record.get(k) is not None}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(f"train/{k}", v, step)
        if self._wandb is not None:
            self._wandb.log({f"train/{k}": v for k, v in scalars.items()} | {"tokens": record["tokens"]}, step=step)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                  tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
        elif self._lines:
            gn = record.get("grad_norm")
            print(f"step {step}/{self.total_steps} loss {record['loss']:.4f} lr {record['lr']:.3e} "
                  f"grad_norm {gn if gn is None else f'{gn:.3f}'} tok/s {record['tokens_per_s']:.0f}"
                  + (f" mfu {record['mfu']:.3f}" if record.get("mfu") is not None else "")
                  + (f" skipped {record['skipped_steps']}" if record.get("skipped_steps") else ""), flush=True)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def eval(self, step: int, tokens: int, val_loss: float) -> None:
        if not self.enabled:
            return
        self._write({"type": "eval", "step": step, "tokens": tokens, "val_loss": val_loss})
        if self._tb is not None:
            self._tb.add_scalar("val/loss", val_loss, step)
        if self._wandb is not None:
            self._wandb.log({"val/loss": val_loss}, step=step)
        self.note(f"step {step}: validation loss {val_loss:.4f}")

    def telemetry(self, step: int, layers: dict) -> None:
        if not self.enabled:
            return
        self._write({"type": "telemetry", "step": step, "layers": _jsonable(layers)})

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._file is not None:
            self._file.close()
        self.enabled = False


def _wandb_id(run_dir: Path) -> str:
    """One wandb run id per run directory (kept in the run directory, so a resume continues the same run)."""
    path = run_dir / "wandb_id.txt"
    if path.is_file():
        return path.read_text().strip()
    import uuid

    rid = uuid.uuid4().hex[:12]
    path.write_text(rid + "\n")
    return rid


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and getattr(x, "numel", lambda: 2)() == 1:
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return str(x)


def load_metrics(path: str | os.PathLike, record_type: str = "train") -> list[dict]:
    """Records of one type from a ``metrics.jsonl`` (a run directory or the file), one per step (the last
    written wins), ordered by step."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if rec.get("type") == record_type:
                by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]
