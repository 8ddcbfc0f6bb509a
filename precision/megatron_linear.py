"""megatron-core tensor-parallel linear layers whose GEMMs run under a :class:`QuantRecipe`.

``QuantColumnParallelLinear`` and ``QuantRowParallelLinear`` are megatron's ``ColumnParallelLinear`` and
``RowParallelLinear`` with ONE method replaced, ``_forward_impl`` (the GEMM megatron calls between its own
communication). They take megatron's constructor arguments plus three keyword-only extras, so a
``ModuleSpec(module=QuantColumnParallelLinear, params={"recipe": ..., "layer_name": ..., "seed": ...})``
builds them through ``build_module``:

    recipe      the layer's precision (default: bf16)
    layer_name  the name in the layer precision map (``"12.mlp.fc1"``), used in errors and telemetry
    block, role the global block index and role the layer precision map resolved ``recipe`` from (None, "":
                a layer outside the map); kept with ``recipe`` as ``base_recipe`` for the precision switch
    seed        the stochastic-rounding seed, mixed with the layer name so layers draw different bits

Communication is megatron's, exactly:

- column layer: megatron's own ``_forward_impl`` all-gathers the sequence-parallel input in forward and
  all-reduces (or reduce-scatters, under sequence parallelism) the input gradient in backward. The quantized
  path does the same with megatron's autograd-aware mappings around :func:`quantized_linear`:
  ``gather_from_sequence_parallel_region`` (forward all-gather, backward reduce-scatter) or
  ``copy_to_tensor_model_parallel_region`` (backward all-reduce). The reductions stay in the activation
  dtype (bf16), RECIPE §4.
- row layer: the all-reduce / reduce-scatter of the output happens in megatron's ``forward`` after
  ``_forward_impl``; nothing to do here (megatron passes ``tp_group=None``: the layer's own group is used).

Every per-tensor NVFP4 / FP8 amax is all-reduced with MAX over the layer's TP group (``LinearContext.
amax_group``), so the scales are those of the unsharded tensor and the numerics do not depend on the TP size
(block scales are local and shard boundaries fall on block boundaries, except in a layer whose odd
dims are zero-padded, see ``recipe_padding``).

An all-bf16 recipe runs megatron's original ``_forward_impl`` (bitwise the stock layer). Parameter names and
state-dict keys are the stock ones: precision is not part of a checkpoint, and :meth:`set_recipe` changes it
in place (the late switch to bf16, paper App. D). Gradient-accumulation fusion (megatron's
``gradient_accumulation_fusion``): a bf16 layer runs megatron's fused path through our cuBLASLt stand-in for
APEX's extension (``nvfp4_train.mcore_compat.wgrad``); a quantized layer adds its Wgrad GEMM into ``main_grad``
where one GEMM can (bf16 Wgrad operands, NVFP4 on the cuBLASLt engine; ``nvfp4_train.precision.linear``) and
otherwise returns the gradient for megatron's DDP hook to add, as without the switch.

Weight quantization: by default every forward re-quantizes the weight (always correct; for M = 8192 tokens
it costs little next to the GEMMs). :func:`set_weight_cache` lets a layer keep its quantized weight across
the micro-batches of one optimizer step; then the trainer MUST call :func:`invalidate_weight_caches` after
every optimizer step: megatron's optimizers write the new weights through ``param.data`` / the parameter
buffer, which the cache's version-counter check (``WeightCache``) cannot see.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.utils import get_pg_size

from nvfp4_train.kernels.sr_key import ROLE_SLOTS, block_seed, layer_stream
from nvfp4_train.mcore_compat.linear import forward_impl_kwargs
from nvfp4_train.mcore_compat.wgrad import install_wgrad_accumulation
from nvfp4_train.precision.linear import LinearContext, quantized_linear
from nvfp4_train.precision.recipe import BF16, GEMM_ROLES, QuantRecipe
from nvfp4_train.precision.telemetry import LayerTelemetry, probe_input_grad

__all__ = [
    "QuantColumnParallelLinear",
    "QuantRowParallelLinear",
    "recipe_shape_problems",
    "token_block",
    "check_recipe_shape",
    "recipe_padding",
    "quant_layers",
    "set_weight_cache",
    "invalidate_weight_caches",
    "set_sr_streams",
]

# (role, operand index) -> (operand name, which weight dims are [rows, reduction]) for the weight-shaped dims;
# see recipe.py: fprop A = x [M,K], B = W [N,K]; dgrad A = dy [M,N], B = Wᵀ [K,N]; wgrad A = dyᵀ [N,M],
# B = xᵀ [K,M]. "M" is the token count, known only at run time.
_OPERAND_DIMS = {
    ("fprop", 0): ("x", "M", "K"),
    ("fprop", 1): ("W", "N", "K"),
    ("dgrad", 0): ("dy", "M", "N"),
    ("dgrad", 1): ("Wᵀ", "K", "N"),
    ("wgrad", 0): ("dyᵀ", "N", "M"),
    ("wgrad", 1): ("xᵀ", "K", "M"),
}


def _dim_problems(recipe: QuantRecipe, sizes: dict[str, int]) -> list[str]:
    problems = []
    for role in GEMM_ROLES:
        g = getattr(recipe, role)
        for i, cast in enumerate((g.a, g.b)):
            if not cast.quantized or cast.block is None:
                continue
            name, rows, red = _OPERAND_DIMS[(role, i)]
            for dim, blk in ((red, cast.block[1]), (rows, cast.block[0])):
                if blk > 1 and dim in sizes and sizes[dim] % blk != 0:
                    problems.append(
                        f"{role} {name}: {dim}={sizes[dim]} is not a multiple of {blk} "
                        f"({cast.format} {cast.block[0]}x{cast.block[1]} blocks)"
                    )
    return list(dict.fromkeys(problems))


def recipe_shape_problems(recipe: QuantRecipe, out_features: int, in_features: int) -> list[str]:
    """Why ``recipe`` cannot run a (per-rank) weight [N=out_features, K=in_features]; empty if it can."""
    return _dim_problems(recipe, {"N": out_features, "K": in_features})


def token_block(recipe: QuantRecipe) -> int:
    """The multiple the token count M must be (the wgrad operands are blocked along M)."""
    b = 1
    for cast in (recipe.wgrad.a, recipe.wgrad.b):
        if cast.quantized and cast.block is not None:
            b = max(b, cast.block[1])
    return b


def check_recipe_shape(recipe: QuantRecipe, out_features: int, in_features: int, layer_name: str) -> None:
    """ValueError naming the layer, the shape and the fix when ``recipe`` cannot take the weight."""
    problems = recipe_shape_problems(recipe, out_features, in_features)
    if problems:
        raise ValueError(
            f"layer {layer_name or '<unnamed>'!r}: recipe {recipe.name!r} cannot take its weight "
            f"[N={out_features}, K={in_features}] (per tensor-parallel rank): " + "; ".join(problems) + ". "
            f"Keep this layer in bf16 with a precision rule (precision.rules: [{{roles: <its role>, "
            f"blocks: <its block>, recipe: bf16}}]) or change the model/TP sizes so the dims divide."
        )


def recipe_padding(recipe: QuantRecipe, out_features: int, in_features: int) -> tuple[int, int]:
    """Zeros to append to N and K so that every quantized operand's block divides its dims.

    A weight whose N or K is not a multiple of a block (e.g. Mamba's in_proj, whose width ends with one
    column per head) runs with x, W and b zero-padded along K and N, and the padded output columns dropped.
    This is exact: appended zeros change no amax and no sum, so every partial block is quantized with the
    scale of its real elements (as Transformer Engine treats a trailing partial block), and the gradients
    of the padding are discarded by autograd. Under tensor parallelism each rank pads its own shard, so a
    padded layer's block boundaries, and hence its numerics, depend on the TP size; unpadded layers do not.
    """
    need = {"N": 1, "K": 1}
    for role in GEMM_ROLES:
        g = getattr(recipe, role)
        for i, cast in enumerate((g.a, g.b)):
            if not cast.quantized or cast.block is None:
                continue
            _, rows, red = _OPERAND_DIMS[(role, i)]
            for dim, blk in ((red, cast.block[1]), (rows, cast.block[0])):
                if dim in need:
                    need[dim] = max(need[dim], blk)  # blocks are powers of two: the max is the lcm
    return (-out_features % need["N"], -in_features % need["K"])


class _QuantLayer:
    """What both layers share: the recipe, its LinearContext, telemetry (mixed into the megatron class)."""

    layer_name: str
    lctx: LinearContext
    quant_telemetry: LayerTelemetry

    def _init_quant(self, recipe: QuantRecipe, layer_name: str, seed: int, out_f: int, in_f: int,
                    block: int | None, role: str) -> None:
        if not isinstance(recipe, QuantRecipe):
            raise TypeError(f"layer {layer_name!r}: recipe must be a QuantRecipe, got {type(recipe).__name__}")
        if not isinstance(layer_name, str):
            raise TypeError(f"layer_name must be a str, got {type(layer_name).__name__}")
        self.layer_name = layer_name
        self.block, self.role, self.base_recipe = block, role, recipe
        self._weight_shape = (out_f, in_f)
        group = self.tp_group if get_pg_size(self.tp_group) > 1 else None
        self.lctx = LinearContext(recipe=recipe, seed=layer_stream(seed, layer_name), amax_group=group,
                                  weight_pad=recipe_padding(recipe, out_f, in_f))
        self.quant_telemetry = LayerTelemetry()
        self.weight_cache_enabled = False  # see set_weight_cache

    @property
    def recipe(self) -> QuantRecipe:
        return self.lctx.recipe

    def set_recipe(self, recipe: QuantRecipe) -> None:
        """Run ``recipe`` from the next forward on (parameters untouched; the cached weight copies dropped)."""
        if not isinstance(recipe, QuantRecipe):
            raise TypeError(f"layer {self.layer_name!r}: recipe must be a QuantRecipe, got {type(recipe).__name__}")
        self.lctx.weight_pad = recipe_padding(recipe, *self._weight_shape)
        self.lctx.recipe = recipe
        self.lctx.weight_cache.clear()

    def set_telemetry(self, enabled: bool) -> None:
        """Record operand statistics on every GEMM from now on (True) or stop (False: zero cost)."""
        self.lctx.telemetry = self.quant_telemetry if enabled else None
        if not enabled:
            self.quant_telemetry.clear_stats()

    def _check_tokens(self, x: torch.Tensor) -> None:
        m = x.numel() // x.shape[-1] if x.shape[-1] else 0
        b = token_block(self.lctx.recipe)
        if m % b != 0:
            raise ValueError(
                f"layer {self.layer_name or '<unnamed>'!r}: recipe {self.lctx.recipe.name!r} quantizes the "
                f"weight-gradient operands in blocks of {b} along the tokens, but this batch has "
                f"M={m} tokens (input shape {tuple(x.shape)}): make sequence length x micro-batch size a "
                f"multiple of {b}, or keep this layer in bf16 with a precision rule"
            )

    def _forward_impl(self, input, weight, *args, **kwargs):
        """megatron's GEMM slot: the stock implementation for a bf16 recipe, else :meth:`_quantized_forward`
        (each layer's own communication around :meth:`_quant_gemm`); telemetry probes on both paths."""
        tel = self.quant_telemetry
        input = probe_input_grad(input, tel)
        if self.lctx.recipe.is_bf16:
            y = super()._forward_impl(input, weight, *args, **kwargs)
        else:
            y = self._quantized_forward(input, weight, **forward_impl_kwargs(kwargs))
        tel.check_output(y)
        return y

    def _quant_gemm(self, x: torch.Tensor, weight: torch.Tensor, bias, grad_output_buffer) -> torch.Tensor:
        if grad_output_buffer is not None:
            raise ValueError(
                f"layer {self.layer_name!r}: deferred embedding wgrad (defer_embedding_wgrad_compute) is not "
                f"supported by the quantized layers: turn it off or keep this layer in bf16"
            )
        self._check_tokens(x)
        if not self.weight_cache_enabled:
            self.lctx.weight_cache.clear()
        pn, pk = self.lctx.weight_pad
        if not (pn or pk):
            return quantized_linear(x, weight, bias, self.lctx)
        # a dim that is not a multiple of its block: zero-pad it to the next multiple (see recipe_padding); the
        # weight is padded inside the layer's weight cache, so a cached weight is not padded again
        n = weight.shape[0]
        x = torch.nn.functional.pad(x, (0, pk))
        bias = None if bias is None else torch.nn.functional.pad(bias, (0, pn))
        y = quantized_linear(x, weight, bias, self.lctx)
        # the real columns as a contiguous tensor: the copy its consumers make anyway (Mamba's mixer merges (s, b)
        # into rows, a tensor-parallel reduction needs one buffer), and the layer's non-finite check then runs as
        # its kernel (which takes one span of memory) instead of the reference's torch ops on a strided view
        return y[..., :n].contiguous() if pn else y


class QuantColumnParallelLinear(_QuantLayer, ColumnParallelLinear):
    """megatron's ColumnParallelLinear (weight [N/tp, K]) with its GEMMs under ``recipe``."""

    def __init__(
        self,
        input_size,
        output_size,
        *,
        config,
        init_method,
        recipe: QuantRecipe = BF16,
        layer_name: str = "",
        seed: int = 0,
        block: int | None = None,
        role: str = "",
        **kwargs,
    ):
        if getattr(config, "gradient_accumulation_fusion", False):
            install_wgrad_accumulation()  # megatron's own check at construction needs the stand-in
        ColumnParallelLinear.__init__(self, input_size, output_size, config=config, init_method=init_method,
                                      **kwargs)
        self._init_quant(recipe, layer_name, seed, self.output_size_per_partition, self.input_size, block, role)

    def _quantized_forward(self, input, weight, *, bias, gradient_accumulation_fusion, allreduce_dgrad,
                           sequence_parallel, grad_output_buffer=None, wgrad_deferral_limit=None,
                           tp_group=None):
        self.lctx.wgrad_fusion = bool(gradient_accumulation_fusion)
        group = tp_group if tp_group is not None else self.tp_group
        if sequence_parallel:
            # forward: all-gather the sequence shards; backward: reduce-scatter the input gradient
            x = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=group)
        elif allreduce_dgrad:
            # forward: identity; backward: all-reduce the input gradient
            x = copy_to_tensor_model_parallel_region(input, group=group)
        else:
            x = input
        return self._quant_gemm(x, weight, bias, grad_output_buffer)


class QuantRowParallelLinear(_QuantLayer, RowParallelLinear):
    """megatron's RowParallelLinear (weight [N, K/tp]) with its GEMMs under ``recipe``."""

    def __init__(
        self,
        input_size,
        output_size,
        *,
        config,
        init_method,
        recipe: QuantRecipe = BF16,
        layer_name: str = "",
        seed: int = 0,
        block: int | None = None,
        role: str = "",
        **kwargs,
    ):
        if getattr(config, "gradient_accumulation_fusion", False):
            install_wgrad_accumulation()
        RowParallelLinear.__init__(self, input_size, output_size, config=config, init_method=init_method,
                                   **kwargs)
        self._init_quant(recipe, layer_name, seed, self.output_size, self.input_size_per_partition, block, role)

    def _quantized_forward(self, input, weight, *, bias, grad_output_buffer=None, allreduce_dgrad=False,
                           sequence_parallel=False, gradient_accumulation_fusion=False, **_unused):
        # megatron calls this with allreduce_dgrad=False, sequence_parallel=False, tp_group=None: the output
        # reduction follows in RowParallelLinear.forward; the amax group is self.tp_group
        assert not allreduce_dgrad and not sequence_parallel
        self.lctx.wgrad_fusion = bool(gradient_accumulation_fusion)
        return self._quant_gemm(input, weight, bias, grad_output_buffer)


def quant_layers(model: torch.nn.Module):
    """Every quantized layer in ``model`` (module tree order)."""
    return [m for m in model.modules() if isinstance(m, _QuantLayer)]


def set_weight_cache(model: torch.nn.Module, enabled: bool) -> None:
    """Let every quantized layer keep its quantized weight between forwards (True) or re-quantize it in
    every forward (False, the default). With the cache on, call :func:`invalidate_weight_caches` after every
    optimizer step."""
    for m in quant_layers(model):
        m.weight_cache_enabled = enabled
        m.lctx.weight_cache.clear()


def invalidate_weight_caches(model: torch.nn.Module) -> None:
    """Drop every layer's cached quantized weight copies: call after each optimizer step when the weight
    cache is on (:func:`set_weight_cache`).

    The cache (``WeightCache``) notices an update made through the parameter itself (``torch.optim`` steps
    bump its version counter), but NOT a write through ``param.data`` or through a buffer the parameter
    is a view of, which is how megatron's mixed-precision and distributed optimizers copy the updated main
    weights into the model: without this call the layers would keep quantizing from stale copies.
    """
    for m in quant_layers(model):
        m.lctx.weight_cache.clear()


def set_sr_streams(model: torch.nn.Module, run_seed: int) -> int:
    """Give every quantized layer of ``model`` the stochastic-rounding stream it would have in a model built
    with run seed ``run_seed`` (``nvfp4_train.models.build.build_model(..., seed=run_seed)``: ``layer_stream(block_seed(
    run_seed, block, ROLE_SLOTS[role]), layer_name)``, see ``kernels/sr_key.py``) and restart its call counter
    (``lctx.calls = 0``; the cached weight copies are dropped): the next forward draws the rounding bits of that
    freshly built model's first forward. Parameters and recipes are untouched. Returns the number of layers set.

    A layer must carry the global ``block`` and ``role`` the model builder gives it; a layer built on its own
    (``block`` None) has no run-seed stream and is refused."""
    if not isinstance(run_seed, int) or isinstance(run_seed, bool) or run_seed < 0:
        raise ValueError(f"run_seed={run_seed!r} must be a non-negative int")
    layers = quant_layers(model)
    for m in layers:
        if m.block is None or m.role not in ROLE_SLOTS:
            raise ValueError(f"layer {m.layer_name or '<unnamed>'!r} has no global block index and role "
                             f"(block={m.block!r}, role={m.role!r}): only layers built by the model have a "
                             f"run-seed stream")
    for m in layers:
        m.lctx.seed = layer_stream(block_seed(run_seed, m.block, ROLE_SLOTS[m.role]), m.layer_name)
        m.lctx.calls = 0
        m.lctx.weight_cache.clear()  # a cached weight copy was rounded with the old stream
    return len(layers)
