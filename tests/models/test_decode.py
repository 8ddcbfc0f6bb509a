"""Incremental decoding (models/decode.py): the one-token steps against the full-sequence ops, and cached greedy
decoding against the uncached path it replaces (CPU in float64 and bf16; the CUDA kernels, gpu-marked)."""

from __future__ import annotations

import pytest
import torch

from nvfp4_train.generate import _forward_logits, generate, next_token
from nvfp4_train.models.config import model_config
from nvfp4_train.models.decode import DecodeState
from nvfp4_train.models.mamba.ops import (
    causal_conv1d_ref,
    causal_conv1d_update_ref,
    mamba_conv_scan_norm,
    mamba_conv_scan_norm_chunk,
)
from nvfp4_train.models.mamba.ssd import ssd_sequential_ref, ssd_step_ref
from tests.precision.mcore_util import megatron_single_rank

# tiny (M-*-M-: Mamba, attention and MLP blocks) and a RoPE variant whose attention block comes after a Mamba block
VARIANTS = {"tiny": {}, "tiny_rope": {"position_embedding": "rope", "pattern": "M*-*", "num_layers": 4}}
PROMPT, NEW = 7, 16


@pytest.fixture
def single_rank():
    with megatron_single_rank():
        yield


# ------------------------------------------------------------------------------ the steps, against the ops


def test_conv_step_is_the_convolution_at_each_position(gen):
    """The same multiply-adds in the same order at each position as the full convolution: bitwise before the
    activation. With SiLU: torch's fp32 SiLU on a [b, d] slice (scalar code) and on the [b, d, l] tensor
    (vectorised code) may differ by one fp32 ulp, which can move the one rounding to bf16 across a tie: at most
    one bf16 ulp apart (seen on about 1 in 3,000 random draws)."""
    x = torch.randn(2, 11, 9, generator=gen).bfloat16()
    weight, bias = torch.randn(11, 4, generator=gen).bfloat16(), torch.randn(11, generator=gen).bfloat16()
    for activation in (None, "silu"):
        want = causal_conv1d_ref(x, weight, bias, activation)
        state = torch.zeros(2, 11, 3, dtype=x.dtype)
        got = torch.stack([causal_conv1d_update_ref(x[..., t], state, weight, bias, activation) for t in range(9)],
                          dim=-1)
        assert torch.equal(state, x[..., -3:])  # the inputs of the last width - 1 positions
        if activation is None:
            assert torch.equal(got, want)
            continue
        # bf16 bit patterns of same-sign values: adjacent floats differ by 1; a sign flip only around 0, where
        # SiLU(v) ~ v/2 and a one-ulp fp32 difference cannot reach the other sign
        g, w = got.view(torch.int16).int(), want.view(torch.int16).int()
        assert torch.equal(got.signbit(), want.signbit())
        assert int((g - w).abs().max()) <= 1


def test_ssd_step_is_the_sequential_recurrence(gen):
    """ssd_step_ref is the sequential reference's step, operation for operation, but softplus and exp over a
    [b, h] slice may differ from their evaluation over [b, l, h] in the last bit (vectorised vs scalar code; both
    within an ulp). In float64 each output sums at most l n = 30 products of such factors: the two differ by
    < 2 (30 + 8) 2^-53 mag, mag the same recurrence on |x|, |B|, |C|, |D|; bound 2^-45 mag."""
    b, l, h, p, g, n = 2, 6, 4, 3, 2, 5
    f64 = dict(generator=gen, dtype=torch.float64)
    x, dt = torch.randn(b, l, h, p, **f64), torch.randn(b, l, h, **f64)
    A, B, C = -torch.rand(h, **f64) - 0.5, torch.randn(b, l, g, n, **f64), torch.randn(b, l, g, n, **f64)
    D, dt_bias = torch.randn(h, **f64), torch.randn(h, **f64)
    kw = dict(dt_bias=dt_bias, dt_softplus=True, return_final_states=True)
    want, final = ssd_sequential_ref(x, dt, A, B, C, D, **kw)
    mag, mag_final = ssd_sequential_ref(x.abs(), dt, A, B.abs(), C.abs(), D.abs(), **kw)
    state = torch.zeros(b, h, p, n, dtype=torch.float64)
    got = torch.stack([ssd_step_ref(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D, dt_bias, dt_softplus=True)
                       for t in range(l)], dim=1)
    assert ((got - want).abs() <= 2.0**-45 * mag).all()
    assert ((state - final).abs() <= 2.0**-45 * mag_final.abs()).all()


def test_chunk_from_the_start_is_the_full_core(gen):
    """On CPU the prefill's core runs the unfused path's three ops on the same tensors: bitwise; its states are the
    conv inputs of the last width - 1 positions and the scan's final state."""
    s, b, h, hd, g, n, w = 10, 2, 4, 4, 2, 8, 4
    d, cd = h * hd, h * hd + 2 * g * n
    zxbcdt = torch.randn(s, b, d + cd + h, generator=gen).bfloat16()
    params = (torch.randn(cd, w, generator=gen).bfloat16(), torch.randn(cd, generator=gen).bfloat16(),
              torch.randn(h, generator=gen), -torch.rand(h, generator=gen) - 0.5, torch.randn(h, generator=gen),
              torch.randn(d, generator=gen).bfloat16())
    want = mamba_conv_scan_norm(zxbcdt, *params, headdim=hd, ngroups=g, chunk_size=4, fused=False)
    got, conv, ssm = mamba_conv_scan_norm_chunk(zxbcdt, *params, headdim=hd, ngroups=g, chunk_size=4)
    assert torch.equal(got, want)
    assert torch.equal(conv, zxbcdt[-(w - 1):, :, d:d + cd].permute(1, 2, 0))
    assert ssm.shape == (b, h, hd, n) and ssm.dtype == torch.float32


# ----------------------------------------------------------------------- cached vs uncached greedy decoding


def _build(variant: str, dtype: torch.dtype, device: str = "cpu"):
    from nvfp4_train.export.checkpoint_io import build_model_single

    torch.manual_seed(0)  # fixed weights
    return build_model_single(model_config("tiny").replace(**VARIANTS[variant]), dtype=dtype).to(device)


def _paths(model, prompt: torch.Tensor):
    """The uncached greedy path (``generate(cache=False)``'s steps: the whole prefix through the model, the argmax of
    its last logits) with the logits at each of its positions, and the cached logits along the same tokens (the
    prompt's prefill, then one path token per step). Returns (ids [1, PROMPT + NEW], uncached logits [NEW, V],
    cached logits [NEW, V]), logits in float64."""
    ids, lu = prompt, []
    with torch.no_grad():
        for _ in range(NEW):
            lu.append(_forward_logits(model, ids, 1, 0)[0])
            ids = torch.cat([ids, next_token(lu[-1][None])[:, None]], dim=1)
        state = DecodeState(PROMPT + NEW)
        lc = [model.forward_cached(prompt, state)[0]]
        lc += [model.forward_cached(ids[:, PROMPT + t:PROMPT + t + 1], state)[0] for t in range(NEW - 1)]
    return ids, torch.stack(lu).double(), torch.stack(lc).double()


def _margins(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 of each row, as greedy decoding sees them (``next_token`` takes the fp32 argmax)."""
    top = logits.float().topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).double()


def _check_tokens(model, prompt, ids, lu, lc, delta: float) -> None:
    """Where the uncached top-2 margin exceeds ``delta`` (a bound on |cached - uncached| on both logits, times 2),
    the cached argmax is the uncached one; free-running cached decoding follows the uncached path up to the first
    position whose margin does not (beyond it a float-noise tie may legitimately pick the other token)."""
    path = ids[0, PROMPT:]
    clear = _margins(lu) > delta
    assert torch.equal(lc.float().argmax(-1)[clear], path[clear])
    with torch.no_grad():
        cached = generate(model, prompt, max_new_tokens=NEW, cache=True)[0, PROMPT:]
    upto = NEW if bool(clear.all()) else int((~clear).nonzero()[0])
    assert torch.equal(cached[:upto], path[:upto])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_greedy_decoding_is_the_uncached_one_fp64(single_rank, variant):
    """float64 weights and activations: both paths compute one function, differing only in summation order (the
    chunked scan vs the one-step recurrence, SDPA over a masked vs an exact key range, GEMMs blocked for another
    token count). A reordered sum of n terms moves by at most ~2(n - 1) u sum|terms| (u = 2^-53); with n <= 64
    (sequence, head, state dims here), at most 6 blocks each adding its own, and the norms' and residual stream's
    gains of a random-init model below 1e3, the logits differ by < 6 * 128 * 1e3 * u * (1 + max|l|) ~ 9e-11 *
    (1 + max|l|). Bound: 2^-30 (1 + max|l|), a factor ~10 above that. Tokens: a margin above 2 * bound, plus the
    fp32 rounding of the four logits involved (2^-22 max|l|), fixes the argmax."""
    model = _build(variant, torch.float64)
    prompt = torch.randint(0, model.model_cfg.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    ids, lu, lc = _paths(model, prompt)
    scale = 1 + float(lu.abs().max())
    bound = 2.0**-30 * scale
    assert float((lc - lu).abs().max()) <= bound
    _check_tokens(model, prompt, ids, lu, lc, 2 * bound + 2.0**-22 * scale)
    # the prompt in two chunks (a later chunk of several positions: conv and SSM states in, the causal mask shifted)
    with torch.no_grad():
        state = DecodeState(PROMPT)
        model.forward_cached(prompt[:, :3], state)
        chunked = model.forward_cached(prompt[:, 3:], state)[0].double()
    assert float((chunked - lu[0]).abs().max()) <= bound


def test_cached_decoding_refuses_quantized_layers(single_rank):
    from nvfp4_train.export.checkpoint_io import build_model_single

    model = build_model_single(model_config("tiny"), recipe="nvfp4")
    with pytest.raises(ValueError, match="cached decoding needs every linear layer in bf16.*cache=False"):
        generate(model, torch.zeros(1, 16, dtype=torch.long), max_new_tokens=1, cache=True)


def _bf16_against_fp64(model, ref, prompt) -> None:
    """bf16 weights (the generation default): both paths round activations to bf16 at the same points, so the
    cached path must be as accurate as the uncached one. Measured against ``ref``, the same weights in float64 on
    the CPU (the exact function up to ~1e-13): E_u = max |l_u - l_ref| over the path; the bound on |l_c - l_ref| is
    4 E_u plus 2^-8 x the largest |logit| (between half and one bf16 ulp of it: the logits' own rounding). The
    factor 4 is an allowance, not a derivation: the cached path rounds the same quantities at the same points
    except the prompt's chunked scan against the one-step recurrence; on 10 prompts of both variants E_c / E_u
    measured 1.000 (2026-12-04). Then |l_c - l_u| <= bound + E_u, and a margin above twice that fixes the argmax
    (bf16 logits are exact in fp32)."""
    ids, lu, lc = _paths(model, prompt)
    with torch.no_grad():
        ref_device = next(ref.parameters()).device
        full = ref(input_ids=ids.to(ref_device), position_ids=torch.arange(ids.shape[1], device=ref_device)[None],
                   attention_mask=None)
    lr = full[0, PROMPT - 1:-1].to(lu.device)  # the logits that choose each path token
    e_u = float((lu - lr).abs().max())
    bound = 4 * e_u + 2.0**-8 * float(lr.abs().max())
    assert float((lc - lr).abs().max()) <= bound
    _check_tokens(model, prompt, ids, lu, lc, 2 * (bound + e_u))


def test_cached_greedy_decoding_bf16(single_rank):
    model = _build("tiny", torch.bfloat16)
    ref = _build("tiny", torch.float64)
    ref.load_state_dict(model.state_dict())
    prompt = torch.randint(0, model.model_cfg.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    _bf16_against_fp64(model, ref, prompt)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_greedy_decoding_cuda_kernels(variant):
    """The CUDA path: the prefill through mamba-ssm's scan and causal-conv1d's convolution, each step through
    ``selective_state_update`` and ``causal_conv1d_update``, SDPA's CUDA kernels; bounded as the CPU bf16 test."""
    from nvfp4_train.models.mamba._import import load_causal_conv1d_update, load_selective_state_update

    for fn, reason in (load_selective_state_update(), load_causal_conv1d_update()):
        if fn is None:
            pytest.skip(f"the CUDA step kernels are not installed: {reason}")
    with megatron_single_rank("cuda"):
        model = _build(variant, torch.bfloat16, "cuda")
        # the float64 reference on the CPU of this GPU machine: also the check that a model with RoPE moved to the
        # CPU keeps its rotary embedding there (megatron-core would move it to the GPU; mcore_compat.rope)
        ref = _build(variant, torch.float64)
        ref.load_state_dict(model.state_dict())  # copied to the CPU, in float64
        prompt = torch.randint(0, model.model_cfg.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
        _bf16_against_fp64(model, ref, prompt.cuda())
