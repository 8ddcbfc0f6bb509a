"""Residual add + RMSNorm at the models' block boundaries: the fused kernels (``fusion.residual_norm``,
``kernels/fused/residual_norm.py``) against the unfused ops they replace, forward and forward + backward.

    python3 scripts/bench_residual_norm.py                      # 1.2b's and small's boundaries, bf16
    python3 scripts/bench_residual_norm.py --shapes 8192x2048 --json rn.json

Unfused = what the model runs with ``fusion.residual_norm=false``: torch's bf16 add (megatron's bias-dropout-add with
no bias, dropout 0), ``F.rms_norm`` (torch's fused CUDA norm), and in backward autograd's norm backward plus the add
of the two gradients of the sum. Each case is first checked: the fused kernels' outputs and gradients bit for bit
against the reference (``residual_norm_reference.py``) on the GPU. Times: median of ``triton.testing.do_bench``;
"% of copy" counts the bytes each side must move (forward: fused 4 tensors, unfused 5; forward + backward: fused 8,
unfused 13) against a device-to-device copy of one tensor measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _parse_shape(s: str) -> tuple[int, int]:
    rows, n = s.lower().split("x")
    return int(rows), int(n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["8192x2048", "16384x768"],
                    help="ROWSxHIDDEN (default: 1.2b's boundary, 2 x 4096 tokens x 2048; small's, 8 x 2048 x 768)")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_residual_norm: error: needs a CUDA device", file=sys.stderr)
        return 2
    import triton.testing

    from nvfp4_train.kernels.fused.residual_norm import residual_norm, residual_norm_ref

    eps, rows_out = 1e-5, []
    print("| rows x hidden | fwd unfused (us) | fwd fused (us) | fused/unfused | fwd+bwd unfused (us) | "
          "fwd+bwd fused (us) | fused/unfused | fused % of copy (fwd, fwd+bwd) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for spec in a.shapes:
        rows, n = _parse_shape(spec)
        g = torch.Generator(device="cuda").manual_seed(0)

        def rnd():
            return torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)

        res, delta, g_skip, g_normed = rnd(), rnd(), rnd(), rnd()
        w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16)
        leaves = [t.clone().requires_grad_(True) for t in (res, delta, w)]

        def unfused(r, d, ww, e):
            x = r + d
            return x, torch.nn.functional.rms_norm(x, (n,), ww, e)

        def run_fwd(fn):
            return lambda: fn(res, delta, w, eps)

        def run_bwd(fn):
            def f():
                r, d, ww = leaves
                x, y = fn(r, d, ww, eps)
                return torch.autograd.grad((x, y), (r, d, ww), (g_skip, g_normed))
            return f

        # the kernels against the reference, bit for bit, on this device
        got = run_bwd(residual_norm)(), residual_norm(res, delta, w, eps)
        want = run_bwd(residual_norm_ref)(), residual_norm_ref(res, delta, w, eps)
        for x, y in zip((*got[0], *got[1]), (*want[0], *want[1])):
            if not torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
                               y.view(torch.int16) if y.dtype == torch.bfloat16 else y):
                print(f"bench_residual_norm: error: {spec}: the kernels differ from the reference", file=sys.stderr)
                return 1
        copy_dst = torch.empty_like(res)
        t_copy = triton.testing.do_bench(lambda: copy_dst.copy_(res), return_mode="median")  # ms, 2 tensors
        per_tensor = t_copy / 2
        t = {
            "fwd_unfused": triton.testing.do_bench(run_fwd(unfused), return_mode="median"),
            "fwd_fused": triton.testing.do_bench(run_fwd(residual_norm), return_mode="median"),
            "fb_unfused": triton.testing.do_bench(run_bwd(unfused), return_mode="median"),
            "fb_fused": triton.testing.do_bench(run_bwd(residual_norm), return_mode="median"),
        }
        row = {"rows": rows, "hidden": n, "copy_ms": t_copy, **{k + "_ms": v for k, v in t.items()},
               "fused_fwd_pct_copy": 100 * 4 * per_tensor / t["fwd_fused"],
               "fused_fb_pct_copy": 100 * 8 * per_tensor / t["fb_fused"]}
        rows_out.append(row)
        print(f"| {rows} x {n} | {1e3 * t['fwd_unfused']:.1f} | {1e3 * t['fwd_fused']:.1f} | "
              f"{t['fwd_fused'] / t['fwd_unfused']:.2f} | {1e3 * t['fb_unfused']:.1f} | {1e3 * t['fb_fused']:.1f} | "
              f"{t['fb_fused'] / t['fb_unfused']:.2f} | {row['fused_fwd_pct_copy']:.0f}%, "
              f"{row['fused_fb_pct_copy']:.0f}% |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
