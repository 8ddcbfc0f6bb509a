"""megatron-core's gradient-accumulation fusion (``TransformerConfig.gradient_accumulation_fusion``) without APEX.

With the switch on, megatron's linear layers (``LinearWithGradAccumulationAndAsyncCommunication``, 0.16.1 ...
0.19.x) do not return a bf16 weight gradient for its DDP hook to add into the fp32 ``main_grad``: they call
``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)``, APEX's
extension, and mark ``weight.grad_added_to_main_grad``. Without APEX megatron refuses the switch at layer
construction. :func:`install_wgrad_accumulation` gives megatron's ``tensor_parallel.layers`` module a stand-in
for that extension (the one place this project patches it): the Wgrad GEMM runs in cuBLASLt with the fp32
``main_grad`` as C and D and beta = 1 (``nvfp4_train.kernels.cublaslt``), reading ``grad_output`` and the input
through transposed views, so per weight and micro-batch one pass of the gradient is neither written in bf16
nor read back and added: ``main_grad = fl32(sum_m dy[m, n] x[m, k] + main_grad)`` (fp32 accumulation), against
the unfused ``main_grad + fl32(bf16(sum))``: the fused result skips one bf16 rounding of the gradient
(|difference| <= 2^-9 |dW| per accumulation, plus fp32 rounding; docs/numerics.md, "Fused step").

On a CPU tensor (tests, CPU runs) the stand-in computes the same sum with torch in fp32 (bf16 products are
exact in fp32) and adds it: the fused arithmetic up to the fp32 summation order.

Our quantized layers (``nvfp4_train.precision.megatron_linear``) follow the same protocol for their low-precision
Wgrad GEMMs (:func:`wgrad_accumulate` on dequantized operands with the NVFP4 alpha, ``nvfp4_train.precision.linear``).
"""

from __future__ import annotations

import torch

__all__ = ["install_wgrad_accumulation", "wgrad_accumulate", "FusedWgrad"]


def wgrad_accumulate(grad_output: torch.Tensor, total_input: torch.Tensor, main_grad: torch.Tensor,
                     alpha: torch.Tensor | None = None) -> None:
    """``main_grad[N, K] += alpha * grad_output[M, N]^T . total_input[M, K]`` with fp32 accumulation and one
    rounding to ``main_grad``'s dtype (fp32, or bf16/fp16 when gradients are reduced in 16 bits). ``alpha``: a
    1-element fp32 device tensor scaling the product (None: 1). On CUDA one cuBLASLt GEMM, no copies."""
    go = grad_output.reshape(-1, grad_output.shape[-1])
    x = total_input.reshape(-1, total_input.shape[-1])
    if main_grad.shape != (go.shape[1], x.shape[1]):
        raise ValueError(f"wgrad_accumulate: main_grad {tuple(main_grad.shape)} is not [{go.shape[1]}, {x.shape[1]}] "
                         f"(grad_output {tuple(grad_output.shape)}, input {tuple(total_input.shape)})")
    if main_grad.is_cuda:
        from nvfp4_train.kernels.cublaslt import matmul_device_alpha

        matmul_device_alpha(go.t(), x.t(), alpha, main_grad.dtype, out=main_grad, accumulate=True)
        return
    acc = torch.mm(go.t().float(), x.float())
    if alpha is not None:
        acc = acc * alpha.to(acc.device)
    main_grad.add_(acc)


class FusedWgrad:
    """The two functions of APEX's ``fused_weight_gradient_mlp_cuda`` megatron-core calls (argument order as
    megatron passes them: input, grad_output, main_grad)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        wgrad_accumulate(grad_output, total_input, main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        wgrad_accumulate(grad_output, total_input, main_grad)


def install_wgrad_accumulation() -> None:
    """Let megatron-core's linear layers run ``gradient_accumulation_fusion`` through :class:`FusedWgrad`
    (idempotent; an installed APEX extension is left in place)."""
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "_grad_accum_fusion_available", False) and \
            getattr(layers, "fused_weight_gradient_mlp_cuda", None) is not None:
        return
    layers.fused_weight_gradient_mlp_cuda = FusedWgrad
    layers._grad_accum_fusion_available = True
