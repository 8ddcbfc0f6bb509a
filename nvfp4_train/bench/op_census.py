"""Census of the aten ops of ONE training step, grouped by op, operand shapes/dtypes/strides and the source
line that issued them: attributes a GPU profile's elementwise/copy/reduce kernels (which carry no source
location) to our code or megatron's, by running the same step on the CPU.

It builds the trainer of a case (``nvfp4_train.bench.cases.build_trainer``: the ``small`` model by default; its config, DDP, distributed
optimizer and its own ``train_step``) at a smaller micro-batch and sequence, runs one warm-up step (the optimizer's lazy
state), then one full step (zero grads, forward, backward, grad sync, optimizer step) under a
``TorchDispatchMode`` that sees every aten op below autograd (roughly one kernel launch each on the GPU; view
ops, which launch nothing, are dropped) and groups them by (op, operands -> result, source line, phase). The
source line is the innermost frame in models/, nvfp4_train/, scripts/ or megatron/ of the Python stack; an
op that a built-in autograd formula runs in backward gets the line of the forward op that made its node
(anomaly mode records it; ``check_nan=False`` adds no ops) and the phase ``bwd:<node>``. A non-contiguous
operand shows its strides in brackets: broadcast or strided operands make the GPU run PyTorch's
non-vectorized (``elementwise_kernel<128, N> ... nocast``) kernels.

CPU and GPU take different paths in a few places, so counts there do not carry over (``gpu`` column ``no``):
the SSD scan (models/mamba/ssd.py on CPU, mamba-ssm's Triton kernels and their Python wrappers on GPU), the
gated RMSNorm (rmsnorm_gated_ref vs Triton) and the optimizer's Adam update (per-tensor on CPU, _foreach
multi_tensor_apply kernels on GPU). The causal conv1d runs causal_conv1d_ref on both when the causal-conv1d
extension is absent (as on the H200 before 2026-11-29's causal-conv1d build). Counts per step do not depend on the sizes, provided the
micro-batch is at least 2 (a batch of 1 makes some transposes contiguous, which drops copies); element
counts scale with micro_batch * seq (the GPU benchmark runs 8 * 2048).

    python3 scripts/op_census.py                 # --quick: small, micro-batch 2, seq 256, bf16 (CPU)
    python3 scripts/op_census.py --ops mul copy_ cat --top 40
    python3 scripts/op_census.py --composite-norm --json census.json   # the blocks' norm as before 86e9b91
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nvfp4_train.bench.aten_ops import launches_kernel

PROJECT = re.compile(r"(^|/)(models|nvfp4_train|scripts|megatron)/")
SKIP = re.compile(r"nvfp4_train/bench/|cuda_on_cpu")  # the driver and wrappers, not sources
CPU_ONLY = re.compile(r"models/mamba/ssd\.py|rmsnorm_gated_ref|core/optimizer/optimizer\.py:\d+ step_with_ready_grads")
TB_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _short(path: str) -> str | None:
    hit = PROJECT.search(path)
    if not hit or SKIP.search(path):
        return None
    return path.split("site-packages/", 1)[1] if "site-packages/" in path else path[hit.start(2):]


def python_frame() -> str | None:
    """The innermost project frame of the current Python stack, as 'path:line func'."""
    f = sys._getframe(2)
    while f is not None:
        short = _short(f.f_code.co_filename)
        if short:
            return f"{short}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return None


def node_frame(node) -> str | None:
    """The innermost project frame of the forward that created an autograd node (anomaly mode's traceback)."""
    tb = node.metadata.get("traceback_") if node is not None else None
    for entry in reversed(tb or ()):
        m = TB_FRAME.search(entry)
        if m and _short(m.group(1)):
            return f"{_short(m.group(1))}:{m.group(2)} {m.group(3)}"
    return None


def _desc(t) -> str:
    if not isinstance(t, torch.Tensor):
        return ""
    shape = "x".join(map(str, t.shape)) or "()"
    dt = str(t.dtype).replace("torch.", "").replace("float32", "f32").replace("bfloat16", "bf16")
    lay = "" if t.is_contiguous() else "[" + ",".join(map(str, t.stride())) + "]"
    return f"{shape}:{dt}{lay}"


class Census(TorchDispatchMode):
    """Counts every aten op that reaches the dispatcher below autograd, by (op, operands, source, phase)."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: dict[tuple, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if launches_kernel(name):
            node = torch._C._current_autograd_node()
            frame = python_frame()
            phase = "fwd"
            if node is not None:
                phase = "bwd:" + node.name()
                if frame is None:  # a built-in backward formula: the line of the forward op that made the node
                    frame = node_frame(node)
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [x for a in args if isinstance(a, (list, tuple)) for x in a if isinstance(x, torch.Tensor)]
            res = out[0] if isinstance(out, (list, tuple)) and out else out
            operands = " ".join(_desc(t) for t in tensors[:4]) + (" -> " + _desc(res) if isinstance(res, torch.Tensor)
                                                                  else "")
            self.groups[(name, operands, frame or "?", phase)] += 1
        return out


def numel(operands: str) -> int:
    best = 0
    for s in operands.split():
        if s == "->":
            continue
        n = 1
        for v in s.split(":")[0].split("x"):
            n *= int(v) if v.isdigit() else 1
        best = max(best, n)
    return best


def build_step(case: str, recipe: str, seq: int, mb: int, work_dir: Path):
    """The trainer's own step (``Trainer.train_step``, one micro-batch per step) of ``case`` under ``recipe`` at
    micro-batch ``mb`` and sequence ``seq`` (``nvfp4_train.bench.cases.build_trainer``; its files under
    ``work_dir``), and the trainer (close it when done)."""
    from nvfp4_train.bench.cases import build_trainer

    trainer = build_trainer(case, recipe, grad_accum=1, steps=4, work_dir=work_dir, seq=seq, mb=mb)
    return trainer.train_step, trainer


def census(step) -> list[dict]:
    step()  # warm-up: the optimizer's state, weight caches
    mode = Census()
    # anomaly mode keeps each autograd node's forward traceback (check_nan=False: no extra ops in backward)
    with torch.autograd.set_detect_anomaly(True, check_nan=False), mode:
        step()
    rows = [dict(op=k[0], operands=k[1], frame=k[2], phase=k[3], count=c, numel=numel(k[1]),
                 gpu=not CPU_ONLY.search(k[2]))
            for k, c in mode.groups.items()]
    rows.sort(key=lambda r: -r["count"] * r["numel"])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="small")
    ap.add_argument("--recipe", default="bf16")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2,
                    help="at least 2: a batch of 1 makes some transposes contiguous (no copy) that copy at 8")
    ap.add_argument("--quick", action="store_true", help="the defaults (small, micro-batch 2, seq 256, bf16); CPU")
    ap.add_argument("--top", type=int, default=50, help="rows to print (most elements * launches first)")
    ap.add_argument("--ops", nargs="*", help="only these aten ops, e.g. mul copy_ _to_copy cat")
    ap.add_argument("--composite-norm", action="store_true",
                    help="the blocks' RMSNorm as nvfp4_train.models.layers.rms_norm_composite (the code the H200 "
                         "profile of 2026-11-29 ran) instead of F.rms_norm; only for this census")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.composite_norm:
        import nvfp4_train.models.layers

        nvfp4_train.models.layers.rms_norm = nvfp4_train.models.layers.rms_norm_composite
    with tempfile.TemporaryDirectory(prefix="op_census_") as tmp:
        step, trainer = build_step(a.case, a.recipe, a.seq, a.micro_batch, Path(tmp))
        with trainer:
            rows = census(step)
    if a.ops:
        rows = [r for r in rows if r["op"] in a.ops]
    print(f"{a.case}/{a.recipe} micro-batch {a.micro_batch} seq {a.seq}: {sum(r['count'] for r in rows)} ops "
          f"in {len(rows)} groups\n")
    print("| count | op | operands -> result (shape:dtype[strides if not contiguous]) | phase | source | gpu |")
    print("|---|---|---|---|---|---|")
    for r in rows[:a.top]:
        print(f"| {r['count']} | {r['op']} | {r['operands']} | {r['phase']} | {r['frame']} | "
              f"{'yes' if r['gpu'] else 'no'} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
