"""The training loop: ``train(cfg, model_provider=None)``, or ``Trainer(cfg)`` step by step.

Model-agnostic: the model comes from ``model_provider(pre_process, post_process) -> MegatronModule`` (the
hybrid model of ``nvfp4_train.models.build`` by default) whose ``forward(input_ids=, position_ids=, attention_mask=,
labels=)`` returns the per-token loss ``[b, s]`` on the last pipeline stage, like megatron's ``GPTModel``.
Optional model methods the trainer uses when present: ``precision_layers()`` (the precision switch: each
layer carries its global ``block`` index and ``role``), ``flops_per_token(seq_length)`` (MFU; else 6 x
parameters).

One step (:meth:`Trainer.train_step`): set the step's learning rate (WSD), apply the precision switch when it
starts, run megatron's ``get_forward_backward_func`` over ``global_batch_size / (micro_batch_size * DP)``
micro-batches (1F1B under pipeline parallelism; the next step's micro-batches are read while the device
runs them), all-reduce [loss, non-finite flag, signal flag] over the world on the device, enqueue the
optimizer's global norm (``nvfp4_train.optim.begin_optimizer_step``: the non-finite-gradient check and the
clipping decision), read all of it in the step's one host read, then either skip the optimizer (non-finite
loss, learning rate or gradient) or finish its step (``finish_optimizer_step``: clipped, then megatron's
update; see ``nvfp4_train.optim``). :meth:`Trainer.run` is that step in a loop, then, in this order: the step's
records, bad-step handling (``optim.max_consecutive_bad_steps`` skipped steps in a row stop the run,
``TrainingDiverged``, with a report naming the first non-finite quantized layer, its telemetry and the
checkpoint to resume from: ``nvfp4_train.spikes.RecoveryPoint``), spike handling (``spike.*``, off by default:
logged, or rolled back to the last checkpoint past its data window), evaluation every
``schedule.eval_interval`` steps, and the
checkpoint policy (every ``checkpoint.interval`` steps, never during a streak of bad steps;
SIGTERM/SIGUSR1/SIGINT finish the step, save and return; a run that ends inside a streak of bad steps raises
``TrainingDiverged`` too). What the build finds wrong with the config's files is a ``RunSetupError``. See
docs/reliability.md.

With ``schedule.cuda_graph`` on (``auto``: on CUDA where the layout allows it) the step's forwards and
backwards are replayed from a CUDA graph (``nvfp4_train.cuda_graph.CudaGraphStep``), the rest of the step eager,
bitwise the eager step; the trainer then builds and runs everything on one side stream.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import contextlib
import os
import signal
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from nvfp4_train.checkpoint import (CheckpointError, CheckpointWriteError, check_writable, find_resume_checkpoint,
                                    load_checkpoint, save_checkpoint, start_checkpoint_writer)
from nvfp4_train.config.compose import check_finite
from nvfp4_train.config.precision import without_retired_fields
from nvfp4_train.cuda_graph import CudaGraphStep, resolve_cuda_graph
from nvfp4_train.mcore_compat.safe_load import UntrustedPickleError
from nvfp4_train.metrics import MetricsLogger, peak_flops_per_device, peak_memory_gb
from nvfp4_train.optim import begin_optimizer_step, check_adam_step_size, finish_optimizer_step
from nvfp4_train.parallel.setup import ParallelState, setup_parallel, teardown_parallel
from nvfp4_train.precision import telemetry as quant_telemetry
from nvfp4_train.precision.layer_map import LayerPrecisionMap, recipe_in_effect
from nvfp4_train.precision.megatron_linear import invalidate_weight_caches, set_weight_cache
from nvfp4_train.spikes import RecoveryPoint, SpikeDetector
from nvfp4_train.warnings_log import RunEventWarning

__all__ = ["train", "Trainer", "StepOutcome", "NonfiniteSite", "BadStreak", "TrainResult", "TrainingDiverged",
           "RunDirLocked", "RunSetupError", "hybrid_model_provider", "resolve_model_provider",
           "apply_precision_switch"]


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient, a run that ended inside such a streak, or
    a loss spike with no rollback left. The message is the stop report (one line: the first non-finite
    layer, the checkpoint to resume from); ``train.py`` exits 3."""


class RunSetupError(ValueError):
    """What a run finds before its first step that the config, or the files it names, must change for: a data
    file (missing, truncated or corrupt, prepared with another tokenizer), the tokenizer, a checkpoint (another
    model's, refused as untrusted, damaged, written with another global batch or past
    ``schedule.train_steps``, or present under ``checkpoint.resume=none``), a value that cannot run
    (``model.vocab_size`` below the tokenizer's ids, a learning rate that overflows AdamW). The message is one
    line naming the problem and the fix; the original error is its ``__cause__``. ``train.py`` exits 2."""


@contextlib.contextmanager
def _setup_errors(*errors: type[BaseException]):
    """Re-raise ``errors`` (our own functions' documented user errors) as :class:`RunSetupError`."""
    try:
        yield
    except errors as e:
        raise RunSetupError(" ".join(str(e).split("\n"))) from e


@dataclass(kw_only=True)
class TrainResult:
    run_dir: str
    step: int
    consumed_tokens: int
    loss: float | None
    val_loss: float | None
    skipped_steps: int
    stopped_by_signal: bool
    checkpoint: str | None
    resumed_from: str | None


def hybrid_model_provider(cfg, layer_map: LayerPrecisionMap | None = None):
    """The default provider: ``nvfp4_train.models.build.build_model`` (the hybrid Mamba-Transformer) with ``layer_map``
    (the trainer hands down the map it resolved; None: resolved here from ``cfg.precision``)."""
    from nvfp4_train.models.build import build_model, transformer_config

    if layer_map is None:
        layer_map = cfg.precision.layer_map(cfg.model.pattern)
    tcfg = transformer_config(cfg.model, tp=cfg.parallel.tp, pp=cfg.parallel.pp,
                              sequence_parallel=cfg.parallel.sequence_parallel, fusion=cfg.fusion)

    def provider(pre_process: bool, post_process: bool):
        return build_model(cfg.model, layer_map, config=tcfg, pre_process=pre_process, post_process=post_process,
                           seed=cfg.experiment.seed, seq_length=cfg.data.seq_length, fusion=cfg.fusion)

    return provider


def resolve_model_provider(cfg, layer_map: LayerPrecisionMap | None = None):
    """``experiment.model_provider`` (``module:function``, called with the config) or the hybrid model (given
    ``layer_map``, see :func:`hybrid_model_provider`)."""
    spec = cfg.experiment.model_provider
    if spec is None:
        return hybrid_model_provider(cfg, layer_map)
    module, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"experiment.model_provider={spec!r} cannot be loaded ({e})") from None
    return factory(cfg)


def apply_precision_switch(module, layer_map: LayerPrecisionMap, switch, *, step: int, total_steps: int) -> int:
    """Set each quantized layer's recipe in effect at ``step`` (paper App. D): the recipe ``layer_map`` gives
    the layer's global ``block`` index and ``role`` (attributes the quantized layers carry), switched as
    ``switch`` says. Returns the layers changed."""
    if not hasattr(module, "precision_layers"):
        return 0
    n = 0
    for name, layer in module.precision_layers():
        if not (hasattr(layer, "block") and hasattr(layer, "role")):
            raise TypeError(f"layer {name!r} ({type(layer).__name__}) from precision_layers() has no (block, role) "
                            f"attributes: the trainer cannot tell which recipe it was built with")
        base = layer_map.recipe(layer.block, layer.role)
        layer.set_recipe(recipe_in_effect(base, switch, step=step, total_steps=total_steps))
        n += 1
    return n


def quant_rng_counters(module) -> dict[str, int]:
    """The stochastic-rounding call counters of the quantized layers (``layer.lctx.calls``: each layer's SR
    seed is derived from its base seed and this counter), by layer name. Saved per rank in checkpoints so
    that a resumed run draws the same rounding as an uninterrupted one."""
    if not hasattr(module, "precision_layers"):
        return {}
    return {name: int(layer.lctx.calls) for name, layer in module.precision_layers()
            if hasattr(getattr(layer, "lctx", None), "calls")}


def set_quant_rng_counters(module, counters: dict[str, int]) -> int:
    """Restore :func:`quant_rng_counters`; returns how many layers were set."""
    n = 0
    if not counters or not hasattr(module, "precision_layers"):
        return n
    for name, layer in module.precision_layers():
        if name in counters and hasattr(getattr(layer, "lctx", None), "calls"):
            layer.lctx.calls = counters[name]
            n += 1
    return n


class NonfiniteChecks:
    """When the quantized layers run their non-finite check (``logging.nonfinite_check``): ``every_step``
    leaves it on; ``after_skip`` switches it off, on again after a skipped step (so the next bad step of a run
    names its first non-finite layer) and off after the next successful step. ``tel`` is the telemetry module
    (``None``: nothing to switch)."""

    def __init__(self, mode: str, tel, module) -> None:
        self.mode, self.tel, self.module = mode, tel, module
        self.on = True  # the layers' default
        if mode == "after_skip":
            self._set(False)

    def _set(self, on: bool) -> None:
        if on != self.on and self.tel is not None:
            self.tel.set_nonfinite_check(self.module, on)
        self.on = on

    def after_step(self, ok: bool) -> None:
        if self.mode == "after_skip":
            self._set(not ok)


def _phase(name: str):
    """A host range of the training step, ``train_step/<name>``, seen by ``torch.profiler``
    (``nvfp4_train.bench.profile`` attributes the GPU's idle time to these); a no-op op call otherwise."""
    return torch.profiler.record_function(f"train_step/{name}")


def _unwrap(ddp):
    return ddp.module


def _format_stats(layer_stats: dict) -> str:
    """``{operand: {zero, saturated, sqnr_db}}`` on one line."""
    return ", ".join(f"{op} zero {st['zero']:.3g} saturated {st['saturated']:.3g} sqnr {st['sqnr_db']:.3g} dB"
                     for op, st in layer_stats.items())


class _SignalFlag:
    """SIGTERM, SIGUSR1 and SIGINT (Ctrl-C) set a flag; the loop acts on it after the current step. A SIGINT
    while a stop is pending (a second Ctrl-C) ends the process at once: killed by SIGINT, as Ctrl-C ends a
    program, without a checkpoint (those already written are intact; a save cut short leaves a ``.tmp_*``
    the next save removes). Not ``enabled`` (``checkpoint.save_on_signal=false``): SIGTERM and SIGUSR1 end the
    process (their default action) until :meth:`restore`, and SIGINT keeps Python's ``KeyboardInterrupt``."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, enabled: bool) -> None:
        self.signum = 0
        self._old = {}
        for sig in self.SIGNALS:
            if not enabled and sig == signal.SIGINT:
                continue
            try:
                self._old[sig] = signal.signal(sig, self._handle if enabled else signal.SIG_DFL)
            except ValueError:  # not the main thread
                pass

    def _handle(self, signum, _frame) -> None:
        # os.write, not print: the handler may interrupt a write to stderr (the progress bar)
        if signum == signal.SIGINT and self.signum:
            os.write(2, b"\nCtrl-C again: stopping now, without a checkpoint (the checkpoints written are intact)\n")
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
            return
        if signum == signal.SIGINT:
            os.write(2, b"\nCtrl-C: finishing this step, then saving and stopping (Ctrl-C again stops at once)\n")
        self.signum = signum

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def train(cfg, *, model_provider=None, run_dir_ready: Callable[[Path], None] | None = None) -> TrainResult:
    """Train as ``cfg`` says (a ``nvfp4_train.config.Config``); ``model_provider`` overrides the config's;
    ``run_dir_ready(run_dir)`` is called on every rank once the run directory is locked for this run and
    writable (``train.py`` opens its ``warnings.log`` then: a run refused there writes nothing into it).
    Raises :class:`RunSetupError`, :class:`RunDirLocked`, :class:`TrainingDiverged` or
    ``nvfp4_train.checkpoint.CheckpointWriteError`` with a one-line message."""
    with Trainer(cfg, model_provider=model_provider, run_dir_ready=run_dir_ready) as trainer:
        return trainer.run()


@dataclass(frozen=True, kw_only=True)
class NonfiniteSite:
    """Where a step first saw a non-finite value: a quantized layer's output (``forward``) or input gradient
    (``backward``), on the lowest rank that saw one."""

    layer: str
    where: str
    rank: int


@dataclass(frozen=True, kw_only=True)
class StepOutcome:
    """What one :meth:`Trainer.train_step` did (the same on every rank)."""

    step: int
    """The trainer's step count after the step: this step's number, counted from 1."""
    loss: float
    """The world's mean loss over the global batch (NaN or inf when non-finite)."""
    lr: float
    """The learning rate the step ran with (before the parameter groups' multipliers)."""
    grad_norm: torch.Tensor | float | None
    """The global gradient norm before clipping, as ``nvfp4_train.optim.optimizer_step`` returns it (read with the
    step's one host read); None when the update was skipped."""
    skipped: bool
    """The update was not applied (a bad step, counted in ``Trainer.skipped_steps``)."""
    reason: str | None
    """Why it was skipped: ``non-finite loss``, ``non-finite learning rate`` or ``non-finite gradient``."""
    first_nonfinite: NonfiniteSite | None
    """The first quantized layer that saw a non-finite value in this (skipped) step; None: none did."""
    signal: bool
    """A SIGTERM/SIGUSR1/SIGINT reached some rank before the step's all-reduce (:meth:`Trainer.run` saves and
    stops)."""
    time_s: float
    """Wall seconds of the step on the host, from its start to its last launch (the precision switch and
    telemetry collection excluded). The step does not wait for its optimizer kernels: the next step's host
    work overlaps them, and its one host read waits for them, so over consecutive steps the times add up to
    the device's."""


@dataclass(kw_only=True)
class BadStreak:
    """The current run of consecutive bad (skipped) steps."""

    length: int = 0
    """Bad steps in a row (0: not in a streak)."""
    first: NonfiniteSite | None = None
    """The first quantized layer that saw a non-finite value during the streak."""
    first_step: int | None = None
    """The step (counted from 1) in which ``first`` was seen."""
    checkpoint_before: str | None = None
    """The last checkpoint written (or resumed from) before the streak began: no checkpoint is written during
    a streak, so this is the one to resume from."""


class RunDirLocked(RuntimeError):
    """Another live run holds the run directory's lock."""


# The descriptors of the run-directory locks this process holds. A flock belongs to the open file description,
# which a forked child shares: megatron-core's checkpoint writer forks workers during a save, and a worker
# orphaned by a SIGKILL of the trainer kept the lock held, so every restart was refused. Forked children close
# these descriptors at once (``os.register_at_fork``); the parent's lock is unaffected.
_HELD_LOCK_FDS: set[int] = set()


def _close_inherited_lock_fds() -> None:
    import os

    for fd in _HELD_LOCK_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD_LOCK_FDS.clear()


os.register_at_fork(after_in_child=_close_inherited_lock_fds)


class _RunDirLock:
    """An exclusive ``fcntl.flock`` on ``<run dir>/.lock``, held by rank 0 for the trainer's lifetime; processes
    forked from the trainer do not hold it (``_HELD_LOCK_FDS``).

    The file holds the holder's pid and host, emptied when the run ends. The kernel releases a flock when its
    process dies (SIGKILL included), so a lock file left by a killed run is not held: the next run takes it
    and says whose it was.
    On a shared filesystem the lock is as good as its flock: NFSv4 and Lustre mounted with ``flock`` (or
    ``localflock`` for one node) honour it; without that two runs on different nodes are not kept apart."""

    def __init__(self, run_dir: Path) -> None:
        import fcntl
        import os
        import socket

        self.path = run_dir / ".lock"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self.fd, 256, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise RunDirLocked(f"run directory {run_dir} is in use by another run ({holder}, lock {self.path}): "
                               f"wait for it to end, or give this run another experiment.run_dir") from None
        _HELD_LOCK_FDS.add(self.fd)
        self.previous = os.pread(self.fd, 256, 0).decode(errors="replace").strip() or None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)

    def release(self) -> None:
        import os

        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # a lock file left with a holder in it: a run that did not end cleanly
            _HELD_LOCK_FDS.discard(self.fd)
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None


def precision_with_new_defaults(saved: dict, now: dict) -> dict:
    """A checkpoint's ``precision`` section with the fields this run has and it lacks set to their defaults: a
    field added to ``PrecisionConfig`` after the checkpoint was written defaults to the behaviour it was trained
    with, so a resume does not report it as a precision change."""
    from nvfp4_train.config.precision import PrecisionConfig

    defaults = {f.name: f.default for f in dataclasses.fields(PrecisionConfig) if f.default is not dataclasses.MISSING}
    return {**{k: defaults[k] for k in now if k in defaults and k not in saved}, **saved}

class Trainer:
    """A training run, built from its config and driven step by step.

    ``Trainer(cfg)`` builds everything a run needs: the process groups (unless ``parallel_state`` is given), the
    run directory's lock, the model (``model_provider``, else the config's), DDP, optimizer, schedule and
    datasets; it resumes as ``checkpoint.resume`` says, writes ``config.yaml`` and opens the metrics. It trains
    nothing. Then:

    - :meth:`run` trains to ``schedule.train_steps`` (records, bad steps, spikes, evaluation, checkpoints).
    - :meth:`train_step` runs exactly one training step, the one :meth:`run` loops over, and returns its
      :class:`StepOutcome`; it writes no records, evaluates and saves nothing (what a benchmark times).
    - :meth:`close` (or ``with Trainer(cfg) as t:``) releases the signal handlers, the metrics files, the lock
      and the process groups it set up.

    What the build finds wrong with the config or the files it names (data, tokenizer, checkpoints) is a
    :class:`RunSetupError`; a run directory that is a file or read-only, a ``CheckpointWriteError``; one in use
    by another run, :class:`RunDirLocked`. Each has a one-line message; nothing is written into the run
    directory before it is locked. ``run_dir_ready(run_dir)``, if given, is called on every rank right after.
    """

    def __init__(self, cfg, *, model_provider=None, parallel_state: ParallelState | None = None,
                 run_dir_ready: Callable[[Path], None] | None = None) -> None:
        check_finite(cfg)  # also a config built in code, not composed
        self._run_dir_ready = run_dir_ready
        # a signal from here on stops the run cleanly (before the first step: without training anything)
        self._signals = _SignalFlag(cfg.checkpoint.save_on_signal)
        self._lock: _RunDirLock | None = None
        self.metrics: MetricsLogger | None = None
        self._owns_parallel = False
        self._stream = None  # the side stream of a run with CUDA graphs (everything runs on it)
        try:
            if parallel_state is None:
                parallel_state = setup_parallel(cfg.parallel, seed=cfg.experiment.seed)
                self._owns_parallel = True
            self.ps = parallel_state
            self._graphs, self._graph_warning = resolve_cuda_graph(
                cfg.schedule.cuda_graph, device_type=torch.device(parallel_state.device).type, pp=parallel_state.pp,
                world_size=parallel_state.world_size, backend=parallel_state.backend,
                overlap_grad_reduce=cfg.optim.overlap_grad_reduce, overlap_param_gather=cfg.optim.overlap_param_gather)
            if self._graphs:
                self._stream = torch.cuda.Stream(device=torch.device(parallel_state.device))
            with self._on_stream():
                self._build(cfg, model_provider)
        except BaseException:
            self.close()
            raise

    def _build(self, cfg, model_provider) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from omegaconf import OmegaConf

        from nvfp4_train.data.datasets import DataError, build_datasets, load_tokenizer_for
        from nvfp4_train.optim import build_ddp, build_optimizer
        from nvfp4_train.schedule import WSDSchedule

        ps = self.ps
        self.cfg = cfg
        self.run_dir = Path(cfg.experiment.resolved_run_dir())
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.device = torch.device(ps.device)
        self.is_rank0 = ps.rank == 0
        if not self.is_rank0:  # rank 0 reports the third-party warnings every rank would repeat; ours stay
            warnings.filterwarnings("ignore", module=r"(?!nvfp4_train(\.|$))")
        if ps.cpu_compat:  # on CPU the "CUDA" RNG of megatron's tracker IS the CPU RNG: its every-step warning
            logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)  # says nothing
        self._resume_changes: list[tuple[str, dict, str]] = []  # (event, fields, note) logged when run() starts
        self.cuda_graph: CudaGraphStep | None = None  # made at the end of the build
        if self._graph_warning:
            warnings.warn(self._graph_warning, RunEventWarning, stacklevel=3)
            self._resume_changes.append(("cuda_graph_fallback", {"reason": self._graph_warning}, self._graph_warning))
        self._lock_run_dir()

        sc = cfg.schedule
        self.sched = sc.resolve(cfg.data.seq_length)
        per_micro = sc.micro_batch_size * ps.dp
        if sc.global_batch_size % per_micro:
            raise RunSetupError(f"schedule.global_batch_size={sc.global_batch_size} is not a multiple of "
                                f"micro_batch_size * DP = {sc.micro_batch_size} * {ps.dp}")
        self.num_micro = sc.global_batch_size // per_micro
        with _setup_errors(ValueError):  # each learning rate the schedule reaches
            for name in ("lr", "init_lr", "min_lr"):
                check_adam_step_size(cfg.optim, getattr(sc, name), name=f"schedule.{name}")

        with _setup_errors(ValueError, OSError):  # our tokenizer file's errors name the file
            tokenizer = load_tokenizer_for(cfg.data)
        if cfg.model.vocab_size < tokenizer.vocab_size:
            raise RunSetupError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                                f"{tokenizer.vocab_size} ids ({tokenizer.path}), which the data holds: set "
                                f"model.vocab_size >= {tokenizer.vocab_size}")
        self.layer_map = cfg.precision.layer_map(cfg.model.pattern)  # resolved once, handed to the model
        self.switch = cfg.precision.switch

        # model, DDP, optimizer
        with _setup_errors(ValueError):  # experiment.model_provider that cannot be loaded
            provider = model_provider if model_provider is not None else resolve_model_provider(cfg, self.layer_map)
        module = provider(pre_process=ps.is_first_stage, post_process=ps.is_last_stage)
        if getattr(module, "config", None) is None:
            raise TypeError(f"the model provider returned a {type(module).__name__} without a megatron "
                            f"TransformerConfig .config")
        self.ddp = build_ddp(module, cfg.optim)
        tconfig = module.config
        tconfig.finalize_model_grads_func = finalize_model_grads
        if cfg.optim.overlap_grad_reduce:
            tconfig.no_sync_func = self.ddp.no_sync
        self.optimizer = build_optimizer([self.ddp], cfg.optim, lr=sc.lr, min_lr=sc.min_lr)
        self.lr_schedule = WSDSchedule(self.sched, self.optimizer, weight_decay=cfg.optim.weight_decay)
        self.tconfig = tconfig
        self.fb = get_forward_backward_func()
        self.flops_per_token = self._flops_per_token(module, parallel_state)
        self.peak_flops = peak_flops_per_device(cfg.logging)

        # data
        gbs = sc.global_batch_size
        valid_samples = sc.eval_batches * gbs
        with _setup_errors(DataError):
            self.train_ds, self.valid_ds = build_datasets(cfg.data, train_samples=self.sched.train_steps * gbs
                                                          + self._rollback_reserve(), valid_samples=valid_samples,
                                                          tokenizer=tokenizer, vocab_size=cfg.model.vocab_size)

        # resume
        self.step = 0
        self.skipped_steps = 0
        self.resumed_from = None
        self.spikes = SpikeDetector(cfg.spike)
        self.rollbacks = 0
        self.skipped_samples = 0  # training samples never trained on: the data windows skipped by rollbacks
        self.eval_step: int | None = None  # the step of the latest evaluation (a resumed one: the checkpoint's)
        self.recovery = RecoveryPoint(cfg.spike)  # the checkpoint a diverged run should resume from
        with _setup_errors(CheckpointError, ValueError):  # ValueError: resume=none over checkpoints
            path = find_resume_checkpoint(cfg.checkpoint.resume, self.ckpt_dir,
                                          checksums=cfg.checkpoint.verify == "sha256")
        self.config_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
        self.config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
        if path is not None:
            with _setup_errors(CheckpointError, UntrustedPickleError):  # another model's, refused, unreadable
                tstate = self._load(path)
            self.skipped_samples = tstate.get("skipped_samples", 0)
            self.rollbacks = tstate.get("rollbacks", 0)
            self.eval_step = tstate.get("eval_step")
            if tstate.get("consumed_samples") != self.step * gbs + self.skipped_samples:
                saved_gbs = (tstate.get("consumed_samples", 0) - self.skipped_samples) // max(self.step, 1)
                raise RunSetupError(
                    f"checkpoint {path}: consumed_samples={tstate.get('consumed_samples')} is not step * "
                    f"global_batch_size + skipped_samples = {self.step} * {gbs} + {self.skipped_samples}: the "
                    f"global batch size changed; resume with schedule.global_batch_size={saved_gbs} as saved, or "
                    f"start a new run (another experiment.run_dir)")
            if self.step > self.sched.train_steps:
                raise RunSetupError(
                    f"checkpoint {path} is at step {self.step}, past schedule.train_steps={self.sched.train_steps}: "
                    f"resume with schedule.train_steps >= {self.step} (the run that wrote it had "
                    f"{tstate.get('schedule', {}).get('train_steps', '?')}), or start a new run (another "
                    f"experiment.run_dir)")
            self._note_resume_changes(path, tstate)
            self.resumed_from = str(path)

        self.metrics = MetricsLogger(cfg.logging, self.run_dir, enabled=self.is_rank0,
                                     total_steps=self.sched.train_steps, start_step=self.step,
                                     run_name=cfg.experiment.name, config_dict=self.config_dict)
        if self.is_rank0:
            (self.run_dir / "config.yaml").write_text(self.config_yaml)
        self.telemetry_interval = cfg.logging.telemetry_interval
        self.last_telemetry: tuple[int, dict] | None = None  # (step, layers) of the latest collection

        # the loop's state
        module = _unwrap(self.ddp)
        # quantize each weight once per optimizer step (not once per micro-batch); megatron's optimizer
        # writes the weights through param.data, so the caches are dropped explicitly after every step
        set_weight_cache(module, True)
        self.switch_start = self.switch.start_step(self.sched.train_steps)
        self.switched = False
        self.streak = BadStreak()  # the current run of bad steps
        self._streak_fields: dict = {}  # the streak's first non-finite layer, for the diverged event
        self.checks = NonfiniteChecks(cfg.logging.nonfinite_check, quant_telemetry, module)
        self._telemetry_next = False  # collect telemetry in the next step (after a skipped step or a loss spike)
        self.last_checkpoint: str | None = None  # the latest checkpoint this process wrote or rolled back to
        self.saved_step = self.step if self.resumed_from else None
        self.last_loss: float | None = None  # of the latest good step
        self.last_val: float | None = None  # of the latest evaluation
        self._batches = None  # the training batches' iterator, from the current position (made at the first step)
        self._ahead: list | None = None  # the next step's micro-batches, read during this one (_read_ahead)
        if self._graphs:  # after the resume: the device counters start from the restored host counts
            self.cuda_graph = CudaGraphStep(module, device=self.device, stream=self._stream)

    def _on_stream(self):
        """The context every step, evaluation, checkpoint and rollback runs in: the side stream of a run with
        CUDA graphs (see nvfp4_train.cuda_graph), nothing otherwise."""
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def close(self) -> None:
        """Restore the signal handlers; close the metrics; release the run directory and the process groups
        this trainer set up (idempotent)."""
        self._signals.restore()
        if getattr(self, "cuda_graph", None) is not None:
            self.cuda_graph.drop()  # the graph's memory pool
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._owns_parallel:
            self._owns_parallel = False
            teardown_parallel(self.ps)

    def _lock_run_dir(self) -> None:
        """Rank 0 creates the run directory and takes its lock, then checks that it and the checkpoint
        directory are writable (a probe file, :func:`~nvfp4_train.checkpoint.check_writable`); every rank raises
        :class:`RunDirLocked` or ``CheckpointWriteError`` when it cannot, then calls ``run_dir_ready``
        (collective). A refused run writes nothing into the directory."""
        err: tuple[str, str, str] | None = None  # (kind, path or message, reason): exceptions do not all pickle
        if self.is_rank0:
            try:
                try:
                    self.run_dir.mkdir(parents=True, exist_ok=True)
                    self._lock = _RunDirLock(self.run_dir)
                except OSError:  # a file in the way, a read-only or unwritable parent: named by the probe
                    check_writable(self.run_dir)
                    raise
                check_writable(self.run_dir)
                check_writable(self.ckpt_dir)
            except RunDirLocked as e:
                err = ("locked", str(e), "")
            except CheckpointWriteError as e:
                err = ("write", e.path, e.reason)
            except OSError as e:  # anything the probe did not name (e.g. a directory where the lock file goes)
                err = ("write", str(getattr(e, "filename", None) or self.run_dir),
                       f"{e.strerror or e}: remove it or choose another experiment.run_dir")
        err = self._all_ranks(err)[0]
        if err is not None and err[0] == "locked":
            raise RunDirLocked(err[1])
        if err is not None:
            raise CheckpointWriteError(err[1], err[2])
        if self._run_dir_ready is not None:
            self._run_dir_ready(self.run_dir)
        if self._lock is not None and self._lock.previous:
            self._resume_changes.append(("lock_taken_over", {"previous": self._lock.previous},
                                         f"took over the run directory's lock left by {self._lock.previous} "
                                         f"(that run is gone: the lock was not held)"))

    def _note_resume_changes(self, path: Path, tstate: dict) -> None:
        """Warn about, and log when run() starts, what differs from the checkpoint: the schedule (the
        learning rate's shape and the data order change) and the precision."""
        import yaml

        saved_sched = tstate.get("schedule", {})
        if saved_sched and saved_sched != self.lr_schedule.state_dict():
            now = self.lr_schedule.state_dict()
            diff = {k: [saved_sched.get(k), now.get(k)] for k in sorted(set(saved_sched) | set(now))
                    if saved_sched.get(k) != now.get(k)}
            text = (f"the schedule differs from checkpoint {path}'s: "
                    + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items())
                    + "; continuing with this run's: the learning rate from here on follows the new schedule "
                      "(the data order also changes when train_steps changes)")
            warnings.warn(text, RunEventWarning, stacklevel=3)
            self._resume_changes.append(("schedule_change", {"changed": diff}, text))
        saved_yaml = path / "config.yaml"
        saved_prec = (yaml.safe_load(saved_yaml.read_text()) or {}).get("precision") if saved_yaml.is_file() else None
        now_prec = yaml.safe_load(self.config_yaml).get("precision")
        if saved_prec is not None:
            saved_prec = precision_with_new_defaults(without_retired_fields(saved_prec), now_prec)
        if saved_prec is not None and saved_prec != now_prec:
            text = (f"the precision differs from checkpoint {path}'s (recipe {saved_prec.get('recipe')!r} -> "
                    f"{now_prec.get('recipe')!r}); the layers run this run's precision from here on")
            warnings.warn(text, RunEventWarning, stacklevel=3)
            self._resume_changes.append(("precision_change", {"checkpoint": saved_prec, "now": now_prec}, text))

    # -- helpers ----------------------------------------------------------------------------------------
    def _flops_per_token(self, module, parallel_state) -> float:
        if hasattr(module, "flops_per_token"):
            return float(module.flops_per_token(self.cfg.data.seq_length))
        local = 0.0
        for p in module.parameters():
            local += p.numel() if getattr(p, "tensor_model_parallel", False) else p.numel() / self.ps.tp
        t = torch.tensor([local], dtype=torch.float64, device=self.device)
        if self.ps.world_size > 1:
            torch.distributed.all_reduce(t, group=parallel_state.get_model_parallel_group())
        return 6.0 * float(t.item())

    def _loader(self, dataset, consumed_samples: int):
        from nvfp4_train.data.datasets import build_data_loader

        return build_data_loader(dataset, micro_batch_size=self.cfg.schedule.micro_batch_size,
                                 consumed_samples=consumed_samples, dp_rank=self.ps.dp_rank, dp_size=self.ps.dp,
                                 num_workers=self.cfg.data.num_workers, seed=self.cfg.data.seed)

    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        tokens = batch["tokens"].to(self.device, non_blocking=True)
        labels = batch["labels"].to(self.device, non_blocking=True)
        loss_mask = batch["loss_mask"].to(self.device, non_blocking=True)
        position_ids = batch["position_ids"].to(self.device, non_blocking=True)
        attention_mask = batch.get("attention_mask")
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device, non_blocking=True)
        output = model(input_ids=tokens, position_ids=position_ids, attention_mask=attention_mask, labels=labels)
        return output, partial(self._loss_func, loss_mask)

    @staticmethod
    def _loss_func(loss_mask, output_tensor):
        losses = output_tensor.float().reshape(-1)
        mask = loss_mask.reshape(-1).float()
        loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
        return loss, {"loss": loss.detach().clone()}

    def _run_fb(self, iterator, *, forward_only: bool, num_micro: int):
        sc = self.cfg.schedule
        return self.fb(forward_step_func=self._forward_step, data_iterator=iterator, model=[self.ddp],
                       num_microbatches=num_micro, seq_length=self.cfg.data.seq_length,
                       micro_batch_size=sc.micro_batch_size, forward_only=forward_only)

    def _graph_fb(self, iterator, finalize: bool):
        """The training forward-backward as ``CudaGraphStep`` runs it: without ``finalize`` megatron's schedule
        leaves the gradient synchronisation (``finalize_model_grads``) to :meth:`_finalize_grads`, eager."""
        if finalize:
            return self._run_fb(iterator, forward_only=False, num_micro=self.num_micro)
        fin, self.tconfig.finalize_model_grads_func = self.tconfig.finalize_model_grads_func, None
        try:
            return self._run_fb(iterator, forward_only=False, num_micro=self.num_micro)
        finally:
            self.tconfig.finalize_model_grads_func = fin

    def _finalize_grads(self) -> None:
        """What megatron's schedule calls after the last backward (the DP gradient reduction, the
        sequence-parallel norm all-reduce), with the process groups it defaults to."""
        self.tconfig.finalize_model_grads_func([self.ddp], None)

    def _local_loss(self, losses) -> torch.Tensor:
        """This rank's contribution to the world-summed loss, a 0-d float64 device tensor: its DP replica's
        mean over micro-batches divided by DP on the last stage's tensor-parallel rank 0 (the same float64
        arithmetic as a host-side ``float(mean) / dp``), 0 elsewhere."""
        if not (self.ps.is_last_stage and self.ps.tp_rank == 0) or not losses:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return (torch.stack([d["loss"].float() for d in losses]).mean().double() / self.ps.dp).to(self.device)

    def _step_stats(self, losses) -> torch.Tensor:
        """The step's [loss, non-finite loss, stop signal] summed over the world, a float64 device tensor left
        unread (the trainer reads it with the optimizer's decisions, one host read per step); this rank's loss is
        :meth:`_local_loss`."""
        local = self._local_loss(losses)
        sig = torch.full((), float(self._signals.signum != 0), dtype=torch.float64, device=self.device)
        t = torch.stack([local, (~torch.isfinite(local)).double(), sig])
        if self.ps.world_size > 1:
            torch.distributed.all_reduce(t)
        return t

    def _step_batches(self) -> list:
        """This step's micro-batches: those read ahead during the previous step (:meth:`_read_ahead`), else
        read now. The first call opens the training data at the current position."""
        if self._batches is None:
            start = self.step * self.cfg.schedule.global_batch_size + self.skipped_samples
            self._batches = iter(self._loader(self.train_ds, start))
        batches, self._ahead = self._ahead, None
        return batches if batches is not None else [next(self._batches) for _ in range(self.num_micro)]

    def _read_ahead(self) -> None:
        """Read the next step's micro-batches now, while the device runs this step's forwards and backwards
        (queued, not waited for): the host would otherwise read them at the next step's start with the device
        idle (a DataLoader worker hands each batch over through shared memory). Nothing after the last step;
        the data order is the same (a rollback re-opens the data and drops what was read ahead)."""
        if self.step + 1 >= self.sched.train_steps:
            return
        try:
            self._ahead = [next(self._batches) for _ in range(self.num_micro)]
        except StopIteration:  # the next step fails reading, as it would have without this
            self._ahead = None

    def _allreduce(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.ps.world_size > 1:
            torch.distributed.all_reduce(t)
        return t.tolist()

    def evaluate(self) -> float | None:
        """The mean validation loss over ``schedule.eval_batches`` fixed global batches (eager, also with CUDA
        graphs; its forwards advance the stochastic-rounding counters as training forwards do). The quantized
        weights it cached are dropped after it: each training step quantizes its weights in its own first
        forward, with its own keys (what a captured step does)."""
        if self.valid_ds is None or self.cfg.schedule.eval_batches == 0:
            return None
        with self._on_stream():
            self.ddp.eval()
            total = 0.0
            it = iter(self._loader(self.valid_ds, 0))
            with torch.no_grad():
                for _ in range(self.cfg.schedule.eval_batches):
                    losses = self._run_fb(it, forward_only=True, num_micro=self.num_micro)
                    total += float(self._local_loss(losses))
            self.ddp.train()
            invalidate_weight_caches(_unwrap(self.ddp))
            (val,) = self._allreduce([total / self.cfg.schedule.eval_batches])
        return val

    def _rollback_reserve(self) -> int:
        """Training samples beyond ``train_steps * global_batch_size`` for the data windows that rollbacks
        skip: a window is at most the steps since the last checkpoint (``checkpoint.interval``, or the whole run
        without one), and there are at most ``spike.max_rollbacks`` of them."""
        sp = self.cfg.spike
        if not (sp.enabled and sp.rollback):
            return 0
        window = self.cfg.checkpoint.interval or self.sched.train_steps
        return sp.max_rollbacks * window * self.cfg.schedule.global_batch_size

    def _trainer_state(self) -> dict:
        gbs = self.cfg.schedule.global_batch_size
        return {"step": self.step, "consumed_samples": self.step * gbs + self.skipped_samples,
                "consumed_tokens": self.step * self.sched.tokens_per_step, "skipped_steps": self.skipped_steps,
                "skipped_samples": self.skipped_samples, "rollbacks": self.rollbacks,
                "spike": self.spikes.state_dict(), "recovery": self.recovery.state_dict(),
                "schedule": self.lr_schedule.state_dict(),
                "layout": self.ps.layout(), "eval_step": self.eval_step}

    def _all_ranks(self, item) -> list:
        """``item`` of every rank, in rank order (collective)."""
        if self.ps.world_size == 1:
            return [item]
        items = [None] * self.ps.world_size
        torch.distributed.all_gather_object(items, item)
        return items

    def _first_over_ranks(self, item) -> tuple:
        """(item, rank) of the lowest rank whose ``item`` is not None, else (None, None) (collective)."""
        for rank, x in enumerate(self._all_ranks(item)):
            if x is not None:
                return x, rank
        return None, None

    def _layer_telemetry(self, layer: str | None) -> tuple[int | None, dict | None]:
        """(step, operand stats) of ``layer`` in the latest telemetry collection that has it."""
        if layer is None or self.last_telemetry is None or layer not in self.last_telemetry[1]:
            return None, None
        return self.last_telemetry[0], self.last_telemetry[1][layer]

    def _load(self, path) -> dict:
        """Load checkpoint ``path`` into the model and optimizer and restore what resume and rollback share:
        the step, this rank's stochastic-rounding counters, the skipped-step count, the spike detector and the
        recovery point. Returns the trainer state."""
        tstate = load_checkpoint(path, ddp=self.ddp, optimizer=self.optimizer, layout=self.ps.layout(),
                                 model_config=dataclasses.asdict(self.cfg.model), trust=self.cfg.checkpoint.trust)
        self.step = tstate["step"]
        if tstate.get("rank_extra"):
            set_quant_rng_counters(_unwrap(self.ddp), tstate["rank_extra"].get("quant_calls", {}))
        if self.cuda_graph is not None:  # the device counters follow (in place: no new capture)
            self.cuda_graph.sync_counters()
        self.skipped_steps = tstate.get("skipped_steps", 0)
        self.spikes = SpikeDetector(self.cfg.spike)
        if tstate.get("spike"):
            self.spikes.load_state_dict(tstate["spike"])
        self.recovery = RecoveryPoint(self.cfg.spike)
        if tstate.get("recovery"):  # (checkpoints written before it existed start without one)
            self.recovery.load_state_dict(tstate["recovery"], Path(path).parent)
        return tstate

    def _rollback(self, path) -> tuple[int, int]:
        """Reload checkpoint ``path`` after a loss spike; the data from its position up to the current one
        (the window that led to the spike, the spiking step's batch included) is skipped. Returns the
        window [first, end) in training samples."""
        gbs = self.cfg.schedule.global_batch_size
        end = self.step * gbs + self.skipped_samples
        with self._on_stream():
            tstate = self._load(path)
        first = tstate["consumed_samples"]
        self.skipped_samples = end - self.step * gbs
        self.rollbacks += 1  # not the checkpoint's count: rollbacks are never undone
        invalidate_weight_caches(_unwrap(self.ddp))  # the weights changed outside an optimizer step
        return first, end

    def save(self) -> str:
        """Write a checkpoint of the current step (collective); it becomes :attr:`last_checkpoint`."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the last step's optimizer kernels are done (a step does not wait for them)
        meta = {"model": dataclasses.asdict(self.cfg.model), "layout": self.ps.layout(), "step": self.step,
                "consumed_tokens": self.step * self.sched.tokens_per_step, "time": time.time()}
        t0 = time.time()
        recover = self.recovery.checkpoint  # never pruned: it is what a divergence report names
        keep = ((Path(recover).name,) if recover and Path(recover).resolve().parent == Path(self.ckpt_dir).resolve()
                else ())
        with self._on_stream():
            path = save_checkpoint(self.ckpt_dir, step=self.step, ddp=self.ddp, optimizer=self.optimizer,
                                   trainer_state=self._trainer_state(), config_yaml=self.config_yaml, meta=meta,
                                   keep_last=self.cfg.checkpoint.keep_last,
                                   optim_format=self.cfg.checkpoint.optim_format,
                                   rank_extra={"quant_calls": quant_rng_counters(_unwrap(self.ddp))}, keep=keep)
        self.metrics.event("checkpoint", self.step, path=str(path), seconds=round(time.time() - t0, 3))
        self.metrics.note(f"step {self.step}: checkpoint {path}")
        self.last_checkpoint, self.saved_step = str(path), self.step
        return str(path)

    # -- one training step ------------------------------------------------------------------------------
    def train_step(self) -> StepOutcome:
        """Run one training step, the one :meth:`run` loops over, and return its :class:`StepOutcome`.

        In order: the precision switch when its step has come, telemetry when due, the step's learning rate
        (WSD), forward and backward over the global batch's micro-batches (read ahead during the previous
        step), one all-reduce of [loss, non-finite loss, signal] and the optimizer's global norm on the device,
        one host read of both, then the optimizer step (clipped) unless the loss, the learning rate or a
        gradient is non-finite. A skipped step is counted in
        :attr:`skipped_steps` and extends :attr:`streak` (naming the first non-finite quantized layer over the
        ranks); a good step ends the streak. ``step`` advances by one. Collective: every rank calls it.

        It writes no step record, evaluates and saves nothing, and does not stop on a signal or a streak
        (:meth:`run` does); the precision switch and a telemetry collection log their own records. The first
        call opens the training data at the current position. With CUDA graphs (``cuda_graph``) the forwards and
        backwards are replayed from a graph, bitwise the same step."""
        with self._on_stream():
            out = self._train_step()
        if self._stream is not None:
            # what the caller's stream does next (a timing event, a read) comes after this step's kernels, the
            # optimizer's included, without the host waiting for them
            torch.cuda.current_stream().wait_stream(self._stream)
        return out

    def _train_step(self) -> StepOutcome:
        cfg = self.cfg
        module = _unwrap(self.ddp)
        step = self.step
        if self.switch_start is not None and step >= self.switch_start and not self.switched:
            n = apply_precision_switch(module, self.layer_map, self.switch, step=step,
                                       total_steps=self.sched.train_steps)
            self.switched = True
            self.metrics.event("precision_switch", step, mode=self.switch.mode, layers=n)
            self.metrics.note(f"step {step}: precision switch {self.switch.describe()} ({n} layers)")
        telemetry_now = bool(self.telemetry_interval and step % self.telemetry_interval == 0) or self._telemetry_next
        self._telemetry_next = False
        if telemetry_now:
            quant_telemetry.set_telemetry(module, True)

        lr = self.lr_schedule.apply(step)
        t0 = time.perf_counter()
        with _phase("prepare"):
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            batches = self._step_batches()
        with _phase("forward_backward"):
            if self.cuda_graph is not None:
                losses = self.cuda_graph.run(self._graph_fb, batches, self._finalize_grads)
            else:
                losses = self._run_fb(iter(batches), forward_only=False, num_micro=self.num_micro)
        with _phase("read_ahead"):
            self._read_ahead()
        grad_norm = pending = None
        with _phase("optimizer_begin"):
            stats = self._step_stats(losses)
            if math.isfinite(lr):  # else the same on every rank: an update by it would be non-finite everywhere
                # megatron's step with our sync-free clipping, its decisions read with the loss in the step's
                # one host read
                pending = begin_optimizer_step(self.optimizer, cfg.optim.clip_grad)
        with _phase("host_read"):
            decisions = None if pending is None else pending.flags
            read = stats if decisions is None else torch.cat([stats, decisions.to(stats.device)])
            loss, bad_loss, sig, *flags = read.tolist()
        if bad_loss > 0:
            reason = "non-finite loss"
        elif pending is None:
            reason = "non-finite learning rate"
        else:
            with _phase("optimizer_finish"):
                ok, grad_norm, _ = finish_optimizer_step(pending, flags)  # grad_norm: read with the flags
            reason = None if ok else "non-finite gradient"
        with _phase("end"):
            # no wait for the optimizer's kernels: the next step's host work (its zeroing, batches, launch)
            # overlaps them on the device
            invalidate_weight_caches(module)
        dt = time.perf_counter() - t0
        self.step += 1

        if telemetry_now:
            self.last_telemetry = (self.step, quant_telemetry.collect_telemetry(module))
            self.metrics.telemetry(self.step, self.last_telemetry[1])
            quant_telemetry.set_telemetry(module, False)
        first = self._count_bad_step() if reason is not None else None
        if reason is None:
            self.streak = BadStreak()  # the current run of bad steps
        self.checks.after_step(reason is None)
        return StepOutcome(step=self.step, loss=loss, lr=lr, grad_norm=grad_norm, skipped=reason is not None,
                           reason=reason, first_nonfinite=first, signal=sig > 0, time_s=dt)

    def _count_bad_step(self) -> NonfiniteSite | None:
        """Count a skipped step into :attr:`skipped_steps` and :attr:`streak`; returns the first quantized layer
        that saw a non-finite value in it, over the ranks (collective)."""
        self.skipped_steps += 1
        if self.streak.length == 0:
            self.streak.checkpoint_before = self.last_checkpoint or self.resumed_from
        self.streak.length += 1
        module = _unwrap(self.ddp)
        events = quant_telemetry.nonfinite_events(module)  # since the last reset: this step's, this rank's
        quant_telemetry.reset_nonfinite(module)
        item, rank = self._first_over_ranks(events[0][1:] if events else None)
        first = NonfiniteSite(layer=item[0], where=item[1], rank=rank) if item else None
        if self.streak.first is None and first is not None:
            self.streak.first, self.streak.first_step = first, self.step
        self._telemetry_next = True  # the next step records every layer's telemetry (for the report)
        return first

    # -- the loop ---------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Train from the current step to ``schedule.train_steps``: :meth:`train_step` in a loop, each step
        followed by its records, bad-step handling, spike handling, evaluation and the checkpoint policy;
        then a final evaluation and checkpoint. Returns when done or stopped by a signal; raises
        :class:`TrainingDiverged`."""
        self._start()
        if self._signal_before_first_step():
            return self._result(stopped=True)
        out = None
        while self.step < self.sched.train_steps:
            out = self.train_step()
            self._record_step(out)
            self.recovery.observe(out.step, out.loss, self.last_checkpoint or self.resumed_from)
            self._stop_if_diverged(out)
            if self._handle_spike(out):
                continue  # rolled back: the loop goes on from the checkpoint
            if self.cfg.schedule.eval_interval and self.step % self.cfg.schedule.eval_interval == 0:
                self._evaluate_and_record()
            if out.signal:
                self._stop_on_signal()
                return self._result(stopped=True)
            if self.cfg.checkpoint.interval and self.step % self.cfg.checkpoint.interval == 0:
                self._save_unless_in_streak("checkpoint.interval")
        if self.streak.length:  # the run's last steps were skipped: its weights are those of a diverging run
            self._diverged(f"the run ended at step {self.step} inside a streak of {self.streak.length} steps with "
                           f"a non-finite loss or gradient ({self.skipped_steps} skipped in total; last loss "
                           f"{out.loss}); {self._streak_origin()}; no final checkpoint was written")
        self._finish()
        return self._result(stopped=False)

    def _start(self) -> None:
        sc = self.cfg.schedule
        self.metrics.note(f"{self.layer_map.summary_line()}; {self.sched.describe()}; tp={self.ps.tp} pp={self.ps.pp} "
                          f"dp={self.ps.dp}, {self.num_micro} micro-batches of {sc.micro_batch_size}; "
                          f"run dir {self.run_dir}")
        if self.resumed_from:
            self.metrics.event("resume", self.step, checkpoint=self.resumed_from)
            self.metrics.note(f"resumed from {self.resumed_from} at step {self.step}")
        else:
            self.metrics.event("start", self.step)
        for name, fields, text in self._resume_changes:
            self.metrics.event(name, self.step, **fields)
            self.metrics.note(f"step {self.step}: {text}")
        start_checkpoint_writer()  # an in-process results queue: no helper process for a signal to kill

    def _signal_before_first_step(self) -> bool:
        """A stop signal that came while the trainer was being built ends the run before it trains (nothing
        to save: the run directory holds what it held) (collective)."""
        (sig,) = self._allreduce([float(self._signals.signum != 0)])
        if sig == 0:
            return False
        self.metrics.event("signal", self.step, signum=self._signals.signum, before_first_step=True)
        self.metrics.note(f"step {self.step}: signal received before the first step; stopping without training "
                          f"(nothing to save)")
        return True

    def _record_step(self, out: StepOutcome) -> None:
        """The step's records: a skipped step's event, and every ``logging.interval`` steps a train record."""
        if out.skipped:
            layer = out.first_nonfinite.layer if out.first_nonfinite else None
            self.metrics.event("skipped_step", out.step, loss=out.loss, reason=out.reason,
                               consecutive=self.streak.length, first_nonfinite_layer=layer)
            self.metrics.note(f"step {out.step}: skipped ({out.reason}{f', first in {layer}' if layer else ''}); "
                              f"{self.streak.length} in a row")
        else:
            self.last_loss = out.loss
        if out.step % self.cfg.logging.interval == 0 or out.step == self.sched.train_steps:
            tps = self.sched.tokens_per_step / out.time_s if out.time_s > 0 else float("nan")
            mfu = (self.flops_per_token * tps / (self.peak_flops * self.ps.world_size) if self.peak_flops else None)
            gn = None if out.grad_norm is None else float(out.grad_norm)
            self.metrics.train({"step": out.step, "tokens": out.step * self.sched.tokens_per_step, "loss": out.loss,
                                "lr": out.lr, "grad_norm": gn, "tokens_per_s": tps, "mfu": mfu,
                                "peak_mem_gb": peak_memory_gb(), "skipped_steps": self.skipped_steps,
                                "skipped": out.skipped, "time_s": out.time_s})
        self.metrics.advance()

    def _stop_if_diverged(self, out: StepOutcome) -> None:
        """Bad-step handling: ``optim.max_consecutive_bad_steps`` skipped steps in a row raise
        :class:`TrainingDiverged` with a report naming the streak's first non-finite layer, its telemetry and
        the checkpoint to resume from (collective)."""
        cfg, streak = self.cfg, self.streak
        if streak.length < cfg.optim.max_consecutive_bad_steps:
            return
        self._diverged(f"stopping at step {self.step}: {streak.length} consecutive steps with a non-finite "
                       f"loss or gradient (optim.max_consecutive_bad_steps={cfg.optim.max_consecutive_bad_steps}"
                       f"; {self.skipped_steps} skipped in total; last loss {out.loss}); {self._streak_origin()}")

    def _streak_origin(self) -> str:
        """The current streak's first non-finite layer and its telemetry, in words; sets
        ``self._streak_fields`` for the ``diverged`` event (collective)."""
        streak = self.streak
        first = streak.first
        first_layer = first.layer if first else None
        tel_rank = first.rank if first else 0  # its telemetry from the rank that named it
        tel_step, layer_tel = self._all_ranks(self._layer_telemetry(first_layer))[tel_rank]
        if first:
            where = "output" if first.where == "forward" else "input gradient"
            text = (f"first non-finite value: the {where} of layer {first_layer} at step {streak.first_step}"
                    + (f" (rank {first.rank})" if self.ps.world_size > 1 else ""))
            text += (f"; its quantization telemetry at step {tel_step}: {_format_stats(layer_tel)}"
                     if layer_tel else "; no telemetry of it was collected")
        else:
            text = "no quantized layer saw a non-finite value (the loss, or a module outside them)"
        self._streak_fields = dict(first_nonfinite_layer=first_layer,
                                   first_nonfinite_step=streak.first_step if first else None,
                                   first_nonfinite_in=first.where if first else None,
                                   first_nonfinite_rank=first.rank if first else None, telemetry_step=tel_step,
                                   layer_telemetry=layer_tel)
        return text

    def _recovery_advice(self, newest: str | None) -> str:
        """Which checkpoint to resume from (:attr:`recovery`) and how, given ``newest``: the newest checkpoint
        with finite weights (what ``checkpoint.resume=auto`` picks)."""
        rec = self.recovery
        left = rec.describe_exit()
        if newest is None:
            return "No checkpoint was saved: start again with a lower schedule.lr"
        if rec.checkpoint is None:
            return (f"No checkpoint is known to have been followed by a loss inside its window"
                    f"{f' ({left})' if left else ''}: the newest one, {newest}, may diverge again; resume from it "
                    f"with a lower schedule.lr (checkpoint.resume=auto), or start again in another "
                    f"experiment.run_dir")
        if rec.checkpoint == newest:
            return (f"Resume from {newest}, the newest checkpoint (checkpoint.resume=auto picks it), with a lower "
                    f"schedule.lr or another precision (python -m nvfp4_train.table)")
        fresh = f"{self.run_dir}_from_{Path(rec.checkpoint).name}"
        return (f"No loss inside the window followed the newest checkpoint, {newest} ({left}); resume from "
                f"{rec.checkpoint}, the newest one a loss inside the window followed, in a new run directory (so "
                f"that checkpoint.resume=auto there never returns to the newer ones): rerun with "
                f"checkpoint.resume={rec.checkpoint} experiment.run_dir={fresh} and a lower schedule.lr or another "
                f"precision (python -m nvfp4_train.table)")

    def _diverged(self, head: str) -> None:
        """Log the ``diverged`` event and raise :class:`TrainingDiverged`: ``head`` (what happened), then which
        checkpoint to resume from."""
        newest = self.streak.checkpoint_before if self.streak.length else (self.last_checkpoint or self.resumed_from)
        msg = f"{head}. {self._recovery_advice(newest)}"
        fields = self._streak_fields if self.streak.length else {}
        self.metrics.event("diverged", self.step, message=msg, newest_checkpoint=newest,
                           recover_from=self.recovery.checkpoint, loss_left_window_at=self.recovery.left_at,
                           **fields)
        raise TrainingDiverged(msg)

    def _handle_spike(self, out: StepOutcome) -> bool:
        """Spike handling (``spike.*``): a good step whose loss is a spike is logged (and the next step
        collects telemetry), or rolled back to the last checkpoint, skipping the data window since it. Returns
        True when it rolled back; raises :class:`TrainingDiverged` when no rollback is left."""
        cfg = self.cfg
        if out.skipped or not self.spikes.observe(out.loss):
            return False
        loss, med = out.loss, self.spikes.median()
        tel_step, layers = self.last_telemetry or (None, None)
        self.metrics.event("loss_spike", self.step, loss=loss, median=med, factor=cfg.spike.factor,
                           telemetry_step=tel_step, telemetry=layers)
        self.metrics.note(f"step {self.step}: loss spike, {loss:.4f} > spike.factor {cfg.spike.factor} x "
                          f"running median {med:.4f}")
        if not cfg.spike.rollback:
            self._telemetry_next = True  # the step after the spike records every layer's telemetry
            return False
        if self.rollbacks >= cfg.spike.max_rollbacks:
            self._diverged(f"stopping at step {self.step}: loss spike ({loss:.4f} > spike.factor {cfg.spike.factor} "
                           f"x running median {med:.4f}) with spike.max_rollbacks={cfg.spike.max_rollbacks} "
                           f"rollbacks done (or raise spike.factor or spike.max_rollbacks)")
        path = find_resume_checkpoint("auto", self.ckpt_dir, checksums=cfg.checkpoint.verify == "sha256")
        if path is None:
            self.metrics.note(f"step {self.step}: no checkpoint to roll back to yet; continuing")
            return False
        from_step = self.step
        first, end = self._rollback(path)
        self._batches, self._ahead = iter(self._loader(self.train_ds, end)), None
        self.last_checkpoint, self.saved_step, self.streak = str(path), self.step, BadStreak()
        if self.switched and self.step < self.switch_start:  # back before the precision switch
            apply_precision_switch(_unwrap(self.ddp), self.layer_map, self.switch, step=self.step,
                                   total_steps=self.sched.train_steps)
            self.switched = False
        self.metrics.event("rollback", self.step, from_step=from_step, checkpoint=str(path),
                           skipped_samples=[first, end], rollbacks=self.rollbacks)
        self.metrics.note(f"step {from_step}: rolled back to {path} (step {self.step}), skipping "
                          f"training samples [{first}, {end}) (rollback {self.rollbacks} of "
                          f"spike.max_rollbacks={cfg.spike.max_rollbacks})")
        return True

    def _evaluate_and_record(self) -> None:
        self.last_val = self.evaluate()
        self.eval_step = self.step
        if self.last_val is not None:
            self.metrics.eval(self.step, self.step * self.sched.tokens_per_step, self.last_val)

    def _save_unless_in_streak(self, why: str) -> None:
        """Checkpoint policy: save now, unless the run is in a streak of bad steps (a checkpoint then could
        hold the state that is going wrong; the one before the streak stays the newest)."""
        if self.streak.length:
            self.metrics.event("checkpoint_skipped", self.step, why=why, bad_steps=self.streak.length,
                               last_checkpoint=self.streak.checkpoint_before)
            self.metrics.note(f"step {self.step}: no checkpoint ({why}): {self.streak.length} bad steps in a row; "
                              f"the last checkpoint is {self.streak.checkpoint_before or 'none'}")
            return
        self.save()

    def _stop_on_signal(self) -> None:
        self.metrics.event("signal", self.step, signum=self._signals.signum)
        signum = self._signals.signum  # 0: it reached another rank
        name = signal.Signals(signum).name if signum else "by another rank"
        self.metrics.note(f"step {self.step}: signal received ({name}), saving and stopping")
        if self.cfg.checkpoint.save_on_signal and self.saved_step != self.step:
            self._save_unless_in_streak("signal")

    def _finish(self) -> None:
        """The end of the run: a final evaluation (unless this step's was done, also by the run that saved
        the checkpoint this one resumed from), a final checkpoint (``checkpoint.save_at_end``), the end event."""
        if self.eval_step != self.step:
            self._evaluate_and_record()
        if self.cfg.checkpoint.save_at_end and self.saved_step != self.step:
            self._save_unless_in_streak("checkpoint.save_at_end")
        graph = {} if self.cuda_graph is None else {"cuda_graph_captures": self.cuda_graph.captures,
                                                     "cuda_graph_replays": self.cuda_graph.replays}
        self.metrics.event("end", self.step, loss=self.last_loss, val_loss=self.last_val,
                           skipped_steps=self.skipped_steps, **graph)

    def _result(self, *, stopped: bool) -> TrainResult:
        return TrainResult(run_dir=str(self.run_dir), step=self.step,
                           consumed_tokens=self.step * self.sched.tokens_per_step, loss=self.last_loss,
                           val_loss=self.last_val, skipped_steps=self.skipped_steps,
                           stopped_by_signal=stopped, checkpoint=self.last_checkpoint, resumed_from=self.resumed_from)
