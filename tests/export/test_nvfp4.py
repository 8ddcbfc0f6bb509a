"""The NVFP4 export: its codes, block scales and tensor scale are bitwise the training's quantization (a
zero-padded width included), an engine's dequantized weight is ours within the derived bound, the 16x16 tile
scale is on every 1x16 row block of its tile, q/k/v split by rows, config.json carries the quantization
description ModelOpt's own exporter writes, and ModelOpt itself reads the folder (when it imports here)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from nvfp4_train.export.nvfp4 import dequantize_exported, quantize_weight
from nvfp4_train.kernels.fp4_reference import e2m1_decode, unpack_nibbles
from nvfp4_train.kernels.nvfp4 import dequantize_nvfp4
from nvfp4_train.kernels.nvfp4.reference import NVFP4Tensor, decode_scale
from nvfp4_train.precision.linear import pad_weight
from nvfp4_train.precision.megatron_linear import recipe_padding
from nvfp4_train.precision.operand import cast_one
from nvfp4_train.precision.recipe import named_recipe
from tests.export.conftest import VALIDATION, import_off_root
from tests.precision.mcore_util import megatron_single_rank
from tests.trainer.runs import ROOT, env

NEG_ZERO_BITS = -(2**31)  # float32 -0.0 viewed as int32


@pytest.fixture
def single_rank():
    with megatron_single_rank():
        yield


def _weight(gen, n, k, scale_range=6.0):
    # magnitudes over several binades, so that tiles get different E4M3 scales; a few exact zeros and ties
    w = torch.randn(n, k, generator=gen) * torch.exp2(torch.empty(n, k).uniform_(-scale_range, 0, generator=gen))
    w[0, :16] = 0.0
    return w.to(torch.bfloat16)


def _ours(codes: torch.Tensor, scales: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Our dequantization of exported tensors: ``(e2m1 * fp32(scale)) * weight_scale_2``, as dequantize_nvfp4."""
    n, k = codes.shape[0], codes.shape[1] * 2
    vals = e2m1_decode(unpack_nibbles(codes)).view(n, k // 16, 16)
    return (vals * scales.to(torch.float32).unsqueeze(-1) * weight_scale_2).view(n, k)


def _check_engine_reading(codes: torch.Tensor, scales: torch.Tensor, weight_scale_2: torch.Tensor,
                          engine: torch.Tensor) -> tuple[float, float, int]:
    """The exact statement of docs/export.md, element by element, for an engine that reads a weight as
    ``e2m1 * (fp32(scale) * weight_scale_2)`` (ModelOpt's ``NVFP4QTensor``) against ours,
    ``(e2m1 * fp32(scale)) * weight_scale_2``. Returns (fraction differing, fraction of codes 1.5/3/6, max ulp).

    Derivation: e2m1 has at most 2 significant bits and an E4M3 scale at most 4, so ``e2m1 * scale`` is exact in
    fp32 and ours is the correctly rounded exact product (checked against float64, where the product of 2 + 4 +
    24 significant bits is exact). The engine rounds ``scale * weight_scale_2`` first. For |e2m1| in {0.5, 1, 2,
    4} the second product scales by a power of two, which is exact: bitwise equal. For |e2m1| in {1.5, 3, 6}
    it is ``3 * 2^j`` times the rounded product, whose rounding error (at most half an ulp of the scale product)
    becomes at most 3/4 of an ulp of the result before the final rounding: the two round to the same or to
    adjacent floats, at most one ulp apart. Code 8 (-0) is -0.0 for us and +0.0 in ModelOpt's value table.
    (No fp32 underflow: that would need a tensor amax below 1e-30.)"""
    c = unpack_nibbles(codes)
    n, k = c.shape
    vals = e2m1_decode(c).view(n, k // 16, 16)
    exact = (vals.double() * scales.to(torch.float64).unsqueeze(-1) * weight_scale_2.double()).view(n, k)
    ours = _ours(codes, scales, weight_scale_2)
    o, e = ours.view(torch.int32), engine.view(torch.int32)
    assert torch.equal(o, exact.to(torch.float32).view(torch.int32)), "ours is not the correctly rounded product"
    neg_zero = c == 8
    assert bool((o[neg_zero] == NEG_ZERO_BITS).all()) and bool((e[neg_zero] == 0).all())
    magnitude = c & 7
    three = (magnitude == 3) | (magnitude == 5) | (magnitude == 7)  # 1.5, 3, 6
    power_of_two = ~three & ~neg_zero  # 0, 0.5, 1, 2, 4 and their negatives
    assert torch.equal(o[power_of_two], e[power_of_two])
    ulps = (o[three].long() - e[three].long()).abs()
    max_ulp = int(ulps.max()) if ulps.numel() else 0
    assert max_ulp <= 1, f"{max_ulp} ulps apart on codes 1.5/3/6"
    return float((ulps != 0).sum()) / c.numel(), float(three.sum()) / c.numel(), max_ulp


@pytest.mark.parametrize("n,k", [(64, 128), (48, 272), (2048 + 16, 80), (648, 128)])
def test_exported_weight_is_the_trained_weight_bitwise(gen, n, k):
    recipe = named_recipe("nvfp4")
    assert recipe.fprop.b.block == (16, 16)
    w = _weight(gen, n, k)
    # what the layer's forward GEMM uses: the weight zero-padded to whole blocks as training pads it (tiny's
    # Mamba in_proj has 648 rows), quantized; its real rows are the first n
    pad = recipe_padding(recipe, n, k)
    trained = cast_one(pad_weight(w, pad), recipe.fprop.b, seed=0).data
    exported = quantize_weight(w, block_2d=True)
    assert exported.codes.shape == (n, k // 2) and exported.scales.shape == (n, k // 16)
    assert torch.equal(exported.codes, trained.codes[:n])
    assert torch.equal(exported.scales.view(torch.uint8), trained.scales[:n].view(torch.uint8))
    assert torch.equal(exported.amax, trained.amax)
    w_scale_2 = decode_scale(exported.amax)
    # ModelOpt's weight_scale_2: the decode scale amax / (6*448), correctly rounded to fp32 (a quotient rounded
    # from fp64 to fp32 is the correctly rounded fp32 quotient: 53 >= 2 * 24 + 2 bits)
    assert w_scale_2.dtype == torch.float32
    assert w_scale_2.item() == torch.tensor(exported.amax.item() / 2688, dtype=torch.float32).item()
    # our dequantization of the exported tensors is the training's dequantized weight, bitwise
    ours = _ours(exported.codes, exported.scales, w_scale_2)
    assert torch.equal(ours.view(torch.int32), dequantize_nvfp4(trained)[:n].view(torch.int32))
    _check_engine_reading(exported.codes, exported.scales, w_scale_2,
                          dequantize_exported(exported.codes, exported.scales, w_scale_2))
    # every 1x16 block of a 16x16 tile carries the tile's scale
    tiles = trained.scales.view(-1, 16, k // 16)
    assert torch.equal(tiles.view(torch.uint8), tiles[:, :1].expand_as(tiles).view(torch.uint8))


def test_qkv_rows_split_keeps_each_rows_values(gen):
    from nvfp4_train.models.config import model_config
    from nvfp4_train.export.hf import _qkv_rows

    mc = model_config("tiny")
    w = _weight(gen, mc.attention_qkv_width, mc.hidden_size)
    q = quantize_weight(w, block_2d=True)
    full = dequantize_nvfp4(NVFP4Tensor(codes=q.codes, scales=q.scales, amax=q.amax, block_2d=True))
    t = decode_scale(q.amax)
    for rows in _qkv_rows(mc):
        part = _ours(q.codes[rows], q.scales[rows], t)
        assert torch.equal(part.view(torch.int32), full[rows].view(torch.int32))


def test_a_layer_whose_k_is_not_a_multiple_of_16_is_named(single_rank):
    """K % 16 != 0 has no NVFP4 form (blocks run along K): one error naming the layer and --padded bf16; with
    --padded bf16 it is written in BF16 and excluded. Its N-padded partner (up_proj, 264 rows) exports."""
    from nvfp4_train.export.hf import expected_hf_shapes, from_hf_state
    from nvfp4_train.export.nvfp4 import nvfp4_layers, to_nvfp4_state
    from nvfp4_train.models.config import model_config
    from nvfp4_train.precision.layer_map import LayerPrecisionMap

    mc = model_config("tiny").replace(ffn_hidden_size=264)
    state = from_hf_state(mc, {k: torch.full(s, 0.5, dtype=torch.bfloat16) for k, s in expected_hf_shapes(mc).items()})
    layers = nvfp4_layers(mc, LayerPrecisionMap(mc.pattern, "nvfp4", keep_first=0, keep_last=0), state)
    with pytest.raises(ValueError, match=r"^layer blocks\.1\.mlp\.fc2 \(model\.layers\.1\.mixer\.down_proj\) has "
                                         r"input width K=264.*--padded bf16") as e:
        to_nvfp4_state(mc, layers, state, {})
    assert "\n" not in str(e.value)
    amax = {la.name: torch.tensor(1.0) for la in layers}
    tensors, excluded = to_nvfp4_state(mc, layers, state, amax, padded="bf16")
    assert set(excluded) == {"lm_head", *(f"model.layers.{i}.mixer.down_proj" for i in (1, 3, 5))}
    assert tensors["model.layers.1.mixer.down_proj.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.1.mixer.up_proj.weight"].shape == (264, mc.hidden_size // 2)
    assert tensors["model.layers.1.mixer.up_proj.weight_scale"].shape == (264, mc.hidden_size // 16)


def _cli(*args, timeout=300):
    e = env()
    e.pop("PYTHONWARNINGS", None)  # the user's warning filters would switch the routing off
    return subprocess.run([sys.executable, "-m", "nvfp4_train.export", *map(str, args)], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=timeout)


def assert_no_third_party_warning(stderr: str) -> None:
    """No warning printed by another package (megatron-core's deprecations, torch's): they are routed."""
    assert "site-packages" not in stderr and not re.search(r"\w+Warning: ", stderr), stderr[-3000:]


@pytest.fixture(scope="module")
def exported(trained_tiny, tmp_path_factory):
    """``python -m nvfp4_train.export nvfp4`` of the trained ``tiny`` (its 648-row in_proj included)."""
    out = tmp_path_factory.mktemp("nvfp4_export") / "nv"
    r = _cli("nvfp4", trained_tiny, out, "--calib-data", VALIDATION, "--calib-batches", 2, "--calib-seq", 64)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == str(out)
    assert_no_third_party_warning(r.stderr)
    assert len(r.stderr.splitlines()) <= 1, r.stderr  # at most the note on the warnings held back
    return out


def _nvfp4_modules(tensors: dict) -> list[str]:
    return sorted(k[: -len(".weight_scale_2")] for k in tensors if k.endswith(".weight_scale_2"))


def test_export_files(exported):
    from safetensors.torch import load_file

    quant = json.loads((exported / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4" and quant["group_size"] == 16 and quant["kv_cache_quant_algo"] is None
    # tiny under nvfp4 keeps blocks 0 and 5 in bf16; block 4's in_proj (648 rows, trained zero-padded to 656)
    # exports in NVFP4
    assert set(quant["exclude_modules"]) == {"lm_head", "model.layers.0.mixer.in_proj", "model.layers.0.mixer.out_proj",
                                             "model.layers.5.mixer.up_proj", "model.layers.5.mixer.down_proj"}
    t = load_file(str(exported / "model.safetensors"))
    assert t["model.layers.4.mixer.in_proj.weight"].shape == (648, 64)
    assert t["model.layers.4.mixer.in_proj.weight_scale"].shape == (648, 8)
    for name in ("model.layers.2.mixer.q_proj", "model.layers.3.mixer.up_proj", "model.layers.4.mixer.out_proj",
                 "model.layers.4.mixer.in_proj"):
        assert t[f"{name}.weight"].dtype == torch.uint8
        n, half = t[f"{name}.weight"].shape
        assert t[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn and t[f"{name}.weight_scale"].shape == (n, half // 8)
        assert t[f"{name}.weight_scale_2"].shape == () and t[f"{name}.input_scale"].item() > 0
    assert t["model.layers.0.mixer.in_proj.weight"].dtype == torch.bfloat16
    qs = [t[f"model.layers.2.mixer.{p}_proj.{s}"] for p in "qkv" for s in ("weight_scale_2", "input_scale")]
    assert torch.equal(qs[0], qs[2]) and torch.equal(qs[0], qs[4]) and torch.equal(qs[1], qs[3])


def test_config_json_carries_what_modelopt_writes(exported):
    """config.json's quantization_config is the converted form ModelOpt's exporter writes there: the rules of
    ``modelopt.torch.export.convert_hf_config.convert_hf_quant_config_format`` (nvidia-modelopt 0.47.0) for an
    NVFP4 hf_quant_config.json without KV-cache quantization, written out. vLLM reads config.json first and
    keeps the modules of ``ignore`` unquantized."""
    hf_quant = json.loads((exported / "hf_quant_config.json").read_text())
    q = hf_quant["quantization"]
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": q["group_size"]}
    expected = {
        "config_groups": {"group_0": {"input_activations": fp4, "weights": fp4, "targets": ["Linear"]}},
        "ignore": q["exclude_modules"],  # every BF16 layer and lm_head
        "quant_algo": "NVFP4",
        "producer": hf_quant["producer"],
        "quant_method": "modelopt",
    }
    config = json.loads((exported / "config.json").read_text())
    assert config["quantization_config"] == expected
    assert "lm_head" in expected["ignore"] and "model.layers.5.mixer.down_proj" in expected["ignore"]


def test_exported_tensors_are_the_trainings_and_engines_read_them_within_one_ulp(exported, trained_tiny, single_rank):
    """Codes, scales and weight_scale_2 of every NVFP4 module: bitwise the training's quantization of the
    checkpoint's weight; the engine's dequantization vs ours: the statement of _check_engine_reading."""
    from safetensors.torch import load_file

    from nvfp4_train.export.checkpoint_io import load_checkpoint_model
    from nvfp4_train.export.hf import _qkv_rows

    info, state = load_checkpoint_model(trained_tiny)
    t = load_file(str(exported / "model.safetensors"))
    modules = _nvfp4_modules(t)
    assert len(modules) == 10  # blocks 1-4: 2 + (q, k, v, o) + 2 + 2
    for m in modules:
        block, role = int(m.split(".")[2]), m.split(".")[-1]
        key = {"in_proj": "mixer.in_proj", "out_proj": "mixer.out_proj", "up_proj": "mlp.linear_fc1",
               "down_proj": "mlp.linear_fc2", "o_proj": "self_attention.linear_proj"}.get(role,
                                                                                        "self_attention.linear_qkv")
        q = quantize_weight(state[f"decoder.layers.{block}.{key}.weight"], block_2d=True)
        codes, scales = q.codes, q.scales
        if role in ("q_proj", "k_proj", "v_proj"):
            rows = _qkv_rows(info.model)["qkv".index(role[0])]
            codes, scales = codes[rows], scales[rows]
        w, s, s2 = t[f"{m}.weight"], t[f"{m}.weight_scale"], t[f"{m}.weight_scale_2"]
        assert torch.equal(w, codes) and torch.equal(s.view(torch.uint8), scales.view(torch.uint8)), m
        assert s2.view(torch.int32).item() == decode_scale(q.amax).view(torch.int32).item(), m
        _check_engine_reading(w, s, s2, dequantize_exported(w, s, s2))


def test_modelopt_reads_the_folder(exported):
    """NVIDIA ModelOpt itself (requirements/modelopt.txt): its converter gives our config.json's
    quantization_config from our hf_quant_config.json, and its NVFP4QTensor dequantizes every exported
    NVFP4 weight as dequantize_exported models it (bitwise), within the statement of _check_engine_reading."""
    from safetensors.torch import load_file

    try:
        (convert,) = import_off_root("modelopt.torch.export.convert_hf_config", "convert_hf_quant_config_format")
        (NVFP4QTensor,) = import_off_root("modelopt.torch.quantization.qtensor.nvfp4_tensor", "NVFP4QTensor")
    except ImportError as e:
        pytest.skip(f"nvidia-modelopt is not importable ({e}): pip install --no-deps -r requirements/modelopt.txt")
    hf_quant = json.loads((exported / "hf_quant_config.json").read_text())
    config = json.loads((exported / "config.json").read_text())
    assert convert(hf_quant) == config["quantization_config"]
    t = load_file(str(exported / "model.safetensors"))
    for m in _nvfp4_modules(t):
        w, s, s2 = t[f"{m}.weight"], t[f"{m}.weight_scale"], t[f"{m}.weight_scale_2"]
        shape = torch.Size((w.shape[0], w.shape[1] * 2))
        theirs = NVFP4QTensor(shape, torch.float32, w).dequantize(dtype=torch.float32, scale=s, double_scale=s2,
                                                                  block_sizes={-1: 16})
        assert torch.equal(theirs.view(torch.int32), dequantize_exported(w, s, s2).view(torch.int32)), m
        _check_engine_reading(w, s, s2, theirs)


def test_cli_errors_are_one_line(trained_tiny, tmp_path):
    r = _cli("nvfp4", trained_tiny, tmp_path / "out", "--calib-data", tmp_path / "nothing")
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and str(tmp_path / "nothing") in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
