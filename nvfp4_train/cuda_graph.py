"""CUDA graphs in training (``schedule.cuda_graph``): a step's forwards and backwards replayed from one graph,
bitwise the eager step.

What is captured: the forwards and backwards of the step's micro-batches (megatron's forward-backward function,
its TP collectives and the quantized layers' amax all-reduces included). What stays eager, after each replay:
the gradient synchronisation (megatron's ``finalize_model_grads``: the DP reduce-scatter / all-reduce, the
sequence-parallel norm all-reduce), the loss all-reduce, the optimizer's global norm, the step's one host read (the
loss and the non-finite and clipping decisions), the optimizer's update and the weight-cache drop; the trainer reads
the next step's micro-batches while a replay runs (``nvfp4_train.trainer``).

Why the graphed step is bitwise the eager one:

- stochastic rounding: each quantized layer counts its calls in a device tensor too (``LinearContext.
  call_counter``); every forward advances it and computes its operand seeds on the device (``nvfp4_train.kernels.sr_key.
  next_call_seeds``), and the quantize kernels load them (``KEY_PTR``), so each replay draws the keys eager
  training draws at that step. The host count (``LinearContext.calls``, what checkpoints save) advances by each
  replay's calls, counted at capture; a resume or rollback sets both (:meth:`CudaGraphStep.sync_counters`).
- the non-finite check times its checks by a device counter (``telemetry.set_device_clock``).
- data: the step's micro-batches are copied into static buffers the graph reads; the losses come out of the
  graph's own tensors.
- weights: quantized once per step by the first micro-batch's forward (the caches are empty at the start of
  every step, eager or graphed: the trainer drops them after the optimizer step and after an evaluation), read
  by the graph from the parameters' own storage, which megatron's optimizer updates in place.

A graph is captured after ``warmup_steps`` eager steps in a row with the same capture key (every quantized
layer's recipe, weight padding, non-finite check and telemetry state; these eager steps are ordinary training
steps, on the device counters too), and replayed while the key holds. A step with another key (a telemetry
step, the step after a skipped one under ``logging.nonfinite_check=after_skip``) runs eager and keeps the graph;
a key that lasts ``warmup_steps`` steps (the precision switch) is captured anew. A step whose micro-batches do
not fit the static buffers runs eager (one warning).

Everything runs on one side stream (``CudaGraphStep.stream``): megatron's DDP keeps each parameter's
``AccumulateGrad`` node from its construction, and a capture on another stream than the one those nodes were
made on is invalidated, so the trainer builds the model, DDP and optimizer under it too.

Layouts that cannot be captured fall back to eager with one warning naming the reason (:func:`fallback_reason`,
``docs/training.md``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import torch

from nvfp4_train.precision import telemetry as quant_telemetry
from nvfp4_train.precision.megatron_linear import invalidate_weight_caches, quant_layers
from nvfp4_train.schedule import CUDA_GRAPH_MODES

__all__ = ["fallback_reason", "resolve_cuda_graph", "enable_device_counters", "CudaGraphStep"]


def fallback_reason(*, device_type: str, pp: int, world_size: int, backend: str, overlap_grad_reduce: bool,
                    overlap_param_gather: bool) -> str | None:
    """Why a run of this layout cannot replay its steps from a CUDA graph; None when it can."""
    if device_type != "cuda":
        return f"the run is on {device_type}, not on a CUDA device"
    if pp > 1:
        return (f"pipeline parallelism (parallel.pp={pp}): the point-to-point transfers between stages of megatron's "
                f"1F1B schedule are not captured")
    if world_size > 1 and backend != "nccl":
        return f"the {backend} backend: only NCCL collectives can be captured"
    if overlap_grad_reduce:
        return ("optim.overlap_grad_reduce=true: the gradient reduction that backward hooks start asynchronously is "
                "waited for in the eager step")
    if overlap_param_gather:
        return ("optim.overlap_param_gather=true: the forward pre-hooks wait for a parameter all-gather started by "
                "the eager optimizer step")
    return None


def resolve_cuda_graph(mode: str, **layout) -> tuple[bool, str | None]:
    """(use CUDA graphs, the warning to give) for ``schedule.cuda_graph=mode`` on ``layout`` (the keywords of
    :func:`fallback_reason`): ``off`` never; ``auto`` where the layout allows it, off on a CPU run without a
    word; ``on`` where the layout allows it. A CUDA run whose layout does not allow it (and ``on`` on CPU) runs
    eager, with the warning."""
    if mode not in CUDA_GRAPH_MODES:
        raise ValueError(f"schedule.cuda_graph={mode!r} is not one of {CUDA_GRAPH_MODES}")
    if mode == "off":
        return False, None
    reason = fallback_reason(**layout)
    if reason is None:
        return True, None
    if mode == "auto" and layout["device_type"] != "cuda":
        return False, None
    return False, f"schedule.cuda_graph={mode}: the steps run eager (without CUDA graphs): {reason}"


def enable_device_counters(module: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """Give every quantized layer of ``module`` a device call counter equal to its host count, and the model's
    non-finite checks one device clock (returned): what a replayed graph needs to draw each step's own keys and
    times. The eager path keeps its bits (the device seeds are the host ints' values)."""
    for m in quant_layers(module):
        m.lctx.call_counter = torch.tensor(m.lctx.calls, dtype=torch.int64, device=device)
    clock = torch.zeros((), dtype=torch.float64, device=device)
    quant_telemetry.set_device_clock(module, clock)
    return clock


def _fits(static: list[dict], batches: list[dict]) -> bool:
    if len(static) != len(batches):
        return False
    for s, b in zip(static, batches):
        if s.keys() != b.keys():
            return False
        for k, v in b.items():
            if not isinstance(v, torch.Tensor) or v.shape != s[k].shape or v.dtype != s[k].dtype:
                return False
    return True


class CudaGraphStep:
    """The forwards and backwards of a training step, replayed from a CUDA graph (see the module docstring).

    ``run(fb, batches, finalize)`` runs one step's: ``fb(iterator, finalize)`` is the trainer's forward-backward
    over an iterator of micro-batch dicts (with ``finalize`` False it must not synchronise the gradients),
    ``batches`` the step's micro-batches (host or device tensors), ``finalize()`` the gradient synchronisation.
    Returns what ``fb`` returns (after a replay: the graph's own loss tensors, valid until the next replay).
    Build it, and call everything, under ``stream``."""

    def __init__(self, module: torch.nn.Module, *, device: torch.device, stream, warmup_steps: int = 2) -> None:
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 1 (a capture needs an eager step before it)")
        self.module, self.device, self.stream, self.warmup_steps = module, device, stream, warmup_steps
        self.layers = quant_layers(module)
        self.clock = enable_device_counters(module, device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key: tuple | None = None  # the graph's capture key
        self.captures = 0  # graphs captured so far
        self.replays = 0  # steps replayed (a capture's own step included)
        self._static: list[dict] = []
        self._losses = None
        self._deltas: list[int] = []
        self._pending: tuple | None = None  # the key of the eager steps in a row, and how many
        self._warned_fit = False

    def capture_key(self) -> tuple:
        """What a graph is captured for: every quantized layer's recipe, weight padding, weight cache, non-finite
        check and telemetry state."""
        return tuple((m.lctx.recipe, m.lctx.weight_pad, m.weight_cache_enabled, m.quant_telemetry.check_nonfinite,
                      m.lctx.telemetry is None) for m in self.layers)

    def sync_counters(self) -> None:
        """Set every layer's device call counter to its host count (after a resume or rollback set the counts):
        in place, the graph keeps reading the same tensors."""
        for m in self.layers:
            m.lctx.call_counter.fill_(m.lctx.calls)

    def run(self, fb: Callable[[Iterator, bool], list], batches: list[dict], finalize: Callable[[], None]):
        key = self.capture_key()
        if self.graph is not None and key == self.key:
            if _fits(self._static, batches):
                return self._replay(batches, finalize)
            self._warn_fit()
            return fb(iter(batches), True)
        if any(m.lctx.telemetry is not None for m in self.layers):
            return fb(iter(batches), True)  # telemetry reads its statistics on the host: never captured
        if not all(isinstance(v, torch.Tensor) for b in batches for v in b.values()):
            self._warn_fit()
            return fb(iter(batches), True)
        count = self._pending[1] + 1 if self._pending is not None and self._pending[0] == key else 1
        if count <= self.warmup_steps:
            self._pending = (key, count)
            return fb(iter(batches), True)
        self._pending = None
        return self._capture(fb, batches, finalize, key)

    def _warn_fit(self) -> None:
        if not self._warned_fit:
            self._warned_fit = True
            warnings.warn("schedule.cuda_graph: a step's micro-batches hold something other than tensors, or differ "
                          "in number, keys, shapes or dtypes from the captured ones; such steps run eager",
                          stacklevel=3)

    def drop(self) -> None:
        """Free the graph, its memory pool and static buffers (the next steps warm up and capture anew)."""
        self.graph = self.key = self._losses = None
        self._static, self._deltas = [], []

    def _capture(self, fb, batches, finalize, key):
        self.drop()
        self._static = [{k: torch.empty(v.shape, dtype=v.dtype, device=self.device) for k, v in b.items()}
                        for b in batches]
        self._copy_in(batches)
        # the captured forwards quantize every weight, as each step's first forwards do (the caches are empty at
        # a step's start already; dropped again so that no cached copy outside the graph's pool is captured)
        invalidate_weight_caches(self.module)
        before = [m.lctx.calls for m in self.layers]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            losses = fb(iter(self._static), False)
        # the host counts advanced once, at capture, for the replay that follows
        self._deltas = [m.lctx.calls - b for m, b in zip(self.layers, before)]
        self.graph, self.key, self._losses = graph, key, losses
        self.captures += 1
        graph.replay()
        self.replays += 1
        finalize()
        return losses

    def _copy_in(self, batches) -> None:
        for s, b in zip(self._static, batches):
            for k, v in b.items():
                s[k].copy_(v, non_blocking=True)

    def _replay(self, batches, finalize):
        self._copy_in(batches)
        self.graph.replay()
        self._pending = None  # warm-up steps count in a row
        for m, d in zip(self.layers, self._deltas):
            m.lctx.calls += d
        self.replays += 1
        finalize()
        return self._losses
