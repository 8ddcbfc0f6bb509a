"""The benchmark cases and their training step: a model of a named case under a recipe, built as the trainer
builds one, and the step ``train.py`` runs on it.

``train_step`` is the one training step of the benchmarks (``nvfp4_train.bench.train``, ``op_census``): every
tool that times or inspects a step gets it from here.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable

import torch

CASES = {
    # name: (size, overrides, seq, micro_batch, keep_all_quantized)
    "slice12b": ("12b", {"pattern": "M-*-", "num_layers": 4}, 8192, 1, True),
    "small": ("small", {}, 2048, 8, False),
    "1.2b": ("1.2b", {}, 4096, 2, False),
    "tiny": ("tiny", {}, 256, 2, False),
}


def init_dist() -> None:
    """One process as a group of one (gloo on CPU, NCCL on CUDA), as the benchmarks run."""
    from nvfp4_train.parallel.setup import init_single_process

    init_single_process()


def build_case(case: str, recipe: str, seq: int | None = None, mb: int | None = None, device: str = "cpu"):
    """The model of ``CASES[case]`` under ``recipe`` (its config, its layer precision map: every block quantized
    where the case says so), built from seed 0, and its input: token ids from seed 1, [mb, seq] (the case's own
    sequence and micro-batch unless given), and positions. Returns ``(model, mc, lm, ids, pos)``. The one builder
    of the step benchmark, the op census and the saved-tensor census."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from models.build import build_model, transformer_config
    from models.config import model_config
    from nvfp4_train.precision.layer_map import LayerPrecisionMap

    size, overrides, case_seq, case_mb, all_q = CASES[case]
    seq, mb = seq or case_seq, mb or case_mb
    mc = model_config(size).replace(**overrides)
    keep = {"keep_first": 0, "keep_last": 0} if all_q and recipe != "bf16" else {}
    lm = LayerPrecisionMap(mc.pattern, recipe, **keep)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = build_model(mc, lm, config=transformer_config(mc), seq_length=seq)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, mc.vocab_size, (mb, seq), generator=g).to(device)
    pos = torch.arange(seq, device=device)[None].expand(mb, seq)
    return model, mc, lm, ids, pos


def cuda_step_times(step: Callable[[], None], iters: int) -> list[float]:
    """Seconds of each of ``iters`` calls of ``step``, timed with CUDA events around it (synchronized after each)."""
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return times


def graph_steps(zero: Callable[[], None], fwd_bwd: Callable[[], None], rest: Callable[[], None],
                invalidate: Callable[[], None], warmup: int, iters: int, tokens: int) -> dict:
    """EXPERIMENTAL, a benchmark only: ``bench_case``'s step (``zero``, then ``fwd_bwd``: the forwards and
    backwards of its micro-batches, then ``rest``: the gradient sync, optimizer step and weight-cache drop) with
    ``fwd_bwd`` captured once in a CUDA graph (``torch.cuda.graph``) and replayed, the rest eager (megatron's
    ``prepare_grads`` reads ``found_inf`` on the host, which a graph cannot hold). It measures what the step costs
    with no host work per kernel launch. The stochastic-rounding keys and the non-finite clock change from replay to
    replay only when the model's layers have device counters (``nvfp4_train.cuda_graph.enable_device_counters``,
    which ``--cuda-graph`` gives them); training with CUDA graphs is ``schedule.cuda_graph``. Returns the median step time and tokens/s, or raises on the first capture error."""
    if not torch.cuda.is_available():
        raise RuntimeError("--cuda-graph needs CUDA")
    stream = torch.cuda.current_stream()
    if stream == torch.cuda.default_stream():
        # megatron's DDP keeps each parameter's AccumulateGrad node from its construction; a capture on another
        # stream than the one those nodes were made on is invalidated (H200, 2026-11-30): build, warm up and
        # capture on one side stream (``main`` runs a --cuda-graph case under one)
        raise RuntimeError("--cuda-graph: run the case under a side stream (torch.cuda.stream), not the default")
    for _ in range(2):
        zero()
        fwd_bwd()
        rest()
    zero()
    invalidate()  # the captured forward quantizes every weight, as each step's first does
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fwd_bwd()
    rest()

    def step() -> None:
        zero()
        graph.replay()
        rest()

    for _ in range(warmup):
        step()
    t = statistics.median(cuda_step_times(step, iters))
    return dict(step_s=t, tokens_per_s=tokens / t)


def _nothing(*_args) -> None:
    pass


def train_step(model, ids: torch.Tensor, pos: torch.Tensor, grad_accum: int = 1, optimizer: bool = True):
    """A training step of ``model`` on the batch ``ids``/``pos`` as ``train.py`` runs one, in pieces:
    ``(zero, fwd_bwd, rest, step)``. ``zero`` clears the gradients; ``fwd_bwd(after_forward)`` runs the forwards
    and backwards of ``grad_accum`` micro-batches (megatron's ``no_sync`` for all but the last, as its schedules
    do; ``after_forward`` called once, after the first forward); ``rest`` reduces the gradients, steps the
    optimizer and drops the weight caches; ``step(after_forward)`` is the three. With ``optimizer`` the model
    is wrapped in megatron's DDP with the distributed optimizer (FP32 master weights, AdamW, sync-free clipping)
    and the weight cache is on (each weight quantized once per step); without, ``zero`` and ``rest`` do nothing.
    The one step of the step benchmark and the op census."""
    from nvfp4_train.optim import OptimConfig, build_ddp, build_optimizer, optimizer_step
    from nvfp4_train.precision.megatron_linear import invalidate_weight_caches, set_weight_cache

    if optimizer:
        ddp = net = build_ddp(model, OptimConfig())
        opt = build_optimizer([ddp], OptimConfig(), lr=1e-4, min_lr=1e-5)
        set_weight_cache(model, True)  # as the trainer: quantize each weight once per optimizer step

        def zero() -> None:
            ddp.zero_grad_buffer()
            opt.zero_grad()

        def rest() -> None:
            ddp.finish_grad_sync()
            optimizer_step(opt, OptimConfig().clip_grad)
            invalidate_weight_caches(model)
    else:
        net, zero, rest = model, _nothing, _nothing

    def fwd_bwd(after_forward: Callable[[], None] = _nothing) -> None:
        for i in range(grad_accum):
            with ddp.no_sync() if optimizer and i < grad_accum - 1 else contextlib.nullcontext():
                loss = net(ids, pos, None, labels=ids).float().mean()
                if i == 0:
                    after_forward()
                loss.backward()

    def step(after_forward: Callable[[], None] = _nothing) -> None:
        zero()
        fwd_bwd(after_forward)
        rest()

    return zero, fwd_bwd, rest, step
