"""The fused rotary embedding (``kernels/fused/rope.py``): bitwise the reference, which is bitwise megatron-core's
unfused ``_apply_rotary_pos_emb_bshd`` and autograd's backward of it.

Every comparison is of bits (NaN positions equal; a NaN's sign and payload are not specified). Inputs hold edge
values: signed zeros, subnormals (their products with the tables are fp32 subnormals, rounded twice), values near
the format's maximum (sums that overflow), +-Inf and NaN; ``freqs`` whose two halves differ (megatron's are
``cat(f, f)``, which would hide a table read from the wrong half).
"""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4_train.kernels.fused.rope import (
    apply_rope,
    apply_rope_qkv,
    apply_rope_qkv_ref,
    rope_backward_triton,
    rope_forward_triton,
    rope_tables,
)
from nvfp4_train.kernels.fused.rope_reference import (
    ROPE_DTYPES,
    apply_rope_ref,
    check_rope_input,
    rope_backward_ref,
    rope_forward_ref,
    rope_tables_ref,
)

# (head dim d, rot_dim): whole head, half a head (pass-through tail), halves that are not powers of two
HEADS = [(64, 64), (64, 32), (80, 80), (96, 48)]
# Inf and NaN inputs: numpy (the interpreter's arithmetic) warns where IEEE arithmetic gives them
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    na, nb = a.isnan(), b.isnan()
    assert torch.equal(na, nb), "NaN positions differ"
    diff = (_bits(a) != _bits(b)) & ~na
    assert not diff.any(), f"{int(diff.sum())} elements differ, first at {diff.nonzero()[0].tolist()}"


def edge_values(shape, dtype: torch.dtype, gen: torch.Generator, nonfinite: bool = True) -> torch.Tensor:
    """Standard normals with ~4% +0, 4% -0, 6% subnormal-sized, 3% near +-max, 1% +-Inf, 1% NaN (in dtype)."""
    fi = torch.finfo(dtype)
    x = torch.randn(shape, generator=gen)
    u = torch.rand(shape, generator=gen)
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    x = torch.where(u < 0.04, 0.0, x)
    x = torch.where((u >= 0.04) & (u < 0.08), -0.0, x)
    x = torch.where((u >= 0.08) & (u < 0.14), x * (fi.tiny * 0.3), x)
    x = torch.where((u >= 0.14) & (u < 0.17), sign * (fi.max * 0.6) * (1 + 0.6 * torch.rand(shape, generator=gen)), x)
    if nonfinite:
        x = torch.where((u >= 0.17) & (u < 0.18), sign * math.inf, x)
        x = torch.where((u >= 0.18) & (u < 0.19), math.nan, x)
    return x.to(dtype)


def general_freqs(s: int, rot: int, gen: torch.Generator) -> torch.Tensor:
    """[s, 1, 1, rot] fp32 angles whose halves differ: megatron's position * inv_freq (positions from a random
    offset) in one half, uniform angles in [-60, 60] in the other."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    pos = torch.arange(s, dtype=torch.float32) + float(torch.randint(0, 5000, (1,), generator=gen))
    f = torch.outer(pos, inv)
    other = (torch.rand(s, rot // 2, generator=gen) - 0.5) * 120
    return torch.cat((f, other), dim=-1)[:, None, None, :]


def megatron_freqs(s: int, rot: int) -> torch.Tensor:
    """megatron's ``RotaryEmbedding`` output at base 10000: cat(f, f), [s, 1, 1, rot] fp32."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    f = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    return torch.cat((f, f), dim=-1)[:, None, None, :]


def strided_view(s, b, h, d, dtype, gen, device):
    """t [s, b, h, d] as a view into a bigger tensor (gaps in every dim, as q/k/v out of the qkv split)."""
    base = edge_values((s, b + 1, h + 2, d + 5), dtype, gen).to(device)
    return base[:, 1:, 1 : h + 1, 3 : d + 3]


# ------------------------------------------------------------------------------------------------------------
# CPU tier: the reference is megatron's arithmetic
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ROPE_DTYPES, ids=str)
@pytest.mark.parametrize("d,rot", HEADS)
def test_reference_is_megatrons_unfused_path_bitwise(gen, dtype, d, rot):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    s, b, h = 37, 3, 5
    t = strided_view(s, b, h, d, dtype, gen, "cpu")
    freqs = general_freqs(s, rot, gen)
    t_m = t.detach().requires_grad_(True)  # views of the same storage, each its own leaf
    t_r = t.detach().requires_grad_(True)
    assert not t_m.is_contiguous()
    out_m = _apply_rotary_pos_emb_bshd(t_m, freqs)
    out_r = apply_rope_ref(t_r, freqs)
    assert_same_bits(out_r, out_m)
    g = edge_values(out_m.shape, dtype, gen)
    (grad_m,) = torch.autograd.grad(out_m, t_m, g)
    (grad_r,) = torch.autograd.grad(out_r, t_r, g)
    assert_same_bits(grad_r, grad_m)
    assert_same_bits(rope_backward_ref(g, *rope_tables_ref(freqs, dtype)), grad_m)


def test_backward_turns_negative_zeros_positive_as_autograd_does(gen):
    """g = -0 everywhere: each product g * cos_ and g * sin_ is a signed zero, -0 + -0 = -0 where both are
    -0; autograd adds the zero-filled gradients of t's two slices, which makes every -0 +0: all bits 0."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    t = torch.randn(5, 2, 3, 16, generator=gen).to(torch.bfloat16).requires_grad_(True)
    freqs = megatron_freqs(5, 8) + 2.0  # cos < 0 in places: both signs of the zero products
    out = _apply_rotary_pos_emb_bshd(t, freqs)
    g = torch.full_like(out, -0.0)
    (grad_m,) = torch.autograd.grad(out, t, g)
    assert (_bits(grad_m) == 0).all()
    cos_, sin_ = rope_tables_ref(freqs, t.dtype)
    # without the final step the sum would keep some -0 (the case this test is about)
    raw = g[..., :8] * cos_[:, None, None, :] + torch.cat((g[..., 4:8] * sin_[:, None, None, 4:],
                                                          -(g[..., :4] * sin_[:, None, None, :4])), -1)
    assert (_bits(raw) == -32768).any()
    assert (_bits(rope_backward_ref(g, cos_, sin_)) == 0).all()


def test_check_rope_input_names_the_problem():
    t = torch.zeros(4, 2, 3, 16)
    good = torch.zeros(4, 1, 1, 16)
    assert check_rope_input(t, good) == 16
    cases = [
        (t.to(torch.int32), good, "bfloat16, float16 or float32"),
        (t[0], good, r"\[s, b, h, d\]"),
        (t, torch.zeros(4, 2, 1, 16), "apply_rope_fusion=False"),  # per-sample freqs (mRoPE)
        (t, torch.zeros(5, 1, 1, 16), "slice freqs"),
        (t, torch.zeros(4, 1, 1, 6)[..., :5], "even"),
        (t, torch.zeros(4, 1, 1, 18), "at most the head dim 16"),
        (t, good.requires_grad_(True), "detach"),
    ]
    for tt, ff, match in cases:
        with pytest.raises(ValueError, match=match):
            apply_rope(tt, ff)


def test_tables_are_cached_per_freqs_dtype_and_version():
    freqs = megatron_freqs(6, 8)
    a = rope_tables(freqs, torch.bfloat16)
    assert rope_tables(freqs, torch.bfloat16)[0] is a[0]  # the same tensors: no cos/sin computed again
    assert rope_tables(freqs, torch.float32)[0].dtype == torch.float32
    for got, want in zip(a, rope_tables_ref(freqs, torch.bfloat16)):
        assert_same_bits(got, want)
    freqs.mul_(2.0)  # a new version: computed again, and not cached over the first entry
    b = rope_tables(freqs, torch.bfloat16)
    for got, want in zip(b, rope_tables_ref(freqs, torch.bfloat16)):
        assert_same_bits(got, want)
    assert b[0] is not a[0] and rope_tables(freqs, torch.bfloat16)[0] is not b[0]
    with torch.inference_mode():
        f = megatron_freqs(6, 8)
        assert rope_tables(f, torch.bfloat16)[0] is not rope_tables(f, torch.bfloat16)[0]


# ------------------------------------------------------------------------------------------------------------
# Triton tier: the kernels are the reference, bit for bit
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.triton
@pytest.mark.parametrize("dtype", ROPE_DTYPES, ids=str)
@pytest.mark.parametrize("d,rot", HEADS)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_kernels_match_reference_forward_and_backward(gen, triton_device, dtype, d, rot, layout):
    s, b, h = 37, 3, 5
    if layout == "strided":
        t = strided_view(s, b, h, d, dtype, gen, triton_device)
    else:
        t = edge_values((s, b, h, d), dtype, gen).to(triton_device)
    freqs = general_freqs(s, rot, gen).to(triton_device)
    g = edge_values((s, b, h, d), dtype, gen).to(triton_device)

    cos_, sin_ = rope_tables_ref(freqs, dtype)
    out = rope_forward_triton(t, cos_, sin_)
    assert out.is_contiguous()
    assert_same_bits(out, rope_forward_ref(t, cos_, sin_))
    assert_same_bits(rope_backward_triton(g, cos_, sin_), rope_backward_ref(g, cos_, sin_))

    # the autograd op against autograd through the reference (= megatron's backward)
    t_k = t.detach().requires_grad_(True)
    t_r = t.detach().requires_grad_(True)
    out_k = apply_rope(t_k, freqs)
    out_r = apply_rope_ref(t_r, freqs)
    assert_same_bits(out_k, out_r)
    assert_same_bits(torch.autograd.grad(out_k, t_k, g)[0], torch.autograd.grad(out_r, t_r, g)[0])


@pytest.mark.triton
def test_kernels_on_qkv_split_and_transposed_views(gen, triton_device):
    """The views megatron hands over: q, k and v of the fused qkv projection split along its last dim (k and v
    are [s, b, ng, hn] views with a head stride of (np/ng + 2) * hn), and a view whose head dim is not the
    innermost one (stride_d > 1)."""
    s, b, ng, per_group, hn = 23, 2, 3, 2, 32
    mixed = edge_values((s, b, ng, (per_group + 2) * hn), torch.bfloat16, gen).to(triton_device)
    q, k, v = torch.split(mixed, [per_group * hn, hn, hn], dim=3)
    q = q.reshape(s, b, -1, hn)
    transposed = edge_values((s, b, hn, 5), torch.bfloat16, gen).to(triton_device).permute(0, 1, 3, 2)
    assert transposed.stride(-1) == 5
    freqs = general_freqs(s, hn, gen).to(triton_device)
    cos_, sin_ = rope_tables_ref(freqs, torch.bfloat16)
    for x in (q, k, v, transposed):
        assert_same_bits(rope_forward_triton(x, cos_, sin_), rope_forward_ref(x, cos_, sin_))
    # output gradients: a transposed layout, and one broadcast over b and h (zero strides, as from a sum)
    for g in (edge_values((s, ng, b, hn), torch.bfloat16, gen).to(triton_device).transpose(1, 2),
              edge_values((s, 1, 1, hn), torch.bfloat16, gen).to(triton_device).expand(s, b, ng, hn)):
        assert_same_bits(rope_backward_triton(g, cos_, sin_), rope_backward_ref(g, cos_, sin_))


@pytest.mark.triton
@pytest.mark.parametrize("s,b,h,d,rot", [(1, 1, 1, 2, 2), (3, 1, 33, 16, 4), (2, 7, 1, 8, 8), (0, 2, 3, 8, 8)])
def test_kernels_on_edge_shapes(gen, triton_device, s, b, h, d, rot):
    t = edge_values((s, b, h, d), torch.float16, gen).to(triton_device)
    g = edge_values((s, b, h, d), torch.float16, gen).to(triton_device)
    cos_, sin_ = rope_tables_ref(general_freqs(s, rot, gen).to(triton_device), t.dtype)
    assert_same_bits(rope_forward_triton(t, cos_, sin_), rope_forward_ref(t, cos_, sin_))
    assert_same_bits(rope_backward_triton(g, cos_, sin_), rope_backward_ref(g, cos_, sin_))


# ------------------------------------------------------------------------------------------------------------
# GPU: the production shape against megatron on CUDA, and under CUDA-graph capture
# ------------------------------------------------------------------------------------------------------------


def _qkv_case(gen, device, dtype, s, b, ng, hg, d, rot):
    mixed = edge_values((s, b, ng, (hg + 2) * d), dtype, gen).to(device)
    return mixed, general_freqs(s, rot, gen).to(device), general_freqs(s, rot, gen).to(device), [hg * d, d, d]


def check_qkv(mixed, qf, kf, split, gen) -> None:
    """``apply_rope_qkv`` against the split path (``apply_rope_qkv_ref``) bit for bit: q, k, v and the gradient of
    the fused output for random output gradients (edge values: -0, subnormals, Inf, NaN); v is a view of it."""
    m_f = mixed.detach().requires_grad_(True)
    m_r = mixed.detach().requires_grad_(True)
    out_f = apply_rope_qkv(m_f, qf, kf, split)
    out_r = apply_rope_qkv_ref(m_r, qf, kf, split)
    for a, b in zip(out_f, out_r):
        assert_same_bits(a, b)
    assert out_f[0].is_contiguous() and out_f[1].is_contiguous()
    assert out_f[2].data_ptr() == mixed.data_ptr() + (split[0] + split[1]) * mixed.element_size()  # v: a view
    grads = [edge_values(t.shape, mixed.dtype, gen).to(mixed.device) for t in out_r]
    torch.autograd.backward(out_f, grads)
    torch.autograd.backward(out_r, grads)
    assert_same_bits(m_f.grad, m_r.grad)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", ROPE_DTYPES, ids=str)
@pytest.mark.parametrize("hg,d,rot", [(2, 64, 64), (1, 64, 32), (4, 80, 80), (3, 96, 48)])
def test_qkv_kernels_match_the_split_path(gen, triton_device, dtype, hg, d, rot):
    """q and k rotated where the fused qkv output holds them, their gradients and v's written into one gradient
    (megatron's ``fused_single_qkv_rope``): bitwise the split path (split, the query's reshape copy, the rotary
    embedding of q and k, the concatenation of the gradients) for every dtype, GQA grouping (1 to 4 query heads per
    group), whole and partial rotations."""
    check_qkv(*_qkv_case(gen, triton_device, dtype, 9, 2, 3, hg, d, rot), gen)


@pytest.mark.triton
def test_qkv_kernels_on_edge_shapes_and_bad_splits(gen, triton_device):
    check_qkv(*_qkv_case(gen, triton_device, torch.bfloat16, 1, 1, 1, 1, 2, 2), gen)
    check_qkv(*_qkv_case(gen, triton_device, torch.float32, 5, 3, 7, 2, 16, 8), gen)
    mixed, qf, kf, _ = _qkv_case(gen, triton_device, torch.bfloat16, 4, 1, 2, 2, 8, 8)
    for split in ([16, 8], [16, 8, 4], [12, 8, 8], [8, 8, 8]):
        with pytest.raises(ValueError, match="heads per group"):
            apply_rope_qkv(mixed, qf, kf, split)


@pytest.mark.gpu
def test_gpu_1p2b_attention_shapes_match_megatron_bitwise(gen):
    """The ``1.2b`` block (s 4096, micro-batch 2, 16 query heads / 8 KV groups of 128, bf16): q contiguous
    (megatron's reshape copies it), k a strided view of the qkv split; megatron's unfused path on the same GPU."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    s, b, ng, per_group, hn = 4096, 2, 8, 2, 128
    mixed = edge_values((s, b, ng, (per_group + 2) * hn), torch.bfloat16, gen).cuda()
    q, k, _ = torch.split(mixed, [per_group * hn, hn, hn], dim=3)
    q = q.reshape(s, b, -1, hn)
    freqs = megatron_freqs(s, hn).cuda()
    for x in (q, k):
        g = edge_values(x.shape, torch.bfloat16, gen).cuda()
        x_m = x.detach().requires_grad_(True)
        x_k = x.detach().requires_grad_(True)
        out_m = _apply_rotary_pos_emb_bshd(x_m, freqs)
        out_k = apply_rope(x_k, freqs)
        assert_same_bits(out_k, out_m)
        assert_same_bits(torch.autograd.grad(out_k, x_k, g)[0], torch.autograd.grad(out_m, x_m, g)[0])


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_the_eager_bits(gen):
    """Forward and backward captured after an eager warm-up (which caches the tables on freqs; the capture reads
    them and writes no cache entry of its own), replayed on new inputs: the eager reference's bits."""
    s, b, h, d = 128, 2, 4, 64
    freqs = megatron_freqs(s, d).cuda()
    x = torch.zeros(s, b, h, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    g = torch.zeros(s, b, h, d, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            torch.autograd.grad(apply_rope(x, freqs), x, g)
    torch.cuda.current_stream().wait_stream(side)
    cached = rope_tables(freqs, torch.bfloat16)
    fresh = megatron_freqs(s, d).cuda()  # never used eagerly: computed inside the capture, not cached
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = apply_rope(x, freqs)
        (grad,) = torch.autograd.grad(out, x, g)
        out2 = apply_rope(x.detach(), fresh)
    assert rope_tables(freqs, torch.bfloat16)[0] is cached[0]
    assert "_rope_tables" not in fresh.__dict__
    for _ in range(2):
        new_x, new_g = edge_values(x.shape, x.dtype, gen).cuda(), edge_values(g.shape, g.dtype, gen).cuda()
        with torch.no_grad():
            x.copy_(new_x)
        g.copy_(new_g)
        graph.replay()
        torch.cuda.synchronize()
        x_r = new_x.requires_grad_(True)
        out_r = apply_rope_ref(x_r, freqs)
        assert_same_bits(out, out_r)
        assert_same_bits(out2, out_r)
        assert_same_bits(grad, torch.autograd.grad(out_r, x_r, new_g)[0])
