"""nvfp4_train.bench.sass: the opcode count of an nvdisasm listing, and the quantize kernel compiled for sm_90 on this
(GPU-less) machine with the runtime's specializations: vectorized loads, the hardware conversions the GPU path asks
for, and more instructions with stochastic rounding than without."""

from __future__ import annotations

import pytest

from nvfp4_train.bench import sass

LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/               @P0 VIADD R2, R3, 0xaffff02 ;
        /*0030*/              @!P1 FADD R4, R5, R6 ;
        /*0040*/                   FADD.FTZ R4, R4, R6 ;
        /*0050*/                   NOP;
.L_x_1:
        /*0060*/                   EXIT ;
"""


def test_count_opcodes_drops_predicates_and_modifiers():
    ops = sass.count_opcodes(LISTING)
    assert ops == {"LDC": 1, "S2R": 1, "VIADD": 1, "FADD": 2, "NOP": 1, "EXIT": 1}


LOOPS = """
        /*0000*/                   MOV R1, RZ ;
.L_x_0:
        /*0010*/                   FADD R2, R2, R3 ;
        /*0020*/                   ISETP.NE.AND P0, PT, R1, 0x3, PT ;
        /*0030*/               @P0 BRA `(.L_x_0) ;
        /*0040*/                   BRA `(.L_x_2) ;
.L_x_1:
        /*0050*/                   FMUL R2, R2, R3 ;
        /*0060*/               @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0070*/                   EXIT ;
"""


def test_count_opcodes_counts_loop_bodies_by_their_trips():
    """A branch back to a label above it closes a loop: with trip counts its body counts that many times, in the
    listing's order; a forward branch is no loop; without trip counts every instruction counts once."""
    assert sass.count_opcodes(LOOPS) == {"MOV": 1, "FADD": 1, "ISETP": 1, "BRA": 3, "FMUL": 1, "EXIT": 1}
    assert sass.count_opcodes(LOOPS, (4, 2)) == {"MOV": 1, "FADD": 4, "ISETP": 4, "BRA": 4 + 1 + 2, "FMUL": 2,
                                                 "EXIT": 1}
    with pytest.raises(ValueError, match="2 loops, 1 trip counts"):
        sass.count_opcodes(LOOPS, (4,))


@pytest.mark.skipif(not sass.have_nvidia_tools(), reason="this Triton installation ships no ptxas / nvdisasm")
def test_quantize_kernel_counts_for_sm90():
    rne = sass.quantize_kernel_sass(sr=False)
    assert rne.threads == 128 and rne.elements == 64 * 128
    assert rne.total == sum(rne.by_op.values())
    per_thread = rne.elements // rne.threads  # 64 bf16 elements of x per thread
    # x's loads are vectorized (4 bf16 a load; the rest are the encode-table lookups and the amax), i.e. the
    # divisibility specialization took effect: without it each element is a load of its own (135 loads)
    assert rne.by_op["LDG"] < per_thread
    assert rne.by_op["F2FP"] > 0  # cvt.rn.bf16x2 and the E4M3 scale conversion, the GPU path's
    assert rne.by_op["PRMT"] > 0  # the byte permutes of the code packing
    sr = sass.quantize_kernel_sass(sr=True)
    assert sr.total > rne.total  # the counter hash and the rounding-up add of every code
    assert "instructions per program" in sass.report(rne, 5)


@pytest.mark.skipif(not sass.have_nvidia_tools(), reason="this Triton installation ships no ptxas / nvdisasm")
def test_fp8_blockwise_kernel_counts_for_sm90():
    """The FP8 1x128 tile kernel's rowwise copy: x read with 16-byte loads (8 bf16 each: 32 per thread of its
    production 32 x 128 tile on 4 warps, 128 of a 128 x 128 tile), the E4M3 bytes through the GPU's conversion,
    and the bigger tile issuing more instructions per program."""
    row = sass.fp8_blockwise_kernel_sass()
    big = sass.fp8_blockwise_kernel_sass(block_m=128)
    assert row.threads == big.threads == 128 and row.elements == 32 * 128 and big.elements == 128 * 128
    assert row.by_op["LDG"] == 4 and big.by_op["LDG"] == 16  # elements per thread / 8
    for c in (row, big):
        assert c.by_op["F2FP"] > 0  # cvt.rn.satfinite.e4m3x2.f32
    assert big.total > row.total


@pytest.mark.skipif(not sass.have_nvidia_tools(), reason="this Triton installation ships no ptxas / nvdisasm")
def test_fp8_rowcol_grouped_kernel_counts_for_sm90():
    """The grouped kernel of both 1x128 copies, as launched (64-row chunks on 8 warps) and with 32-row chunks on 4:
    no spills; x read twice in 16-byte loads (the rest of the loads are the scale lookups); and exactly one paired
    E4M3 conversion per two elements and copy, its halves merged into the stored words (no byte is moved on its
    own)."""
    g = sass.fp8_rowcol_grouped_kernel_sass()
    small = sass.fp8_rowcol_grouped_kernel_sass(chunk_m=32, num_warps=4)
    assert g.threads == 256 and small.threads == 128 and g.elements == small.elements == 128 * 128
    for c in (g, small):
        per_thread = c.elements // c.threads  # 64 or 128
        assert c.by_op.get("STL", 0) == c.by_op.get("LDL", 0) == 0
        assert 2 * per_thread // 8 <= c.by_op["LDG"] < 2 * per_thread // 4
        assert c.by_op["F2FP"] == per_thread
        assert c.by_op.get("STSM", 0) == 0  # no stmatrix: see the next test
    assert "registers per thread" in sass.report(g, 3)


@pytest.mark.skipif(not sass.have_nvidia_tools(), reason="this Triton installation ships no ptxas / nvdisasm")
@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
def test_no_stmatrix_in_the_nvfp4_quantize_kernel(sr):
    """No launch of the NVFP4 quantize kernel stores through stmatrix (STSM): on the H200's Triton 3.6 the column
    copy of fp32 input, bitwise under the interpreter and wrong on the GPU, was a launch whose store's layout change
    used it, and none of its launches that passed there does (the column scale in ``kernels/nvfp4/quantize.py``).
    Other kernels use stmatrix and pass there: this keeps the suspect out."""
    c = sass.quantize_kernel_sass(sr=sr)
    assert c.by_op.get("STSM", 0) == 0, sr
