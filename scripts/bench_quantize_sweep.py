"""Tile-shape sweep of the fused NVFP4 quantizer on one 8192x5120 bf16 tensor (GPU only).

Usage: python3 scripts/bench_quantize_sweep.py  (prints one line per variant; GB/s over the bytes each variant
moves, as a share of a device-to-device copy measured in the same run)."""
import torch, triton, sys
from triton.testing import do_bench
from kernels.nvfp4.quantize import quantize_nvfp4_rowcol_triton, amax_triton
torch.manual_seed(0)
big = torch.empty(2**28, dtype=torch.uint8, device="cuda"); big2 = torch.empty_like(big)
t = do_bench(lambda: big2.copy_(big), return_mode="median")
copy_bw = 2 * big.numel() / t / 1e6
print(f"copy bandwidth {copy_bw:.0f} GB/s")
M, K = 8192, 5120
x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
am = amax_triton(x, True)
nb_row = 2*M*K + M*K//2 + M*K//16
nb_rc = 2*M*K + 2*(M*K//2 + M*K//16)
def rep(name, fn, nb):
    fn(); torch.cuda.synchronize()
    ms = do_bench(fn, return_mode="median")
    print(f"{name:44s} {ms*1e3:8.1f} us {nb/ms/1e6:7.0f} GB/s {nb/ms/1e6/copy_bw*100:5.1f}%")
rep("amax rht (persistent)", lambda: amax_triton(x, True), 2*M*K)
rep("amax row (persistent)", lambda: amax_triton(x, False), 2*M*K)
for bm, bk, nw in [(64,64,4),(32,128,4),(64,128,4),(64,128,8),(128,64,8),(128,128,8),(16,256,4),(32,64,4),(32,32,2)]:
    try:
        rep(f"row only given amax {bm}x{bk} w{nw}", lambda: quantize_nvfp4_rowcol_triton(x, row_amax=am[0], block_m=bm, block_k=bk, num_warps=nw), nb_row)
        rep(f"row+col no-rht given amax {bm}x{bk} w{nw}", lambda: quantize_nvfp4_rowcol_triton(x, write_col=True, row_amax=am[0], col_amax=am[0], block_m=bm, block_k=bk, num_warps=nw), nb_rc)
        rep(f"row+col rht given amax {bm}x{bk} w{nw}", lambda: quantize_nvfp4_rowcol_triton(x, write_col=True, col_rht=True, row_amax=am[0], col_amax=am[1], block_m=bm, block_k=bk, num_warps=nw), nb_rc)
        rep(f"row+col rht full {bm}x{bk} w{nw}", lambda: quantize_nvfp4_rowcol_triton(x, write_col=True, col_rht=True, block_m=bm, block_k=bk, num_warps=nw), nb_rc)
    except Exception as e:
        print(bm, bk, nw, "failed", str(e)[:200])
