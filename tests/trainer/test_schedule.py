"""WSD schedule (RECIPE.md section 7): megatron-core's OptimizerParamScheduler at every position, exact values
at the phase boundaries, steps and tokens giving the same schedule."""

from __future__ import annotations

import math
import types

import pytest

from nvfp4_train.schedule import DECAY_STYLES, ScheduleConfig, WSDSchedule, wsd_lr


def _megatron_lrs(*, max_lr, min_lr, init_lr, warmup, total, decay, style, positions):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = types.SimpleNamespace(param_groups=[{}])
    sched = OptimizerParamScheduler(opt, init_lr=init_lr, max_lr=max_lr, min_lr=min_lr, lr_warmup_steps=warmup,
                                    lr_decay_steps=total, lr_decay_style="WSD", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=total, wd_incr_style="constant", wsd_decay_steps=decay,
                                    lr_wsd_decay_style=style)
    out = []
    for p in positions:
        sched.num_steps = p
        out.append(sched.get_lr({}))
    return out


@pytest.mark.parametrize("style", DECAY_STYLES)
@pytest.mark.parametrize("warmup,total,decay", [(7, 103, 17), (0, 50, 10), (1, 12, 11), (5, 40, 0)])
def test_wsd_equals_megatron_everywhere(style, warmup, total, decay):
    kw = dict(max_lr=4.5e-4, min_lr=4.5e-6, init_lr=1e-7, warmup=warmup, total=total, decay=decay, style=style)
    positions = list(range(total + 3))  # past the end too
    if decay == 0:  # megatron divides by wsd_decay_steps only inside the anneal, which is then empty
        positions = positions[: total + 1]
    ours = [wsd_lr(p, **kw) for p in positions]
    assert ours == _megatron_lrs(**kw, positions=positions)


@pytest.mark.parametrize("style", DECAY_STYLES)
def test_wsd_boundaries_exact(style):
    # warmup 4, stable 4..12, decay over the last 8 of 20; max 2.0, min 0.5, init 0.25 (all dyadic: exact)
    kw = dict(max_lr=2.0, min_lr=0.5, init_lr=0.25, warmup=4, total=20, decay=8, style=style)
    assert wsd_lr(0, **kw) == 0.25  # warmup starts at init_lr
    assert wsd_lr(2, **kw) == 0.25 + 1.75 * 0.5  # halfway through warmup: exact in binary
    assert wsd_lr(4, **kw) == 2.0  # the warmup's last position is the peak
    assert wsd_lr(5, **kw) == 2.0
    assert wsd_lr(12, **kw) == 2.0  # anneal start = total - decay: still the peak (r = 0)
    assert wsd_lr(20, **kw) == 0.5  # r = 1: every style's coefficient is exactly 0
    assert wsd_lr(21, **kw) == 0.5  # past the end: min_lr
    # r = 1/2 at position 16: coefficients 1/2, 1/2 (1 + cos(pi/2) rounds to 1), sqrt(2)-1, 1-sqrt(1/2)
    coeff = {"linear": 0.5, "cosine": 0.5, "exponential": math.sqrt(2.0) - 1.0, "minus_sqrt": 1.0 - math.sqrt(0.5)}
    # exact for linear/cosine; for the two others the two expressions round differently by at most 2 ulp of
    # coeff (~1e-16), times (max - min) = 1.5, plus the rounding of the sum: bound 1e-15 absolute
    assert wsd_lr(16, **kw) == pytest.approx(0.5 + coeff[style] * 1.5, abs=1e-15)
    if style in ("linear", "cosine"):
        assert wsd_lr(16, **kw) == 1.25
    # monotone non-increasing over the anneal
    lrs = [wsd_lr(p, **kw) for p in range(12, 21)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_no_warmup_starts_at_peak():
    assert wsd_lr(0, max_lr=1.0, min_lr=0.0, init_lr=0.0, warmup=0, total=10, decay=2, style="linear") == 1.0


def test_steps_and_tokens_give_the_same_schedule():
    seq = 64
    a = ScheduleConfig(global_batch_size=6, train_steps=50, warmup_steps=5, decay_steps=12, lr=3e-4, min_lr=3e-6,
                       decay_style="cosine").resolve(seq)
    t = 6 * seq
    b = ScheduleConfig(global_batch_size=6, train_tokens=50 * t, warmup_tokens=5 * t, decay_tokens=12 * t,
                       decay_fraction=None, lr=3e-4, min_lr=3e-6, decay_style="cosine").resolve(seq)
    assert a == b
    plain = [wsd_lr(k, max_lr=3e-4, min_lr=3e-6, init_lr=0.0, warmup=5, total=50, decay=12, style="cosine")
             for k in range(50)]
    got = [a.lr_at_step(k) for k in range(50)]
    # the anneal ratio float(k*T)/float(D*T) is the same correctly rounded rational as float(k)/float(D):
    # bitwise from the warmup's end on; in the warmup megatron's order (max_lr * position) / warmup rounds a
    # product of a different size: at most 2 roundings of relative size 2^-53 each -> rel 1e-15
    assert got[5:] == plain[5:]
    assert got[:5] == pytest.approx(plain[:5], rel=1e-15, abs=0)


def test_resolve_lengths_and_fraction():
    r = ScheduleConfig(global_batch_size=4, train_tokens=1000, warmup_steps=2, decay_fraction=0.2).resolve(16)
    assert r.tokens_per_step == 64
    assert r.train_steps == 16  # ceil(1000 / 64)
    assert r.total_tokens == 16 * 64
    assert r.decay_tokens == 3 * 64  # round(0.2 * 16) = 3 whole steps
    assert r.warmup_tokens == 2 * 64
    # the last step runs one decay unit above min_lr, as in megatron
    assert r.lr_at_step(15) > r.min_lr
    assert r.lr_at_step(13) == r.max_lr  # step 13 at 13*64 = anneal start


def test_schedule_sets_lr_and_weight_decay_per_group():
    opt = types.SimpleNamespace(param_groups=[{"wd_mult": 1.0, "lr_mult": 1.0}, {"wd_mult": 0.0}])
    r = ScheduleConfig(global_batch_size=1, train_steps=10, warmup_steps=2, decay_steps=2, lr=1.0,
                       min_lr=0.0).resolve(1)
    s = WSDSchedule(r, opt, weight_decay=0.1)
    assert s.apply(1) == 0.5
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.5]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # no decay on biases / norms


@pytest.mark.parametrize("kwargs,needle", [
    (dict(train_steps=10, warmup_steps=6, decay_steps=5), "exceed the run"),
    (dict(train_steps=10, train_tokens=100), "not both"),
    (dict(train_steps=10, decay_style="step"), "decay_style='step'"),
    (dict(train_steps=10, min_lr=1.0, lr=0.1), "min_lr"),
    (dict(train_steps=10, global_batch_size=0), "global_batch_size=0"),
    (dict(train_steps=10, decay_fraction=1.5), "decay_fraction=1.5"),
    (dict(), "train_steps=N"),
])
def test_bad_schedule_values(kwargs, needle):
    with pytest.raises(ValueError, match=None) as e:
        ScheduleConfig(**kwargs).resolve(8)
    assert needle in str(e.value)
