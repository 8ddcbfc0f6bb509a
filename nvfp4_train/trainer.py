"""The training loop: ``train(cfg, model_provider=None)``.

Model-agnostic: the model comes from ``model_provider(pre_process, post_process) -> MegatronModule`` (the
hybrid model of ``models.build`` by default) whose ``forward(input_ids=, position_ids=, attention_mask=,
labels=)`` returns the per-token loss ``[b, s]`` on the last pipeline stage, like megatron's ``GPTModel``.
Optional model methods the trainer uses when present: ``precision_layers()`` (the precision switch),
``flops_per_token(seq_length)`` (MFU; else 6 x parameters).

One step: set the step's learning rate (WSD), apply the precision switch when it starts, run megatron's
``get_forward_backward_func`` over ``global_batch_size / (micro_batch_size * DP)`` micro-batches (1F1B under
pipeline parallelism), all-reduce [loss, non-finite flag, signal flag] over the world, then either skip the
optimizer (non-finite loss) or call it (it skips itself on non-finite gradients; the gradient clipping is
``nvfp4_train.optim.optimizer_step``'s, without host syncs: see ``nvfp4_train.optim``).
Every ``logging.interval`` steps a metrics record, every ``schedule.eval_interval`` steps a validation pass,
every ``checkpoint.interval`` steps a checkpoint; SIGTERM/SIGUSR1 finish the step, save and return.
``optim.max_consecutive_bad_steps`` skipped steps in a row stop the run (``TrainingDiverged``) with a report
naming the first non-finite quantized layer and its telemetry; a loss spike (``spike.*``, off by default) is
logged, or rolled back to the last checkpoint past its data window. See docs/reliability.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import re
import signal
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from nvfp4_train.checkpoint import (check_writable, find_resume_checkpoint, load_checkpoint, save_checkpoint,
                                    start_checkpoint_writer)
from nvfp4_train.metrics import MetricsLogger, peak_flops_per_device, peak_memory_gb
from nvfp4_train.optim import optimizer_step
from nvfp4_train.parallel.setup import ParallelState, setup_parallel, teardown_parallel
from nvfp4_train.spikes import SpikeDetector

__all__ = ["train", "TrainResult", "TrainingDiverged", "hybrid_model_provider", "resolve_model_provider",
           "apply_precision_switch"]


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient, or a loss spike with no rollback left."""


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


def hybrid_model_provider(cfg):
    """The default provider: ``models.build.build_model`` (the hybrid Mamba-Transformer)."""
    try:
        from models.build import build_model, transformer_config
    except ImportError as e:
        raise ImportError(f"the default model provider needs models.build ({e}); give another one with "
                          f"experiment.model_provider=module:function") from e
    layer_map = cfg.precision.layer_map(cfg.model.pattern)
    tcfg = transformer_config(cfg.model, tp=cfg.parallel.tp, pp=cfg.parallel.pp,
                              sequence_parallel=cfg.parallel.sequence_parallel)

    def provider(pre_process: bool, post_process: bool):
        return build_model(cfg.model, layer_map, config=tcfg, pre_process=pre_process, post_process=post_process,
                           seed=cfg.experiment.seed, seq_length=cfg.data.seq_length)

    return provider


def resolve_model_provider(cfg):
    """``experiment.model_provider`` (``module:function``, called with the config) or the hybrid model."""
    spec = cfg.experiment.model_provider
    if spec is None:
        return hybrid_model_provider(cfg)
    module, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"experiment.model_provider={spec!r} cannot be loaded ({e})") from None
    return factory(cfg)


_LAYER_NAME = re.compile(r"^blocks\.(\d+)\.(.+)$")


def _base_recipe(layer, layer_map):
    """The recipe a quantized layer was built with: from its ``layer_name`` ``blocks.<global block>.<role>``
    (``models.hybrid``), its ``block``/``role`` attributes, or its ``base_recipe``."""
    m = _LAYER_NAME.match(getattr(layer, "layer_name", "") or "")
    if m:
        return layer_map.recipe(int(m.group(1)), m.group(2))
    if hasattr(layer, "block") and hasattr(layer, "role"):
        return layer_map.recipe(layer.block, layer.role)
    if hasattr(layer, "base_recipe"):
        return layer.base_recipe
    raise TypeError(f"{type(layer).__name__} from precision_layers() has neither a layer_name 'blocks.<i>.<role>', "
                    f"(block, role) attributes nor a base_recipe: the trainer cannot tell which recipe it was built with")


def apply_precision_switch(module, layer_map, switch, *, step: int, total_steps: int) -> int:
    """Set each quantized layer's recipe in effect at ``step`` (paper App. D). Returns the layers changed."""
    from nvfp4_train.precision.layer_map import recipe_in_effect

    if not hasattr(module, "precision_layers"):
        return 0
    n = 0
    for _name, layer in module.precision_layers():
        layer.set_recipe(recipe_in_effect(_base_recipe(layer, layer_map), switch, step=step, total_steps=total_steps))
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


def _telemetry_module():
    try:
        return importlib.import_module("nvfp4_train.precision.telemetry")
    except ImportError:
        return None


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


def _set_weight_cache(module, enabled: bool) -> None:
    from nvfp4_train.precision.megatron_linear import set_weight_cache

    set_weight_cache(module, enabled)  # a model without quantized layers has nothing to set


def _invalidate_weight_caches(module) -> None:
    from nvfp4_train.precision.megatron_linear import invalidate_weight_caches

    invalidate_weight_caches(module)


def _unwrap(ddp):
    return ddp.module


def _format_stats(layer_stats: dict) -> str:
    """``{operand: {zero, saturated, sqnr_db}}`` on one line."""
    return ", ".join(f"{op} zero {st['zero']:.3g} saturated {st['saturated']:.3g} sqnr {st['sqnr_db']:.3g} dB"
                     for op, st in layer_stats.items())


class _SignalFlag:
    """SIGTERM / SIGUSR1 set a flag; the loop acts on it after the current step."""

    def __init__(self, enabled: bool) -> None:
        self.signum = 0
        self._old = {}
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                try:
                    self._old[sig] = signal.signal(sig, self._handle)
                except ValueError:  # not the main thread
                    pass

    def _handle(self, signum, _frame) -> None:
        self.signum = signum

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def train(cfg, *, model_provider=None) -> TrainResult:
    """Train as ``cfg`` says (a ``nvfp4_train.config.Config``); ``model_provider`` overrides the config's."""
    state = setup_parallel(cfg.parallel, seed=cfg.experiment.seed)
    try:
        return _Trainer(cfg, model_provider, state).run()
    finally:
        teardown_parallel(state)


class _Trainer:
    def __init__(self, cfg, model_provider, ps: ParallelState) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import finalize_model_grads
        from omegaconf import OmegaConf

        from nvfp4_train.data.datasets import build_datasets, load_tokenizer_for
        from nvfp4_train.optim import build_ddp, build_optimizer
        from nvfp4_train.schedule import WSDSchedule

        self.cfg, self.ps = cfg, ps
        self.run_dir = Path(cfg.experiment.resolved_run_dir())
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.device = torch.device(ps.device)
        self.is_rank0 = ps.rank == 0
        if not self.is_rank0:
            warnings.filterwarnings("ignore")
        if ps.cpu_compat:  # on CPU the "CUDA" RNG of megatron's tracker IS the CPU RNG: its every-step warning
            logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)  # says nothing

        sc = cfg.schedule
        self.sched = sc.resolve(cfg.data.seq_length)
        per_micro = sc.micro_batch_size * ps.dp
        if sc.global_batch_size % per_micro:
            raise ValueError(f"schedule.global_batch_size={sc.global_batch_size} is not a multiple of "
                             f"micro_batch_size * DP = {sc.micro_batch_size} * {ps.dp}")
        self.num_micro = sc.global_batch_size // per_micro

        tokenizer = load_tokenizer_for(cfg.data)
        if cfg.model.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                             f"{tokenizer.vocab_size} ids: set model.vocab_size >= {tokenizer.vocab_size}")
        self.layer_map = cfg.precision.layer_map(cfg.model.pattern)
        self.switch = cfg.precision.switch

        # model, DDP, optimizer
        provider = model_provider if model_provider is not None else resolve_model_provider(cfg)
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
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.fb = get_forward_backward_func()
        self.flops_per_token = self._flops_per_token(module, parallel_state)
        self.peak_flops = peak_flops_per_device(cfg.logging)

        # data
        gbs = sc.global_batch_size
        valid_samples = sc.eval_batches * gbs
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
        path = find_resume_checkpoint(cfg.checkpoint.resume, self.ckpt_dir,
                                      checksums=cfg.checkpoint.verify == "sha256")
        self.config_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
        self.config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
        if path is not None:
            tstate = self._load(path)
            self.skipped_samples = tstate.get("skipped_samples", 0)
            self.rollbacks = tstate.get("rollbacks", 0)
            if tstate.get("consumed_samples") != self.step * gbs + self.skipped_samples:
                raise ValueError(f"checkpoint {path}: consumed_samples={tstate.get('consumed_samples')} is not "
                                 f"step * global_batch_size + skipped_samples = {self.step} * {gbs} + "
                                 f"{self.skipped_samples}: the global batch size changed; resume with "
                                 f"schedule.global_batch_size as saved")
            saved_sched = tstate.get("schedule", {})
            if saved_sched and saved_sched != self.lr_schedule.state_dict():
                warnings.warn(f"the schedule differs from the checkpoint's ({saved_sched}); continuing with this "
                              f"run's (the data order also changes when train_steps changes)", stacklevel=2)
            self.resumed_from = str(path)
        if self.step > self.sched.train_steps:
            raise ValueError(f"checkpoint at step {self.step} is past schedule.train_steps={self.sched.train_steps}")

        self.metrics = MetricsLogger(cfg.logging, self.run_dir, enabled=self.is_rank0,
                                     total_steps=self.sched.train_steps, start_step=self.step,
                                     run_name=cfg.experiment.name, config_dict=self.config_dict)
        if self.is_rank0:
            check_writable(self.run_dir)
            check_writable(self.ckpt_dir)
            (self.run_dir / "config.yaml").write_text(self.config_yaml)
        self.telemetry = _telemetry_module() if cfg.logging.telemetry_interval else None
        if cfg.logging.telemetry_interval and self.telemetry is None:
            self.metrics.note("telemetry: nvfp4_train.precision.telemetry is not available, telemetry is off")
        self.last_telemetry: tuple[int, dict] | None = None  # (step, layers) of the latest collection
        self.tel_mod = self.telemetry or _telemetry_module()  # also for one-off collections and non-finite names

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
                                 num_workers=self.cfg.data.num_workers)

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

    def _local_loss(self, losses) -> float:
        """This rank's contribution to the world-summed loss: its DP replica's mean over micro-batches,
        divided by DP, on the last stage's tensor-parallel rank 0; 0 elsewhere."""
        if not (self.ps.is_last_stage and self.ps.tp_rank == 0) or not losses:
            return 0.0
        vals = torch.stack([d["loss"].float() for d in losses])
        return float(vals.mean()) / self.ps.dp

    def _allreduce(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.ps.world_size > 1:
            torch.distributed.all_reduce(t)
        return t.tolist()

    def evaluate(self) -> float | None:
        if self.valid_ds is None or self.cfg.schedule.eval_batches == 0:
            return None
        self.ddp.eval()
        total = 0.0
        it = iter(self._loader(self.valid_ds, 0))
        with torch.no_grad():
            for _ in range(self.cfg.schedule.eval_batches):
                losses = self._run_fb(it, forward_only=True, num_micro=self.num_micro)
                total += self._local_loss(losses)
        self.ddp.train()
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
                "spike": self.spikes.state_dict(), "schedule": self.lr_schedule.state_dict(),
                "layout": self.ps.layout()}

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
        the step, this rank's stochastic-rounding counters, the skipped-step count and the spike detector.
        Returns the trainer state."""
        tstate = load_checkpoint(path, ddp=self.ddp, optimizer=self.optimizer, layout=self.ps.layout(),
                                 model_config=dataclasses.asdict(self.cfg.model), trust=self.cfg.checkpoint.trust)
        self.step = tstate["step"]
        if tstate.get("rank_extra"):
            set_quant_rng_counters(_unwrap(self.ddp), tstate["rank_extra"].get("quant_calls", {}))
        self.skipped_steps = tstate.get("skipped_steps", 0)
        self.spikes = SpikeDetector(self.cfg.spike)
        if tstate.get("spike"):
            self.spikes.load_state_dict(tstate["spike"])
        return tstate

    def _rollback(self, path) -> tuple[int, int]:
        """Reload checkpoint ``path`` after a loss spike; the data from its position up to the current one
        (the window that led to the spike, the spiking step's batch included) is skipped. Returns the
        window [first, end) in training samples."""
        gbs = self.cfg.schedule.global_batch_size
        end = self.step * gbs + self.skipped_samples
        tstate = self._load(path)
        first = tstate["consumed_samples"]
        self.skipped_samples = end - self.step * gbs
        self.rollbacks += 1  # not the checkpoint's count: rollbacks are never undone
        _invalidate_weight_caches(_unwrap(self.ddp))  # the weights changed outside an optimizer step
        return first, end

    def save(self) -> str:
        meta = {"model": dataclasses.asdict(self.cfg.model), "layout": self.ps.layout(), "step": self.step,
                "consumed_tokens": self.step * self.sched.tokens_per_step, "time": time.time()}
        t0 = time.time()
        path = save_checkpoint(self.ckpt_dir, step=self.step, ddp=self.ddp, optimizer=self.optimizer,
                               trainer_state=self._trainer_state(), config_yaml=self.config_yaml, meta=meta,
                               keep_last=self.cfg.checkpoint.keep_last, optim_format=self.cfg.checkpoint.optim_format,
                               rank_extra={"quant_calls": quant_rng_counters(_unwrap(self.ddp))})
        self.metrics.event("checkpoint", self.step, path=str(path), seconds=round(time.time() - t0, 3))
        self.metrics.note(f"step {self.step}: checkpoint {path}")
        return str(path)

    # -- the loop ---------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        cfg, sc = self.cfg, self.cfg.schedule
        total = self.sched.train_steps
        self.metrics.note(f"{self.layer_map.summary_line()}; {self.sched.describe()}; tp={self.ps.tp} pp={self.ps.pp} "
                          f"dp={self.ps.dp}, {self.num_micro} micro-batches of {sc.micro_batch_size}; "
                          f"run dir {self.run_dir}")
        if self.resumed_from:
            self.metrics.event("resume", self.step, checkpoint=self.resumed_from)
            self.metrics.note(f"resumed from {self.resumed_from} at step {self.step}")
        else:
            self.metrics.event("start", self.step)
        start_checkpoint_writer()  # before our handlers: a signal to the process group must not kill it
        flag = _SignalFlag(cfg.checkpoint.save_on_signal)
        module = _unwrap(self.ddp)
        # quantize each weight once per optimizer step (not once per micro-batch); megatron's optimizer
        # writes the weights through param.data, so the caches are dropped explicitly after every step
        _set_weight_cache(module, True)
        switch_start = self.switch.start_step(total)
        switched = False
        consecutive_bad = 0
        last_loss = last_val = None
        last_ckpt = None
        saved_step = self.step if self.resumed_from else None
        last_eval_step = -1
        stopped = False
        streak = None  # (step, layer, "forward" | "backward") of the first non-finite layer of a run of bad steps
        checks = NonfiniteChecks(cfg.logging.nonfinite_check, self.tel_mod, module)
        telemetry_next = False  # collect telemetry in the next step (after a skipped step or a loss spike)
        loader_it = iter(self._loader(self.train_ds, self.step * sc.global_batch_size + self.skipped_samples))
        try:
            while self.step < total:
                step = self.step
                if switch_start is not None and step >= switch_start and not switched:
                    n = apply_precision_switch(module, self.layer_map, self.switch, step=step, total_steps=total)
                    switched = True
                    self.metrics.event("precision_switch", step, mode=self.switch.mode, layers=n)
                    self.metrics.note(f"step {step}: precision switch {self.switch.describe()} ({n} layers)")
                telemetry_now = bool(self.telemetry and cfg.logging.telemetry_interval
                                     and step % cfg.logging.telemetry_interval == 0)
                telemetry_now = telemetry_now or (telemetry_next and self.tel_mod is not None)
                telemetry_next = False
                if telemetry_now:
                    self.tel_mod.set_telemetry(module, True)
                lr = self.lr_schedule.apply(step)
                t0 = time.perf_counter()
                self.ddp.zero_grad_buffer()
                self.optimizer.zero_grad()
                losses = self._run_fb(loader_it, forward_only=False, num_micro=self.num_micro)
                local = self._local_loss(losses)
                loss, bad_loss, sig = self._allreduce([local, 0.0 if math.isfinite(local) else 1.0,
                                                       float(flag.signum != 0)])
                grad_norm = None
                if bad_loss > 0:
                    ok = False
                else:
                    # megatron's step with our sync-free clipping; grad_norm: a device tensor, read at logging
                    ok, grad_norm, _ = optimizer_step(self.optimizer, cfg.optim.clip_grad)
                _invalidate_weight_caches(module)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                self.step += 1
                if telemetry_now:
                    self.last_telemetry = (self.step, self.tel_mod.collect_telemetry(module))
                    self.metrics.telemetry(self.step, self.last_telemetry[1])
                    self.tel_mod.set_telemetry(module, False)
                if ok:
                    consecutive_bad = 0
                    streak = None
                    last_loss = loss
                else:
                    self.skipped_steps += 1
                    consecutive_bad += 1
                    layer = None
                    tel = self.tel_mod
                    if tel is not None and hasattr(tel, "nonfinite_events"):
                        events = tel.nonfinite_events(module)  # since the last reset: this step's, this rank's
                        tel.reset_nonfinite(module)
                        first, rank = self._first_over_ranks(events[0][1:] if events else None)
                        layer = first[0] if first else None
                        if streak is None and first:
                            streak = (self.step, layer, first[1], rank)
                        telemetry_next = True  # the next step records every layer's telemetry (for the report)
                    self.metrics.event("skipped_step", self.step, loss=loss,
                                       reason="non-finite loss" if bad_loss > 0 else "non-finite gradient",
                                       consecutive=consecutive_bad, first_nonfinite_layer=layer)
                    self.metrics.note(f"step {self.step}: skipped (non-finite {'loss' if bad_loss > 0 else 'gradient'}"
                                      f"{f', first in {layer}' if layer else ''}); {consecutive_bad} in a row")
                checks.after_step(ok)
                if self.step % cfg.logging.interval == 0 or self.step == total:
                    tps = self.sched.tokens_per_step / dt if dt > 0 else float("nan")
                    mfu = (self.flops_per_token * tps / (self.peak_flops * self.ps.world_size)
                           if self.peak_flops else None)
                    gn = None if grad_norm is None else float(grad_norm)
                    self.metrics.train({"step": self.step, "tokens": self.step * self.sched.tokens_per_step,
                                        "loss": loss, "lr": lr, "grad_norm": gn, "tokens_per_s": tps, "mfu": mfu,
                                        "peak_mem_gb": peak_memory_gb(), "skipped_steps": self.skipped_steps,
                                        "skipped": not ok, "time_s": dt})
                self.metrics.advance()
                if consecutive_bad >= cfg.optim.max_consecutive_bad_steps:
                    first_layer = streak[1] if streak else None
                    tel_rank = streak[3] if streak else 0  # its telemetry from the rank that named it
                    tel_step, layer_tel = self._all_ranks(self._layer_telemetry(first_layer))[tel_rank]
                    if streak:
                        where = "output" if streak[2] == "forward" else "input gradient"
                        first = (f"first non-finite value: the {where} of layer {first_layer} at step {streak[0]}"
                                 + (f" (rank {streak[3]})" if self.ps.world_size > 1 else ""))
                        first += (f"; its quantization telemetry at step {tel_step}: {_format_stats(layer_tel)}"
                                  if layer_tel else "; no telemetry of it was collected")
                    else:
                        first = "no quantized layer saw a non-finite value (the loss, or a module outside them)"
                    msg = (f"stopping at step {self.step}: {consecutive_bad} consecutive steps with a non-finite "
                           f"loss or gradient (optim.max_consecutive_bad_steps={cfg.optim.max_consecutive_bad_steps}"
                           f"; {self.skipped_steps} skipped in total; last loss {loss}); {first}. The last good "
                           f"checkpoint is {last_ckpt or self.resumed_from or 'none (none was saved)'} (rerun with "
                           f"checkpoint.resume=auto to resume from it); lower schedule.lr or check precision "
                           f"(python -m nvfp4_train.precision.table)")
                    self.metrics.event("diverged", self.step, message=msg, first_nonfinite_layer=first_layer,
                                       first_nonfinite_step=streak[0] if streak else None,
                                       first_nonfinite_in=streak[2] if streak else None,
                                       first_nonfinite_rank=streak[3] if streak else None, telemetry_step=tel_step,
                                       layer_telemetry=layer_tel)
                    raise TrainingDiverged(msg)
                if ok and self.spikes.observe(loss):
                    med = self.spikes.median()
                    tel_step, layers = self.last_telemetry or (None, None)
                    self.metrics.event("loss_spike", self.step, loss=loss, median=med, factor=cfg.spike.factor,
                                       telemetry_step=tel_step, telemetry=layers)
                    self.metrics.note(f"step {self.step}: loss spike, {loss:.4f} > spike.factor {cfg.spike.factor} x "
                                      f"running median {med:.4f}")
                    if not cfg.spike.rollback:
                        telemetry_next = True  # the step after the spike records every layer's telemetry
                    elif self.rollbacks >= cfg.spike.max_rollbacks:
                        msg = (f"stopping at step {self.step}: loss spike ({loss:.4f} > spike.factor "
                               f"{cfg.spike.factor} x running median {med:.4f}) with spike.max_rollbacks="
                               f"{cfg.spike.max_rollbacks} rollbacks done. The last checkpoint is "
                               f"{last_ckpt or self.resumed_from or 'none (none was saved)'}; lower schedule.lr, or "
                               f"raise spike.factor or spike.max_rollbacks")
                        self.metrics.event("diverged", self.step, message=msg)
                        raise TrainingDiverged(msg)
                    else:
                        path = find_resume_checkpoint("auto", self.ckpt_dir,
                                                      checksums=cfg.checkpoint.verify == "sha256")
                        if path is None:
                            self.metrics.note(f"step {self.step}: no checkpoint to roll back to yet; continuing")
                        else:
                            from_step = self.step
                            first, end = self._rollback(path)
                            loader_it = iter(self._loader(self.train_ds, end))
                            last_ckpt, saved_step, consecutive_bad, streak = str(path), self.step, 0, None
                            if switched and self.step < switch_start:  # back before the precision switch
                                apply_precision_switch(module, self.layer_map, self.switch, step=self.step,
                                                       total_steps=total)
                                switched = False
                            self.metrics.event("rollback", self.step, from_step=from_step, checkpoint=str(path),
                                               skipped_samples=[first, end], rollbacks=self.rollbacks)
                            self.metrics.note(f"step {from_step}: rolled back to {path} (step {self.step}), skipping "
                                              f"training samples [{first}, {end}) (rollback {self.rollbacks} of "
                                              f"spike.max_rollbacks={cfg.spike.max_rollbacks})")
                            continue
                if sc.eval_interval and self.step % sc.eval_interval == 0:
                    last_val = self.evaluate()
                    last_eval_step = self.step
                    if last_val is not None:
                        self.metrics.eval(self.step, self.step * self.sched.tokens_per_step, last_val)
                if sig > 0:
                    self.metrics.event("signal", self.step, signum=flag.signum)
                    self.metrics.note(f"step {self.step}: signal received, saving and stopping")
                    if cfg.checkpoint.save_on_signal and saved_step != self.step:
                        last_ckpt, saved_step = self.save(), self.step
                    stopped = True
                    break
                if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
                    last_ckpt, saved_step = self.save(), self.step
            if not stopped:
                if last_eval_step != self.step:
                    last_val = self.evaluate()
                    if last_val is not None:
                        self.metrics.eval(self.step, self.step * self.sched.tokens_per_step, last_val)
                if cfg.checkpoint.save_at_end and saved_step != self.step:
                    last_ckpt, saved_step = self.save(), self.step
                self.metrics.event("end", self.step, loss=last_loss, val_loss=last_val,
                                   skipped_steps=self.skipped_steps)
        finally:
            flag.restore()
            self.metrics.close()
        return TrainResult(run_dir=str(self.run_dir), step=self.step,
                           consumed_tokens=self.step * self.sched.tokens_per_step, loss=last_loss, val_loss=last_val,
                           skipped_steps=self.skipped_steps, stopped_by_signal=stopped, checkpoint=last_ckpt,
                           resumed_from=self.resumed_from)
