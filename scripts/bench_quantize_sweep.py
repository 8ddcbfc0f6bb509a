#!/usr/bin/env python3
"""Launch configs of the fused NVFP4 row+column quantizer on x [8192, K] bf16 (GPU only).

Every variant is first checked bit for bit against ``quantize_nvfp4_rowcol_ref`` on the whole tensor (a
failing variant is reported and not timed), then timed with ``triton.testing.do_bench`` (median; it flushes
L2 before each call). GB/s count the bytes each variant moves: "full" = amax pass (1 read of x) + quantize
pass (1 read + the four outputs), "amax given" = the quantize pass alone; both as a share of a device-to-device
copy measured in the same run (bytes read + written).

Usage: python3 scripts/bench_quantize_sweep.py [--ks 5120 10240 20480] [--quick] [--variants LABEL ...] [--modes RNE SR]
                                                [--out sweep.json]
       --quick         the default configs only
       [--wait FILE]   compile and check everything first, then wait until FILE exists before timing
                       (lets a test run share the compile phase without disturbing the timings)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from nvfp4_train.kernels.fp4_reference import seed_key
from nvfp4_train.kernels.nvfp4.quantize import amax_triton, quantize_nvfp4_rowcol_triton
from nvfp4_train.kernels.nvfp4.reference import quantize_nvfp4_rowcol_ref

M = 8192
# (label, quantize-pass config, amax-pass config, modes)
VARIANTS = [
    ("64x128 w4 (default)", dict(block_m=64, block_k=128, num_warps=4), dict(), ("RNE", "SR")),
    ("64x256 w4", dict(block_m=64, block_k=256, num_warps=4), dict(), ("RNE", "SR")),
    ("64x128 w4 maxnreg 168", dict(block_m=64, block_k=128, num_warps=4, maxnreg=168), dict(), ("RNE", "SR")),
    ("64x128 w4 maxnreg 128", dict(block_m=64, block_k=128, num_warps=4, maxnreg=128), dict(), ("RNE",)),
    ("32x128 w4", dict(block_m=32, block_k=128, num_warps=4), dict(), ("RNE", "SR")),
    ("32x128 w2", dict(block_m=32, block_k=128, num_warps=2), dict(), ("RNE", "SR")),
    ("64x64 w4", dict(block_m=64, block_k=64, num_warps=4), dict(), ("RNE", "SR")),
    ("64x64 w2", dict(block_m=64, block_k=64, num_warps=2), dict(), ("RNE", "SR")),
]
QUICK = {"64x128 w4 (default)"}
AMAX_VARIANTS = [
    ("32x256 w4 3/SM (default)", dict(block_m=32, block_k=256, num_warps=4, per_sm=3)),
    ("64x128 w4 4/SM", dict(block_m=64, block_k=128, num_warps=4, per_sm=4)),
    ("32x256 w4 2/SM", dict(block_m=32, block_k=256, num_warps=4, per_sm=2)),
    ("32x256 w4 6/SM", dict(block_m=32, block_k=256, num_warps=4, per_sm=6)),
    ("32x256 w4 8/SM", dict(block_m=32, block_k=256, num_warps=4, per_sm=8)),
    ("64x256 w8 3/SM", dict(block_m=64, block_k=256, num_warps=8, per_sm=3)),
]
MODES = [
    ("RNE", dict(), dict()),
    ("SR", dict(row_stochastic=True, col_stochastic=True, row_seed=1, col_seed=2),
     dict(row_stochastic=True, col_stochastic=True, row_key=seed_key(1), col_key=seed_key(2))),
]


def same(out, ref) -> bool:
    rc, rs, cc, cs, am = out
    r, c = ref
    return (torch.equal(rc, r.codes) and torch.equal(rs, r.scales.view(torch.uint8)) and torch.equal(cc, c.codes)
            and torch.equal(cs, c.scales.view(torch.uint8)) and torch.equal(am[0], r.amax) and torch.equal(am[1], c.amax))


def copy_bandwidth() -> float:
    """GB/s (bytes read + written) of a 1 GiB device-to-device copy."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / do_bench(lambda: dst.copy_(src), return_mode="median") / 1e6


def checked(name: str, check, failures: list[str]) -> bool:
    """Run ``check()`` (True when the variant's bits equal the reference's); a variant that differs or does not
    compile is recorded in ``failures`` and reported, and must not stop the others."""
    try:
        ok = check()
    except Exception as e:
        ok = False
        print(f"  ERROR {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    if not ok:
        failures.append(name)
        print(f"  CHECK FAILED {name}", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", type=int, nargs="*", default=[5120, 10240, 20480])
    ap.add_argument("--quick", action="store_true", help="only the variants in QUICK")
    ap.add_argument("--variants", nargs="*", help="only the quantize and amax variants with these labels")
    ap.add_argument("--modes", nargs="*", choices=[m[0] for m in MODES], help="only these rounding modes")
    ap.add_argument("--wait", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    keep = QUICK if args.quick else None
    if args.variants is not None:
        keep = set(args.variants) | (keep or set())
        unknown = keep - {v[0] for v in VARIANTS} - {v[0] for v in AMAX_VARIANTS}
        if unknown:
            ap.error(f"--variants: no variant labelled {', '.join(sorted(unknown))}")
    variants = [v for v in VARIANTS if keep is None or v[0] in keep]
    run_modes = [m for m in MODES if args.modes is None or m[0] in args.modes]

    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)

    jobs, failures = [], []
    t0 = time.time()
    for K in args.ks:
        x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
        n = M * K
        writes = 2 * (n // 2 + n // 16)
        for mode, ref_kw, kw in run_modes:
            ref = quantize_nvfp4_rowcol_ref(x, col_rht=True, **ref_kw)
            am_row, am_col = ref[0].amax, ref[1].amax
            for label, cfg, acfg, modes in variants:
                if mode not in modes:
                    continue
                for given in (False, True):
                    amax_kw = dict(row_amax=am_row, col_amax=am_col) if given else dict()

                    def fn(x=x, cfg=cfg, acfg=acfg, kw=kw, amax_kw=amax_kw):
                        return quantize_nvfp4_rowcol_triton(x, write_col=True, col_rht=True, amax_cfg=acfg, **cfg,
                                                            **kw, **amax_kw)

                    name = f"K={K} {mode} {label} {'amax given' if given else 'full'}"
                    if not checked(name, lambda fn=fn: same(fn(), ref), failures):
                        continue
                    nbytes = (2 * n if given else 4 * n) + writes
                    jobs.append(dict(K=K, mode=mode, variant=label, amax_given=given, fn=fn, nbytes=nbytes))
        amax_variants = [v for v in AMAX_VARIANTS if (keep is None or v[0] in keep)] if not args.quick \
            else AMAX_VARIANTS[:1]
        for label, acfg in amax_variants:
            ref_am = torch.stack((ref[0].amax, ref[1].amax))

            def afn(x=x, acfg=acfg):
                return amax_triton(x, True, **acfg)

            name = f"K={K} amax pass {label}"
            if not checked(name, lambda afn=afn: torch.equal(afn(), ref_am), failures):
                continue
            jobs.append(dict(K=K, mode="amax only", variant=label, amax_given=False, fn=afn, nbytes=2 * n))
    torch.cuda.synchronize()
    print(f"compiled and checked {len(jobs)} variants in {time.time() - t0:.0f} s; {len(failures)} failed",
          flush=True)
    if args.wait is not None:
        while not args.wait.exists():
            time.sleep(1)
    print(f"\n| K | mode | variant | pass | us | GB/s | % of copy ({copy_bw:.0f} GB/s) |\n|---|---|---|---|---|---|---|",
          flush=True)
    rows = []
    for j in jobs:
        ms = do_bench(j["fn"], warmup=10, rep=60, return_mode="median")
        gbs = j["nbytes"] / ms / 1e6
        r = dict(K=j["K"], mode=j["mode"], variant=j["variant"], amax_given=j["amax_given"], us=ms * 1e3,
                 GBps=gbs, pct_copy=100 * gbs / copy_bw)
        rows.append(r)
        what = "quantize pass (amax given)" if r["amax_given"] else ("amax pass" if r["mode"] == "amax only" else "full")
        print(f"| {r['K']} | {r['mode']} | {r['variant']} | {what} | {r['us']:.1f} | {r['GBps']:.0f} "
              f"| {r['pct_copy']:.0f}% |", flush=True)
    if failures:
        print("\nFAILED: " + "; ".join(failures))
    if args.out:
        args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                                            triton=triton.__version__, copy_GBps=copy_bw, rows=rows,
                                            failures=failures), indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
