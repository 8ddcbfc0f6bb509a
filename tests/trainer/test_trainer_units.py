"""Trainer pieces without a run: the precision switch on precision_layers(), metrics records, loss plot."""

from __future__ import annotations

import json

import pytest

from nvfp4_train.metrics import LoggingConfig, MetricsLogger, load_metrics
from nvfp4_train.precision.layer_map import LayerPrecisionMap, PrecisionSwitch
from nvfp4_train.trainer import apply_precision_switch


class _Layer:
    def __init__(self, block, role):
        self.block, self.role, self.recipe = block, role, None

    def set_recipe(self, recipe):
        self.recipe = recipe


class _Model:
    def __init__(self, layers):
        self.layers = layers

    def precision_layers(self):
        return ((f"l{i}", layer) for i, layer in enumerate(self.layers))


def test_precision_switch_sets_each_layers_recipe_in_effect():
    switch = PrecisionSwitch(mode="fprop_bf16", at_fraction=0.82)
    lmap = LayerPrecisionMap("M-*-M-M-M-M-", "nvfp4", keep_first=1, keep_last=1, switch=switch)
    layers = [_Layer(0, "mamba.in_proj"), _Layer(2, "attention.qkv"), _Layer(5, "mlp.fc2")]
    model = _Model(layers)
    assert switch.start_step(100) == 82
    assert apply_precision_switch(model, lmap, switch, step=81, total_steps=100) == 3
    assert [layer.recipe.name for layer in layers] == ["bf16", "nvfp4", "nvfp4"]  # before the switch
    apply_precision_switch(model, lmap, switch, step=82, total_steps=100)
    assert [layer.recipe.name for layer in layers] == ["bf16", "nvfp4+fprop_bf16", "nvfp4+fprop_bf16"]
    assert layers[1].recipe.fprop.quantized is False and layers[1].recipe.dgrad.quantized is True
    assert apply_precision_switch(object(), lmap, switch, step=82, total_steps=100) == 0  # no quantized layers


def test_precision_switch_needs_to_know_each_layers_recipe():
    class Bare:
        def set_recipe(self, r):
            pass

    class M:
        def precision_layers(self):
            yield "x", Bare()

    lmap = LayerPrecisionMap("M-", "nvfp4")
    with pytest.raises(TypeError, match="the trainer cannot tell which recipe it was built with"):
        apply_precision_switch(M(), lmap, PrecisionSwitch(at_step=0), step=0, total_steps=1)


def test_metrics_jsonl_records_and_last_write_wins(tmp_path):
    cfg = LoggingConfig(progress="none", tensorboard=False, wandb="disabled")
    m = MetricsLogger(cfg, tmp_path, enabled=True, total_steps=3, start_step=0, run_name="t")
    rec = dict(tokens=64, lr=1e-3, grad_norm=1.5, tokens_per_s=100.0, mfu=None, peak_mem_gb=0.1, skipped_steps=0,
               skipped=False, time_s=0.5)
    m.train({"step": 1, "loss": 5.0, **rec})
    m.train({"step": 2, "loss": float("nan"), **rec})
    m.eval(2, 128, 4.5)
    m.telemetry(2, {"layer0": {"x": {"amax": 3.0}}})
    m.event("resume", 1)
    m.train({"step": 2, "loss": 4.0, **rec})  # the step redone after a resume replaces the first attempt
    m.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["type"] for x in lines] == ["train", "train", "eval", "telemetry", "event", "train"]
    assert [r["loss"] for r in load_metrics(tmp_path)] == [5.0, 4.0]
    assert load_metrics(tmp_path, "eval") == [{"type": "eval", "step": 2, "tokens": 128, "val_loss": 4.5}]
    assert load_metrics(tmp_path, "telemetry")[0]["layers"] == {"layer0": {"x": {"amax": 3.0}}}
    off = MetricsLogger(cfg, tmp_path / "other", enabled=False, total_steps=3, start_step=0, run_name="t")
    off.train({"step": 1, "loss": 1.0, **rec})
    assert not (tmp_path / "other").exists()  # only rank 0 writes


def test_plot_runs_writes_a_png(tmp_path):
    from nvfp4_train.experiments.plots import plot_runs

    for name, scale in (("base", 1.0), ("other", 1.01)):
        d = tmp_path / name
        d.mkdir()
        with open(d / "metrics.jsonl", "w") as f:
            for s in range(1, 21):
                f.write(json.dumps({"type": "train", "step": s, "tokens": 64 * s, "loss": scale * 10 / s}) + "\n")
    out = plot_runs([tmp_path / "base", tmp_path / "other"], tmp_path / "p" / "loss.png", smooth=3)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    one = plot_runs([tmp_path / "other"], tmp_path / "p" / "one.png")  # a single run: no comparison panel
    assert one.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hybrid_layers_carry_their_block_role_and_base_recipe():
    """The quantized layers of the hybrid model carry the global block index and role the map resolved their
    recipe from, and that recipe; the precision switch finds each layer through them (no name parsing)."""
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nvfp4_train.models.build import build_model, transformer_config
    from nvfp4_train.models.config import model_config
    from tests.precision.mcore_util import megatron_single_rank

    with megatron_single_rank():
        mc = model_config("tiny")
        switch = PrecisionSwitch(mode="fprop_bf16", at_step=3)
        lmap = LayerPrecisionMap(mc.pattern, "nvfp4", switch=switch)
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        model = build_model(mc, lmap, config=transformer_config(mc), seq_length=64)
        layers = dict(model.precision_layers())
        assert len(layers) == lmap.num_linear
        for layer in layers.values():
            assert layer.layer_name == f"blocks.{layer.block}.{layer.role}"
            assert layer.base_recipe == lmap.recipe(layer.block, layer.role) == layer.recipe
        assert apply_precision_switch(model, lmap, switch, step=3, total_steps=10) == len(layers)
        for layer in layers.values():
            want = layer.base_recipe.name if layer.base_recipe.is_bf16 else f"{layer.base_recipe.name}+fprop_bf16"
            assert layer.recipe.name == want


def test_a_precision_field_added_after_the_checkpoint_is_no_precision_change():
    from nvfp4_train.trainer import precision_with_new_defaults

    now = {"recipe": "nvfp4", "gemm_engine": "cublas", "keep_first": None}
    # written before gemm_engine existed: its default is what the checkpoint trained with
    assert precision_with_new_defaults({"recipe": "nvfp4", "keep_first": None}, now) == now
    # a value that differs from the default, or a field the checkpoint names, is still a change
    assert precision_with_new_defaults({"recipe": "nvfp4", "keep_first": None},
                                       {**now, "gemm_engine": "triton"}) != {**now, "gemm_engine": "triton"}
    assert precision_with_new_defaults({**now, "gemm_engine": "triton"}, now) != now


@pytest.mark.parametrize("direct_dequant", [False, True])
def test_a_retired_precision_field_of_a_checkpoint_is_no_precision_change(direct_dequant):
    """A checkpoint written while ``precision.direct_dequant`` existed (the same bits as the packed path every run
    now takes) resumes, evaluates and exports with this schema: the retired field is dropped, nothing else."""
    import yaml
    from omegaconf import OmegaConf

    from nvfp4_train.config.precision import PrecisionConfig, saved_precision_config, without_retired_fields
    from nvfp4_train.trainer import precision_with_new_defaults

    now = yaml.safe_load(OmegaConf.to_yaml(OmegaConf.structured(PrecisionConfig(recipe="nvfp4"))))
    saved = {**now, "direct_dequant": direct_dequant}
    assert precision_with_new_defaults(without_retired_fields(saved), now) == now
    assert without_retired_fields({**saved, "gemm_engine": "triton"}) == {**now, "gemm_engine": "triton"}
    assert saved_precision_config(saved) == PrecisionConfig(recipe="nvfp4")
