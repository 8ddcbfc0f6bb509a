"""The gradient-fidelity tool (nvfp4_train.experiments.grad_fidelity) on the hybrid `tiny` on CPU: exactness
against itself, deterministic recipes, the mean over stochastic-rounding seeds recomputed independently, the
command line end to end, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nvfp4_train.experiments import grad_fidelity as gf
from nvfp4_train.precision.megatron_linear import set_sr_streams
from tests.export.conftest import VALIDATION

U64 = 2.0**-53  # float64 unit roundoff
SEQ, MB = 32, 2  # 64 tokens: a multiple of nvfp4's 16 and mxfp4's 32 token blocks


@pytest.fixture(scope="module")
def model():
    from nvfp4_train.models.config import SIZES
    from nvfp4_train.export.checkpoint_io import build_model_single

    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build_model_single(SIZES["tiny"], dtype=torch.bfloat16)


def _batch(gen, vocab: int):
    t = torch.randint(0, vocab, (MB, SEQ + 1), generator=gen)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _run(model, tokens, labels, names, *, sr_seeds, base_seed, sample_all=False):
    pattern = model.model_cfg.pattern
    layers = gf.fidelity_layers(model)
    maps = {n: gf.precision_map(n, pattern) for n in names}
    return layers, gf.measure_batch(model, layers, tokens, labels, maps, bf16_map=gf.precision_map("bf16", pattern),
                                    sr_seeds=sr_seeds, base_seed=base_seed, sample_all=sample_all)


def test_bf16_against_bf16_is_exact(model, gen):
    tokens, labels = _batch(gen, model.model_cfg.vocab_size)
    layers, (r,) = _run(model, tokens, labels, ["bf16"], sr_seeds=4, base_seed=7)
    assert r.seeds == 1 and not r.stochastic  # bf16 has no stochastic cast: one sample
    assert set(r.layer_recipes) == {"bf16"} and len(r.layer_recipes) == len(layers) == 12
    for q in gf.QUANTITIES:
        assert all(n > 0 for n in r.ref_norms[q])
        for m in ("err", "err_seed0", "bias", "bias_noise"):
            assert r.values[q][m] == [0.0] * len(layers), (q, m)
        assert r.values[q]["cos"] == [1.0] * len(layers), q  # dot = ||g||^2 exactly; sqrt(fl(a*a)) = a (IEEE)


def test_deterministic_recipe_gives_the_same_numbers_for_every_seed(model, gen):
    """nvfp4_no_sr rounds every cast to nearest: sampled 3 times anyway (sample_all), every sample is the same
    gradient, so the mean over the samples is that gradient and the bias is the single-seed error exactly."""
    tokens, labels = _batch(gen, model.model_cfg.vocab_size)
    _, (once,) = _run(model, tokens, labels, ["nvfp4_no_sr"], sr_seeds=3, base_seed=11)
    _, (r,) = _run(model, tokens, labels, ["nvfp4_no_sr"], sr_seeds=3, base_seed=11, sample_all=True)
    assert once.seeds == 1 and r.seeds == 3 and not r.stochastic
    quantized = [i for i, lr in enumerate(r.layer_recipes) if lr != "bf16"]
    assert quantized  # tiny: blocks 1-4 of 6 quantized
    for q in gf.QUANTITIES:
        v = r.values[q]
        # the sum of 3 equal bf16-valued float64 tensors is exact, so is its division by 3: mean = the sample
        assert v["bias"] == v["err_seed0"] == once.values[q]["err_seed0"], q
        assert v["bias_noise"] == [0.0] * len(v["bias"]), q
        for i in quantized:
            assert v["err_seed0"][i] > 0
            # err = (e + e + e) / 3 in float64: at most 2 roundings of the sum (<= 2u each) and one of the division
            assert abs(v["err"][i] - v["err_seed0"][i]) <= 4 * U64 * v["err_seed0"][i]
            assert abs(v["cos"][i] - once.values[q]["cos"][i]) <= 4 * U64


def _independent(model, layers, tokens, labels, name, seeds, base_seed):
    """Per layer: the bf16 reference and the per-seed weight gradients and outputs, by hand."""
    pattern = model.model_cfg.pattern
    outs: list = []
    hooks = [m.register_forward_hook(lambda _m, _i, o, i=i: outs.append((i, o[0].detach().double())))
             for i, m in enumerate(layers)]

    def run(layer_map, seed):
        gf.apply_layer_map(layers, layer_map)
        set_sr_streams(model, seed)
        for p in model.parameters():
            p.grad = None
        outs.clear()
        pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
        model(input_ids=tokens, position_ids=pos, attention_mask=None, labels=labels).float().mean().backward()
        y = dict(outs)
        return {"wgrad": [m.weight.grad.double() for m in layers], "output": [y[i] for i in range(len(layers))]}

    try:
        ref = run(gf.precision_map("bf16", pattern), base_seed)
        samples = [run(gf.precision_map(name, pattern), base_seed + k) for k in range(seeds)]
    finally:
        for h in hooks:
            h.remove()
    return ref, samples


def test_nvfp4_bias_is_the_mean_over_seeds_recomputed_independently(model, gen):
    """The tool's bias, errors, cosines and bias noise of nvfp4 (stochastic rounding of the gradients) against
    the same numbers computed here from the per-seed gradients and outputs (streams of run seed base + k)."""
    tokens, labels = _batch(gen, model.model_cfg.vocab_size)
    base, seeds = int(torch.randint(0, 2**20, (1,), generator=gen)), 3
    layers, (r,) = _run(model, tokens, labels, ["nvfp4"], sr_seeds=seeds, base_seed=base)
    assert r.seeds == seeds and r.stochastic
    ref, samples = _independent(model, layers, tokens, labels, "nvfp4", seeds, base)
    # Tolerance: both sides hold the same float64 values (bf16 gradients and outputs, their sums over 3 seeds
    # exact); they may differ only in the order of the float64 reductions over < 2**17 elements (the largest
    # tiny layer output, 64 x 1616) and a few final roundings: relative error <= 2**17 * u ~ 1.5e-11 per sum of
    # nonnegative terms, halved by the square root; rtol = 1e-9 covers it. The tool's bias noise is a
    # difference, sum_k e_k - S b^2 (e_k = ||g_k - r||^2, b = ||mean - r||): its rounding error is that of the
    # two sums times kappa = sum_k e_k / sum_k ||g_k - mean||^2, checked below to be < 1e3: <= 1e3 * 2 * 1.5e-11
    # = 3e-8 relative, under the 1e-6 used.
    rtol = 1e-9
    quantized = [i for i, lr in enumerate(r.layer_recipes) if lr != "bf16"]
    for q in gf.QUANTITIES:
        v = r.values[q]
        for i in range(len(layers)):
            rr = ref[q][i]
            rn = float(rr.norm())
            gs = [s[q][i] for s in samples]
            mean = torch.stack(gs).sum(0) / seeds
            errs = [float((g - rr).norm()) / rn for g in gs]
            coss = [float((g * rr).sum()) / (float(g.norm()) * rn) for g in gs]
            spread2 = sum(float(((g - mean) ** 2).sum()) for g in gs)
            assert r.ref_norms[q][i] == pytest.approx(rn, rel=rtol)
            assert v["bias"][i] == pytest.approx(float((mean - rr).norm()) / rn, rel=rtol, abs=0), (q, i)
            assert v["err_seed0"][i] == pytest.approx(errs[0], rel=rtol), (q, i)
            assert v["err"][i] == pytest.approx(sum(errs) / seeds, rel=rtol), (q, i)
            assert v["cos"][i] == pytest.approx(sum(coss) / seeds, rel=rtol), (q, i)
            noise = math.sqrt(spread2 / (seeds * (seeds - 1))) / rn
            if spread2 > 0:
                assert sum(float(((g - rr) ** 2).sum()) for g in gs) < 1e3 * spread2  # kappa, see above
            assert v["bias_noise"][i] == pytest.approx(noise, rel=1e-6, abs=1e-12), (q, i)
            assert all(math.isfinite(v[m][i]) for m in gf.METRICS)
            # ||mean_k (g_k - r)|| <= mean_k ||g_k - r|| (triangle inequality), up to float64 rounding
            assert v["bias"][i] <= v["err"][i] * (1 + 1e-12)
        for i in quantized:
            assert v["err"][i] > 0
        if q == "wgrad":  # stochastic rounding of dy: the samples differ, in every quantized layer's gradient
            assert all(v["bias_noise"][i] > 0 for i in quantized)
        else:  # the forward pass rounds to nearest in nvfp4: every sample's output is the same
            assert all(v["bias_noise"][i] == 0.0 for i in range(len(layers)))


def test_cli_writes_json_markdown_and_png(tmp_path, capsys):
    out = tmp_path / "gf"
    rc = gf.main(["--init-only", "tiny", "--random-tokens", "--batches", "2", "--sr-seeds", "2", "--recipes", "bf16",
                  "nvfp4", "nvfp4_no_sr", "--seq", str(SEQ), "--micro-batch", str(MB), "--out", str(out),
                  "--device", "cpu"])
    assert rc == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "grad_fidelity.json").read_text())
    md = (out / "grad_fidelity.md").read_text()
    assert (out / "grad_fidelity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert md.strip() == printed.strip()
    assert doc["meta"]["seeds_per_recipe"] == {"bf16": 1, "nvfp4": 2, "nvfp4_no_sr": 1}
    assert doc["meta"]["stochastic_rounding"] == {"bf16": False, "nvfp4": True, "nvfp4_no_sr": False}
    assert len(doc["results"]) == 2 * 3 and len(doc["layers"]) == 12
    assert {li["layer_class"] for li in doc["layers"]} == {"mamba.in_proj", "mamba.out_proj", "mlp.fc1", "mlp.fc2",
                                                             "attention.qkv", "attention.proj"}
    assert {(li["name"], li["block"]) for li in doc["layers"]} >= {("blocks.2.attention.qkv", 2)}
    classes = {row["class"] for row in doc["summary"]}
    for cls in classes:
        assert f"## {cls}" in md
    nv = [row for row in doc["summary"] if row["recipe"] == "nvfp4"]
    assert nv and all(row["quantized"] and row["batches"] == 2 and row["wgrad"]["err"]["se"] is not None
                      for row in nv)
    assert "| nvfp4 | " in md and "| bf16 (none quantized: all layers) | " in md


def test_bad_input_names_the_problem(tmp_path, capsys):
    missing = tmp_path / "no_such_run"
    assert gf.main([str(missing), "--out", str(tmp_path / "o")]) == 2
    assert str(missing) in capsys.readouterr().err
    assert gf.main(["--init-only", "tiny", "--recipes", "nvfp4", "nvfp5", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "'nvfp5'" in err and "nvfp4_no_rht" in err  # names it, lists the known ones
    assert gf.main(["--init-only", "huge", "--out", str(tmp_path / "o")]) == 2
    assert "'huge'" in capsys.readouterr().err
    assert gf.main(["--init-only", "tiny", "--random-tokens", "--batches", "1", "--recipes", "mxfp4", "--seq", "16",
                    "--micro-batch", "1", "--device", "cpu", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "'mxfp4'" in err and "blocks of 32 tokens" in err and "16 tokens" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_checkpoint_of_a_run_with_its_validation_data(trained_tiny, tmp_path, capsys):
    """A run directory of train.py: the weights of its checkpoint, the run's seed, validation data and tokenizer."""
    from nvfp4_train.evaluate import load_model

    out = tmp_path / "gf"
    rc = gf.main([str(trained_tiny), "--batches", "1", "--sr-seeds", "2", "--recipes", "nvfp4", "--seq", str(SEQ),
                  "--micro-batch", str(MB), "--device", "cpu", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err[-2000:]
    meta = json.loads((out / "grad_fidelity.json").read_text())["meta"]
    info, _ = load_model(str(trained_tiny), precision="bf16")
    assert meta["checkpoint"] == str(info.path) and meta["step"] == info.step == 3
    assert meta["base_seed"] == info.config["experiment"]["seed"]
    assert meta["data"] == VALIDATION and meta["seeds_per_recipe"] == {"nvfp4": 2}
