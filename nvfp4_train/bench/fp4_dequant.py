"""The FP4 GEMM's dequantize launch on the `1.2b` and 12B GEMM operand pairs: every launch configuration of a
sweep, checked bit for bit, timed.

The "cublas" GEMM engine dequantizes both NVFP4 operands of each GEMM in one launch (``kernels/fp4_gemm.py``,
``_dequant_pair``: ``q * block_scale`` into bf16, exact) before the cuBLASLt GEMM. For the operand pairs of the three
GEMMs of a linear layer (Fprop: x [M, K] and W [N, K]; Dgrad: dy [M, N] and W^T [K, N]; Wgrad: dy^T [N, M] and
x^T [K, M]; M = 8192 tokens) it runs the launch under each configuration of the sweep (row tile, K tile, warps).
The reference is ``_blockwise_values`` of ``kernels/nvfp4/reference.py`` rounded to bf16 (exact); the bytes a launch
must move are the codes and scales read once and bf16 written once. The check, the timing, the table and the exit
status are ``nvfp4_train.bench.sweep``'s.

Usage (repo root)::

    python3 scripts/bench_fp4_dequant.py --json dequant.json          # GPU
    TRITON_INTERPRET=1 python3 scripts/bench_fp4_dequant.py --quick   # CPU smoke test: tiny shapes, two configs
"""

from __future__ import annotations

import sys

import torch

from nvfp4_train.bench.sweep import Case, Config, run_sweep, sweep_main

M_TOKENS = 8192
# (name, rows of A, rows of B, K): the operand pairs of the GEMMs of a linear layer, `1.2b` (hidden 2048, MLP 6144)
# and the 12B (hidden 5120, MLP 20480)
CASES = (
    ("1.2b fc1 Fprop", M_TOKENS, 6144, 2048),
    ("1.2b fc1 Dgrad", M_TOKENS, 2048, 6144),
    ("1.2b fc1 Wgrad", 6144, 2048, M_TOKENS),
    ("1.2b qkv Fprop", M_TOKENS, 4096, 2048),
    ("12B fc1 Fprop", M_TOKENS, 20480, 5120),
    ("12B fc2 Wgrad", 5120, 20480, M_TOKENS),
)
QUICK_CASES = (("pair", 64, 48, 256), ("odd rows", 37, 20, 128))
# (block_m, block_k, num_warps) tried besides the library's default launch (16 x 512, 4 warps; 64 x 128, 4 warps before)
SWEEP = ((64, 128, 4), (32, 128, 4), (64, 256, 4), (64, 256, 8), (128, 128, 8), (32, 256, 4), (128, 256, 8),
         (64, 512, 8))


def _operand(rows: int, k: int, g: torch.Generator, device: torch.device):
    """Random codes (every byte) and finite E4M3 scales (every byte but the two NaNs) as an NVFP4Tensor."""
    from nvfp4_train.kernels.nvfp4.reference import NVFP4Tensor

    codes = torch.randint(0, 256, (rows, k // 2), generator=g, device=device, dtype=torch.int32).to(torch.uint8)
    s = torch.randint(0, 254, (rows, k // 16), generator=g, device=device, dtype=torch.int32)
    s = torch.where(s >= 0x7F, s + 1, s).to(torch.uint8)  # skip 0x7F (and 0xFF: the draw stops at 0xFE)
    return NVFP4Tensor(codes=codes, scales=s.view(torch.float8_e4m3fn), amax=torch.ones((), device=device))


def _launch(a, b, cfg: Config):
    from nvfp4_train.kernels.fp4_gemm import _dequant_pair

    kw = {} if cfg is None else dict(zip(("block_m", "block_k", "num_warps"), cfg))
    return _dequant_pair(a.codes, a.scales, b.codes, b.scales, block=16, scale_format="e4m3", dtype=torch.bfloat16,
                         **kw)[:2]


def _reference(a, b) -> list[torch.Tensor]:
    from nvfp4_train.kernels.nvfp4.reference import _blockwise_values

    return [_blockwise_values(q).to(torch.bfloat16) for q in (a, b)]


def _same(out, ref: list[torch.Tensor]) -> bool:
    return len(out) == len(ref) and all(
        x.shape == y.shape and torch.equal(x.contiguous().view(torch.int16), y.view(torch.int16))
        for x, y in zip(out, ref))


def _bytes(rows_a: int, rows_b: int, k: int) -> int:
    n = (rows_a + rows_b) * k
    return n // 2 + n // 16 + 2 * n


def run(args) -> tuple[list[dict], bool]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(args.seed)

    def case(name, ra, rb, k):
        return Case(fields={"pair": name, "a": [ra, k], "b": [rb, k]}, cells=(name, f"{ra}x{k}", f"{rb}x{k}"),
                    make=lambda: (_operand(ra, k, g, device), _operand(rb, k, g, device)),
                    reference=lambda ab: _reference(*ab), configs=SWEEP[:1] if args.quick else SWEEP,
                    nbytes=_bytes(ra, rb, k))

    return run_sweep([case(*c) for c in (QUICK_CASES if args.quick else CASES)],
                     lambda ab, cfg: _launch(ab[0], ab[1], cfg), _same, ("pair", "A", "B"), device, args.quick)


def main(argv=None) -> int:
    return sweep_main(argv, __doc__.split("\n")[0], run)


if __name__ == "__main__":
    sys.exit(main())
