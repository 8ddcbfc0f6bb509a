"""RMSNorm on the models' shapes, forward + backward and backward alone: torch's fused ``rms_norm`` (what the model
runs with ``fusion.rms_norm=false``), ours (the same forward, the backward as one Triton kernel:
``nvfp4_train.models.layers.RMSNormFunction``, ``fusion.rms_norm``) and Liger-Kernel's ``LigerRMSNormFunction``
when ``liger_kernel`` imports (not a dependency; casting mode "gemma": everything in fp32, as torch's).

Each implementation is checked first: its dx and dw for one output gradient against the exact float64 gradients at
the rstd it used (torch's and ours: the forward's; Liger's: the one it saves), within the bound of
``kernels/fused/rms_norm_reference.py: rms_norm_backward_bound`` (torch's rounding counts for torch, ours for ours;
Liger's from its gemma-mode kernel: ``LIGER_ROUNDINGS``). A result beyond its bound is marked in the table; one of
torch's or ours makes the run fail (exit status 1).

Times: ``triton.testing.do_bench`` medians on the GPU (one wall-clock call on the CPU: a smoke test). "backward"
replays autograd's backward of one forward (``retain_graph``); "fwd+bwd" runs both. "% of copy": the bytes the step
must move (forward: x read, y written; backward: x and dy read, dx written; the weight, rstd and any partial sums
left out: the same bytes for every implementation) at the device-to-device copy bandwidth measured in the same run.

    python3 scripts/bench_rms_norm.py                          # 1.2b's [8192, 2048] and small's [16384, 768], bf16
    python3 scripts/bench_rms_norm.py --shapes 8192x2048 --json rms_norm.json
    TRITON_INTERPRET=1 python3 scripts/bench_rms_norm.py --quick   # CPU smoke test: tiny shapes, the kernel interpreted
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from nvfp4_train.bench.sweep import copy_bandwidth, time_ms

EPS = 1e-5
SHAPES = ("8192x2048", "16384x768")
"""Rows x hidden of one norm call: ``1.2b`` (2 x 4096 tokens, hidden 2048), ``small`` (8 x 2048 tokens, 768)."""
QUICK_SHAPES = ("64x784", "48x256")
LIGER_ROUNDINGS = (3, 11)
"""Liger's gemma-mode dx, ``fl(fl(r dy) w) + fl(r fl(fl(fl(fl(c r) r) S) x))`` with ``S = sum fl(fl(dy w) x)`` and
``c = -(1 / H)`` an fp32 division (the GPU's approximate one: within 2 ulp, budgeted as 4 roundings): a = 3,
b = H + 11; its dw rounds each term twice (``dy * (x * r)``) before per-program sums and their ``torch.sum``."""


def _shape(s: str) -> tuple[int, int]:
    rows, h = s.lower().split("x")
    return int(rows), int(h)


def implementations(device: torch.device) -> dict:
    """name -> (forward(x, w) -> y, rstd(x, w, y) -> the fp32 [M] rstd its backward used, the bound's ``impl``)."""
    from nvfp4_train.models.layers import RMSNormFunction

    def fused_rstd(x, w, y):
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], w, EPS)[1].reshape(-1)

    out = {
        "torch": (lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, EPS), fused_rstd,
                  "torch_cuda" if device.type == "cuda" else "torch_cpu"),
        "ours": (lambda x, w: RMSNormFunction.apply(x, w, EPS), fused_rstd, "ours"),
    }
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return out
    if device.type != "cuda":
        return out

    def liger(x, w):
        try:
            return LigerRMSNormFunction.apply(x, w, EPS, 0.0, "gemma", False)  # in_place=False: dy kept
        except TypeError:  # releases before in_place
            return LigerRMSNormFunction.apply(x, w, EPS, 0.0, "gemma")

    def liger_rstd(x, w, y):
        saved = [t for t in getattr(y.grad_fn, "saved_tensors", ()) if t.dtype == torch.float32
                 and t.numel() == x.shape[0] and t is not w]
        return saved[0].reshape(-1) if saved else None

    out["liger"] = (liger, liger_rstd, LIGER_ROUNDINGS)
    return out


def check(fwd, rstd_of, impl, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> float | None:
    """max |result - exact| / bound over dx and dw (<= 1: within the bound); None when the rstd is not known."""
    from nvfp4_train.kernels.fused.rms_norm_reference import rms_norm_backward_bound, rms_norm_backward_exact

    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fwd(xi, wi)
    dx, dw = torch.autograd.grad(y, (xi, wi), dy.clone())
    rstd = rstd_of(x, w, y)
    if rstd is None:
        return None
    exact = rms_norm_backward_exact(dy, x, rstd.float(), w)
    bound = rms_norm_backward_bound(dy, x, rstd.float(), w, impl)
    return max(float(((got.double() - e).abs() / b).max()) for got, e, b in zip((dx, dw), exact, bound))


def run(args: argparse.Namespace) -> tuple[list[dict], bool]:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = getattr(torch, args.dtype)
    copy_gbs = copy_bandwidth(device, args.quick)
    impls = implementations(device)
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{dev}, {args.dtype}; device-to-device copy {copy_gbs:.0f} GB/s (bytes read + written); implementations: "
          f"{', '.join(impls)}\n")
    print("| rows x hidden | implementation | fwd+bwd (us) | % of copy | backward (us) | % of copy | backward vs "
          "torch | within the bound (worst error / bound) |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    rows, ok = [], True
    gen = torch.Generator(device=device).manual_seed(args.seed)
    for spec in (QUICK_SHAPES if args.quick else args.shapes):
        m, h = _shape(spec)
        x = torch.randn(m, h, device=device, generator=gen).to(dtype)
        dy = torch.randn(m, h, device=device, generator=gen).to(dtype)
        w = (1 + 0.1 * torch.randn(h, device=device, generator=gen)).to(dtype)
        elem = m * h * x.element_size()
        base = None
        for name, (fwd, rstd_of, impl) in impls.items():
            worst = check(fwd, rstd_of, impl, x, w, dy)
            within = None if worst is None else worst <= 1.0
            ok &= within is not False or name == "liger"
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = fwd(xi, wi)
            bwd_ms = time_ms(lambda: torch.autograd.grad(y, (xi, wi), dy, retain_graph=True), device)
            fb_ms = time_ms(lambda: torch.autograd.grad(fwd(xi, wi), (xi, wi), dy), device)
            base = base or bwd_ms
            row = {"rows": m, "hidden": h, "dtype": args.dtype, "impl": name, "fwd_bwd_us": 1e3 * fb_ms,
                   "bwd_us": 1e3 * bwd_ms, "fwd_bwd_copy_fraction": 5 * elem / (fb_ms * 1e-3) / 1e9 / copy_gbs,
                   "bwd_copy_fraction": 3 * elem / (bwd_ms * 1e-3) / 1e9 / copy_gbs, "within_bound": within,
                   "worst_error_over_bound": worst, "copy_gbs": copy_gbs, "device": dev}
            rows.append(row)
            verdict = "not checked (no rstd)" if worst is None else f"{'yes' if within else 'NO'} ({worst:.2f})"
            print(f"| {m} x {h} | {name} | {row['fwd_bwd_us']:.1f} | {100 * row['fwd_bwd_copy_fraction']:.0f}% | "
                  f"{row['bwd_us']:.1f} | {100 * row['bwd_copy_fraction']:.0f}% | {bwd_ms / base:.2f} | {verdict} |",
                  flush=True)
    return rows, ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="ROWSxHIDDEN of one call (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: tiny shapes, one call each")
    ap.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    rows, ok = run(args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
