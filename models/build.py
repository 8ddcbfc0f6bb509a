"""Build the hybrid model of one pipeline stage on megatron-core: ``transformer_config`` maps our
:class:`~nvfp4_train.models.config.ModelConfig` (+ parallel sizes) to megatron's ``TransformerConfig``; ``build_model``
builds :class:`~nvfp4_train.models.hybrid.HybridModel` with every linear layer's recipe resolved by the layer
precision map. This module and ``nvfp4_train.models.hybrid`` are the only places that talk to megatron-core's model
classes (a megatron upgrade touches them and nothing else)."""

from __future__ import annotations

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from nvfp4_train.models.config import ModelConfig
from nvfp4_train.mcore_compat.embedding import rows_into_main_grad
from nvfp4_train.models.fusion import FusionConfig
from nvfp4_train.models.hybrid import HybridModel, HybridStack
from nvfp4_train.models.layers import RMSNorm, hand_input_grad_check_to_norm
from nvfp4_train.models.pattern import HybridPattern
from nvfp4_train.mcore_compat.transformer import no_cuda_graph_kwargs
from nvfp4_train.mcore_compat.rope import install_fused_qkv_rope, install_fused_rope
from nvfp4_train.mcore_compat.wgrad import install_wgrad_accumulation
from nvfp4_train.precision.layer_map import LayerPrecisionMap

__all__ = ["transformer_config", "stage_pattern", "build_model"]


def _squared_relu(x: torch.Tensor) -> torch.Tensor:
    """megatron-core's ``squared_relu`` without its ``torch.compile``: without CUDA, compiling this one
    elementwise op costs each process 5-10 s of inductor work (the same values: relu is exact, the square
    rounds once either way)."""
    return torch.pow(torch.nn.functional.relu(x), 2)


def _activation(name: str):
    import torch.nn.functional as F

    if name == "squared_relu" and torch.cuda.is_available():
        from megatron.core.activations import squared_relu
    else:
        squared_relu = _squared_relu
    return {"squared_relu": (squared_relu, False), "swiglu": (F.silu, True), "gelu": (F.gelu, False)}[name]


def stage_pattern(model_cfg: ModelConfig, pp: int) -> HybridPattern:
    """The pattern split into ``pp`` stages: as written when it has ``|`` boundaries (then their count must
    match), else split into near-equal block counts."""
    pattern = model_cfg.hybrid_pattern()
    if pp > 1 and pattern.num_stages == 1:
        return HybridPattern.parse(pattern.even_split(pp), num_layers=model_cfg.num_layers, pp_size=pp)
    return model_cfg.hybrid_pattern(pp_size=pp)


def transformer_config(
    model_cfg: ModelConfig,
    *,
    tp: int = 1,
    pp: int = 1,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.bfloat16,
    use_cpu_initialization: bool | None = None,
    fusion: FusionConfig | None = None,
) -> TransformerConfig:
    """megatron-core's ``TransformerConfig`` for ``model_cfg`` (dropout 0, no Transformer Engine: our quantized
    layers replace its linear layers). ``fusion``: the fused kernels to run (``nvfp4_train.models.fusion``), set as
    megatron's own switches (``apply_rope_fusion``, ``cross_entropy_loss_fusion``, ``gradient_accumulation_fusion``)
    with our kernels installed behind them; None: none (megatron's unfused paths, e.g. for a model trained without
    megatron's DDP, whose gradient buffers the fused weight gradient needs)."""
    fusion = fusion if fusion is not None else FusionConfig.all_off()
    if fusion.wgrad_accumulation:
        install_wgrad_accumulation()
    has_rope = model_cfg.position_embedding == "rope"
    rope = fusion.rope and has_rope
    if rope:
        install_fused_rope()  # before TransformerConfig: its validation refuses apply_rope_fusion without a kernel
    qkv_rope = fusion.qkv_rope and has_rope  # megatron asserts the path is taken once the switch is on
    if qkv_rope:
        install_fused_qkv_rope()
    if sequence_parallel and tp == 1:
        raise ValueError("parallel.sequence_parallel=true needs parallel.tp > 1 (it shards the sequence over TP)")
    act, gated = _activation(model_cfg.activation)
    stages = stage_pattern(model_cfg, pp).stage_sizes()
    first = last = None
    if pp > 1 and len(set(stages)) > 1:  # megatron knows uneven first/last stages; middle ones must agree
        first, last = stages[0], stages[-1]
        if len(set(stages[1:-1])) > 1:
            raise ValueError(f"pipeline stages of {stages} blocks: megatron-core supports a different first and "
                             f"last stage only; make the middle stages equal")
    heads = model_cfg.num_attention_heads or 1  # a pattern without attention still needs a valid config
    cfg = TransformerConfig(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        ffn_hidden_size=model_cfg.ffn_hidden_size or 4 * model_cfg.hidden_size,
        num_attention_heads=heads,
        num_query_groups=model_cfg.num_query_groups or heads,
        kv_channels=model_cfg.kv_channels or model_cfg.hidden_size // heads,
        activation_func=act,
        gated_linear_unit=gated,
        normalization="RMSNorm",
        layernorm_epsilon=model_cfg.norm_epsilon,
        add_bias_linear=model_cfg.add_bias_linear,
        init_method_std=model_cfg.init_method_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=rope,
        fused_single_qkv_rope=qkv_rope,
        cross_entropy_loss_fusion=fusion.cross_entropy,  # HybridModel.compute_language_model_loss: our kernel
        gradient_accumulation_fusion=fusion.wgrad_accumulation,
        persist_layer_norm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=(not torch.cuda.is_available()) if use_cpu_initialization is None
        else use_cpu_initialization,
        mamba_state_dim=model_cfg.mamba_state_dim,
        mamba_head_dim=model_cfg.mamba_head_dim or 64,
        mamba_num_groups=model_cfg.mamba_num_groups,
        mamba_num_heads=model_cfg.mamba_num_heads,
        **no_cuda_graph_kwargs(TransformerConfig),
    )
    return cfg


def build_model(
    model_cfg: ModelConfig,
    layer_map: LayerPrecisionMap,
    *,
    config: TransformerConfig,
    pre_process: bool = True,
    post_process: bool = True,
    seed: int = 0,
    seq_length: int = 4096,
    pg_collection: ProcessGroupCollection | None = None,
    fusion: FusionConfig | None = None,
) -> HybridModel:
    """The model of this rank's pipeline stage (megatron's parallel state must be initialised).

    ``layer_map`` must be resolved for ``model_cfg.pattern``; ``seed`` seeds the stochastic-rounding streams of
    the quantized layers (weights are initialised from the RNG state at call time, as megatron does). ``fusion``:
    the fusions the model builds in (``fusion.mamba``: the Mamba mixers' fused op; ``fusion.activation``: the MLPs'
    squared ReLU with two of the non-finite checks in its kernels; ``fusion.rms_norm``: every RMSNorm's backward as
    one kernel, a block's norm running the input-gradient check of the linear layer it feeds; the others are ``config``'s megatron switches, see :func:`transformer_config`); None: none.
    """
    if layer_map.num_blocks != model_cfg.num_layers:
        raise ValueError(f"layer precision map covers {layer_map.num_blocks} blocks, model has {model_cfg.num_layers}")
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    pattern = stage_pattern(model_cfg, config.pipeline_model_parallel_size)
    stack = ModuleSpec(module=HybridStack, params=dict(model_cfg=model_cfg, layer_map=layer_map, pattern=pattern,
                                                       seed=seed, fused_mamba=bool(fusion and fusion.mamba),
                                                       fused_activation=bool(fusion and fusion.activation)))
    model = HybridModel(
        config=config,
        mamba_stack_spec=stack,
        vocab_size=model_cfg.vocab_size,
        max_sequence_length=seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not model_cfg.untie_embeddings_and_output_weights,
        position_embedding_type=model_cfg.position_embedding,
        rotary_base=int(model_cfg.rotary_base),
        pg_collection=pg_collection,
    )
    model.model_cfg = model_cfg
    if fusion is not None and fusion.rms_norm:
        for module in model.modules():  # every block's norm and the final norm
            if isinstance(module, RMSNorm):
                module.fused_backward = True
        for layer in model.decoder.layers:  # a block's norm feeds one linear layer: its backward checks that input
            attention, mlp, mixer = (getattr(layer, n, None) for n in ("self_attention", "mlp", "mixer"))
            for norm_name, consumer in (("input_layernorm", getattr(attention, "linear_qkv", None)),
                                        ("pre_mlp_layernorm", getattr(mlp, "linear_fc1", None)),
                                        ("norm", getattr(mixer, "in_proj", None))):
                if consumer is not None:
                    hand_input_grad_check_to_norm(getattr(layer, norm_name, None), consumer)
    if fusion is not None and fusion.wgrad_accumulation and pre_process:
        # the word embedding's gradient rows into main_grad too (no [vocab, hidden] gradient, no full-table add)
        rows_into_main_grad(model.embedding.word_embeddings)
    return model
