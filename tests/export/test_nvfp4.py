"""The NVFP4 export: the inference engine's dequantized weight is bitwise our training's dequantized weight,
the 16x16 tile scale is on every 1x16 row block of its tile, q/k/v split by rows, the ModelOpt files."""

from __future__ import annotations

import json

import pytest
import torch

from nvfp4_train.kernels.nvfp4 import dequantize_nvfp4
from nvfp4_train.kernels.nvfp4.reference import decode_scale
from nvfp4_train.export.nvfp4 import dequantize_exported, quantize_weight
from nvfp4_train.precision.operand import cast_one
from nvfp4_train.precision.recipe import named_recipe
from tests.export.conftest import VALIDATION
from tests.precision.mcore_util import megatron_single_rank


@pytest.fixture
def single_rank():
    with megatron_single_rank():
        yield


def _weight(gen, n, k, scale_range=6.0):
    # magnitudes over several binades, so that tiles get different E4M3 scales; a few exact zeros and ties
    w = torch.randn(n, k, generator=gen) * torch.exp2(torch.empty(n, k).uniform_(-scale_range, 0, generator=gen))
    w[0, :16] = 0.0
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("n,k", [(64, 128), (48, 272), (2048 + 16, 80)])
def test_exported_weight_is_the_trained_weight_bitwise(gen, n, k):
    recipe = named_recipe("nvfp4")
    w = _weight(gen, n, k)
    trained = cast_one(w, recipe.fprop.b, seed=0).data  # what the layer's forward GEMM uses
    exported = quantize_weight(w, block_2d=recipe.fprop.b.block == (16, 16))
    assert recipe.fprop.b.block == (16, 16)
    assert torch.equal(exported.codes, trained.codes) and torch.equal(exported.scales.view(torch.uint8),
                                                                         trained.scales.view(torch.uint8))
    w_scale_2 = decode_scale(exported.amax)
    # ModelOpt's weight_scale_2: the decode scale amax / (6*448), correctly rounded to fp32 (a quotient rounded
    # from fp64 to fp32 is the correctly rounded fp32 quotient: 53 >= 2 * 24 + 2 bits)
    assert w_scale_2.dtype == torch.float32
    assert w_scale_2.item() == torch.tensor(exported.amax.item() / 2688, dtype=torch.float32).item()
    engine = dequantize_exported(exported.codes, exported.scales, w_scale_2)
    ours = dequantize_nvfp4(trained)
    assert torch.equal(engine.view(torch.int32), ours.view(torch.int32))  # bitwise, signed zeros included
    # every 1x16 block of a 16x16 tile carries the tile's scale
    tiles = exported.scales.view(n // 16, 16, k // 16)
    assert torch.equal(tiles.view(torch.uint8), tiles[:, :1].expand_as(tiles).view(torch.uint8))


def test_qkv_rows_split_keeps_each_rows_values(gen):
    from nvfp4_train.models.config import model_config
    from nvfp4_train.export.hf import _qkv_rows

    mc = model_config("tiny")
    w = _weight(gen, mc.attention_qkv_width, mc.hidden_size)
    q = quantize_weight(w, block_2d=True)
    full = dequantize_nvfp4(q)
    t = decode_scale(q.amax)
    for rows in _qkv_rows(mc):
        part = dequantize_exported(q.codes[rows], q.scales[rows], t)
        assert torch.equal(part.view(torch.int32), full[rows].view(torch.int32))


def test_export_cli_files_and_errors(trained_tiny, tmp_path, single_rank):
    from safetensors.torch import load_file

    from nvfp4_train.export.nvfp4 import export_nvfp4

    # tiny's Mamba in_proj is 648 wide: trained zero-padded, it has no NVFP4 form
    with pytest.raises(ValueError, match=r"in_proj.*\(648, 128\).*--padded bf16"):
        export_nvfp4(trained_tiny, tmp_path / "refused", calib_data=VALIDATION, calib_batches=1, calib_seq=64)
    out = export_nvfp4(trained_tiny, tmp_path / "nv", calib_data=VALIDATION, calib_batches=2, calib_seq=64,
                       padded="bf16")
    quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    config = json.loads((out / "config.json").read_text())
    assert quant["quant_algo"] == "NVFP4" and quant["group_size"] == 16
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert config["quantization_config"]["exclude_modules"] == quant["exclude_modules"]
    # tiny under nvfp4 keeps blocks 0 and 5 in bf16; block 4's in_proj is padded
    assert set(quant["exclude_modules"]) == {"lm_head", "model.layers.0.mixer.in_proj", "model.layers.0.mixer.out_proj",
                                             "model.layers.4.mixer.in_proj", "model.layers.5.mixer.up_proj",
                                             "model.layers.5.mixer.down_proj"}
    t = load_file(str(out / "model.safetensors"))
    for name in ("model.layers.2.mixer.q_proj", "model.layers.3.mixer.up_proj", "model.layers.4.mixer.out_proj"):
        assert t[f"{name}.weight"].dtype == torch.uint8
        n, half = t[f"{name}.weight"].shape
        assert t[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn and t[f"{name}.weight_scale"].shape == (n, half // 8)
        assert t[f"{name}.weight_scale_2"].shape == () and t[f"{name}.input_scale"].item() > 0
    assert t["model.layers.0.mixer.in_proj.weight"].dtype == torch.bfloat16
    assert t["model.layers.4.mixer.in_proj.weight"].dtype == torch.bfloat16
    qs = [t[f"model.layers.2.mixer.{p}_proj.{s}"] for p in "qkv" for s in ("weight_scale_2", "input_scale")]
    assert torch.equal(qs[0], qs[2]) and torch.equal(qs[0], qs[4]) and torch.equal(qs[1], qs[3])

