"""The optimizer's AdamW form (``nvfp4_train.optim``: torch's fused multi-tensor kernel on CUDA, torch's default on
the CPU), set on megatron-core's inner AdamW by ``nvfp4_train.mcore_compat.optimizer.set_fused_adam``.

- numerics: the fused update against the foreach one megatron ran before (GPU), and torch's fused CPU kernel
  against the CPU default (CPU: the same derived bound, checked where it runs), each step of a few from the same
  random state, odd shapes, edge values, two param groups with their own lr and weight decay;
- megatron: ``build_optimizer`` fuses where the master weights are on CUDA and nowhere else; a fused megatron step
  is ``torch._fused_adamw_`` on its master weights, gradients and moments with megatron's per-group lr and weight
  decay, bit for bit; the ``step`` states are float32 on the parameters' device; a NaN gradient skips the step
  and leaves the step counts alone;
- checkpoints: saved in one form and loaded into a run of the other (``dp_reshardable`` and
  ``fully_reshardable``), the run keeps its form, every parameter gets its own ``step`` with the saved count
  where its form keeps it, and the next step equals that of a run that never stopped, bit for bit.

GPU tier: ``pytest -q -m gpu tests/trainer/test_fused_adam.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4_train.mcore_compat.optimizer import adam_is_fused, set_fused_adam
from nvfp4_train.optim import OptimConfig, build_ddp, build_optimizer, optimizer_step
from tests.precision.mcore_util import megatron_single_rank

FP32_U = 2.0 ** -24  # unit roundoff of fp32
UNDERFLOW = 2.0 ** -126  # absolute slack: a result in fp32's subnormal range loses up to 2^-149 per rounding
OPT = OptimConfig()
BETA1, BETA2, EPS = OPT.adam_beta1, OPT.adam_beta2, OPT.adam_eps


# -- the bound -----------------------------------------------------------------------------------------------

def adam_bound(p, g, m, v, *, t: int, lr: float, wd: float):
    """Per-element bounds (fp64) on |a - b| between two fp32 AdamW implementations' new (param, exp_avg,
    exp_avg_sq) computed from the same fp32 inputs ``p, g, m, v`` at step ``t`` (the count after the increment).

    Exact step: p1 = p (1 - lr wd), m1 = b1 m + w1 g, v1 = b2 v + w2 g^2 (w1 = 1 - b1, w2 = 1 - b2),
    U = S m1 / D with S = lr / (1 - b1^t), D = sqrt(v1) / sqrt(1 - b2^t) + eps, p2 = p1 - U.
    Each fp32 operation rounds once (relative u = 2^-24), a Python scalar passed to a float kernel rounds once
    too; torch's CUDA fused kernel evaluates p1, m1 and v1 in double and rounds each once to fp32. Per form:

    - m1 (M = b1 |m| + w1 |g| >= |m1|): fused CUDA one rounding, u M; foreach ``lerp`` m + fl(w1) (g - m) (w1 <
      1/2) u |m1| + 3 u w1 |g - m| <= 4 u M (w1 |m| <= b1 |m| as w1 <= b1); the CPU forms (the same lerp, or
      fl(b1) m + fl(w1) g) at most 4 u M. Two forms: |dm| <= 8 u M.
    - v1: all its terms are >= 0, so each rounding on a term's path costs at most u v1: fused CUDA 1; foreach
      ``mul_(b2)`` then ``addcmul_`` (fl(b2), the product, fl(w2), g g, the product, the sum) at most 4 per path;
      the CPU forms 4. Two forms: |dv| <= 8 u v1.
    - U from a form's own m1', v1': fl(S), fl(sqrt(1 - b2^t)), the sqrt, the division, fl(eps) and the sum in D,
      the division by D and the product by S: 8 u |U|; its m1' error (4 u M) moves U by 4 u (S / D) M; its v1'
      error (4 u relative) moves sqrt(v1') by 2 u, D and so U by 2 u. With |U| <= (S / D) M each form is within
      14 u (S / D) M of U. Two forms: 28 u (S / D) M.
    - p1: fused CUDA one rounding (u |p1|); foreach and the CPU default fl(p fl(1 - lr wd)) (2 u); the CPU fused
      p - fl(lr wd) p (3 u). Two forms: 6 u |p1| (exact, and the same, when wd = 0). p2 = p1' - U' rounds once
      in each: 2 u |p2|.

    Rounded up for second-order terms: |dp2| <= 6 u |p1| + 2 u |p2| + 30 u (S / D) M, |dm1| <= 8 u M,
    |dv1| <= 8 u v1, each plus 4 x 2^-126 for results in the subnormal range (inputs are normal numbers or 0)."""
    p, g, m, v = (x.double() for x in (p, g, m, v))
    w1, w2 = 1.0 - BETA1, 1.0 - BETA2
    big_m = BETA1 * m.abs() + w1 * g.abs()
    v1 = BETA2 * v + w2 * g * g
    s = lr / (1.0 - BETA1 ** t)
    d = v1.sqrt() / math.sqrt(1.0 - BETA2 ** t) + EPS
    p1 = p * (1.0 - lr * wd)
    p2 = p1 - s * (BETA1 * m + w1 * g) / d
    u, tiny = FP32_U, 4 * UNDERFLOW
    return (6 * u * p1.abs() + 2 * u * p2.abs() + 30 * u * (s / d) * big_m + tiny,
            8 * u * big_m + tiny, 8 * u * v1 + tiny)


# -- random shards ---------------------------------------------------------------------------------------------

SHAPES = [(1,), (7,), (257,), (1023, 5), (3, 4099), (65537,)]  # odd sizes: the kernels' non-vectorized tails
MATRIX_GROUP = {"lr_mult": 1.0, "wd": 0.1}
VECTOR_GROUP = {"lr_mult": 0.5, "wd": 0.0}  # megatron's no-decay group (biases, norms)


def _edge_fill(x: torch.Tensor, gen: torch.Generator, values: list[float]) -> None:
    """Overwrite ~1/8 of ``x`` (flat) with ``values`` at random places."""
    flat = x.view(-1)
    n = max(1, flat.numel() // 8)
    idx = torch.randint(0, flat.numel(), (n,), generator=gen)
    pick = torch.tensor(values, dtype=x.dtype)[torch.randint(0, len(values), (n,), generator=gen)]
    flat[idx] = pick


def _random_state(shape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """(param, grad, exp_avg, exp_avg_sq) as a trained state could hold them, with zeros, tiny and huge values
    (all normal fp32 numbers; g^2 stays finite)."""
    scale = 10.0 ** torch.empty(shape).uniform_(-3, 1, generator=gen)  # magnitudes over four decades
    p = torch.randn(shape, generator=gen) * 0.02 * scale
    g = torch.randn(shape, generator=gen) * 1e-3 * scale
    m = 0.3 * g + torch.randn(shape, generator=gen) * 1e-4 * scale
    v = (torch.randn(shape, generator=gen) * 1e-3 * scale) ** 2
    _edge_fill(p, gen, [0.0, -0.0, 1e-30, -3e-25, 1e4, -7e8])
    _edge_fill(g, gen, [0.0, 1e-30, -2e-20, 1e-8, -5e3, 1e15])
    _edge_fill(m, gen, [0.0, 1e-30, -4e-12, 2e2])
    _edge_fill(v, gen, [0.0, 2e-38, 1e-24, 1e10, 3e30])
    return {"p": p, "g": g, "m": m, "v": v}


def _optimizer(states: list[dict], device, *, fused: bool | None, foreach: bool | None):
    """A torch AdamW over copies of ``states`` on ``device`` in two groups (matrices first): its params in order."""
    params = []
    for st in states:
        p = st["p"].to(device).clone().requires_grad_(False)
        params.append(p)
    groups = [{"params": [p for p, st in zip(params, states) if st["group"] is grp],
               "lr": 1e-3, "weight_decay": grp["wd"]} for grp in (MATRIX_GROUP, VECTOR_GROUP)]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(BETA1, BETA2), eps=EPS, fused=fused, foreach=foreach)
    return opt, params


def _load_state(opt, params, states: list[dict], step: int) -> None:
    """Put ``states`` (param, grad, moments) into ``opt`` with the step count ``step - 1`` before the update."""
    for p, st in zip(params, states):
        group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
        on_device = bool(group.get("fused"))
        with torch.no_grad():
            p.copy_(st["p"])
        p.grad = st["g"].to(p.device).clone()
        opt.state[p] = {"step": torch.tensor(float(step - 1), dtype=torch.float32,
                                             device=p.device if on_device else "cpu"),
                        "exp_avg": st["m"].to(p.device).clone(), "exp_avg_sq": st["v"].to(p.device).clone()}


def _check_forms_agree(gen: torch.Generator, device: str, fused_kw: dict, ref_kw: dict) -> float:
    """Steps of two AdamW forms from the same random states (one state per step, step counts 1, 2, 3, 10, 1000
    as a resumed run has them; the lr changes per step as the schedule's does): every element within
    :func:`adam_bound`. Returns the largest |difference| / bound seen."""
    worst = 0.0
    for k, step in enumerate((1, 2, 3, 10, 1000)):
        states = []
        for i, shape in enumerate(SHAPES):
            st = _random_state(shape, gen)
            st["group"] = VECTOR_GROUP if len(shape) == 1 and i % 2 == 0 else MATRIX_GROUP
            states.append(st)
        lr = 1e-3 * (0.5 + k)
        a, a_params = _optimizer(states, device, **fused_kw)
        b, b_params = _optimizer(states, device, **ref_kw)
        for opt, params in ((a, a_params), (b, b_params)):
            for grp, group in zip((MATRIX_GROUP, VECTOR_GROUP), opt.param_groups):
                group["lr"] = lr * grp["lr_mult"]
            _load_state(opt, params, states, step)
            opt.step()
        for st, pa, pb in zip(states, a_params, b_params):
            grp = st["group"]
            bounds = adam_bound(st["p"], st["g"], st["m"], st["v"], t=step, lr=lr * grp["lr_mult"], wd=grp["wd"])
            sa, sb = a.state[pa], b.state[pb]
            assert float(sa["step"]) == float(sb["step"]) == step
            for name, x, y, bound in (("param", pa, pb, bounds[0]), ("exp_avg", sa["exp_avg"], sb["exp_avg"],
                                      bounds[1]), ("exp_avg_sq", sa["exp_avg_sq"], sb["exp_avg_sq"], bounds[2])):
                diff = (x.detach().cpu().double() - y.detach().cpu().double()).abs()
                ratio = float((diff / bound).max())
                worst = max(worst, ratio)
                assert ratio <= 1.0, (name, tuple(st["p"].shape), step, ratio)
    return worst


@pytest.mark.gpu
def test_fused_update_matches_foreach_within_the_bound_gpu(gen):
    _check_forms_agree(gen, "cuda", {"fused": True, "foreach": False}, {"fused": None, "foreach": True})


def test_fused_cpu_update_matches_the_cpu_default_within_the_bound(gen):
    """torch's fused CPU kernel against the CPU default (a loop over the tensors): the bound of the derivation
    holds for these forms too (the CPU runs keep the default; this checks the derivation where it can run)."""
    _check_forms_agree(gen, "cpu", {"fused": True, "foreach": False}, {"fused": None, "foreach": None})


# -- megatron ----------------------------------------------------------------------------------------------

VOCAB, HIDDEN, FFN, LAYERS, SEQ = 96, 32, 64, 2, 16


def _build(device: str, *, fused: bool | None = None):
    """A small megatron GPT (bf16, local spec) in DDP and the project's optimizer; ``fused`` overrides the
    form ``build_optimizer`` picks."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    tconfig = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=4, kv_channels=8,
        init_method_std=0.05, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, add_bias_linear=True)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = GPTModel(config=tconfig, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="rope").to(torch.bfloat16)
    if device == "cuda":
        model = model.cuda()
    ddp = build_ddp(model, OPT)
    opt = build_optimizer([ddp], OPT, lr=1e-3, min_lr=0.0)
    if fused is not None:
        set_fused_adam(opt, fused)
    return model, ddp, opt


def _inner(opt) -> list:
    return [sub.optimizer for sub in getattr(opt, "chained_optimizers", [opt])]


def _set_grads(model, ddp, opt, step: int) -> None:
    """Seeded stand-in gradients in megatron's FP32 gradient buffers (no forward or backward: the test is of the
    update, and device kernels of a backward need not be deterministic)."""
    ddp.zero_grad_buffer()
    opt.zero_grad()
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.main_grad.copy_(torch.randn(p.main_grad.shape, generator=g) * 1e-2)


def _schedule(opt, step: int) -> None:
    """What the schedule does each step: the groups' lr and weight decay by their multipliers."""
    for group in opt.param_groups:
        group["lr"] = 1e-3 * (1 + step) * group.get("lr_mult", 1.0)
        group["weight_decay"] = OPT.weight_decay * group.get("wd_mult", 1.0)


def _step(model, ddp, opt, step: int) -> None:
    _set_grads(model, ddp, opt, step)
    _schedule(opt, step)
    ok, _, _ = optimizer_step(opt, OPT.clip_grad)
    assert ok


def _steps_where_the_form_keeps_them(opt, count: float) -> None:
    for inner in _inner(opt):
        for group in inner.param_groups:
            for p in group["params"]:
                step = inner.state[p]["step"]
                want = p.device if group.get("fused") else torch.device("cpu")
                assert step.dtype == torch.float32 and step.device == want and float(step) == count
        ids = [id(inner.state[p]["step"]) for group in inner.param_groups for p in group["params"]]
        assert len(set(ids)) == len(ids), "the parameters share a step tensor"


def _check_megatron_step_is_the_fused_kernel(device: str) -> None:
    model, ddp, opt = _build(device)
    assert adam_is_fused(opt) == (device == "cuda")
    if device == "cpu":  # the CPU keeps torch's default; the fused form is still what the CUDA runs do
        assert all(g["fused"] is None and g["foreach"] is None for inner in _inner(opt) for g in inner.param_groups)
        set_fused_adam(opt, True)
    assert all(g["fused"] is True and g["foreach"] is False for inner in _inner(opt) for g in inner.param_groups)
    _step(model, ddp, opt, 0)
    _steps_where_the_form_keeps_them(opt, 1.0)
    # step 1 by hand: torch's fused kernel on copies of the master weights, gradients and moments, with the
    # hyperparameters of each megatron group, against megatron's step
    _set_grads(model, ddp, opt, 1)
    _schedule(opt, 1)
    assert not opt.prepare_grads()
    want = []
    for inner in _inner(opt):
        for group in inner.param_groups:
            ps = [p.detach().clone() for p in group["params"]]
            gs = [p.grad.detach().clone() for p in group["params"]]
            ms = [inner.state[p]["exp_avg"].clone() for p in group["params"]]
            vs = [inner.state[p]["exp_avg_sq"].clone() for p in group["params"]]
            ts = [inner.state[p]["step"].clone() + 1 for p in group["params"]]
            if ps:
                torch._fused_adamw_(ps, gs, ms, vs, [], ts, lr=group["lr"], beta1=BETA1, beta2=BETA2,
                                    weight_decay=group["weight_decay"], eps=EPS, amsgrad=False, maximize=False)
            want += list(zip(ps, ms, vs))
    assert opt.step_with_ready_grads()
    got = [(p.detach(), inner.state[p]["exp_avg"], inner.state[p]["exp_avg_sq"])
           for inner in _inner(opt) for group in inner.param_groups for p in group["params"]]
    assert len(got) == len(want) > 4
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    _steps_where_the_form_keeps_them(opt, 2.0)
    # a NaN gradient: megatron's found-inf check skips the update; no weight, moment or step count moves
    _set_grads(model, ddp, opt, 2)
    next(iter(model.parameters())).main_grad.view(-1)[0] = float("nan")
    before = [t.clone() for t in _everything(model, opt)]
    assert optimizer_step(opt, OPT.clip_grad) == (False, None, None)
    after = _everything(model, opt)
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    _steps_where_the_form_keeps_them(opt, 2.0)


def _everything(model, opt) -> list[torch.Tensor]:
    """Parameters, master weights, moments and step counts, in a fixed order."""
    out = [p.detach() for p in model.parameters()]
    for inner in _inner(opt):
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                out += [p.detach(), st["exp_avg"], st["exp_avg_sq"], st["step"]]
    return out


def test_megatron_step_is_the_fused_kernel_cpu():
    with megatron_single_rank("cpu"):
        _check_megatron_step_is_the_fused_kernel("cpu")


@pytest.mark.gpu
def test_megatron_step_is_the_fused_kernel_gpu():
    with megatron_single_rank("cuda"):
        _check_megatron_step_is_the_fused_kernel("cuda")


# -- checkpoints -------------------------------------------------------------------------------------------

SAVED_AT = 2


def _save(ddp, opt, root, optim_format: str):
    from nvfp4_train.checkpoint import save_checkpoint

    layout = {"tp": 1, "pp": 1, "dp": 1}
    return save_checkpoint(root, step=SAVED_AT, ddp=ddp, optimizer=opt, trainer_state={"step": SAVED_AT},
                           config_yaml="{}\n", meta={"model": {}, "layout": layout, "step": SAVED_AT}, keep_last=1,
                           optim_format=optim_format)


def _load(path, ddp, opt) -> None:
    from nvfp4_train.checkpoint import load_checkpoint

    load_checkpoint(path, ddp=ddp, optimizer=opt, layout={"tp": 1, "pp": 1, "dp": 1}, model_config={})


def _check_resume_across_forms(device: str, tmp_path, optim_format: str, saved_fused: bool) -> None:
    """A run in one form saved after SAVED_AT steps and resumed by a run of the other form, against a run that
    never stopped and changed its form at the same point: the same next step, bit for bit."""
    model, ddp, opt = _build(device, fused=saved_fused)
    for step in range(SAVED_AT):
        _step(model, ddp, opt, step)
    path = _save(ddp, opt, tmp_path / "ckpt", optim_format)
    set_fused_adam(opt, not saved_fused)  # the run that never stopped
    _step(model, ddp, opt, SAVED_AT)
    want = [t.clone() for t in _everything(model, opt)]
    del model, ddp, opt

    model, ddp, opt = _build(device, fused=not saved_fused)
    _load(path, ddp, opt)
    assert adam_is_fused(opt) == (not saved_fused)  # the run's form, not the checkpoint's
    _steps_where_the_form_keeps_them(opt, float(SAVED_AT))
    _step(model, ddp, opt, SAVED_AT)
    got = _everything(model, opt)
    assert len(got) == len(want)
    for i, (x, y) in enumerate(zip(got, want)):
        assert x.dtype == y.dtype and x.device == y.device and torch.equal(x, y), i


@pytest.mark.parametrize("optim_format", ["dp_reshardable", "fully_reshardable"])
@pytest.mark.parametrize("saved_fused", [False, True], ids=["saved_default", "saved_fused"])
def test_a_checkpoint_of_either_form_resumes_in_the_other_cpu(tmp_path, optim_format, saved_fused):
    with megatron_single_rank("cpu"):
        _check_resume_across_forms("cpu", tmp_path, optim_format, saved_fused)


@pytest.mark.gpu
@pytest.mark.parametrize("optim_format", ["dp_reshardable", "fully_reshardable"])
def test_a_foreach_checkpoint_resumes_fused_gpu(tmp_path, optim_format):
    """A checkpoint written before the fused form (foreach, CPU step counts) resumes in it on CUDA."""
    with megatron_single_rank("cuda"):
        _check_resume_across_forms("cuda", tmp_path, optim_format, saved_fused=False)


# -- the benchmark -----------------------------------------------------------------------------------------

def test_bench_optimizer_quick_runs_every_part():
    """``scripts/bench_optimizer.py --quick`` in process (CPU, tiny shapes): a row for every part and form, and
    the two copy-back forms write the same bf16 bits."""
    import argparse

    from nvfp4_train.bench import optimizer as bench

    with megatron_single_rank("cpu"):
        rows, same = bench.run(argparse.Namespace(quick=True, params=None, model="1.2b", megatron=False, iters=2,
                                                  warmup=1, seed=0))
    assert same
    assert [(r["part"], r["form"]) for r in rows][3:5] == [("AdamW", "foreach"), ("AdamW", "fused")]
    assert len(rows) == 9 and all(r["ms"] > 0 and r["bytes"] == bench.BYTES[r["part"]] * r["params"] for r in rows)
    assert sum(s.numel for s in bench.model_shards("1.2b")) == 1_291_929_600
    assert [s.numel for s in bench.count_shards(2 * bench.CHUNK + 5)] == [bench.CHUNK, bench.CHUNK, 5]
