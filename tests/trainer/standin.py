"""A stand-in model for the trainer tests: megatron-core's GPTModel with the local (non-TE) layer spec,
sized from ``cfg.model`` (hidden, layers, heads, ffn, vocab). Use it with
``experiment.model_provider=tests.trainer.standin:gpt_provider``.

``STANDIN_NAN="loss:2,3"`` makes the loss of optimizer steps 2 and 3 (0-based) NaN; ``"grad:2"`` keeps the
loss finite but makes the embedding gradient NaN at step 2 (the optimizer's found-inf path).
"""

from __future__ import annotations

import os

import torch


def gpt_provider(cfg):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    m = cfg.model
    tconfig = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups, kv_channels=m.kv_channels,
        init_method_std=m.init_method_std, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=cfg.parallel.tp, pipeline_model_parallel_size=cfg.parallel.pp,
        sequence_parallel=cfg.parallel.sequence_parallel, add_bias_linear=m.add_bias_linear)
    nan_kind, _, nan_steps = os.environ.get("STANDIN_NAN", "").partition(":")
    bad = {int(s) for s in nan_steps.split(",") if s}
    dp = int(os.environ.get("WORLD_SIZE", "1")) // (cfg.parallel.tp * cfg.parallel.pp)
    num_micro = cfg.schedule.global_batch_size // (cfg.schedule.micro_batch_size * dp)

    def provider(pre_process: bool, post_process: bool):
        model = GPTModel(config=tconfig, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=m.vocab_size,
                         max_sequence_length=cfg.data.seq_length, pre_process=pre_process, post_process=post_process,
                         share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
                         position_embedding_type="rope")
        model = model.to(torch.bfloat16)
        if bad:
            calls = {"n": 0}

            def hook(mod, _inputs, output):
                if not mod.training:
                    return output
                step = calls["n"] // num_micro
                calls["n"] += 1
                if step not in bad:
                    return output
                if nan_kind == "loss":
                    return output * float("nan")
                if nan_kind == "grad":
                    return nan_grad(output)
                raise ValueError(f"STANDIN_NAN kind {nan_kind!r} is not loss or grad")

            model.register_forward_hook(hook)
        return model

    return provider


class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def nan_grad(output):
    """``output`` unchanged forward; its gradient NaN in backward (a fault injected by the tests)."""
    return _NanGrad.apply(output)
