"""The operand layouts of the Blackwell block-scaled FP4 GEMM (``gemm_engine=native``). Imports only torch.

Codes: our packed E2M1 codes (uint8 [rows, K/2], element 2j in the LOW nibble, 2j+1 in the HIGH nibble) are
already the byte layout of ``torch.float4_e2m1fn_x2`` and of the tensor cores' FP4 operands, so the native
GEMM reinterprets them (``as_float4_x2``, a view: no copy, no pass).

Scales: the block-scaled GEMM (cuBLAS's "1D block scaling factors layout", ``SwizzleType.SWIZZLE_32_4_4`` in
torch) reads a [rows, n_blocks] scale matrix (rows = M or N, n_blocks = K/16 for NVFP4, K/32 for MXFP4)
padded with zeros to ``round_up(rows, 128) x round_up(n_blocks, 4)`` and cut into 128 x 4 tiles. The tiles
are stored one after the other, row of tiles by row of tiles (tile (tr, tc) is tile number
``tr * ceil(n_blocks / 4) + tc``), 512 bytes each; inside a tile, element (r, c) (r < 128, c < 4) sits at
byte ``(r % 32) * 16 + (r // 32) * 4 + c``: the 32 x 16 arrangement in which 4 rows 32 apart and their 4
block columns form one 16-byte line. ``blocked_offset`` is that formula; the quantizers store each scale
byte at it directly (``swizzled=True``), ``to_blocked`` / ``from_blocked`` convert a row-major matrix.
The padding bytes are zero (they multiply codes that do not exist: rows past M/N, blocks past K).
"""

from __future__ import annotations

import torch

TILE_ROWS = 128
TILE_COLS = 4
TILE_BYTES = TILE_ROWS * TILE_COLS

__all__ = [
    "TILE_ROWS",
    "TILE_COLS",
    "blocked_shape",
    "blocked_numel",
    "blocked_offset",
    "to_blocked",
    "from_blocked",
    "as_float4_x2",
]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def blocked_shape(rows: int, cols: int) -> tuple[int, int]:
    """(padded rows, padded block columns) of the swizzled layout of a [rows, cols] scale matrix."""
    return _round_up(rows, TILE_ROWS), _round_up(cols, TILE_COLS)


def blocked_numel(rows: int, cols: int) -> int:
    """Bytes of the swizzled scale buffer of a [rows, cols] scale matrix (the count torch's scaled_mm checks)."""
    r, c = blocked_shape(rows, cols)
    return r * c


def blocked_offset(r, c, cols: int):
    """Position of scale (r, c) of a matrix with ``cols`` block columns in the swizzled buffer (ints or
    integer tensors; the Triton quantizers compute the same expression on their own index tensors)."""
    n_col_tiles = -(-cols // TILE_COLS)
    tile = (r // TILE_ROWS) * n_col_tiles + c // TILE_COLS
    rr = r % TILE_ROWS
    return tile * TILE_BYTES + (rr % 32) * 16 + (rr // 32) * 4 + c % TILE_COLS


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """A row-major [rows, cols] scale matrix (any 1-byte dtype) -> the 1-D swizzled buffer of
    ``blocked_numel(rows, cols)`` elements, same dtype, zero padding."""
    if scales.dim() != 2:
        raise ValueError(f"to_blocked takes a [rows, cols] scale matrix, got shape {tuple(scales.shape)}")
    rows, cols = scales.shape
    pr, pc = blocked_shape(rows, cols)
    src = scales.view(torch.uint8) if scales.element_size() == 1 else scales
    out = torch.zeros(pr * pc, dtype=src.dtype, device=scales.device)
    r = torch.arange(rows, device=scales.device)[:, None]
    c = torch.arange(cols, device=scales.device)[None, :]
    out[blocked_offset(r, c, cols).flatten()] = src.reshape(-1)
    return out.view(scales.dtype) if src is not scales else out


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of ``to_blocked``: the 1-D swizzled buffer of a [rows, cols] scale matrix -> the row-major
    [rows, cols] matrix (a new tensor, same dtype)."""
    if blocked.dim() != 1 or blocked.numel() != blocked_numel(rows, cols):
        raise ValueError(f"a swizzled [{rows}, {cols}] scale matrix is a 1-D buffer of "
                         f"{blocked_numel(rows, cols)} elements, got shape {tuple(blocked.shape)}")
    r = torch.arange(rows, device=blocked.device)[:, None]
    c = torch.arange(cols, device=blocked.device)[None, :]
    src = blocked.view(torch.uint8) if blocked.element_size() == 1 else blocked
    out = src[blocked_offset(r, c, cols)]
    return out.view(blocked.dtype) if src is not blocked else out


def as_float4_x2(codes: torch.Tensor) -> torch.Tensor:
    """Packed uint8 E2M1 codes as ``torch.float4_e2m1fn_x2`` (a view of the same bytes: our packing, even
    element in the low nibble, is that dtype's)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"packed E2M1 codes are uint8, got {codes.dtype}")
    return codes.view(torch.float4_e2m1fn_x2)
