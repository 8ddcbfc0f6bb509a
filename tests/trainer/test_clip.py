"""The sync-free gradient clipping (``nvfp4_train.optim.optimizer_step``) against megatron's own
``optimizer.step()`` (``clip_grad`` in its ``OptimizerConfig``), in process on CPU: megatron-core's GPTModel
(local spec, bf16, FP32 gradient buffers, the distributed optimizer, a ``ChainedOptimizer``).

- clipping inactive (a large ``clip_grad``, or 0): the parameters, master weights and Adam moments after a
  few steps are bitwise megatron's (a multiply by exactly 1.0 changes no bit);
- clipping active: each step from the same state (the two paths resynchronised after every step), the grad
  norm and the updated master weights and parameters agree within derived fp32 bounds;
- no host sync inside the clipping (``aten._local_scalar_dense``, what ``.item()``/``float()``/``bool()``
  of a tensor dispatch to, counted with a ``TorchDispatchMode``);
- non-finite norms do what megatron does (inf: the gradients are zeroed; NaN: not clipped), no gradients;
- ``-m dist``: two gloo ranks, DP=2 (the distributed optimizer's sharded gradients, the norm all-reduced
  over both ranks) and TP=2 (tensor-parallel duplicates filtered), the same comparisons on every rank.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from nvfp4_train.mcore_compat.optimizer import grads_for_grad_norm
from nvfp4_train.optim import (OptimConfig, build_ddp, build_optimizer, clip_grad_norm_sync_free,
                               megatron_optimizer_config, optimizer_step)
from tests.precision.mcore_util import assert_ranks_ok, megatron_single_rank, record_outcome

VOCAB, HIDDEN, FFN, LAYERS, SEQ, MICRO = 128, 32, 64, 2, 16, 4
LR = 1e-2
STEPS = 4
FP32_U = 2.0 ** -24  # unit roundoff of fp32


def _model(tp: int = 1):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    tconfig = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=4, kv_channels=8,
        init_method_std=0.05, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, tensor_model_parallel_size=tp,
        add_bias_linear=True)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = GPTModel(config=tconfig, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, share_embeddings_and_output_weights=True,
                     position_embedding_type="rope")
    return model.to(torch.bfloat16)


def _setup(clip: float, *, megatron_clip: bool, tp: int = 1):
    """DDP-wrapped stand-in and its optimizer: ours (megatron's clip_grad 0) or megatron's (clip_grad=clip)."""
    from megatron.core.optimizer import get_megatron_optimizer

    model = _model(tp)
    ocfg = OptimConfig(clip_grad=clip)
    ddp = build_ddp(model, ocfg)
    if megatron_clip:
        conf = dataclasses.replace(megatron_optimizer_config([ddp], ocfg, lr=LR, min_lr=0.0), clip_grad=clip)
        opt = get_megatron_optimizer(conf, [ddp])
    else:
        opt = build_optimizer([ddp], ocfg, lr=LR, min_lr=0.0)
        assert all(o.config.clip_grad == 0.0 for o in opt.chained_optimizers)
    return model, ddp, opt


def _batch(step: int, rank: int = 0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return ids, torch.arange(SEQ)[None].expand(MICRO, SEQ)


def _fb(ddp, opt, step: int, rank: int = 0) -> None:
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ids, pos = _batch(step, rank)
    loss = ddp(ids, pos, None, labels=ids).float().mean() * 100.0  # large enough gradients to clip
    loss.backward()
    ddp.finish_grad_sync()


def _train(clip: float, *, megatron_clip: bool, tp: int = 1, rank: int = 0):
    """STEPS steps; returns (grad norms as floats, model params, fp32 master params, Adam state, an upper
    bound on the number of gradient elements in the norm: this rank's times the ranks)."""
    model, ddp, opt = _setup(clip, megatron_clip=megatron_clip, tp=tp)
    norms = []
    for step in range(STEPS):
        _fb(ddp, opt, step, rank)
        ok, gn, _ = opt.step() if megatron_clip else optimizer_step(opt, clip)
        assert ok
        norms.append(float(gn))
    params = [p.detach().clone() for p in model.parameters()]
    main = [p.detach().clone() for o in opt.chained_optimizers for p in o.get_parameters()]
    state = [t.clone() for o in opt.chained_optimizers for st in o.optimizer.state.values()
             for t in st.values() if isinstance(t, torch.Tensor)]
    n_elems = sum(g.numel() for o in opt.chained_optimizers for g in grads_for_grad_norm(o))
    n_elems *= dist.get_world_size()
    return norms, params, main, state, n_elems


def _bitwise(a: list, b: list, what: str) -> None:
    assert len(a) == len(b) and len(a) > 0, what
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, (what, i)
        assert torch.equal(x.view(torch.int16 if x.element_size() == 2 else torch.int32),
                           y.view(torch.int16 if y.element_size() == 2 else torch.int32)), (what, i)


def _norm_bound(n_elems: int) -> float:
    """Relative bound between two fp32 evaluations of sqrt(sum g^2) over n_elems gradient elements: each
    sum of squares (squares rounded, then summed in any order, also over per-tensor norms) is within
    gamma_n = n u / (1 - n u) of the exact sum (Higham, nonnegative terms), its square root within
    gamma_n / 2 + u of the exact norm (plus one rounding of megatron's norm-of-norms squared); the two
    differ by at most twice that."""
    n = n_elems + 4
    gamma = n * FP32_U / (1 - n * FP32_U)
    return 2 * (gamma / 2 + 3 * FP32_U)


def _check_inactive(clip: float, tp: int = 1, rank: int = 0) -> None:
    ref = _train(clip, megatron_clip=True, tp=tp, rank=rank)
    got = _train(clip, megatron_clip=False, tp=tp, rank=rank)
    if clip > 0:
        assert max(ref[0]) < clip, "the clipping was supposed to stay inactive"
    _bitwise(got[1], ref[1], "model params")
    _bitwise(got[2], ref[2], "fp32 master params")
    _bitwise(got[3], ref[3], "Adam state")
    # the norms (ChainedOptimizer.step returns one also with clip_grad 0)
    bound = _norm_bound(ref[4])
    for a, b in zip(got[0], ref[0]):
        assert b > 0 and abs(a - b) <= bound * b, (a, b, bound)


def _adam_ratio_bounds(t: int, beta1: float, beta2: float) -> tuple[float, float]:
    """Bounds, at Adam step ``t`` (zero initial moments), on the ratio r = m_hat / (sqrt(v_hat) + eps) that
    scales the learning rate, and on its sensitivity to a relative change of the step's gradient.

    With m_t = (1 - b1) sum_i b1^(t-i) g_i and v_t = (1 - b2) sum_i b2^(t-i) g_i^2, Cauchy-Schwarz gives
    |m_t| <= (1 - b1) sqrt(sum_{k<t} (b1^2 / b2)^k) sqrt(v_t / (1 - b2)), so
    R_t = |r| <= (1 - b1) / (1 - b1^t) * sqrt(sum_k (b1^2 / b2)^k) * sqrt((1 - b2^t) / (1 - b2)).
    Writing m = a + (1 - b1) g, v = c + (1 - b2) g^2 (a, c: the previous moments, the same in both paths) and
    S = sqrt(v / (1 - b2^t)) + eps >= sqrt((1 - b2) / (1 - b2^t)) |g|:
    |g dr/dg| <= (1 - b1) / (1 - b1^t) |g| / S + |r| (1 - b2) g^2 / v <= A_t + R_t with
    A_t = (1 - b1) / (1 - b1^t) * sqrt((1 - b2^t) / (1 - b2)). Returns (R_t, A_t)."""
    bc1 = 1.0 - beta1 ** t
    root = math.sqrt((1.0 - beta2 ** t) / (1.0 - beta2))
    a_t = (1.0 - beta1) / bc1 * root
    r_t = a_t * math.sqrt(sum((beta1 ** 2 / beta2) ** k for k in range(t)))
    return r_t, a_t


def _main_bound(t: int, norm_rel: float, w_max: float) -> float:
    """Bound on |w' - w| between the fp32 master weights of the two paths after Adam step ``t``, both started
    from the same weights and moments, whose norms differ by at most ``norm_rel`` (relative).

    The coefficients min(1, clip / (norm + 1e-6)) then differ by at most norm_rel / (1 - norm_rel) (one
    division each, in float64: below 2^-52) plus one rounding each to fp32 (u each), and the clipped
    gradients (one fp32 multiply each, u) relatively by at most delta = norm_rel / (1 - norm_rel) + 4 u.
    The weight decay w (1 - lr wd) is the same in both. By the mean value theorem on g (1 + s), |s| <= delta,
    the exact ratios differ by at most delta (A_t / (1 - delta) + R_t) (:func:`_adam_ratio_bounds`; the A_t
    term scales with |g| / |g (1 + s)|). Each path's fp32 evaluation of the moments and of the ratio (10
    roundings, lerp, square, fma, sqrt, division, addcdiv) is within 10 u R_t of its exact ratio, and the
    final subtraction rounds once (u w_max each)."""
    opt = OptimConfig()
    r_t, a_t = _adam_ratio_bounds(t, opt.adam_beta1, opt.adam_beta2)
    delta = norm_rel / (1.0 - norm_rel) + 4 * FP32_U
    return LR * (delta * (a_t / (1.0 - delta) + r_t) + 2 * 10 * FP32_U * r_t) + 2 * FP32_U * (w_max + LR * r_t)


def _check_active(tp: int = 1, rank: int = 0) -> None:
    """STEPS clipped steps of both paths in lockstep: every step starts both from megatron's weights,
    master weights and Adam moments, so that each step's comparison bounds one clipping and one update.
    (Without the resynchronisation the comparison is chaotic, not boundable: a master weight that sits at
    a bf16 rounding boundary rounds to neighbouring bf16 parameters in the two paths after a one-ulp
    difference of the coefficient, and the next bf16 forward and backward then differ in bf16 ulps
    everywhere, which Adam's normalisation turns into O(lr) updates of the small gradients: measured on two
    ranks, 2026-12-01 at 43727f2, a bitwise-equal gradient and norms equal to 6e-8 for two steps, then
    master weights 1e-2 apart after four.)"""
    clip = 0.5
    ref_model, ref_ddp, ref_opt = _setup(clip, megatron_clip=True, tp=tp)
    model, ddp, opt = _setup(clip, megatron_clip=False, tp=tp)

    def main_params(o):
        return [p for c in o.chained_optimizers for p in c.get_parameters()]

    def adam_state(o):
        return [t for c in o.chained_optimizers for p in c.get_parameters()
                for t in c.optimizer.state[p].values() if isinstance(t, torch.Tensor)]

    n_elems = dist.get_world_size() * sum(g.numel() for o in ref_opt.chained_optimizers
                                          for g in o.get_main_grads_for_grad_norm())
    norm_rel = _norm_bound(n_elems)
    for step in range(STEPS):
        _fb(ref_ddp, ref_opt, step, rank)
        _fb(ddp, opt, step, rank)
        ok_ref, gn_ref, _ = ref_opt.step()
        ok, gn, _ = optimizer_step(opt, clip)
        assert ok and ok_ref
        gn_ref, gn = float(gn_ref), float(gn)
        assert gn_ref > 2 * clip, f"the clipping was supposed to be active: norm {gn_ref} at step {step}"
        assert abs(gn - gn_ref) <= norm_rel * gn_ref, (step, gn, gn_ref, norm_rel)
        ref_main, got_main = main_params(ref_opt), main_params(opt)
        w_max = max(float(p.abs().max()) for p in ref_main)
        bound = _main_bound(step + 1, norm_rel, w_max)
        for x, y in zip(got_main, ref_main):
            assert torch.allclose(x, y, rtol=0, atol=bound), (step, float((x - y).abs().max()), bound)
        # the bf16 parameters are the master weights rounded to nearest: apart by the master weights' bound
        # plus one bf16 ulp (2^-7 relative at most) where the two round to neighbouring bf16 values
        for x, y in zip(model.parameters(), ref_model.parameters()):
            x, y = x.detach().float(), y.detach().float()
            assert torch.allclose(x, y, rtol=2.0 ** -7, atol=bound), (step, float((x - y).abs().max()))
        # the next step starts from megatron's state in both paths
        with torch.no_grad():
            for dst, src in zip(got_main + adam_state(opt) + list(model.parameters()),
                                ref_main + adam_state(ref_opt) + list(ref_model.parameters())):
                dst.copy_(src)


_HOST_READS = {torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__,
               torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.numpy}


def _tensors_in(x) -> int:
    return sum(map(_tensors_in, x)) if isinstance(x, (list, tuple)) else int(isinstance(x, torch.Tensor))


class _HostReads(TorchFunctionMode):
    """Counts the Python-level reads of tensor values on the host: ``.item()``, ``float()``, ``bool()``, ...,
    and ``torch.tensor``/``torch.as_tensor`` of a (nested) list holding tensors (each element read separately, in C++,
    invisible to the dispatcher: megatron's ``torch.tensor(list_of_norms)``)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            self.reads.append(func.__name__)
        elif func in (torch.tensor, torch.as_tensor) and args and isinstance(args[0], (list, tuple)):
            self.reads += [func.__name__] * _tensors_in(args[0])
        return func(*args, **(kwargs or {}))


class _ScalarCopies(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` (a device-to-host copy of one value: a sync on CUDA)."""

    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
                    torch.ops.aten.is_nonzero.default):
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


# -- one rank --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("clip", [1e6, 0.0], ids=["clip_inactive", "clip_0"])
def test_unclipped_steps_are_bitwise_megatrons(clip):
    with megatron_single_rank():
        _check_inactive(clip)


def test_clipped_steps_match_megatron_within_bounds():
    with megatron_single_rank():
        _check_active()


def test_no_host_sync_in_the_clipping():
    with megatron_single_rank():
        _model_, ddp, opt = _setup(0.5, megatron_clip=False)
        _fb(ddp, opt, 0)
        assert not opt.prepare_grads()
        with _HostReads() as reads, _ScalarCopies() as copies:
            gn = clip_grad_norm_sync_free(opt.chained_optimizers, 0.5)
        assert reads.reads == [] and copies.syncs == [], (reads.reads, copies.syncs)
        assert isinstance(gn, torch.Tensor) and gn.dim() == 0
        # the counters see megatron's fallback: a read per gradient tensor (its norm) and more
        with _HostReads() as reads, _ScalarCopies() as copies:
            opt.get_grad_norm()
        assert len(reads.reads) > len(grads_for_grad_norm(opt.chained_optimizers[0])) > 10
        assert copies.syncs


class _FakeOpt:
    """The part of megatron's optimizer API the clipping uses, over plain gradients."""

    def __init__(self, grads, stub=False):
        from megatron.core.optimizer import OptimizerConfig

        self.params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(self.params, grads):
            p.grad = g
        self.config = OptimizerConfig()
        self.is_stub_optimizer = stub

    def get_parameters(self):
        return self.params

    def get_main_grads_for_grad_norm(self):
        return [p.grad for p in self.params]

    def get_grad_stats_parallel_group(self):
        return None


def test_nonfinite_norms_and_no_gradients_as_megatron():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    with megatron_single_rank():
        # inf: the sum of squares overflows (finite gradients); megatron's coefficient 0 zeroes the gradients
        big = [torch.full((4,), 3e19), torch.full((3,), -2e19)]
        opt = _FakeOpt([g.clone() for g in big])
        gn = clip_grad_norm_sync_free([opt], 1.0)
        assert math.isinf(float(gn))
        ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in big]
        for p, g in zip(ref, big):
            p.grad = g.clone()
        clip_grad_by_total_norm_fp32(ref, 1.0, float("inf"))
        _bitwise([p.grad for p in opt.params], [p.grad for p in ref], "inf norm")
        assert all(bool((p.grad == 0).all()) for p in opt.params)
        # NaN (a NaN gradient the found-inf check did not see): megatron does not clip (nan < 1.0 is False)
        nan = [torch.tensor([1.0, float("nan")]), torch.tensor([5.0, -7.0])]
        opt = _FakeOpt([g.clone() for g in nan])
        gn = clip_grad_norm_sync_free([opt], 1.0)
        assert math.isnan(float(gn))
        assert torch.equal(opt.params[1].grad, nan[1]) and float(opt.params[0].grad[0]) == 1.0
        # no gradients at all, a stub optimizer: norm 0, nothing to clip
        assert float(clip_grad_norm_sync_free([_FakeOpt([])], 1.0)) == 0.0
        assert float(clip_grad_norm_sync_free([], 1.0)) == 0.0
        stub = _FakeOpt([torch.full((2,), 10.0)], stub=True)
        assert float(clip_grad_norm_sync_free([stub], 1.0)) == pytest.approx(math.sqrt(200.0))
        assert torch.equal(stub.params[0].grad, torch.full((2,), 10.0))
        # clip 0: the norm only
        opt = _FakeOpt([torch.tensor([3.0, 4.0])])
        assert float(clip_grad_norm_sync_free([opt], 0.0)) == 5.0
        assert torch.equal(opt.params[0].grad, torch.tensor([3.0, 4.0]))
        # two optimizers, separate groups (no shared group): the squares add
        a, b = _FakeOpt([torch.tensor([3.0])]), _FakeOpt([torch.tensor([4.0])])
        assert float(clip_grad_norm_sync_free([a, b], 1.0, shared_group=False)) == 5.0
        assert float(a.params[0].grad) == pytest.approx(3.0 / (5.0 + 1e-6), rel=1e-7)


def test_found_inf_skips_as_megatron():
    with megatron_single_rank():
        _model_, ddp, opt = _setup(1.0, megatron_clip=False)
        _fb(ddp, opt, 0)
        next(iter(ddp.module.parameters())).main_grad.view(-1)[0] = float("nan")
        before = [p.detach().clone() for p in ddp.module.parameters()]
        assert optimizer_step(opt, 1.0) == (False, None, None)
        _bitwise([p.detach() for p in ddp.module.parameters()], before, "skipped step")


# -- two ranks -------------------------------------------------------------------------------------------

CASES = ["dp2", "tp2"]


def _check_nonfinite_outside_the_norm(rank: int) -> None:
    """TP=2: a NaN in a gradient the global norm leaves out (a tensor-parallel duplicate, here rank 1's copy of a
    norm weight) and on that rank only still skips the step on both ranks, the weights untouched: the non-finite
    check covers every main gradient, as megatron's found-inf pass did."""
    from nvfp4_train.mcore_compat.optimizer import grads_for_grad_norm

    _model_, ddp, opt = _setup(1.0, megatron_clip=False, tp=2)
    _fb(ddp, opt, 0, 0)
    assert optimizer_step(opt, 1.0)[0]  # a finite step goes through
    _fb(ddp, opt, 1, 0)
    opt.prepare_grads()
    counted = {(g.data_ptr(), g.numel()) for o in opt.chained_optimizers for g in grads_for_grad_norm(o)}
    left_out = [g for o in opt.chained_optimizers for p in o.get_parameters() if (g := p.grad) is not None
                and (g.data_ptr(), g.numel()) not in counted]
    assert (rank == 1) == bool(left_out)  # rank 0 counts every gradient; rank 1 leaves its duplicates out
    if rank == 1:
        left_out[0].view(-1)[0] = float("nan")
    before = [p.detach().clone() for p in ddp.module.parameters()]
    assert optimizer_step(opt, 1.0) == (False, None, None)
    _bitwise([p.detach() for p in ddp.module.parameters()], before, "skipped step")


def run_two_rank_cases(rank: int, out_dir: str) -> None:
    """Both cases on this rank of the shared gloo group (``tests/two_rank_cases.py``), each recorded in
    ``out_dir`` as ``clip-<case>``."""
    from megatron.core import parallel_state

    def check(tp: int) -> None:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            # DP=2: each rank its own batch (the gradients are averaged, the optimizer sharded);
            # TP=2: both ranks the same batch
            data_rank = rank if tp == 1 else 0
            _check_inactive(1e6, tp=tp, rank=data_rank)
            _check_active(tp=tp, rank=data_rank)
        finally:
            parallel_state.destroy_model_parallel()

    for case in CASES:
        record_outcome(out_dir, f"clip-{case}", rank, lambda: check(2 if case == "tp2" else 1))
        dist.barrier()

    def nonfinite() -> None:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        try:
            _check_nonfinite_outside_the_norm(rank)
        finally:
            parallel_state.destroy_model_parallel()

    record_outcome(out_dir, "clip-tp2-nonfinite", rank, nonfinite)
    dist.barrier()


@pytest.fixture(scope="module")
def dist_outcomes(tmp_path_factory):
    from tests.two_rank_cases import two_rank_outcomes

    return two_rank_outcomes(tmp_path_factory)


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_clipping_as_megatron(dist_outcomes, case):
    assert_ranks_ok(dist_outcomes, f"clip-{case}")


@pytest.mark.dist
def test_two_ranks_nonfinite_gradient_outside_the_norm_skips_the_step(dist_outcomes):
    assert_ranks_ok(dist_outcomes, "clip-tp2-nonfinite")
