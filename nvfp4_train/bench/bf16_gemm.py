"""The BF16 linear layer's GEMMs by torch (cuBLAS as ``torch.matmul`` calls it) and by our cuBLASLt binding
(``nvfp4_train.kernels.cublaslt``), on a model's shapes, in one process; and the Wgrad GEMM with its fp32
``main_grad`` accumulation unfused (``torch.matmul`` to bf16, then ``main_grad.add_``) and fused (beta = 1 in
cuBLASLt's epilogue, ``nvfp4_train.mcore_compat.wgrad``). Also grouped-query attention through SDPA with the K/V
groups repeated (``repeat_interleave``) against SDPA's own ``enable_gqa``.

For each layer (M tokens, K in, N out):

    fprop  y  = x . W^T     [M, K] x [N, K]
    dgrad  dx = dy . W      [M, N] x [K, N] (W read transposed)
    wgrad  dW = dy^T . x    [N, M] x [K, M] (both read transposed), + main_grad

Times: ``triton.testing.do_bench`` medians (ms), TFLOP/s = 2MNK / time. Every cuBLASLt result is compared with
torch's first (bf16 outputs within 2 bf16 ulps of each other: the two libraries may pick different algorithms and
split-K; the fused Wgrad's fp32 main_grad against the unfused one within the bf16 rounding it skips).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SHAPES = {
    # name: [(layer, K, N)], M from --tokens
    "1.2b": [("qkv", 2048, 4096), ("attn out", 2048, 2048), ("fc1", 2048, 6144), ("fc2", 6144, 2048),
             ("output", 2048, 131072)],
    "12b": [("qkv", 5120, 7168), ("attn out", 5120, 5120), ("fc1", 5120, 20480), ("fc2", 20480, 5120),
            ("in_proj", 5120, 22656), ("out_proj", 10240, 5120)],
    "small": [("in_proj", 512, 2320), ("out_proj", 1024, 512), ("fc1", 512, 2048), ("fc2", 2048, 512),
              ("output", 512, 32768)],
}


def _close(a: torch.Tensor, b: torch.Tensor, ulps: float) -> bool:
    """|a - b| <= ulps * ulp_bf16(max(|a|, |b|)) elementwise (ulp of bf16: 2^-7 relative)."""
    scale = torch.maximum(a.float().abs(), b.float().abs())
    return bool(((a.float() - b.float()).abs() <= ulps * 2.0 ** -7 * scale + 1e-30).all())


def bench_gemms(model: str, tokens: int) -> list[dict]:
    from triton.testing import do_bench

    from nvfp4_train.kernels.cublaslt import matmul_device_alpha
    from nvfp4_train.mcore_compat.wgrad import wgrad_accumulate

    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for layer, K, N in SHAPES[model]:
        M = tokens
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16()
        dy = torch.randn(M, N, device="cuda", generator=g).bfloat16()
        main_grad = torch.zeros(N, K, device="cuda", dtype=torch.float32)
        flops = 2.0 * M * N * K
        cases = {
            "fprop": (lambda: torch.matmul(x, w.t()), lambda: matmul_device_alpha(x, w, None, torch.bfloat16)),
            "dgrad": (lambda: torch.matmul(dy, w), lambda: matmul_device_alpha(dy, w.t(), None, torch.bfloat16)),
            "wgrad": (lambda: torch.matmul(dy.t(), x), lambda: matmul_device_alpha(dy.t(), x.t(), None, torch.bfloat16)),
        }
        for gemm, (ref, ours) in cases.items():
            ok = _close(ref(), ours(), 2)
            t_ref, t_ours = do_bench(ref), do_bench(ours)
            rows.append(dict(model=model, layer=layer, gemm=gemm, M=M, K=K, N=N, torch_ms=t_ref, cublaslt_ms=t_ours,
                             torch_tflops=flops / t_ref / 1e9, cublaslt_tflops=flops / t_ours / 1e9, ok=ok))
        # the Wgrad with its main_grad accumulation, unfused (as megatron's DDP hook adds) and fused
        mg_a, mg_b = main_grad.clone(), main_grad.clone()
        mg_a.add_(torch.matmul(dy.t(), x))
        wgrad_accumulate(dy, x, mg_b)
        ok = bool(((mg_a - mg_b).abs() <= 2.0 ** -8 * mg_b.abs() + 1e-30).all())
        t_unf = do_bench(lambda: main_grad.add_(torch.matmul(dy.t(), x)))
        t_fus = do_bench(lambda: wgrad_accumulate(dy, x, main_grad))
        rows.append(dict(model=model, layer=layer, gemm="wgrad + main_grad", M=M, K=K, N=N, torch_ms=t_unf,
                         cublaslt_ms=t_fus, torch_tflops=flops / t_unf / 1e9, cublaslt_tflops=flops / t_fus / 1e9,
                         ok=ok))
    return rows


def bench_gqa(batch: int, heads: int, groups: int, seq: int, head_dim: int) -> list[dict]:
    """Causal SDPA forward + backward, K/V of ``groups`` heads repeated to ``heads`` vs ``enable_gqa=True``."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads, seq, head_dim, device="cuda", generator=g).bfloat16().requires_grad_()
    k = torch.randn(batch, groups, seq, head_dim, device="cuda", generator=g).bfloat16().requires_grad_()
    v = torch.randn(batch, groups, seq, head_dim, device="cuda", generator=g).bfloat16().requires_grad_()
    do = torch.randn(batch, heads, seq, head_dim, device="cuda", generator=g).bfloat16()

    def repeated():
        kk, vv = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
        F.scaled_dot_product_attention(q, kk, vv, is_causal=True).backward(do)

    def native():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(do)

    rows = []
    outs = {}
    for name, fn in (("repeat_interleave", repeated), ("enable_gqa", native)):
        try:
            for t in (q, k, v):
                t.grad = None
            fn()
            outs[name] = tuple(t.grad.clone() for t in (q, k, v))
            ms = do_bench(fn)
            rows.append(dict(attention=name, ms=ms))
        except Exception as e:  # a backend without GQA support: report it
            rows.append(dict(attention=name, error=f"{type(e).__name__}: {e}"[:200]))
    if len(outs) == 2:
        rows.append(dict(attention="grads agree (2 bf16 ulps)",
                         ok=all(_close(a, b, 4) for a, b in zip(outs["repeat_interleave"], outs["enable_gqa"]))))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["1.2b"], choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--gqa", nargs=5, type=int, default=[2, 16, 8, 4096, 128], metavar=("B", "H", "G", "S", "D"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows = [r for m in a.models for r in bench_gemms(m, a.tokens)]
    print("| model | layer | GEMM | M | K | N | torch ms | cuBLASLt ms | torch TFLOP/s | cuBLASLt TFLOP/s | ratio | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['layer']} | {r['gemm']} | {r['M']} | {r['K']} | {r['N']} | {r['torch_ms']:.3f} | "
              f"{r['cublaslt_ms']:.3f} | {r['torch_tflops']:.0f} | {r['cublaslt_tflops']:.0f} | "
              f"{r['torch_ms'] / r['cublaslt_ms']:.3f} | {r['ok']} |")
    gqa = bench_gqa(*a.gqa)
    print()
    for r in gqa:
        print(json.dumps(r))
    if a.json:
        a.json.write_text(json.dumps({"gemms": rows, "gqa": gqa}, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1
