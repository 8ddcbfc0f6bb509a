"""Two-rank equivalence of the hybrid model across parallel layouts (run by test_model_dist.py under
``torchrun --nproc_per_node 2``; not a pytest module).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/models/dist_model_equivalence.py \
        --layout tp|tp_sp|pp[,...] --recipe bf16|nvfp4 --dtype fp32|bf16 --out DIR [--model tiny|small|...]

With CUDA it runs on one GPU per rank over NCCL (the multi-GPU check of issue 8), else on CPU over gloo.
Several comma-separated layouts are each compared with the one reference (``losses_<layout>.pt``).

1. Reference: TP=1, PP=1 (the two ranks are data-parallel replicas). Build the model from a seed and save
   it with megatron's distributed checkpointing (``sharded_state_dict``); run a fixed batch forward and
   backward, take one SGD step on every parameter, run the batch forward again.
2. The layout under test (TP=2, TP=2 with sequence parallelism, or PP=2): build, load the reference
   checkpoint (megatron reshards it: TP splits, Mamba in_proj/conv1d parts, global block keys), and do the
   same. Rank 0 writes both runs' per-token losses (before and after the step) to ``--out``.

Equal losses after the SGD step mean equal gradients for every parameter (a wrong gradient shard or a
missing TP reduction changes the updated weights and so the second loss).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from nvfp4_train.mcore_compat.cuda_on_cpu import enable_cpu_compat

LR = 0.5  # large enough that a wrong gradient moves the second loss visibly


def run_layout(args, tp: int, pp: int, sp: bool, ckpt: Path, save: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.models.build import build_model, transformer_config
    from nvfp4_train.models.config import model_config
    from nvfp4_train.precision.layer_map import LayerPrecisionMap

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    mc = model_config(args.model).replace(vocab_size=args.vocab)
    lm = LayerPrecisionMap(mc.pattern, args.recipe, keep_first=0, keep_last=0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    cfg = transformer_config(mc, tp=tp, pp=pp, sequence_parallel=sp, params_dtype=dtype)
    model = build_model(mc, lm, config=cfg, pre_process=ps.is_pipeline_first_stage(),
                        post_process=ps.is_pipeline_last_stage(), seq_length=args.seq, seed=7)
    if save:
        dist_checkpointing.save(model.sharded_state_dict(), str(ckpt))
    else:
        state = dist_checkpointing.load(model.sharded_state_dict(), str(ckpt))
        model.load_state_dict(state)
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(0, mc.vocab_size, (args.batch, args.seq), generator=g).to(args.device)
    pos = torch.arange(args.seq, device=args.device)[None].expand(args.batch, args.seq)
    losses = []

    def step(_it, m):
        out = m(ids, pos, None, labels=ids)

        def loss_fn(t):
            losses.append(t.detach().float().clone())
            return t.float().mean(), {}
        return out, loss_fn

    fb = get_forward_backward_func()
    results = []
    for phase in range(2):
        losses.clear()
        model.zero_grad(set_to_none=True)
        fb(forward_step_func=step, data_iterator=iter([None]), model=[model], num_microbatches=1,
           seq_length=args.seq, micro_batch_size=args.batch, forward_only=phase == 1)
        if phase == 0:
            # what megatron's finalize_model_grads does for sequence-parallel params (norm weights): each TP
            # rank saw only its sequence shard, so their gradients are summed over the TP group
            if sp:
                for p in model.parameters():
                    if getattr(p, "sequence_parallel", False) and p.grad is not None:
                        dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(LR * p.grad.to(p.dtype))
        results.append(losses[0] if losses else None)
    ps.destroy_model_parallel()
    if results[0] is None:
        return None
    return results[0], results[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", required=True, help="tp, tp_sp, pp, or several comma-separated")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--recipe", default="bf16")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    layouts = args.layout.split(",")
    shapes = {"tp": (2, 1, False), "tp_sp": (2, 1, True), "pp": (1, 2, False)}
    if any(lay not in shapes for lay in layouts):
        ap.error(f"--layout {args.layout!r}: each layout is one of {sorted(shapes)}")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        args.device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl")
    else:
        enable_cpu_compat()
        args.device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt = args.out / "ckpt"
    if rank == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    ref = run_layout(args, 1, 1, False, ckpt, save=True)
    dist.barrier()
    for lay in layouts:
        tp, pp, sp = shapes[lay]
        got = run_layout(args, tp, pp, sp, ckpt, save=False)
        # the last pipeline stage (rank 1 under PP=2, every rank otherwise) holds the losses
        holder = 1 if pp == 2 else 0
        if rank == holder:
            result = {"ref": tuple(t.cpu() for t in ref), "got": tuple(t.cpu() for t in got)}
            torch.save(result, args.out / f"losses_{lay}.pt")
            if len(layouts) == 1:
                torch.save(result, args.out / "losses.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
