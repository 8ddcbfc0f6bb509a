"""Census of the tensors ONE forward saves for backward: which module and which autograd node saved each, what
made it, its dtype and bytes, grouped into a markdown table. Answers "what dominates activation memory" for a
``nvfp4_train.bench.cases`` case under one recipe, on the CPU.

Method (exact, no sampling):

- every saved tensor passes through the pack hook of ``torch.autograd.graph.saved_tensors_hooks``; the hook
  stores the tensor under a fresh integer key, with the module stack at that moment (forward pre/post hooks
  on every module keep it), and returns the key;
- after the forward, the autograd graph is walked from the loss; every node's saved slots are read back
  (built-in nodes: their ``_saved_*`` attributes; custom Functions: ``saved_tensors``), which calls the
  unpack hook with the key, so each key gets the exact node (``MulBackward0``, ``QuantLinearFunctionBackward``,
  ...) that saved it. A custom Function may also keep tensors as plain ``ctx`` attributes, which no hook sees
  (our ``QuantLinearFunction`` keeps its quantized x and W that way): those are read from the node's
  ``__dict__`` (tensors, and objects holding tensors, e.g. an ``Operand`` and its container), and their module
  is the layer that owns the node's ``lctx`` (else the module of the node's hooked saves);
- a ``TorchDispatchMode`` records, for every storage an aten op creates, the op and the module stack, so each
  saved storage is also attributed to what MADE it ("made by": ``in_proj``'s output, a ``contiguous`` copy);
- bytes are counted per storage (``untyped_storage().nbytes()``): a storage saved twice, or several views of one
  storage, count once, under the first node (in graph-walk order) that saved it. Storages of parameters and of
  the inputs existed before the forward and are not activations (listed apart); so are the quantized weight
  copies of the weight cache (bench_train counts them apart as "quantized weight copies").

CPU vs GPU. ``--path cpu`` counts what this CPU forward really saves. Three Mamba ops and the block RMSNorm run
other code on the GPU and save other tensors; ``--path gpu`` (the default) replaces them, for this census only,
by stand-in autograd Functions that compute the same output with the CPU code and save exactly the tensors the
GPU code saves, taken from the libraries' source (mamba-ssm 2.3.2, causal-conv1d 1.7.0, torch):

  ssd_scan        mamba_ssm MambaChunkScanCombinedFn.forward: save_for_backward(out (z is None), x, dt,
                  dA_cumsum, A, B, C, D, z, dt_bias, initial_states, seq_idx): the ORIGINAL x/dt/B/C arguments
                  (views of the conv output / in_proj output), its own output, and dA_cumsum, fp32
                  [b, heads, ceil(l / chunk), chunk]. CPU: models/mamba/ssd.py under autograd saves O(l * chunk)
                  fp32 decay blocks per head.
  causal_conv1d   causal_conv1d CausalConv1dFn.forward: save_for_backward(x, weight, bias, seq_idx,
                  initial_states): x as passed (a view of in_proj's output; contiguous() only when neither
                  dim 1 nor dim 2 has stride 1). ``--gpu-conv ref`` instead keeps causal_conv1d_ref (the GPU
                  runs it when the causal-conv1d extension is absent; it saves fp32 copies).
  rmsnorm_gated   mamba_ssm layernorm_gated LayerNormFn.forward: save_for_backward(x, weight, bias, mean,
                  rstd, z) with x, z reshaped to 2-D (reshape COPIES a non-viewable z; contiguous() when the
                  last stride is not 1), mean None (RMS), rstd fp32 [groups * rows].
  block RMSNorm   F.rms_norm on CUDA runs torch's fused kernel, whose node saves (input, weight, rstd fp32
                  [rows, 1]); on CPU it decomposes into ops that save fp32 copies.

Everything else (linear layers, SDPA: CPU flash saves q, k, v, out and logsumexp as the CUDA flash kernel does,
elementwise ops, megatron's cross entropy) saves the same on both. The stand-ins have no backward: this
script runs forwards only.

Scaling. Saved bytes are linear in the token count micro_batch * seq (every saved tensor is per token, or
per chunk of a sequence whose length is a multiple of the chunk; the NVFP4 scales are per 16 tokens), so the
GPU case's bytes are this run's times (GPU tokens / CPU tokens); ``--scale-to`` prints that column. Run it
at two sizes to check linearity. One exception: RoPE's cos/sin ([seq, 1, 1, head_dim] per use, shared by the
micro-batch) scale with seq only, so keep the GPU case's micro-batch or subtract them (they are listed under
"attention: other").

The model is built as bench_train builds it (its CASES, the same builders and layer precision map, bf16
parameters, the weight cache on), without DDP and optimizer, which save nothing in the forward.

    python3 scripts/saved_census.py --case small --recipe nvfp4 --seq 512 --micro-batch 2
    python3 scripts/saved_census.py --case small --recipe bf16 --path cpu --json bf16_cpu.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nvfp4_train.bench.cases import CASES, build_case, init_dist

# ------------------------------------------------------------------------------ GPU stand-ins (census only)


class _StandIn(torch.autograd.Function):
    """A census stand-in: a subclass's forward computes the output and saves what the GPU library saves; the
    census never runs a backward."""

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("saved_census stand-in: forward only")


class _ScanAsMambaSSM(_StandIn):
    """Output of ``ssd_chunked_scan``; saves what mamba_ssm's MambaChunkScanCombinedFn saves (z=None)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus):
        from nvfp4_train.models.mamba.ssd import ssd_chunked_scan

        with torch.no_grad():
            out = ssd_chunked_scan(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus)
        b, l, h, _ = x.shape
        dA_cumsum = torch.empty(b, h, -(-l // chunk_size), chunk_size, dtype=torch.float32, device=x.device)
        ctx.save_for_backward(out, x, dt, dA_cumsum, A, B, C, D, None, dt_bias, None, None)
        return out


class _ConvAsCausalConv1d(_StandIn):
    """Output of ``causal_conv1d_ref``; saves what causal_conv1d's CausalConv1dFn saves."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation):
        from nvfp4_train.models.mamba.ops import causal_conv1d_ref

        if x.stride(2) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        with torch.no_grad():
            out = causal_conv1d_ref(x, weight, bias, activation)
        ctx.save_for_backward(x, weight, bias, None, None)
        return out


class _GatedNormAsMambaSSM(_StandIn):
    """Output of ``rmsnorm_gated_ref``; saves what mamba_ssm's layernorm_gated LayerNormFn saves (RMS)."""

    @staticmethod
    def forward(ctx, x, z, weight, eps, group_size, norm_before_gate):
        from nvfp4_train.models.mamba.ops import rmsnorm_gated_ref

        with torch.no_grad():
            out = rmsnorm_gated_ref(x, z, weight, eps, group_size, norm_before_gate)
        x2 = x.reshape(-1, x.shape[-1])
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        z2 = None
        if z is not None:
            z2 = z.reshape(-1, z.shape[-1])
            z2 = z2 if z2.stride(-1) == 1 else z2.contiguous()
        groups = x.shape[-1] // (group_size or x.shape[-1])
        rstd = torch.empty(groups * x2.shape[0], dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x2, weight.contiguous(), None, None, rstd, z2)
        return out


class _RMSNormAsFused(_StandIn):
    """Output of ``F.rms_norm``; saves what torch's fused CUDA rms_norm node saves (input, weight, rstd)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        with torch.no_grad():
            out = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
        rstd = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, weight, rstd)
        return out


def install_gpu_stand_ins(gpu_conv: str = "kernel") -> None:
    """Route the mixer's scan, conv, gated norm and the block RMSNorm through the stand-ins above (this process
    only): the names the mixer and RMSNorm look up at call time are replaced."""
    import nvfp4_train.models.layers
    import nvfp4_train.models.mamba.mixer as mixer
    from nvfp4_train.models.mamba.ops import causal_conv1d_ref

    def ssd_scan(x, dt, A, B, C, chunk_size, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                 dt_limit=(0.0, float("inf")), **kw):
        assert z is None and not kw, "the mixer calls the scan without z, initial or final states"
        assert tuple(dt_limit) == (0.0, float("inf")), "the mixer calls the scan without a dt limit"
        return _ScanAsMambaSSM.apply(x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus)

    def conv(x, weight, bias=None, activation=None):
        if gpu_conv == "ref":
            return causal_conv1d_ref(x, weight, bias, activation)
        # ops.causal_conv1d's own contiguous() for the kernel's channel-last path
        if x.stride(2) != 1 and (x.shape[1] % 8 or x.stride(0) % 8 or x.stride(2) % 8):
            x = x.contiguous()
        return _ConvAsCausalConv1d.apply(x, weight, bias, activation)

    def gated(x, z, weight, eps=1e-5, group_size=None, norm_before_gate=False):
        return _GatedNormAsMambaSSM.apply(x, z, weight, eps, group_size, norm_before_gate)

    composite = nvfp4_train.models.layers.rms_norm_composite

    def rms_norm(x, weight, eps):
        return _RMSNormAsFused.apply(x, weight, eps) if weight.dtype == x.dtype else composite(x, weight, eps)

    # the unfused mixer path looks these up in ops at call time (ops.mamba_conv_scan_norm on CPU); the fused op of
    # fusion.mamba (ops._ConvScanNormFn, CUDA only) has no stand-in: the census describes the unfused GPU path
    import nvfp4_train.models.mamba.ops as ops

    mixer.ssd_scan, mixer.causal_conv1d, mixer.rmsnorm_gated = ssd_scan, conv, gated
    ops.ssd_scan, ops.causal_conv1d, ops.rmsnorm_gated = ssd_scan, conv, gated
    nvfp4_train.models.layers.rms_norm = rms_norm


# ------------------------------------------------------------------------------------------------ census


def storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (t.device.type, s.data_ptr(), s.nbytes())


@dataclass
class Saved:
    key: tuple  # storage_key
    nbytes: int  # the storage's bytes
    dtype: str
    shape: tuple
    stack: tuple[str, ...]  # module names, outermost first ("" = outside every module)
    node: str = "?"
    slot: str = ""
    made_by: str = "?"
    order: float = 0.0  # pack order (forward order of saving); ctx attributes after every hooked save


@dataclass
class Census:
    saves: list[Saved] = field(default_factory=list)  # in graph-walk order, one per (node, slot)
    excluded: dict[str, int] = field(default_factory=dict)  # why -> bytes (parameters, inputs, weight cache)

    def unique(self) -> list[Saved]:
        """One entry per storage: its first saver in forward order (excluded storages are never in ``saves``)."""
        first: dict[tuple, Saved] = {}
        for s in self.saves:
            if s.key not in first or s.order < first[s.key].order:
                first[s.key] = s
        return sorted(first.values(), key=lambda s: s.order)


class _Producers(TorchDispatchMode):
    """Records the op and module stack that created each storage (outputs not aliasing an input)."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack, self.made = stack, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {storage_key(a) for a in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(a, torch.Tensor) and a.device.type != "meta"}
        for o in torch.utils._pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.device.type != "meta":
                k = storage_key(o)
                if k not in ins:
                    self.made[k] = (func.overloadpacket.__name__, tuple(self.stack))
        return out


def _tensors_in(obj, depth: int = 0):
    """Tensors held by a ctx attribute: a tensor, a list/tuple/dict of them, or an object (an Operand, a
    quantized container) whose attributes hold them; a layer's persistent state (LinearContext, LayerTelemetry)
    is not a save."""
    from nvfp4_train.precision.linear import LinearContext
    from nvfp4_train.precision.telemetry import LayerTelemetry

    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 3 or obj is None or isinstance(obj, (LinearContext, LayerTelemetry, torch.nn.Module, str, int,
                                                           float, bool)):
        return
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth + 1)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth + 1)
    elif hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            yield from _tensors_in(v, depth + 1)


def graph_nodes(root) -> list:
    """Every node reachable from ``root`` (breadth-first, each once)."""
    seen, order, todo = set(), [], [root]
    while todo:
        n = todo.pop(0)
        if n is None or n in seen:
            continue
        seen.add(n)
        order.append(n)
        todo.extend(f for f, _ in n.next_functions)
    return order


def run_census(model: torch.nn.Module, forward, preexisting: set[tuple]) -> tuple[Census, torch.Tensor]:
    """One ``forward()`` (returning the loss) of ``model`` with every saved tensor attributed (module docstring).
    ``preexisting``: storage keys that are not activations (inputs); parameters and buffers are added here."""
    from nvfp4_train.precision.megatron_linear import quant_layers

    stack: list[str] = []
    handles = []
    for name, m in model.named_modules():
        def pre(mod, args, name=name):
            stack.append(name)

        def post(mod, args, out, name=name):
            assert stack and stack[-1] == name, (stack[-3:], name)
            stack.pop()

        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post, always_call=True))
    packed: dict[int, tuple[torch.Tensor, tuple]] = {}

    def pack(t: torch.Tensor) -> int:
        packed[len(packed)] = (t, tuple(stack))
        return len(packed) - 1

    got: list[tuple[int, str]] = []  # (key, slot) unpacked while one node's saved slots are read
    slot_now = [""]

    def unpack(k: int) -> torch.Tensor:
        got.append((k, slot_now[0]))
        return packed[k][0]

    producers = _Producers(stack)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), producers:
            loss = forward()
    finally:
        for h in handles:
            h.remove()
    # not activations: parameters and buffers, the inputs, the weight cache's quantized weight copies
    params = {storage_key(p) for p in model.parameters()} | {storage_key(b) for b in model.buffers()}
    lctx_owner = {}
    wcache = set()
    for name, m in model.named_modules():
        if m in quant_layers(model):
            lctx_owner[id(m.lctx)] = name
            for op in (m.lctx.weight_cache.row, m.lctx.weight_cache.col):
                wcache |= {storage_key(t) for t in _tensors_in(op)}
    census = Census()
    excluded_keys: dict[tuple, str] = {}

    def add(t: torch.Tensor, stack_: tuple, node: str, slot: str, order: float) -> None:
        k = storage_key(t)
        why = ("parameters" if k in params else "inputs" if k in preexisting
               else "quantized weight copies (weight cache)" if k in wcache else None)
        if why is not None:
            if k not in excluded_keys:
                excluded_keys[k] = why
                census.excluded[why] = census.excluded.get(why, 0) + k[2]
            return
        op, made_stack = producers.made.get(k, ("?", ()))
        made = f"{op} in {(made_stack[-1] or '<model>') if made_stack else '<outside the model>'}"
        census.saves.append(Saved(k, k[2], str(t.dtype).replace("torch.", ""), tuple(t.shape), stack_, node,
                                  slot, made, order))

    read: set[int] = set()
    for node in graph_nodes(loss.grad_fn):
        name = node.name()
        got.clear()
        attrs = [a for a in dir(node) if a.startswith("_saved_")]
        if attrs:  # a built-in node: one attribute per saved slot
            for attr in attrs:
                slot_now[0] = attr[len("_saved_"):]
                getattr(node, attr)
        else:
            slot_now[0] = "saved_tensors"  # before hasattr: the getter itself unpacks
            if hasattr(node, "saved_tensors"):  # a custom Function's node (its ctx)
                node.saved_tensors
        hooked_stacks = []
        for k, slot in list(got):
            if k in read:
                continue
            read.add(k)
            t, st = packed[k]
            hooked_stacks.append(st)
            add(t, st, name, slot, k)
        # custom Functions: tensors kept as plain ctx attributes (no hook sees them); their module is the layer
        # owning the node's LinearContext, else that of the node's hooked saves
        ctx_vars = getattr(node, "__dict__", {})
        lctx = ctx_vars.get("lctx")
        st = ((lctx_owner[id(lctx)],) if lctx is not None and id(lctx) in lctx_owner
              else hooked_stacks[0] if hooked_stacks else ())
        for attr, v in ctx_vars.items():
            for t in _tensors_in(v):
                add(t, st, name, f"ctx.{attr}", len(packed) + len(census.saves))
    for k in packed:  # saved, yet not reachable from the loss (a side branch): counted, marked
        if k not in read:
            t, st = packed[k]
            add(t, st, "<not reachable from the loss>", "", k)
    return census, loss


# ------------------------------------------------------------------------------------------- categories


def category(s: Saved, modules: dict[str, torch.nn.Module]) -> str:
    """What a saved tensor is, from the innermost module of its saver's stack and the saving node."""
    from nvfp4_train.precision.megatron_linear import _QuantLayer

    node = s.node
    inner = s.stack[-1] if s.stack else ""
    mod = modules.get(inner)
    if "ScanAsMambaSSM" in node:
        return "Mamba: SSD scan"
    if "ConvAsCausalConv1d" in node:
        return "Mamba: causal conv1d"
    if "GatedNormAsMambaSSM" in node:
        return "Mamba: gated RMSNorm"
    if "VocabParallelCrossEntropy" in node:
        return "loss: cross entropy (softmax)"
    if isinstance(mod, _QuantLayer):
        role = inner.rsplit(".", 1)[-1]
        return f"linear input: {role}" + ("" if mod.lctx.recipe.is_bf16 else f" ({mod.lctx.recipe.name})")
    if inner.endswith("output_layer"):
        return "linear input: output_layer (logits GEMM)"
    if mod is not None and type(mod).__name__ == "RMSNorm":
        return "RMSNorm (final)" if inner.endswith("final_norm") else "RMSNorm (block)"
    if "embedding" in inner:
        return "embedding"
    if mod is not None and type(mod).__name__ == "SDPAttention":
        return "attention core (SDPA, GQA repeat)"
    if mod is not None and type(mod).__name__ == "MambaMixer":
        # the CPU path's conv/scan/gated-norm ops, and A = -exp(A_log) on both paths
        return "Mamba: other ops (CPU path: conv, scan, gated norm)"
    if mod is not None and type(mod).__name__ == "MLP":
        return "MLP activation"
    if mod is not None and type(mod).__name__ == "SelfAttention":
        return "attention: other (qkv split, RoPE)"
    return f"other: {type(mod).__name__ if mod is not None else '<top>'}"


def table(census: Census, modules: dict[str, torch.nn.Module], scale: float) -> tuple[list[dict], int]:
    rows: dict[str, dict] = {}
    for s in census.unique():
        k = category(s, modules)
        r = rows.setdefault(k, dict(category=k, dtypes=defaultdict(int), bytes=0, storages=0,
                                    nodes=defaultdict(int)))
        r["bytes"] += s.nbytes
        r["dtypes"][s.dtype] += s.nbytes
        r["storages"] += 1
        r["nodes"][s.node] += s.nbytes
    total = sum(r["bytes"] for r in rows.values())
    out = sorted(rows.values(), key=lambda r: -r["bytes"])
    for r in out:
        r["share"] = r["bytes"] / total if total else 0.0
        r["scaled_gib"] = r["bytes"] * scale / 2**30
        r["nodes"] = dict(sorted(r["nodes"].items(), key=lambda kv: -kv[1])[:3])
        r["dtype"] = " ".join(d for d, _ in sorted(r.pop("dtypes").items(), key=lambda kv: -kv[1]))
    return out, total


def detail(census: Census, modules: dict[str, torch.nn.Module], top: int) -> list[dict]:
    """Storages grouped by (category, saving node and slot, made by with block indices dropped, dtype, shape)."""
    import re

    rows: dict[tuple, dict] = {}
    for s in census.unique():
        made = re.sub(r"\.\d+(\.|$)", r".N\1", s.made_by)
        k = (category(s, modules), f"{s.node}.{s.slot}", made, s.dtype, s.shape)
        r = rows.setdefault(k, dict(category=k[0], saved_by=k[1], made_by=made, dtype=k[3], shape=list(k[4]),
                                    count=0, bytes=0))
        r["count"] += 1
        r["bytes"] += s.nbytes
    return sorted(rows.values(), key=lambda r: -r["bytes"])[:top]


# --------------------------------------------------------------------------------------------------- main


def build(case: str, recipe: str, seq: int, mb: int):
    """bench_train.bench_case's model for ``case`` / ``recipe`` (same config and layer map, weight cache on), its
    inputs at micro-batch ``mb`` and sequence ``seq``, and the forward returning the loss bench_train takes."""
    from nvfp4_train.precision.megatron_linear import set_weight_cache

    init_dist()
    model, _, lm, ids, pos = build_case(case, recipe, seq, mb)
    set_weight_cache(model, True)

    def forward() -> torch.Tensor:
        return model(ids, pos, None, labels=ids).float().mean()

    return model, forward, {storage_key(ids), storage_key(pos)}, lm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="small", choices=sorted(CASES))
    ap.add_argument("--recipe", default="bf16", help="bf16 | nvfp4 | fp8 | ... (nvfp4_train.precision.recipe)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--path", choices=["gpu", "cpu"], default="gpu",
                    help="gpu: the Mamba ops and block RMSNorm save what the GPU kernels save (stand-ins); "
                         "cpu: what this CPU run's fallbacks save")
    ap.add_argument("--gpu-conv", choices=["kernel", "ref"], default="kernel",
                    help="with --path gpu: the causal-conv1d CUDA kernel, or causal_conv1d_ref (no extension)")
    ap.add_argument("--scale-to", type=int, default=None, metavar="TOKENS",
                    help="also show bytes scaled to this many tokens (default: the case's GPU seq x micro-batch)")
    ap.add_argument("--top", type=int, default=25, help="rows of the detail table")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.path == "gpu":
        install_gpu_stand_ins(a.gpu_conv)
    model, forward, inputs, lm = build(a.case, a.recipe, a.seq, a.micro_batch)
    census, loss = run_census(model, forward, inputs)
    modules = dict(model.named_modules())
    tokens = a.seq * a.micro_batch
    _, _, gseq, gmb, _ = CASES[a.case]
    target = a.scale_to or gseq * gmb
    scale = target / tokens
    rows, total = table(census, modules, scale)
    det = detail(census, modules, a.top)

    print(f"\n### saved tensors: {a.case} / {a.recipe} / path {a.path}"
          f"{' (conv ' + a.gpu_conv + ')' if a.path == 'gpu' else ''}; seq {a.seq} x micro-batch "
          f"{a.micro_batch} = {tokens} tokens; bf16 linear layers {lm.num_bf16}/{lm.num_linear}\n")
    print(f"| what | dtypes (most bytes first) | storages | MiB | share | GiB at {target} tokens "
          f"| saved by (top nodes) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        nodes = ", ".join(r["nodes"])
        print(f"| {r['category']} | {r['dtype']} | {r['storages']} | {r['bytes'] / 2**20:.2f} | "
              f"{100 * r['share']:.1f}% | {r['scaled_gib']:.3f} | {nodes} |")
    print(f"| **total** | | {sum(r['storages'] for r in rows)} | {total / 2**20:.2f} | 100% | "
          f"{total * scale / 2**30:.3f} | |")
    for why, b in census.excluded.items():
        print(f"\nnot counted: {why}: {b / 2**20:.2f} MiB")
    print("\n#### largest saved storages, grouped\n")
    print("| what | saved by (node.slot) | made by | dtype | shape | count | MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in det:
        print(f"| {r['category']} | {r['saved_by']} | {r['made_by']} | {r['dtype']} | {tuple(r['shape'])} | "
              f"{r['count']} | {r['bytes'] / 2**20:.2f} |")
    print(f"\nbytes per token: {total / tokens:,.0f}; scaled to {target} tokens: "
          f"{total * scale / 2**30:.3f} GiB", flush=True)
    if a.json:
        a.json.write_text(json.dumps(dict(case=a.case, recipe=a.recipe, path=a.path, gpu_conv=a.gpu_conv,
                                          seq=a.seq, micro_batch=a.micro_batch, tokens=tokens,
                                          total_bytes=total, scale_to=target, rows=rows, detail=det,
                                          excluded=census.excluded, loss=float(loss)), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
