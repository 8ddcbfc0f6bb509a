"""The hybrid Mamba-Transformer on megatron-core: block specs, the stack of one pipeline stage, the model.

The model is megatron-core's ``MambaModel`` (embedding, optional RoPE, output layer, loss, pipeline hooks)
with its ``mamba_stack_spec`` slot filled by :class:`HybridStack`, our stack of the blocks of one pipeline
stage. Each block is built from a ``ModuleSpec``:

==========  =========================================================================================
``*``        megatron's ``TransformerLayer`` with ``input_layernorm`` + ``SelfAttention`` (causal; its
             core attention through PyTorch SDPA, :mod:`nvfp4_train.models.attention`) and no MLP
``-``        megatron's ``TransformerLayer`` with ``pre_mlp_layernorm`` + ``MLP`` and no attention
``M``        our :class:`nvfp4_train.models.mamba.mixer.MambaLayer` (RMSNorm + Mamba-2 mixer)
==========  =========================================================================================

Every linear slot (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``, ``in_proj``,
``out_proj``) is our quantized column/row-parallel layer, with the recipe the layer precision map resolved
for its GLOBAL block index and role baked into the spec before anything is built. Layer names, and so
checkpoint keys, are megatron's (``decoder.layers.<global block>.self_attention.linear_qkv.weight``, ...);
they never encode precision, so precision can change at resume.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.mamba.mamba_model import MambaModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from nvfp4_train.kernels._dispatch import use_triton
from nvfp4_train.kernels.fused.cross_entropy import vocab_parallel_cross_entropy
from nvfp4_train.kernels.sr_key import ROLE_SLOTS, block_seed
from nvfp4_train.mcore_compat.rope import rotary_follows_model
from nvfp4_train.models.config import ModelConfig
from nvfp4_train.models.activation import checked_squared_relu_fits, install_checked_squared_relu
from nvfp4_train.models.attention import SDPAttention
from nvfp4_train.models.layers import RMSNorm, linear_spec
from nvfp4_train.models.mamba.mixer import MambaLayer, MambaLayerSubmodules, MambaMixer, MambaMixerSubmodules
from nvfp4_train.models.pattern import ATTENTION, MAMBA, MLP as MLP_KIND, HybridPattern
from nvfp4_train.precision.layer_map import LayerPrecisionMap

__all__ = ["block_spec", "HybridStack", "HybridModel"]


def block_spec(kind: str, block: int, model_cfg: ModelConfig, layer_map: LayerPrecisionMap, seed: int = 0,
               fused_mamba: bool = False) -> ModuleSpec:
    """The ``ModuleSpec`` of global block ``block`` of ``kind``, its linear layers' recipes resolved.
    ``fused_mamba``: a Mamba mixer's conv + scan + gated norm as one op on CUDA (``fusion.mamba``)."""

    def lin(kind_: str, role: str) -> ModuleSpec:
        # the stochastic-rounding seed of this layer: kernels/sr_key.py (one key function for the run)
        return linear_spec(kind_, layer_map.recipe(block, role), f"blocks.{block}.{role}",
                           block_seed(seed, block, ROLE_SLOTS[role]), block=block, role=role)

    if kind == ATTENTION:
        attention = ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=lin("column", "attention.qkv"),
                core_attention=SDPAttention,
                linear_proj=lin("row", "attention.proj"),
                q_layernorm=IdentityOp,
                k_layernorm=IdentityOp,
            ),
        )
        return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm, self_attention=attention, self_attn_bda=get_bias_dropout_add))
    if kind == MLP_KIND:
        mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=lin("column", "mlp.fc1"), linear_fc2=lin("row", "mlp.fc2")))
        return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=RMSNorm, mlp=mlp, mlp_bda=get_bias_dropout_add))
    if kind == MAMBA:
        mixer = ModuleSpec(
            module=MambaMixer,
            params=dict(
                num_heads=model_cfg.mamba_num_heads, head_dim=model_cfg.mamba_head_dim,
                num_groups=model_cfg.mamba_num_groups, state_dim=model_cfg.mamba_state_dim,
                conv_kernel=model_cfg.mamba_conv_kernel, conv_bias=model_cfg.mamba_conv_bias,
                chunk_size=model_cfg.mamba_chunk_size, norm_epsilon=model_cfg.norm_epsilon, fused=fused_mamba,
            ),
            submodules=MambaMixerSubmodules(in_proj=lin("column", "mamba.in_proj"),
                                            out_proj=lin("row", "mamba.out_proj")),
        )
        return ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(norm=RMSNorm, mixer=mixer))
    raise ValueError(f"unknown block kind {kind!r}")


class HybridStack(MegatronModule):
    """The blocks of one pipeline stage (+ the final norm on the last stage), ``[s, b, h] -> [s, b, h]``.

    Built by megatron's ``MambaModel`` through its ``mamba_stack_spec`` slot (it passes ``pre_process``,
    ``post_process``, ``pg_collection`` and its hybrid-ratio arguments, which our explicit pattern replaces).
    ``fused_mamba``: ``fusion.mamba``; ``fused_activation``: ``fusion.activation``, every MLP's squared ReLU runs
    fc1's output check and fc2's input-gradient check in its kernels (``nvfp4_train.models.activation``; a model
    whose MLP adds a bias or gates keeps megatron's activation).
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        model_cfg: ModelConfig,
        layer_map: LayerPrecisionMap,
        pattern: HybridPattern,
        seed: int = 0,
        fused_mamba: bool = False,
        fused_activation: bool = False,
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection: ProcessGroupCollection | None = None,
        **_megatron_kwargs,
    ) -> None:
        super().__init__(config)
        if pg_collection is None:
            raise ValueError("HybridStack needs pg_collection (process groups are passed explicitly)")
        self.pre_process, self.post_process = pre_process, post_process
        stage = pg_collection.pp.rank()
        if pattern.num_stages != pg_collection.pp.size():
            raise ValueError(f"pattern {pattern.text!r} has {pattern.num_stages} stages, pipeline size is "
                             f"{pg_collection.pp.size()}")
        self.offset = pattern.stage_offsets[stage]
        self.block_kinds = pattern.stages[stage]
        self.layers = torch.nn.ModuleList(
            build_module(block_spec(kind, self.offset + i, model_cfg, layer_map, seed, fused_mamba), config=config,
                         layer_number=i + 1, pg_collection=pg_collection)
            for i, kind in enumerate(self.block_kinds)
        )
        if fused_activation and model_cfg.activation == "squared_relu" and checked_squared_relu_fits(config):
            for kind, layer in zip(self.block_kinds, self.layers):
                if kind == MLP_KIND:
                    install_checked_squared_relu(layer.mlp)
        self.final_norm = RMSNorm(config, config.hidden_size, config.layernorm_epsilon) if post_process else None
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        self.input_tensor = input_tensor

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, **_unused) -> torch.Tensor:
        if not self.pre_process:
            hidden_states = self.input_tensor
        for layer in self.layers:
            out = layer(hidden_states=hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
            hidden_states = out[0] if isinstance(out, tuple) else out
        if self.final_norm is not None:
            hidden_states = self.final_norm(hidden_states)
        return hidden_states

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Checkpoint keys with GLOBAL block indices (``layers.<global>.``), so pipeline layouts reshard."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import sharded_state_dict_default

        sd = {}
        for i, layer in enumerate(self.layers):
            local, glob = f"{prefix}layers.{i}.", f"{prefix}layers.{self.offset + i}."
            layer_sd = layer.sharded_state_dict(prefix=local, sharded_offsets=(), metadata=metadata)
            replace_prefix_for_sharding(layer_sd, local, glob)
            sd.update(layer_sd)
        if self.final_norm is not None:
            sd.update(sharded_state_dict_default(self.final_norm, f"{prefix}final_norm.", sharded_offsets, metadata))
        return sd


class HybridModel(MambaModel):
    """megatron-core's ``MambaModel`` with our stack; adds the hooks the trainer uses."""

    model_cfg: ModelConfig

    def _apply(self, fn, *args, **kwargs):
        """``Module.to``/``cuda``/``cpu``, and the rotary embedding's frequencies follow the parameters
        (``nvfp4_train.mcore_compat.rope.rotary_follows_model``: a model on the CPU of a machine with a GPU runs
        there)."""
        module = super()._apply(fn, *args, **kwargs)
        rope = getattr(self, "rotary_pos_emb", None)
        param = next(self.parameters(), None)
        if rope is not None and param is not None:
            rotary_follows_model(rope, param.device)
        return module

    def precision_layers(self) -> Iterator[tuple[str, torch.nn.Module]]:
        """``(name, layer)`` of every quantized linear layer (each has ``set_recipe``/``recipe``)."""
        for name, module in self.named_modules():
            if hasattr(module, "set_recipe") and hasattr(module, "layer_name"):
                yield name, module

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token loss [b, s] fp32 of labels [b, s] and this rank's logits [s, b, V_local] (megatron-core's
        signature, 0.16 to 0.19). With ``config.cross_entropy_loss_fusion`` and logits its Triton kernels take
        (CUDA; CPU under ``TRITON_INTERPRET=1``): the fused vocab-parallel cross-entropy
        (``nvfp4_train.kernels.fused.cross_entropy``) over the logits in their own dtype, on the model's TP group;
        otherwise megatron-core's own loss (on a CPU the fused kernel's blocked reference would be ~4x slower than
        megatron's vectorised torch ops, and it computes the same loss within the bound of
        ``tests/kernels/test_cross_entropy.py``)."""
        if not self.config.cross_entropy_loss_fusion or not use_triton(logits):
            return super().compute_language_model_loss(labels, logits)
        labels = labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b], as megatron-core
        # The gradient overwrites the logits (no second [s, b, V_local] buffer): safe because nothing reads
        # them after this loss's backward: the output layer saves its input and weight, not its output, and the
        # model returns the loss, not the logits. (A later read by autograd raises: the version is bumped.)
        loss = vocab_parallel_cross_entropy(logits, labels, self.tp_group, inplace_backward=True)
        return loss.transpose(0, 1).contiguous()  # [s, b] -> [b, s]

    def forward_cached(self, input_ids: torch.Tensor, state) -> torch.Tensor:
        """Logits [b, vocab] at the last of ``input_ids`` [b, s], the positions that follow the ``state.length``
        ones ``state`` (a :class:`nvfp4_train.models.decode.DecodeState`) holds; ``state`` then holds them too.
        Incremental decoding: the prompt in one call, then one token per call. The same embedding, blocks and output
        layer as :meth:`forward` (RoPE at the positions' absolute indices; megatron-core 0.19's ``_scale_logits`` is
        the identity for our configs, which never set ``use_mup``). Eval mode, TP = PP = 1."""
        from nvfp4_train.models.decode import attached

        if self.training:
            raise ValueError("forward_cached is for inference: call model.eval() first")
        if not (self.pre_process and self.post_process) or self.config.tensor_model_parallel_size != 1:
            raise ValueError("forward_cached needs the whole model in one process (TP = PP = 1)")
        b, s = input_ids.shape
        start = state.length
        if s < 1:
            raise ValueError("forward_cached needs at least one new position (input_ids of shape [batch, >= 1])")
        if start + s > state.max_length:
            raise ValueError(f"{s} new positions after {start} exceed the decode state's {state.max_length}")
        positions = torch.arange(start, start + s, device=input_ids.device)[None].expand(b, s)
        hidden = self.embedding(input_ids=input_ids, position_ids=positions)  # [s, b, h]
        rotary = self.rotary_pos_emb(start + s)[start:] if self.position_embedding_type == "rope" else None
        with attached(self, state):
            hidden = self.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rotary)
        state.length = start + s
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden[-1:], weight=weight)
        return logits[0]

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward) of the whole model, all stages."""
        from nvfp4_train.models.flops import training_flops_per_token

        return training_flops_per_token(self.model_cfg, seq_length)
