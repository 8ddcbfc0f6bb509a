"""Which fused kernels the model's step runs (the ``fusion`` config section).

Each switch names one fusion of the step's non-GEMM work; the unfused arithmetic stays the reference it is
tested against. Four of them are megatron-core's own ``TransformerConfig`` switches, which the model builder
sets from here (``nvfp4_train.models.build.transformer_config``); megatron's code paths then call our kernels
(``nvfp4_train.mcore_compat.fusions``):

==========================  ==================================  ============================================
field                       megatron-core's switch              what runs instead of the unfused ops
==========================  ==================================  ============================================
``rope``                    ``apply_rope_fusion``               one kernel per direction applies the rotary
                                                                embedding (no concatenations); bitwise the
                                                                unfused bf16 arithmetic
``cross_entropy``           ``cross_entropy_loss_fusion``       vocab-parallel cross-entropy that reads the
                                                                bf16 logits once per direction (fp32 math)
``qkv_rope``                ``fused_single_qkv_rope``           q and k rotated where the qkv projection wrote
                                                                them, the query not copied to its own layout
                                                                first, the three gradients written into one
                                                                tensor (no concatenation); bitwise the split
                                                                path
``wgrad_accumulation``      ``gradient_accumulation_fusion``    each weight gradient GEMM adds into the fp32
                                                                ``main_grad`` in its epilogue (beta = 1); the
                                                                word embedding adds its gradient rows into it
``mamba``                   --                                  Mamba-2's conv + scan + gated norm as one
                                                                autograd op of mamba-ssm's and causal-conv1d's
                                                                kernels in megatron's sequence-first layout
                                                                (CUDA; ``models/mamba/ops.py``)
``activation``              --                                  the MLP's squared ReLU as one kernel per
                                                                direction that also runs fc1's output check
                                                                and fc2's input-gradient check (non-finite),
                                                                reading each tensor once, and computes the
                                                                amax fc2's / fc1's quantizer would measure;
                                                                bitwise megatron's ``squared_relu`` and its
                                                                autograd (``models/activation.py``)
``rms_norm``                --                                  RMSNorm's backward as one kernel: dx and the
                                                                weight gradient's partials in one pass over
                                                                x and dy (``kernels/fused/rms_norm.py``), with
                                                                the non-finite check of the input gradient of
                                                                the linear layer the norm feeds
==========================  ==================================  ============================================

``docs/numerics.md`` ("Fused step") states each fusion's arithmetic against the unfused path.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["FusionConfig"]


@dataclass(kw_only=True)
class FusionConfig:
    """Fused kernels of the training step (the ``fusion`` section), each on by default; ``false`` runs the unfused
    reference arithmetic (for numerics comparisons and benchmarks)."""

    rope: bool = True
    """Rotary embedding in one kernel per direction (bitwise the unfused arithmetic)."""
    qkv_rope: bool = True
    """megatron's fused qkv rotary path: q and k rotated where the qkv projection wrote them (no copy of the query
    to [s, b, heads, d] before the rotary embedding), their gradients and v's written into one tensor (no
    concatenation after it); bitwise the split path. Models with the rotary embedding only."""
    cross_entropy: bool = True
    """Vocab-parallel cross-entropy over the bf16 logits in fp32, the logits read once per direction."""
    wgrad_accumulation: bool = True
    """Weight-gradient GEMMs accumulate into the fp32 ``main_grad`` (no bf16 weight gradient, no extra add); the
    word embedding adds its gradient into the ``main_grad`` rows its tokens name (``mcore_compat/embedding.py``)."""
    mamba: bool = True
    """Mamba-2's conv + scan + gated norm as one op of mamba-ssm's and causal-conv1d's kernels (CUDA)."""
    activation: bool = True
    """The MLP's squared ReLU (no bias, no gate) as one kernel per direction that runs the non-finite checks of fc1's
    output (forward) and fc2's input gradient (backward) in the same launch, instead of the check's own reads of
    those tensors, and, where fc2 / fc1 quantize with a tensor amax (NVFP4, FP8 per tensor), the amax of what it
    writes for their quantizers, instead of their amax pass (bitwise the unfused values and operands, the same
    non-finite answers)."""
    rms_norm: bool = True
    """RMSNorm's backward as one Triton kernel (dx and per-program fp32 weight-gradient partials, then their sum)
    instead of torch's two (CUDA; the forward is torch's, bit for bit; the gradients within the bound of
    ``docs/numerics.md``); a block's norm runs the non-finite check of the input gradient of the linear layer it
    feeds in that kernel."""

    @classmethod
    def all_off(cls) -> FusionConfig:
        """Every switch false: megatron's and torch's unfused paths throughout."""
        return cls(**{f.name: False for f in fields(cls)})
