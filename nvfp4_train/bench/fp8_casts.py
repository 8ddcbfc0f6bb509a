"""The FP8 cast kernels on the 12B shapes: every launch configuration of a sweep, checked bit for bit, timed.

For each tensor a 12B linear layer casts (M = 8192 tokens: x and dy with 1x128 blocks, both copies in one pass
as ``quantize_fp8_rowcol`` writes them; x rowwise only; W with 128x128 tiles; the per-tensor cast with its amax
pass), and the two-copy casts of ``1.2b``'s widest layer, it runs ``kernels/fp8/quantize.py``'s launch under each
configuration of the sweep (tile rows and columns, warps; for both 1x128 copies, ``_fp8_rowcol_grouped_kernel``'s
rows per step, 128, warps). The outputs compared with the reference (``kernels/fp8/reference.py`` on the same device) are the data
bytes and scales of every copy; the bytes a cast must move are the bf16 input read once and every copy written once.
The check, the timing, the table and the exit status are ``nvfp4_train.bench.sweep``'s.

Usage (repo root)::

    python3 scripts/bench_fp8_casts.py --json casts.json           # GPU
    TRITON_INTERPRET=1 python3 scripts/bench_fp8_casts.py --quick  # CPU smoke test: tiny shapes, two configs
"""

from __future__ import annotations

import sys

import torch

from nvfp4_train.bench.sweep import Case, Config, run_sweep, sweep_main

M_TOKENS = 8192
# (name, rows, cols, mode): mode "rowcol" = 1x128 rowwise + columnwise copies, "row" = 1x128 rowwise only,
# "tile" = 128x128 (both copies), "tensor" = per tensor (both copies, amax pass included)
CASES = (
    ("x of fc2", M_TOKENS, 20480, "rowcol"),
    ("x of in_proj", M_TOKENS, 5120, "rowcol"),
    ("dy of in_proj", M_TOKENS, 22656, "rowcol"),
    ("x of fc1, 1.2b", M_TOKENS, 2048, "rowcol"),
    ("dy of fc1, 1.2b", M_TOKENS, 6144, "rowcol"),
    ("x of fc2, rowwise", M_TOKENS, 20480, "row"),
    ("W of in_proj", 22656, 5120, "tile"),
    ("W of fc2", 5120, 20480, "tile"),
    ("x of fc2, per tensor", M_TOKENS, 20480, "tensor"),
    ("dy of in_proj, per tensor", M_TOKENS, 22656, "tensor"),
)
QUICK_CASES = (("x", 256, 384, "rowcol"), ("x rowwise", 128, 384, "row"), ("W", 256, 384, "tile"),
               ("x per tensor", 128, 256, "tensor"))
# (block_m, block_k, num_warps) tried besides the library's default launch; "rowcol": (chunk rows, 128, num_warps)
SWEEPS = {
    "rowcol": ((32, 128, 4), (16, 128, 4), (64, 128, 4), (32, 128, 8), (128, 128, 8)),
    "row": ((32, 128, 8), (64, 128, 8), (16, 256, 4), (32, 256, 8), (64, 256, 8), (128, 128, 8)),
    "tile": ((128, 128, 4), (128, 128, 16)),
    "tensor": ((64, 128, 4), (128, 64, 4), (128, 128, 8), (32, 128, 4), (128, 128, 4)),
}


def _launch(x: torch.Tensor, mode: str, cfg: Config):
    from nvfp4_train.kernels.fp8.quantize import quantize_fp8_blockwise_triton, quantize_fp8_tensorwise_triton

    if cfg is not None and mode == "rowcol":
        return quantize_fp8_blockwise_triton(x, (1, 128), write_row=True, write_col=True, chunk_m=cfg[0],
                                             num_warps=cfg[2])
    kw = {} if cfg is None else dict(zip(("block_m", "block_k", "num_warps"), cfg))
    if mode == "tensor":
        return quantize_fp8_tensorwise_triton(x, write_col=True, **kw)
    block = (128, 128) if mode == "tile" else (1, 128)
    return quantize_fp8_blockwise_triton(x, block, write_row=True, write_col=mode != "row", **kw)


def _reference(x: torch.Tensor, mode: str) -> list[torch.Tensor]:
    """The reference's outputs in the launch's order (data as bytes)."""
    from nvfp4_train.kernels.fp8.reference import quantize_fp8_blockwise_ref, quantize_fp8_rowcol_ref

    if mode == "row":
        q = quantize_fp8_blockwise_ref(x, (1, 128))
        return [q.data.view(torch.uint8), q.scale_inv]
    row, col = quantize_fp8_rowcol_ref(x, None if mode == "tensor" else ((128, 128) if mode == "tile" else (1, 128)),
                                       None)
    if mode == "tensor":
        return [row.data.view(torch.uint8), col.data.view(torch.uint8), row.scale_inv]
    return [row.data.view(torch.uint8), row.scale_inv, col.data.view(torch.uint8), col.scale_inv]


def _same(out, ref: list[torch.Tensor]) -> bool:
    got = [t for t in out if t is not None]
    if len(got) != len(ref):
        return False
    # bit for bit in logical order (a scale may be stored transposed; a 0-d one comes back as [1])
    return all(a.dtype == b.dtype and a.numel() == b.numel()
               and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
               for a, b in zip(got, ref))


def _bytes(rows: int, cols: int, mode: str) -> int:
    """Bytes the cast must move: bf16 in once, one byte per element per copy out, fp32 scales."""
    n = rows * cols
    copies = 1 if mode == "row" else 2
    scales = {"rowcol": n // 128 * 2, "row": n // 128, "tile": n // (128 * 128) * 2, "tensor": 1}[mode]
    return 2 * n + copies * n + 4 * scales


def run(args) -> tuple[list[dict], bool]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(args.seed)

    def case(name, rows, cols, mode):
        def make():  # (x, mode): what a launch and the reference take
            return (torch.randn(rows, cols, device=device, generator=g) * 3).bfloat16(), mode

        return Case(fields={"tensor": name, "rows": rows, "cols": cols, "mode": mode},
                    cells=(name, f"{rows}x{cols}", mode), make=make, reference=lambda xm: _reference(*xm),
                    configs=SWEEPS[mode][:1] if args.quick else SWEEPS[mode], nbytes=_bytes(rows, cols, mode))

    return run_sweep([case(*c) for c in (QUICK_CASES if args.quick else CASES)],
                     lambda xm, cfg: _launch(xm[0], xm[1], cfg), _same, ("tensor", "shape", "mode"), device,
                     args.quick)


def main(argv=None) -> int:
    return sweep_main(argv, __doc__.split("\n")[0], run)


if __name__ == "__main__":
    sys.exit(main())
