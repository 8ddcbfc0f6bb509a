"""An NVFP4 checkpoint in the layout NVIDIA ModelOpt writes and TensorRT-LLM / vLLM / SGLang load, made from
the training's own quantization (no post-training quantization step). docs/export.md has the layout.

Per NVFP4-trained linear layer ``<name>`` (Hugging Face Nemotron-H names, ``nvfp4_train.export.hf``):

=========================  =====================  ===========================================================
tensor                     dtype, shape           value
=========================  =====================  ===========================================================
``<name>.weight``          uint8 [N, K/2]         E2M1 codes, element 2j in the low nibble, 2j+1 in the high
``<name>.weight_scale``    float8_e4m3fn [N,K/16] the decode scale of each 1x16 block along K
``<name>.weight_scale_2``  float32 []             the tensor decode scale ``amax_W / (6*448)``
``<name>.input_scale``     float32 []             ``amax_x / (6*448)``, amax_x from a calibration pass
=========================  =====================  ===========================================================

The engine's dequantized weight is ``e2m1(code) * fp32(weight_scale) * weight_scale_2``: exactly our
``dequantize_nvfp4`` (``q * fp32(sdec_b) * (amax / 2688)``). Training quantizes the weight in 16x16 tiles
(RECIPE §3) and stores each tile's scale on each of its 16 rows, i.e. per 1x16 row block already: the export
writes our codes and scales unchanged, so every 1x16 block of a tile carries the tile's scale. Those are
exactly the values the training's forward GEMM used (the weight is quantized by the same call,
``quantize_nvfp4(W, block_2d=True)``, with the unsharded tensor's amax, which is what TP training all-reduces).
The fused attention ``linear_qkv`` is quantized as one tensor and split into ``q_proj``/``k_proj``/``v_proj``
by rows afterwards (whole 16-row tiles, since head_dim is a multiple of 16): the three share one
``weight_scale_2`` and one ``input_scale``, as engines that fuse them again expect.

Layers trained in BF16 (the recipe's first/last blocks, user rules), the embedding, norms, Mamba's conv and
SSM parameters and the output layer are written in BF16 and listed in ``exclude_modules``. A layer whose
width is not a multiple of 16 (training zero-pads it to whole blocks, e.g. ``tiny``'s Mamba ``in_proj``)
has no unpadded NVFP4 form: it is an error, or, with ``padded="bf16"``, written in BF16 and excluded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from nvfp4_train.models.config import ModelConfig
from nvfp4_train.models.pattern import ATTENTION, MAMBA

__all__ = ["NVFP4Layer", "nvfp4_layers", "quantize_weight", "dequantize_exported", "to_nvfp4_state",
           "calibrate_input_amax", "export_nvfp4", "QUANT_CONFIG_NAME", "GROUP_SIZE"]

QUANT_CONFIG_NAME = "hf_quant_config.json"
GROUP_SIZE = 16
PADDED_POLICIES = ("error", "bf16")

# our role -> (our weight key under decoder.layers.<i>., the Hugging Face module names it becomes)
_ROLE_KEYS = {
    "mamba.in_proj": ("mixer.in_proj.weight", ("mixer.in_proj",)),
    "mamba.out_proj": ("mixer.out_proj.weight", ("mixer.out_proj",)),
    "attention.qkv": ("self_attention.linear_qkv.weight", ("mixer.q_proj", "mixer.k_proj", "mixer.v_proj")),
    "attention.proj": ("self_attention.linear_proj.weight", ("mixer.o_proj",)),
    "mlp.fc1": ("mlp.linear_fc1.weight", ("mixer.up_proj",)),
    "mlp.fc2": ("mlp.linear_fc2.weight", ("mixer.down_proj",)),
}
_ROLES = {MAMBA: ("mamba.in_proj", "mamba.out_proj"), ATTENTION: ("attention.qkv", "attention.proj"),
          "-": ("mlp.fc1", "mlp.fc2")}


class NVFP4Layer:
    """One linear layer of the model and how it exports."""

    def __init__(self, block: int, role: str, recipe, shape: tuple[int, int]) -> None:
        self.block, self.role, self.recipe, self.shape = block, role, recipe, shape
        self.key = f"decoder.layers.{block}.{_ROLE_KEYS[role][0]}"
        self.hf_modules = tuple(f"model.layers.{block}.{m}" for m in _ROLE_KEYS[role][1])
        w, x = recipe.fprop.b, recipe.fprop.a
        self.trained_nvfp4 = w.format == "nvfp4" and x.format == "nvfp4"
        if (w.format == "nvfp4") != (x.format == "nvfp4"):
            raise ValueError(f"layer {self.key}: recipe {recipe.name!r} quantizes only one forward operand to "
                             f"NVFP4 (weight {w.format}, input {x.format}): the W4A4 NVFP4 layout needs both")
        self.block_2d = w.block == (16, 16)
        self.padded = any(d % GROUP_SIZE for d in shape) or (self.block_2d and shape[0] % 16)

    @property
    def name(self) -> str:
        return f"blocks.{self.block}.{self.role}"


def nvfp4_layers(model_cfg: ModelConfig, layer_map, state: dict[str, torch.Tensor]) -> list[NVFP4Layer]:
    """Every linear layer of the model with the recipe the run trained it with (no precision switch)."""
    out = []
    for i, kind in enumerate(model_cfg.hybrid_pattern().blocks):
        for role in _ROLES[kind]:
            layer = NVFP4Layer(i, role, layer_map.recipe(i, role), tuple(state[f"decoder.layers.{i}."
                                                                               f"{_ROLE_KEYS[role][0]}"].shape))
            out.append(layer)
    return out


def quantize_weight(w: torch.Tensor, block_2d: bool):
    """The training's quantization of a weight for the forward GEMM (``nvfp4_train.kernels.nvfp4``: RNE, no RHT)."""
    from nvfp4_train.kernels.nvfp4 import quantize_nvfp4

    return quantize_nvfp4(w, block_2d=block_2d)


def dequantize_exported(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """An inference engine's reading of an exported layer: ``e2m1(code) * fp32(weight_scale) * weight_scale_2``
    as float32 [N, K]."""
    from nvfp4_train.kernels.fp4_reference import e2m1_decode, unpack_nibbles

    n, k = weight.shape[0], weight.shape[1] * 2
    vals = e2m1_decode(unpack_nibbles(weight)).view(n, k // GROUP_SIZE, GROUP_SIZE)
    return (vals * weight_scale.to(torch.float32).unsqueeze(-1) * weight_scale_2).view(n, k)


def _split_rows(model_cfg: ModelConfig, layer: NVFP4Layer, t: torch.Tensor) -> list[torch.Tensor]:
    if layer.role != "attention.qkv":
        return [t]
    from nvfp4_train.export.hf import _qkv_rows

    return [t[rows].contiguous() for rows in _qkv_rows(model_cfg)]


def to_nvfp4_state(model_cfg: ModelConfig, layers: list[NVFP4Layer], state: dict[str, torch.Tensor],
                   input_amax: dict[str, torch.Tensor], *, padded: str = "error") -> tuple[dict, list[str]]:
    """(Hugging Face tensors, excluded module names): the NVFP4-trained layers in the ModelOpt layout, the rest
    in BF16. ``input_amax``: the calibrated amax of each NVFP4 layer's input, by ``NVFP4Layer.name``."""
    from nvfp4_train.kernels.nvfp4.reference import decode_scale
    from nvfp4_train.export.hf import to_hf_state

    if padded not in PADDED_POLICIES:
        raise ValueError(f"padded={padded!r} is not one of {PADDED_POLICIES}")
    hf = {k: v.to(torch.bfloat16) for k, v in to_hf_state(model_cfg, state).items()}
    excluded = ["lm_head"]
    for layer in layers:
        if not layer.trained_nvfp4:
            excluded += list(layer.hf_modules)
            continue
        if layer.padded:
            if padded == "error":
                raise ValueError(
                    f"layer {layer.key} ({layer.name}) has shape {layer.shape}: training zero-pads it to whole "
                    f"NVFP4 blocks (every dim a multiple of 16{' (16x16 tiles)' if layer.block_2d else ''}), so "
                    f"it has no unpadded NVFP4 form; export it in BF16 with --padded bf16, or train a model whose "
                    f"widths are multiples of 16")
            excluded += list(layer.hf_modules)
            continue
        if layer.name not in input_amax:
            raise ValueError(f"no calibrated input amax for {layer.name}: run the calibration over its input")
        q = quantize_weight(state[layer.key], layer.block_2d)
        w_scale_2 = decode_scale(q.amax).reshape(())
        in_scale = decode_scale(input_amax[layer.name].to(torch.float32)).reshape(())
        for mod, codes, scales in zip(layer.hf_modules, _split_rows(model_cfg, layer, q.codes),
                                      _split_rows(model_cfg, layer, q.scales)):
            hf[f"{mod}.weight"] = codes
            hf[f"{mod}.weight_scale"] = scales
            hf[f"{mod}.weight_scale_2"] = w_scale_2.clone()
            hf[f"{mod}.input_scale"] = in_scale.clone()
    return hf, excluded


def calibrate_input_amax(model, layers: Iterable[NVFP4Layer], batches: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
    """amax of the input of every layer in ``layers`` over ``batches`` ([b, s] token ids) run through ``model``
    (our model as trained: its precision, its dtype). Forward hooks, no change to the model."""
    wanted = {layer.name for layer in layers}
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for _, module in model.named_modules():
        name = getattr(module, "layer_name", None)
        if name in wanted:
            def hook(mod, args, name=name):
                a = args[0].detach().abs().amax().to(torch.float32)
                amax[name] = torch.maximum(amax[name], a) if name in amax else a
            hooks.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            n = 0
            for ids in batches:
                pos = torch.arange(ids.shape[1])[None].expand_as(ids)
                model(input_ids=ids, position_ids=pos, attention_mask=None)
                n += 1
    finally:
        for h in hooks:
            h.remove()
    if n == 0:
        raise ValueError("the calibration data gave no batch: use more tokens or a shorter --calib-seq")
    missing = sorted(wanted - set(amax))
    if missing:
        raise AssertionError(f"calibration saw no input for {missing[:4]}")
    return amax


def quant_config(excluded: list[str]) -> dict:
    """The ``quantization`` description ModelOpt writes (``hf_quant_config.json``), for W4A4 NVFP4."""
    return {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": GROUP_SIZE,
            "exclude_modules": sorted(excluded)}


def export_nvfp4(checkpoint: str | Path, out: str | Path, *, calib_data: str, calib_batches: int = 8,
                 calib_seq: int = 512, calib_batch_size: int = 1, padded: str = "error") -> Path:
    """``python -m nvfp4_train.export nvfp4 CKPT OUT --calib-data PREFIX``: the NVFP4 checkpoint folder
    (config.json with ``quantization_config``, ``hf_quant_config.json``, model.safetensors, tokenizer.json)."""
    import shutil

    from omegaconf import OmegaConf

    from nvfp4_train.config.precision import PrecisionConfig
    from nvfp4_train.data.tokenizer import DEFAULT_TOKENIZER_PATH
    from nvfp4_train.evaluate import token_batches
    from nvfp4_train.export.checkpoint_io import build_model_single, load_checkpoint_model
    from nvfp4_train.export.hf import _tokenizer_ids, hf_config, save_hf

    info, state = load_checkpoint_model(checkpoint)
    prec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PrecisionConfig), info.config["precision"]))
    layer_map = prec.layer_map(info.model.pattern)
    layers = nvfp4_layers(info.model, layer_map, state)
    wanted = [la for la in layers if la.trained_nvfp4 and not la.padded]
    if not any(la.trained_nvfp4 for la in layers):
        raise ValueError(f"checkpoint {info.path} was trained with precision {prec.recipe!r}: no layer is NVFP4; "
                         f"export it with `python -m nvfp4_train.export hf`")
    if padded not in PADDED_POLICIES:
        raise ValueError(f"padded={padded!r} is not one of {PADDED_POLICIES}")
    if padded == "error":  # before the calibration pass: the error names the layer
        to_nvfp4_state(info.model, [la for la in layers if la.trained_nvfp4 and la.padded], state, {})
    amax = {}
    if wanted:
        model = build_model_single(info.model, dtype=torch.bfloat16, layer_map=layer_map)
        model.load_state_dict(state, strict=False)
        batches = token_batches(calib_data, seq_length=calib_seq, batch_size=calib_batch_size,
                                max_batches=calib_batches, vocab_size=info.model.vocab_size)
        amax = calibrate_input_amax(model, wanted, (ids for ids, _ in batches))
    tensors, excluded = to_nvfp4_state(info.model, layers, state, amax, padded=padded)
    qc = quant_config(excluded)
    config = hf_config(info.model, max_position_embeddings=int(info.config.get("data", {}).get("seq_length", 4096)),
                       **_tokenizer_ids(info.config))
    config["quantization_config"] = {"quant_method": "modelopt", **qc}
    folder = save_hf(out, config, tensors, metadata={"source": str(info.path), "step": str(info.step)})
    (folder / QUANT_CONFIG_NAME).write_text(json.dumps(
        {"producer": {"name": "nvfp4_train", "version": "0.1.0"}, "quantization": qc}, indent=2) + "\n")
    shutil.copyfile(info.config.get("data", {}).get("tokenizer") or DEFAULT_TOKENIZER_PATH, folder / "tokenizer.json")
    return folder
