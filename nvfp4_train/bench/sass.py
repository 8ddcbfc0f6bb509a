"""Static SASS of a Triton kernel, compiled for a GPU this machine need not have: instructions per element.

The fused NVFP4 quantizer is bound by instruction issue (docs/benchmarks.md, "Kernels"), so what predicts its speed
is the number of instructions each element costs. This module compiles a kernel with Triton for an NVIDIA target
(sm_90 by default) on any machine: Triton's own ``ptxas`` assembles it and its ``nvdisasm`` disassembles the cubin,
no GPU or driver needed. It then counts the kernel's instructions by opcode and divides by the elements one program
handles. The counts are static: a loop body counts once, so "per element" is exact for a kernel without loops (the
quantize kernel, fully unrolled); for one whose loops run a known number of times (``loop_trips``), each loop's
body is counted that many times (``count_opcodes(sass, loop_trips)``). Branches taken by no thread count too.

The launch specializations of Triton's runtime are given explicitly: every pointer and the integers that the runtime
finds divisible by 16 (M, K and the row stride of a 16-aligned tensor) carry ``tt.divisibility = 16``, and a unit
stride is a constexpr, as when the kernel is launched on a contiguous tensor. Without them the loads are not
vectorized and the count is not the one the GPU runs.

Usage (repo root)::

    python3 scripts/sass_count.py                        # the quantize kernel, RNE, its default 64x128 tile
    python3 scripts/sass_count.py --sr --sass q.sass     # stochastic rounding; the disassembly written to q.sass
    python3 scripts/sass_count.py --fp8-blockwise --block-m 32         # the FP8 1x128 cast, the rowwise copy
    python3 scripts/sass_count.py --fp8-rowcol --chunk-m 64 --num-warps 8   # FP8 1x128, both copies (grouped)
"""

from __future__ import annotations

import argparse
import inspect
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_INSTR = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)[.\s;]")


@dataclass
class SassCount:
    """``total`` instructions of one program, ``by_op`` per opcode (modifiers dropped), for ``threads`` threads
    and ``elements`` elements per program; ``registers`` per thread where known."""

    total: int
    by_op: Counter
    threads: int
    elements: int
    sass: str
    registers: int | None = None  # per thread, as ptxas allocated them (``cuobjdump -res-usage``)

    def per_element(self, n: int | None = None) -> float:
        """Instructions per element: of all opcodes, or ``n`` instructions (one opcode's count)."""
        return (self.total if n is None else n) * self.threads / self.elements


def _nvidia_tool(name: str) -> Path:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path}: this Triton installation has no {name} (it ships with the NVIDIA backend)")
    return path


def have_nvidia_tools() -> bool:
    """Whether this Triton installation ships ``ptxas``, ``nvdisasm`` and ``cuobjdump`` (what compiling to SASS and
    reading its register count need)."""
    try:
        _nvidia_tool("ptxas"), _nvidia_tool("nvdisasm"), _nvidia_tool("cuobjdump")
    except FileNotFoundError:
        return False
    return True


_ADDR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\s+(?:`\()?(\.L_x_\d+)")


def count_opcodes(sass: str, loop_trips: tuple[int, ...] = ()) -> Counter:
    """Opcode -> count over the instruction lines of an ``nvdisasm`` listing (predicates and modifiers dropped).
    ``loop_trips``: how many times each loop runs, in the order of the listing (a loop is a branch back to a label
    above it; nested loops are not told apart): its body's instructions count that many times."""
    instrs, labels, pending = [], {}, []
    for line in sass.splitlines():
        lab = _LABEL.match(line)
        if lab:
            pending.append(lab.group(1))
            continue
        addr = _ADDR.match(line)
        if addr:
            a = int(addr.group(1), 16)
            labels.update((p, a) for p in pending)
            pending = []
            m = _INSTR.match(line)
            if m:
                instrs.append((a, m.group(1), line))
    loops = []
    for a, _, line in instrs:
        b = _BRANCH.search(line)
        if b and labels.get(b.group(1), a) < a:
            loops.append((labels[b.group(1)], a))
    if loop_trips and len(loops) != len(loop_trips):
        raise ValueError(f"the listing has {len(loops)} loops, {len(loop_trips)} trip counts were given")
    ops: Counter = Counter()
    for a, op, _ in instrs:
        ops[op] += next((n for (lo, hi), n in zip(loops, loop_trips) if lo <= a <= hi), 1)
    return ops


def compile_sass(kernel, signature: dict[str, str], constexprs: dict[str, object], divisible: list[str],
                 num_warps: int, arch: int = 90, options: dict | None = None) -> str:
    """The SASS listing of the ``@triton.jit`` function ``kernel`` compiled for sm_``arch``: ``signature`` gives
    each runtime argument's Triton type (``*bf16``, ``i32``, ...), ``constexprs`` the value of every constexpr
    parameter, ``divisible`` the arguments the runtime would specialize as divisible by 16."""
    return compile_kernel(kernel, signature, constexprs, divisible, num_warps, arch, options)[0]


def compile_for_gpu(kernel, signature: dict[str, str], constexprs: dict[str, object], divisible: list[str],
                    arch: int, options: dict):
    """Triton's compiled kernel for ``sm_<arch>`` on any machine: ``signature`` the types of the runtime arguments,
    ``constexprs`` the values of the others, ``divisible`` the arguments given ``tt.divisibility = 16``, ``options``
    Triton's (``num_warps``, ...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    unknown = (set(signature) | set(constexprs) | set(divisible)) - set(names)
    if unknown:
        raise ValueError(f"{kernel.fn.__name__} has no parameter {', '.join(sorted(unknown))}")
    missing = set(names) - set(signature) - set(constexprs)
    if missing:
        raise ValueError(f"no type or constexpr value for {', '.join(sorted(missing))}")
    sig = {n: signature.get(n, "constexpr") for n in names}
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def compile_kernel(kernel, signature: dict[str, str], constexprs: dict[str, object], divisible: list[str],
                   num_warps: int, arch: int = 90, options: dict | None = None) -> tuple[str, int]:
    """``compile_sass``'s listing and the registers per thread ptxas gave the kernel."""
    compiled = compile_for_gpu(kernel, signature, constexprs, divisible, arch,
                               dict(num_warps=num_warps, **(options or {})))
    with tempfile.TemporaryDirectory(prefix="sass_") as tmp:  # nvdisasm reads a file, not a pipe
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        proc = subprocess.run([str(_nvidia_tool("nvdisasm")), "-c", str(cubin)], capture_output=True)
        res = subprocess.run([str(_nvidia_tool("cuobjdump")), "-res-usage", str(cubin)], capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {proc.stderr.decode(errors='replace').strip()}")
    regs = re.search(r"\bREG:(\d+)", res.stdout.decode())
    if res.returncode != 0 or regs is None:
        raise RuntimeError(f"cuobjdump -res-usage failed: {res.stderr.decode(errors='replace').strip()}")
    return proc.stdout.decode(), int(regs.group(1))


def _tile_kernel_count(kernel, pointers: dict[str, str], ints: dict[str, str], constexprs: dict[str, object],
                       num_warps: int, arch: int, elements: int, options: dict | None = None,
                       loop_trips: tuple[int, ...] = ()) -> SassCount:
    """``kernel`` compiled as launched on a contiguous tensor (every pointer and M, K, stride_m divisible by 16), its
    opcodes counted per program of ``elements`` elements (loops by ``loop_trips``)."""
    sass, regs = compile_kernel(kernel, {**pointers, **ints}, constexprs, divisible=[*pointers, "M", "K", "stride_m"],
                                num_warps=num_warps, arch=arch, options=options)
    ops = count_opcodes(sass, loop_trips)
    return SassCount(sum(ops.values()), ops, 32 * num_warps, elements, sass, regs)


def quantize_kernel_sass(sr: bool = False, block_m: int = 64, block_k: int = 128, num_warps: int = 4,
                         arch: int = 90) -> SassCount:
    """The fused NVFP4 quantize kernel as the linear layers launch it on a contiguous bf16 tensor (both copies, the
    columnwise one Hadamard-mixed; ``sr``: stochastic rounding on both copies, as for a gradient, else
    round-to-nearest-even), on the GPU path (hardware conversions, inline PTX)."""
    from nvfp4_train.kernels.nvfp4.quantize import _quantize_grouped_kernel

    pointers = dict(x_ptr="*bf16", amax_ptr="*fp32", row_codes_ptr="*u8", row_scales_ptr="*u8",
                    col_words_ptr="*i64", col_scales_ptr="*u8", amax_out_ptr="*fp32", enc_tab_ptr="*fp32")
    ints = dict(M="i32", K="i32", stride_m="i32", row_key="i64", col_key="i64")
    constexprs = dict(WRITE_ROW=True, WRITE_COL=True, BLOCK_2D=False, COL_RHT=True, ROW_SR=sr, COL_SR=sr,
                      IS_BF16=True, NATIVE_CVT=True, EVEN=True, BM=block_m, BK=block_k, ASM=True, SWIZZLE=False,
                      KEY_PTR=False, stride_k=1)
    return _tile_kernel_count(_quantize_grouped_kernel, pointers, ints, constexprs, num_warps, arch,
                              block_m * block_k, options=dict(enable_fp_fusion=False))


def fp8_blockwise_kernel_sass(block_m: int = 32, block_k: int = 128, num_warps: int = 4, arch: int = 90) -> SassCount:
    """The FP8 1x128 tile kernel (``kernels/fp8/quantize.py``) writing the rowwise copy alone, as launched on a
    contiguous bf16 tensor, with the GPU's E4M3 conversion (production launch: 32 x 128 on 4 warps)."""
    from nvfp4_train.kernels.fp8.quantize import _fp8_blockwise_kernel

    pointers = dict(x_ptr="*i16", row_data_ptr="*u8", row_sinv_ptr="*fp32", col_data_ptr="*u8", col_sinv_ptr="*fp32")
    ints = dict(M="i32", K="i32", stride_m="i32")
    constexprs = dict(WRITE_ROW=True, WRITE_COL=False, TILE_2D=False, BF16_BITS=True, NATIVE=True,
                      BM=block_m, BK=block_k, stride_k=1)
    return _tile_kernel_count(_fp8_blockwise_kernel, pointers, ints, constexprs, num_warps, arch, block_m * block_k)


def fp8_rowcol_grouped_kernel_sass(chunk_m: int = 64, num_warps: int = 8, arch: int = 90,
                                   table: bool = True) -> SassCount:
    """``_fp8_rowcol_grouped_kernel`` (both 1x128 copies, ``kernels/fp8/quantize.py``) as launched on a contiguous
    bf16 tensor: a [128, 128] tile per program, ``chunk_m`` rows per iteration of its two loops (each runs
    128 / ``chunk_m`` times and counts so), the scales from the table (``table``) or by division (production
    launch: 64 rows on 8 warps, the table)."""
    from nvfp4_train.kernels.fp8.quantize import _fp8_rowcol_grouped_kernel

    pointers = dict(x_ptr="*i16", row_ptr="*i32", row_sinv_ptr="*fp32", col_ptr="*i32", col_sinv_ptr="*fp32",
                    tab_ptr="*i64")
    ints = dict(M="i32", K="i32", stride_m="i32")
    constexprs = dict(BF16_BITS=True, NATIVE=True, TABLE=table, CM=chunk_m, stride_k=1)
    trips = 128 // chunk_m
    return _tile_kernel_count(_fp8_rowcol_grouped_kernel, pointers, ints, constexprs, num_warps, arch, 128 * 128,
                              options=dict(enable_fp_fusion=False, enable_reflect_ftz=False),
                              loop_trips=(trips, trips) if trips > 1 else ())


def report(c: SassCount, top: int) -> str:
    regs = "" if c.registers is None else f", {c.registers} registers per thread"
    lines = [f"{c.total} instructions per program, {c.threads} threads, {c.elements} elements: "
             f"{c.per_element():.2f} per element{regs}", "", "| opcode | count | per element |", "|---|---:|---:|"]
    lines += [f"| {op} | {n} | {c.per_element(n):.2f} |" for op, n in c.by_op.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sr", action="store_true", help="stochastic rounding on both copies (a gradient's)")
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--block-k", type=int, default=128)
    ap.add_argument("--num-warps", type=int, help="default: the kernel's production launch (8 for --fp8-rowcol, "
                                                   "else 4)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability as an integer (90 = sm_90)")
    ap.add_argument("--top", type=int, default=30, help="opcodes listed, most frequent first")
    ap.add_argument("--sass", type=Path, help="also write the disassembly here")
    ap.add_argument("--fp8-blockwise", action="store_true",
                    help="the FP8 1x128 tile kernel writing the rowwise copy instead (--block-m x --block-k)")
    ap.add_argument("--fp8-rowcol", action="store_true",
                    help="the FP8 grouped kernel writing both 1x128 copies instead (--chunk-m rows per step)")
    ap.add_argument("--chunk-m", type=int, default=64)
    ap.add_argument("--divide", action="store_true", help="with --fp8-rowcol: scales by division (fp32 input)")
    a = ap.parse_args(argv)
    if a.num_warps is None:
        a.num_warps = 8 if a.fp8_rowcol else 4
    if a.fp8_rowcol:
        c = fp8_rowcol_grouped_kernel_sass(a.chunk_m, a.num_warps, a.arch, not a.divide)
        print(f"# FP8 grouped kernel, both 1x128 copies, 128x128 tile in chunks of {a.chunk_m} rows, {a.num_warps} "
              f"warps, sm_{a.arch}, scales {'by division' if a.divide else 'from the table'}\n")
    elif a.fp8_blockwise:
        c = fp8_blockwise_kernel_sass(a.block_m, a.block_k, a.num_warps, a.arch)
        print(f"# FP8 1x128 cast kernel, the rowwise copy, {a.block_m}x{a.block_k}, {a.num_warps} warps, "
              f"sm_{a.arch}\n")
    else:
        c = quantize_kernel_sass(a.sr, a.block_m, a.block_k, a.num_warps, a.arch)
        print(f"# NVFP4 quantize kernel, {'SR' if a.sr else 'RNE'}, {a.block_m}x{a.block_k}, {a.num_warps} warps, "
              f"sm_{a.arch}\n")
    print(report(c, a.top))
    if a.sass:
        a.sass.write_text(c.sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
