#!/usr/bin/env python3
"""Kernel benchmarks on the 12B model's GEMM shapes, every number measured in ONE run (ratios are what count).

For M = 8192 tokens and (K, N) of each 12B linear layer, it prints markdown tables of:
  * GEMM TFLOP/s: cuBLAS BF16 (``torch.matmul``), FP8 ``torch._scaled_mm`` tensorwise (scales on device),
    our NVFP4 GEMM: the pre-dequantized design (dequantize both operands to 16 bits, then the Triton 16-bit GEMM; total and
    GEMM-only), the same design with the "cublas" engine (dequantize both to bf16, one cuBLASLt GEMM that
    applies alpha in its epilogue; total, and that GEMM alone from bf16 operands, beside
    the design it replaced, cuBLAS with fp32 output then the Triton alpha pass, and that alpha pass alone; the
    default of ``nvfp4_gemm``), our MXFP4 GEMM, and the naive PyTorch emulation
    (reference quantize of both operands on the GPU + dequantize + bf16 matmul); ratios ours/cuBLAS, ours/FP8
    and the speed-up over the naive emulation (GEMM alone, and with our Triton quantizers included: quantize
    x + quantize W (2-D) + GEMM).
  * NVFP4 quantize throughput of ``quantize_nvfp4_rowcol(x, col_rht=True, ...)`` for x [8192, K] bf16 (the
    two copies a linear layer needs): GB/s counting the bytes actually moved (two reads of x, the amax pass
    and the quantize pass, plus the writes), "effective" GB/s (one read + writes), both as a fraction of the
    measured device-to-device copy bandwidth (bytes read + written), and with the amax supplied (one read).

Every variant is checked once before it is timed: our GEMMs against the float64 reference on a 128x128
slice within the derived bound of tests/kernels/test_nvfp4_gemm.py; the quantizer bit for bit against the
reference on the whole tensor. A variant that fails its check (or fails to compile) is reported, not timed,
and the script exits non-zero.

Timing: ``triton.testing.do_bench`` (median; it flushes L2 before every call). Operand sets smaller than 2x
the L2 size are additionally rotated over several copies.

Usage (on the GPU machine, from the repo root)::

    python3 scripts/bench_kernels.py                    # all 6 shapes -> markdown on stdout
    python3 scripts/bench_kernels.py --out bench.json   # also the raw numbers as JSON
    python3 scripts/bench_kernels.py --quick            # 2 shapes, fewer reps
    python3 scripts/bench_kernels.py --sweep            # also time every SWEEP_CONFIGS entry per shape
    python3 scripts/bench_kernels.py --quantize-only    # only the quantizer table (K of all 6 shapes)
    python3 scripts/bench_kernels.py --gemm-only        # only the GEMM tables (no quantizer table)
    TRITON_INTERPRET=1 python3 scripts/bench_kernels.py --dry-run   # CPU smoke test of this script's logic
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch
import triton

from nvfp4_train.kernels.fp4_gemm import (
    GemmConfig,
    dequantize_fp4_blockwise_pair_triton,
    gemm_alpha_cublas,
    gemm_alpha_triton,
    scale_alpha_triton,
)
from nvfp4_train.kernels.gemm_engine import DEFAULT_GEMM_ENGINE
from nvfp4_train.kernels.nvfp4 import (
    dequantize_nvfp4_ref,
    nvfp4_gemm,
    nvfp4_gemm_ref,
    quantize_nvfp4,
    quantize_nvfp4_ref,
    quantize_nvfp4_rowcol,
    quantize_nvfp4_rowcol_ref,
)
from nvfp4_train.kernels.nvfp4.gemm import nvfp4_gemm_predequant
from nvfp4_train.kernels.nvfp4.reference import NVFP4Tensor, _blockwise_values, nvfp4_alpha

M_TOKENS = 8192
# (name, K, N) of the 12B model's linear layers (docs: GPU.md's table)
SHAPES = [
    ("qkv", 5120, 7168),
    ("attn out", 5120, 5120),
    ("mlp fc1", 5120, 20480),
    ("mlp fc2", 20480, 5120),
    ("mamba in_proj", 5120, 22656),
    ("mamba out_proj", 10240, 5120),
]
QUICK_SHAPES = ["qkv", "mlp fc2"]
CHECK_ROWS = 128

# the dequantize-in-registers ("fused") GEMM left the library (its numbers stay in docs/benchmarks.md): no
# variants of it are timed here any more; its table columns print "–"
FUSED_VARIANTS: list = []
# tile configs of the Triton 16-bit GEMM timed by --sweep
SWEEP_CONFIGS = (
    GemmConfig(128, 256, 64, 8, 3),
    GemmConfig(128, 256, 64, 8, 4),
    GemmConfig(128, 256, 128, 8, 3),
    GemmConfig(128, 256, 128, 8, 2),
    GemmConfig(256, 128, 64, 8, 3),
    GemmConfig(128, 128, 64, 8, 3),
    GemmConfig(128, 128, 128, 8, 3),
    GemmConfig(128, 128, 128, 4, 3),
    GemmConfig(128, 128, 256, 8, 2),
    GemmConfig(64, 256, 128, 4, 3),
)


def dequantize_nvfp4_blockwise_triton(q: NVFP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * sdec_b`` of one operand as [M, K] ``dtype`` (the GEMM's pair dequantize, with an empty partner)."""
    return dequantize_fp4_blockwise_pair_triton(q.codes, q.scales, q.codes[:0], q.scales[:0], block=16,
                                                scale_format="e4m3", dtype=dtype)[0]


# ----------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------


class Timer:
    def __init__(self, dry: bool, quick: bool):
        self.dry = dry
        self.warmup_ms = 10 if quick else 25
        self.rep_ms = 40 if quick else 200
        self.l2_bytes = 50 * 2**20
        if torch.cuda.is_available() and not dry:
            props = torch.cuda.get_device_properties(0)
            self.l2_bytes = int(getattr(props, "L2_cache_size", self.l2_bytes) or self.l2_bytes)

    def n_copies(self, nbytes: int) -> int:
        """How many copies of an operand set to rotate through so that consecutive calls miss in L2."""
        if self.dry or nbytes >= 2 * self.l2_bytes:
            return 1
        return min(8, math.ceil(3 * self.l2_bytes / max(nbytes, 1)))

    def ms(self, fn, sets=None, slow: bool = False) -> float:
        """Median milliseconds of ``fn(*args)``, args cycling over ``sets`` (default: one empty set)."""
        it = itertools.cycle(sets or [()])

        def call():
            return fn(*next(it))

        if self.dry:
            t0 = time.perf_counter()
            call()
            return (time.perf_counter() - t0) * 1e3
        if slow:  # the naive emulation takes tens of ms per call
            return triton.testing.do_bench(call, warmup=1, rep=max(50, self.rep_ms // 2), return_mode="median")
        return triton.testing.do_bench(call, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")


def tflops(m: int, n: int, k: int, ms: float | None) -> float | None:
    return None if ms is None else 2.0 * m * n * k / (ms * 1e-3) / 1e12


def nbytes_q(q) -> int:
    return q.codes.numel() + q.scales.numel()


# ----------------------------------------------------------------------------------------------------------
# correctness checks (once per variant, before timing)
# ----------------------------------------------------------------------------------------------------------


def gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def slice_q(q: NVFP4Tensor, rows: int) -> NVFP4Tensor:
    return NVFP4Tensor(codes=q.codes[:rows], scales=q.scales[:rows], amax=q.amax, block_2d=q.block_2d)


def check_nvfp4_gemm(c: torch.Tensor, a: NVFP4Tensor, b: NVFP4Tensor, exact_dequant: bool = True) -> str | None:
    """``c`` (the full output, any out dtype) against the float64 product on its top-left slice, within the
    derived bound (u = 2^-22 for the tensor cores; plus half a bf16 ulp of the value for bf16 output).
    Returns None when it passes, else a message."""
    r = CHECK_ROWS
    sa, sb = slice_q(a, r), slice_q(b, r)
    K = a.shape[1]
    da = _blockwise_values(sa).double()
    db = _blockwise_values(sb).double()
    alpha = nvfp4_alpha(a.amax, b.amax).double()
    c64 = (da @ db.t()) * alpha
    bound = alpha * (da.abs() @ db.abs().t()) * (gamma(K + 1, 2.0**-22) + gamma(K, 2.0**-53)) + 2.0**-149
    if c.dtype == torch.bfloat16:
        bound = bound + c64.abs() * 2.0**-8 + 2.0**-133
    got = c[:r, :r].double()
    if not torch.isfinite(got).all():
        return "non-finite output"
    err = (got - c64).abs()
    if not (err <= bound).all():
        return f"error {float((err / bound).max()):.3g}x the derived bound"
    # and the reference function agrees on the slice (fp32 out: within the same bound)
    ref = nvfp4_gemm_ref(sa, sb, torch.float32).double()
    if not ((ref - c64).abs() <= bound).all():
        return "nvfp4_gemm_ref disagrees with float64 (bench bug)"
    return None


def check_mxfp4_gemm(c: torch.Tensor, a, b) -> str | None:
    from nvfp4_train.kernels.mxfp4.reference import MXFP4Tensor, dequantize_mxfp4_ref

    r = CHECK_ROWS
    da = dequantize_mxfp4_ref(MXFP4Tensor(a.codes[:r], a.scales[:r])).double()
    db = dequantize_mxfp4_ref(MXFP4Tensor(b.codes[:r], b.scales[:r])).double()
    K = a.codes.shape[1] * 2
    c64 = da @ db.t()
    bound = (da.abs() @ db.abs().t()) * (gamma(K, 2.0**-22) + gamma(K, 2.0**-53)) + 2.0**-149
    bound = bound + c64.abs() * 2.0**-8 + 2.0**-133  # bf16 output
    err = (c[:r, :r].double() - c64).abs()
    if not (err <= bound).all():
        return f"error {float((err / bound).max()):.3g}x the derived bound"
    return None


def same_q(x: NVFP4Tensor, y: NVFP4Tensor) -> bool:
    return (torch.equal(x.codes, y.codes) and torch.equal(x.scales.view(torch.uint8), y.scales.view(torch.uint8))
            and torch.equal(x.amax, y.amax))


# ----------------------------------------------------------------------------------------------------------
# measurements
# ----------------------------------------------------------------------------------------------------------


class Run:
    def __init__(self, args):
        self.args = args
        self.dev = "cpu" if args.dry_run else "cuda"
        self.timer = Timer(args.dry_run, args.quick)
        self.failures: list[str] = []

    def measure(self, label: str, fn, check=None, sets=None, slow=False) -> float | None:
        """Run ``fn`` once, check its output, then time it. Returns ms, or None on failure."""
        try:
            out = fn(*(sets[0] if sets else ()))
            if check is not None:
                msg = check(out)
                if msg is not None:
                    self.failures.append(f"{label}: {msg}")
                    print(f"  CHECK FAILED {label}: {msg}", file=sys.stderr)
                    return None
            del out
            return self.timer.ms(fn, sets, slow=slow)
        except Exception as e:  # a variant that does not compile must not stop the others
            self.failures.append(f"{label}: {type(e).__name__}: {e}")
            print(f"  ERROR {label}: {type(e).__name__}: {e}", file=sys.stderr)
            if self.args.verbose:
                traceback.print_exc()
            return None

    def copy_bandwidth(self) -> float:
        n = (2**24 if self.args.dry_run else 2**30) // 2  # bf16 elements: 1 GiB
        src = torch.empty(n, dtype=torch.bfloat16, device=self.dev).uniform_()
        dst = torch.empty_like(src)
        ms = self.timer.ms(lambda: dst.copy_(src))
        return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9

    # --- GEMMs ----------------------------------------------------------------------------------------
    def gemm_row(self, name: str, M: int, K: int, N: int) -> dict:
        dev, T = self.dev, self.timer
        g = torch.Generator(device=dev).manual_seed(1234)
        x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
        w = (torch.randn(N, K, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        row: dict = dict(gemm=name, M=M, K=K, N=N)

        # cuBLAS BF16 (operands > L2 for every shape: no rotation)
        row["cublas_bf16_ms"] = self.measure("cuBLAS bf16", lambda: torch.matmul(x, w.t()))

        # FP8 tensorwise, scales on device
        def fp8_operands():
            sx = (x.abs().amax().float() / 448.0).reshape(())
            sw = (w.abs().amax().float() / 448.0).reshape(())
            return (x.float() / sx).to(torch.float8_e4m3fn), (w.float() / sw).to(torch.float8_e4m3fn), sx, sw

        if self.args.dry_run:
            row["fp8_tensorwise_ms"] = None
        else:
            x8, w8, sx, sw = fp8_operands()
            row["fp8_tensorwise_ms"] = self.measure(
                "FP8 _scaled_mm",
                lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16))
            del x8, w8

        # NVFP4 operands (our Triton quantizers): x 1x16, W 2-D 16x16
        a = quantize_nvfp4(x)
        b = quantize_nvfp4(w, block_2d=True)
        n_rot = T.n_copies(nbytes_q(a) + nbytes_q(b))
        sets = [(a, b)] + [(clone_q(a), clone_q(b)) for _ in range(n_rot - 1)]
        row["rotated_copies"] = n_rot

        def chk(c):
            return check_nvfp4_gemm(c, a, b)

        # pre-dequantized design: total (dequantize both + 16-bit GEMM) and the GEMM alone
        for dot, dt in (("fp16", torch.float16),) + ((("bf16", torch.bfloat16),) if not self.args.dry_run else ()):
            row[f"predequant {dot}_ms"] = self.measure(
                f"NVFP4 predequant {dot}",
                lambda qa, qb, dot=dot: nvfp4_gemm_predequant(qa, qb, torch.bfloat16, dot_dtype=dot), chk, sets)
            try:
                da = dequantize_nvfp4_blockwise_triton(a, dt)
                db = dequantize_nvfp4_blockwise_triton(b, dt)
                alpha = nvfp4_alpha(a.amax, b.amax).reshape(1)
                n16 = T.n_copies((da.numel() + db.numel()) * 2)
                sets16 = [(da, db)] + [(da.clone(), db.clone()) for _ in range(n16 - 1)]
                row[f"gemm16 {dot}_ms"] = self.measure(
                    f"16-bit GEMM {dot}", lambda p, q: gemm_alpha_triton(p, q, alpha, torch.bfloat16), chk, sets16)
                row[f"dequant {dot}_ms"] = self.measure(
                    f"dequant {dot}",
                    lambda qa, qb, dt=dt: (dequantize_nvfp4_blockwise_triton(qa, dt),
                                           dequantize_nvfp4_blockwise_triton(qb, dt)), None, sets)
                del da, db, sets16
            except Exception as e:
                self.failures.append(f"predequant {dot} setup: {e}")

        # the "cublas" engine of the same design: total (dequantize both to bf16, alpha formed in that launch, one
        # cuBLASLt GEMM with alpha in its epilogue), that GEMM alone from bf16 operands, and beside it the design it
        # replaced: cuBLAS with fp32 output (torch.mm) followed by the Triton alpha pass, and the alpha pass alone
        row["cublas-engine total_ms"] = self.measure(
            "NVFP4 predequant cublas engine",
            lambda qa, qb: nvfp4_gemm_predequant(qa, qb, torch.bfloat16, engine="cublas"), chk, sets)
        try:
            da = dequantize_nvfp4_blockwise_triton(a, torch.bfloat16)
            db = dequantize_nvfp4_blockwise_triton(b, torch.bfloat16)
            alpha = nvfp4_alpha(a.amax, b.amax).reshape(1)
            n16 = T.n_copies((da.numel() + db.numel()) * 2)
            sets16 = [(da, db)] + [(da.clone(), db.clone()) for _ in range(n16 - 1)]
            row["cublasLt alpha epilogue_ms"] = self.measure(
                "cuBLASLt, alpha in the epilogue (bf16 operands)",
                lambda p, q: gemm_alpha_cublas(p, q, alpha, torch.bfloat16), chk, sets16)

            def mm_fp32(p, q):
                return torch.mm(p, q.t(), out_dtype=torch.float32) if p.is_cuda else p.float() @ q.float().t()

            row["mm fp32 + alpha pass_ms"] = self.measure(
                "torch.mm fp32 output + alpha pass (bf16 operands)",
                lambda p, q: scale_alpha_triton(mm_fp32(p, q), alpha, torch.bfloat16), chk, sets16)
            acc = mm_fp32(da, db)
            # torch's own fp32 multiply (correctly rounded) and RNE cast, on the whole tensor (no NaN here)
            ref_b = (acc * alpha).to(torch.bfloat16)
            row["alpha pass_ms"] = self.measure(
                "alpha pass (fp32 [M, N] -> bf16)", lambda: scale_alpha_triton(acc, alpha, torch.bfloat16),
                lambda c: None if torch.equal(c.view(torch.int16), ref_b.view(torch.int16))
                else "differs from torch's (acc * alpha).to(bfloat16)")
            del da, db, sets16, acc, ref_b
        except Exception as e:
            self.failures.append(f"cublas engine setup: {type(e).__name__}: {e}")

        # end to end with our quantizers: quantize x, quantize W (2-D), GEMM
        row["quant+gemm_ms"] = self.measure(
            "quantize x + W + nvfp4_gemm (default engine)",
            lambda: nvfp4_gemm(quantize_nvfp4(x), quantize_nvfp4(w, block_2d=True), torch.bfloat16))

        # naive PyTorch emulation: reference quantize (torch ops on the GPU) + dequantize + bf16 matmul
        def naive():
            qa = dequantize_nvfp4_ref(quantize_nvfp4_ref(x)).to(torch.bfloat16)
            qb = dequantize_nvfp4_ref(quantize_nvfp4_ref(w, block_2d=True)).to(torch.bfloat16)
            return torch.matmul(qa, qb.t())

        def naive_check(c):
            # the emulation rounds each dequantized operand to bf16 (inexact by design): loose sanity check
            ref = nvfp4_gemm_ref(slice_q(a, CHECK_ROWS), slice_q(b, CHECK_ROWS), torch.float32)
            rel = (c[:CHECK_ROWS, :CHECK_ROWS].float() - ref).norm() / ref.norm()
            return None if rel < 2e-2 else f"relative error {float(rel):.3g} vs the NVFP4 reference"

        row["naive_ms"] = self.measure("naive emulation", naive, naive_check, slow=True)

        # MXFP4
        row["mxfp4_ms"] = self.mxfp4(x, w)
        del sets, a, b
        if dev == "cuda":
            torch.cuda.empty_cache()
        return row

    def mxfp4(self, x, w) -> float | None:
        try:
            from nvfp4_train.kernels.mxfp4 import quantize_mxfp4
            from nvfp4_train.kernels.mxfp4.gemm import mxfp4_gemm_triton

            a, b = quantize_mxfp4(x), quantize_mxfp4(w)
        except Exception as e:
            self.failures.append(f"MXFP4 setup: {type(e).__name__}: {e}")
            return None
        n_rot = self.timer.n_copies(nbytes_q(a) + nbytes_q(b))
        sets = [(a, b)] + [(clone_mx(a), clone_mx(b)) for _ in range(n_rot - 1)]
        return self.measure("MXFP4 GEMM", lambda qa, qb: mxfp4_gemm_triton(qa, qb, torch.bfloat16),
                            lambda c: check_mxfp4_gemm(c, a, b), sets)

    def sweep(self, M: int, K: int, N: int) -> list[dict]:
        g = torch.Generator(device=self.dev).manual_seed(99)
        a = quantize_nvfp4(torch.randn(M, K, device=self.dev, generator=g).to(torch.bfloat16))
        b = quantize_nvfp4(torch.randn(N, K, device=self.dev, generator=g).to(torch.bfloat16), block_2d=True)
        da = dequantize_nvfp4_blockwise_triton(a, torch.float16)
        db = dequantize_nvfp4_blockwise_triton(b, torch.float16)
        alpha = nvfp4_alpha(a.amax, b.amax).reshape(1)
        out = []
        for cfg in SWEEP_CONFIGS:
            r = dict(config=f"BM{cfg.block_m} BN{cfg.block_n} BK{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}")
            r["fused_ms"] = None
            r["gemm16_ms"] = self.measure(f"sweep gemm16 {cfg}", lambda: gemm_alpha_triton(da, db, alpha, config=cfg),
                                          lambda c: check_nvfp4_gemm(c, a, b))
            r["fused_tflops"] = tflops(M, N, K, r["fused_ms"])
            r["gemm16_tflops"] = tflops(M, N, K, r["gemm16_ms"])
            out.append(r)
        return out

    # --- quantize ---------------------------------------------------------------------------------------
    def quant_rows(self, K: int, M: int) -> list[dict]:
        dev = self.dev
        g = torch.Generator(device=dev).manual_seed(7)
        x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
        n = x.numel()
        writes = n // 2 + n // 16 + n // 2 + n // 16  # row codes + scales, col codes + scales
        rows = []
        for mode, kw in (("activation (RNE)", dict()),
                         ("gradient (SR)", dict(row_stochastic=True, col_stochastic=True, row_seed=1, col_seed=2))):
            r = dict(K=K, M=M, mode=mode)
            label = f"quantize K={K} {mode}"

            def check(out, kw=kw):
                ref = quantize_nvfp4_rowcol_ref(x, col_rht=True, **kw)
                ok = same_q(out[0], ref[0]) and same_q(out[1], ref[1])
                return None if ok else "differs from quantize_nvfp4_rowcol_ref"

            ms = self.measure(label, lambda kw=kw: quantize_nvfp4_rowcol(x, col_rht=True, **kw), check)
            r["ms"] = ms
            if ms is not None:
                r["GB/s actual"] = (2 * 2 * n + writes) / (ms * 1e-3) / 1e9
                r["GB/s effective"] = (2 * n + writes) / (ms * 1e-3) / 1e9
            row_q, col_q = quantize_nvfp4_rowcol(x, col_rht=True, **kw)
            ms_a = self.measure(
                label + " (amax given)",
                lambda kw=kw: quantize_nvfp4_rowcol(x, col_rht=True, row_amax=row_q.amax, col_amax=col_q.amax, **kw),
                lambda out: None if (same_q(out[0], row_q) and same_q(out[1], col_q)) else "differs with amax given")
            r["amax_given_ms"] = ms_a
            if ms_a is not None:
                r["amax_given GB/s"] = (2 * n + writes) / (ms_a * 1e-3) / 1e9
            rows.append(r)
        return rows


def clone_q(q: NVFP4Tensor) -> NVFP4Tensor:
    return NVFP4Tensor(codes=q.codes.clone(), scales=q.scales.clone(), amax=q.amax.clone(), block_2d=q.block_2d)


def clone_mx(q):
    return type(q)(codes=q.codes.clone(), scales=q.scales.clone())


# ----------------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------------


def fmt(v, spec=".0f") -> str:
    return "–" if v is None else format(v, spec)


def ratio(a, b):
    return None if (a is None or b is None or b == 0) else a / b


def pct(a, b):
    r = ratio(a, b)
    return None if r is None else 100 * r


def print_tables(res: dict) -> None:
    p = print
    p(f"# Kernel benchmark ({res['device']}; torch {res['torch']}, triton {res['triton']})\n")
    p(f"Device-to-device copy: {res['copy_GBps']:.0f} GB/s (bytes read + written). M = {res['M']} tokens. "
      "TFLOP/s = 2MNK / median time.\n")
    p("## GEMM TFLOP/s\n")
    p("| GEMM | K | N | cuBLAS BF16 | FP8 tensorwise | NVFP4 fused | fused/cuBLAS | fused/FP8 | predequant total "
      "| 16-bit GEMM only | cuBLAS-engine total | /cuBLAS | cuBLASLt alpha epilogue only | /cuBLAS "
      "| MXFP4 | naive emulation ms | ×naive (GEMM) | ×naive (quant+GEMM) | ×naive ceiling (cuBLAS BF16) |")
    p("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    # ×naive: the naive emulation's time over ours, ours = the default engine's GEMM from NVFP4 operands
    # (dequantize both + GEMM), and quantize x + W + that GEMM; the ceiling is the naive time over cuBLAS BF16's
    # (no exact NVFP4 GEMM on Hopper's BF16 tensor cores can be faster than the BF16 GEMM it ends in)
    default_key = "cublas-engine total_ms" if DEFAULT_GEMM_ENGINE == "cublas" else "predequant fp16_ms"
    for r in res["gemm"]:
        M, K, N = r["M"], r["K"], r["N"]
        t = {k[:-3]: tflops(M, N, K, v) for k, v in r.items() if k.endswith("_ms")}
        best_pre = max((v for k, v in t.items() if k.startswith("predequant") and v is not None), default=None)
        best_16 = max((v for k, v in t.items() if k.startswith("gemm16") and v is not None), default=None)
        fused = t.get("fused fp16")
        cub_tot, cub_16 = t.get("cublas-engine total"), t.get("cublasLt alpha epilogue")
        p(f"| {r['gemm']} | {K} | {N} | {fmt(t.get('cublas_bf16'))} | {fmt(t.get('fp8_tensorwise'))} "
          f"| {fmt(fused)} | {fmt(ratio(fused, t.get('cublas_bf16')), '.2f')} "
          f"| {fmt(ratio(fused, t.get('fp8_tensorwise')), '.2f')} | {fmt(best_pre)} | {fmt(best_16)} "
          f"| {fmt(cub_tot)} | {fmt(ratio(cub_tot, t.get('cublas_bf16')), '.2f')} "
          f"| {fmt(cub_16)} | {fmt(ratio(cub_16, t.get('cublas_bf16')), '.2f')} "
          f"| {fmt(t.get('mxfp4'))} | {fmt(r.get('naive_ms'), '.2f')} "
          f"| {fmt(ratio(r.get('naive_ms'), r.get(default_key)), '.1f')} "
          f"| {fmt(ratio(r.get('naive_ms'), r.get('quant+gemm_ms')), '.1f')} "
          f"| {fmt(ratio(r.get('naive_ms'), r.get('cublas_bf16_ms')), '.1f')} |")
    p("\n## NVFP4 GEMM variants, TFLOP/s (ratio to cuBLAS BF16)\n")
    keys = [lbl for lbl, _ in FUSED_VARIANTS] + ["predequant fp16", "predequant bf16", "gemm16 fp16", "gemm16 bf16",
                                                 "cublas-engine total", "cublasLt alpha epilogue",
                                                 "mm fp32 + alpha pass"]
    p("| GEMM | " + " | ".join(keys) + " | dequant fp16 ms | dequant bf16 ms | alpha pass ms |")
    p("|---|" + "---|" * (len(keys) + 3))
    for r in res["gemm"]:
        M, K, N = r["M"], r["K"], r["N"]
        cub = tflops(M, N, K, r.get("cublas_bf16_ms"))
        cells = []
        for k in keys:
            v = tflops(M, N, K, r.get(f"{k}_ms"))
            cells.append("–" if v is None else f"{v:.0f} ({fmt(ratio(v, cub), '.2f')})")
        p(f"| {r['gemm']} | " + " | ".join(cells)
          + f" | {fmt(r.get('dequant fp16_ms'), '.3f')} | {fmt(r.get('dequant bf16_ms'), '.3f')} "
          f"| {fmt(r.get('alpha pass_ms'), '.3f')} |")
    p("\n## NVFP4 quantize (x [M, K] bf16 -> rowwise + columnwise RHT copies)\n")
    p("| K | mode | ms | GB/s actual (2 reads) | % copy | GB/s effective (1 read) | % copy | amax given ms "
      "| GB/s (1 read) | % copy |")
    p("|---|---|---|---|---|---|---|---|---|---|")
    bw = res["copy_GBps"]
    for r in res["quantize"]:
        ga, ge, gg = r.get("GB/s actual"), r.get("GB/s effective"), r.get("amax_given GB/s")
        p(f"| {r['K']} | {r['mode']} | {fmt(r.get('ms'), '.3f')} | {fmt(ga)} | {fmt(pct(ga, bw))} "
          f"| {fmt(ge)} | {fmt(pct(ge, bw))} | {fmt(r.get('amax_given_ms'), '.3f')} | {fmt(gg)} | {fmt(pct(gg, bw))} |")
    if res.get("sweep"):
        p("\n## Config sweep (fused fp16 / 16-bit GEMM TFLOP/s)\n")
        for name, rows in res["sweep"].items():
            p(f"### {name}\n\n| config | fused | 16-bit GEMM |\n|---|---|---|")
            for r in rows:
                p(f"| {r['config']} | {fmt(r['fused_tflops'])} | {fmt(r['gemm16_tflops'])} |")
            p("")
    if res["failures"]:
        p("\n## FAILURES\n")
        for f in res["failures"]:
            p(f"- {f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="also write the raw numbers to this JSON file")
    ap.add_argument("--quick", action="store_true", help=f"only {QUICK_SHAPES}, fewer repetitions")
    ap.add_argument("--sweep", action="store_true", help="time every SWEEP_CONFIGS entry per shape")
    ap.add_argument("--shapes", nargs="*", help="subset of GEMM names (default: all)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU smoke test of this script under TRITON_INTERPRET=1 (tiny shapes, no timing value)")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failing variants")
    ap.add_argument("--quantize-only", action="store_true", help="only the NVFP4 quantize table (no GEMMs)")
    ap.add_argument("--gemm-only", action="store_true", help="only the GEMM tables (no quantize table)")
    args = ap.parse_args(argv)

    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--dry-run needs TRITON_INTERPRET=1 in the environment (set before Python starts)")
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --dry-run under TRITON_INTERPRET=1)")

    shapes = SHAPES
    if args.quick:
        shapes = [s for s in SHAPES if s[0] in QUICK_SHAPES]
    if args.shapes:
        shapes = [s for s in SHAPES if s[0] in args.shapes]
    M = M_TOKENS
    if args.dry_run:  # tiny stand-ins with the same structure
        M = 160
        shapes = [(n, 32 * (k // 2560) + 64, 16 * (nn // 2560) + 48) for n, k, nn in shapes[:2]]

    run = Run(args)
    dev_name = torch.cuda.get_device_name(0) if not args.dry_run else f"CPU interpreter ({platform.machine()})"
    res = dict(device=dev_name, torch=torch.__version__, triton=triton.__version__, M=M,
               copy_GBps=run.copy_bandwidth(), gemm=[], quantize=[], sweep={}, failures=run.failures)
    for name, K, N in [] if args.quantize_only else shapes:
        print(f"[{name}: M={M} K={K} N={N}]", file=sys.stderr, flush=True)
        res["gemm"].append(run.gemm_row(name, M, K, N))
        if args.sweep:
            res["sweep"][name] = run.sweep(M, K, N)
    for K in [] if args.gemm_only else sorted({K for _, K, _ in shapes}):
        print(f"[quantize K={K}]", file=sys.stderr, flush=True)
        res["quantize"].extend(run.quant_rows(K, M))

    print_tables(res)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1, default=str))
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
