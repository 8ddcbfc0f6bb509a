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

What is bitwise the training's: the codes, the block scales ``weight_scale`` and the tensor scale
``weight_scale_2`` (our ``decode_scale(amax)``). The dequantized weight is not, quite: ours is
``(e2m1(code) * fp32(weight_scale)) * weight_scale_2``, whose first product is exact, so it is the correctly
rounded value of the exact product; ModelOpt's ``NVFP4QTensor.dequantize`` computes
``e2m1(code) * (fp32(weight_scale) * weight_scale_2)``, rounding twice (:func:`dequantize_exported`). For
codes of magnitude 0.5, 1, 2 and 4 (a power of two times the rounded scale product) the two are bitwise
equal; for 1.5, 3 and 6 they differ by at most one fp32 ulp; code 8 (-0) is -0.0 for us and +0.0 in
ModelOpt's table (docs/export.md, ``tests/export/test_nvfp4.py``).

Training quantizes the weight in 16x16 tiles (RECIPE §3) and stores each tile's scale on each of its 16 rows,
i.e. per 1x16 row block already: the export writes our codes and scales unchanged, so every 1x16 block of a
tile carries the tile's scale. Those are exactly the values the training's forward GEMM used (the weight is
quantized by the same call, ``quantize_nvfp4(W, block_2d=True)``, with the unsharded tensor's amax, which is
what TP training all-reduces). The fused attention ``linear_qkv`` is quantized as one tensor and split into
``q_proj``/``k_proj``/``v_proj`` by rows afterwards (each row keeps its own block scales): the three share one
``weight_scale_2`` and one ``input_scale``, as engines that fuse them again expect.

A weight whose row count N is not a multiple of 16 (``tiny``'s Mamba ``in_proj``, 648 rows) was trained
zero-padded to whole tiles (``precision.megatron_linear.recipe_padding``): zero rows change no amax, so its
real rows' codes and scales are the first N rows of the padded quantization, and it exports in NVFP4 exactly
(ModelOpt's ``NVFP4QTensor`` and vLLM's loader take any N). A weight whose input width K is not a multiple of
16 has no NVFP4 form an engine reads (blocks run along K): an error naming it, or, with ``padded="bf16"``,
written in BF16 and excluded.

Layers trained in BF16 (the recipe's first/last blocks, user rules), the embedding, norms, Mamba's conv and
SSM parameters and the output layer are written in BF16; the linear ones (the BF16-trained layers and
``lm_head``) are listed in ``exclude_modules`` (``ignore`` in ``config.json``'s ``quantization_config``, the
form ModelOpt's own exporter writes there: :func:`modelopt_quantization_config`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path

import torch

from nvfp4_train.models.config import ModelConfig
from nvfp4_train.models.pattern import ATTENTION, MAMBA

__all__ = ["NVFP4Layer", "ExportedWeight", "nvfp4_layers", "quantize_weight", "dequantize_exported",
           "to_nvfp4_state", "calibrate_input_amax", "quant_config", "modelopt_quantization_config",
           "export_nvfp4", "QUANT_CONFIG_NAME", "GROUP_SIZE", "PRODUCER"]

QUANT_CONFIG_NAME = "hf_quant_config.json"
GROUP_SIZE = 16
PADDED_POLICIES = ("error", "bf16")
PRODUCER = {"name": "nvfp4_train", "version": "0.1.0"}

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
        self.k_unaligned = shape[1] % GROUP_SIZE != 0
        """K not a multiple of 16: no NVFP4 form an engine reads (its blocks run along K)."""

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


@dataclasses.dataclass(frozen=True)
class ExportedWeight:
    """An NVFP4 weight as the export writes it: ``codes`` uint8 [N, K/2], ``scales`` float8_e4m3fn [N, K/16]
    (row-major, one per 1x16 block), ``amax`` the fp32 tensor amax (``weight_scale_2 = decode_scale(amax)``)."""

    codes: torch.Tensor
    scales: torch.Tensor
    amax: torch.Tensor


def quantize_weight(w: torch.Tensor, block_2d: bool) -> ExportedWeight:
    """The training's quantization of a weight for the forward GEMM (``nvfp4_train.kernels.nvfp4``: RNE, no
    RHT). A weight whose N is not a multiple of 16 is quantized as training does, zero-padded to whole 16-row
    tiles (``precision.linear.pad_weight``), and its first N rows are returned: the padding changes no amax."""
    from nvfp4_train.kernels.nvfp4 import quantize_nvfp4
    from nvfp4_train.precision.linear import pad_weight

    n, k = w.shape
    if k % GROUP_SIZE:
        raise ValueError(f"a weight of shape {tuple(w.shape)} has no NVFP4 form: K={k} is not a multiple of "
                         f"{GROUP_SIZE}")
    q = quantize_nvfp4(pad_weight(w, (-n % GROUP_SIZE, 0)), block_2d=block_2d)
    return ExportedWeight(codes=q.codes[:n].contiguous(), scales=q.scales[:n].contiguous(), amax=q.amax)


def dequantize_exported(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """ModelOpt's reading of an exported layer (``NVFP4QTensor.dequantize`` of nvidia-modelopt 0.47) as float32
    [N, K]: ``e2m1(code) * (fp32(weight_scale) * weight_scale_2)``, the scale product rounded first, and code 8
    (-0) read as +0.0 from its value table. Ours (``dequantize_nvfp4``) multiplies in the other order; the two
    differ by at most one ulp (module docstring)."""
    from nvfp4_train.kernels.fp4_reference import e2m1_decode, unpack_nibbles

    n, k = weight.shape[0], weight.shape[1] * 2
    vals = e2m1_decode(unpack_nibbles(weight)).view(n, k // GROUP_SIZE, GROUP_SIZE)
    vals = torch.where(vals == 0, torch.zeros_like(vals), vals)  # ModelOpt's table: code 8 is +0.0
    block = weight_scale.to(torch.float32) * weight_scale_2.to(torch.float32)
    return (vals * block.unsqueeze(-1)).view(n, k)


def _split_rows(model_cfg: ModelConfig, layer: NVFP4Layer, t: torch.Tensor) -> list[torch.Tensor]:
    if layer.role != "attention.qkv":
        return [t]
    from nvfp4_train.export.hf import _qkv_rows

    return [t[rows].contiguous() for rows in _qkv_rows(model_cfg)]


def _k_unaligned_error(layer: NVFP4Layer) -> ValueError:
    return ValueError(
        f"layer {layer.name} ({', '.join(layer.hf_modules)}) has input width K={layer.shape[1]}, not a multiple "
        f"of {GROUP_SIZE}: NVFP4 blocks run along K, so it has no NVFP4 form an engine reads; write it in BF16 "
        f"with --padded bf16, or train a model whose widths are multiples of {GROUP_SIZE}")


def to_nvfp4_state(model_cfg: ModelConfig, layers: list[NVFP4Layer], state: dict[str, torch.Tensor],
                   input_amax: dict[str, torch.Tensor], *, padded: str = "error") -> tuple[dict, list[str]]:
    """(Hugging Face tensors, excluded module names): the NVFP4-trained layers in the ModelOpt layout, the rest
    in BF16. ``input_amax``: the calibrated amax of each NVFP4 layer's input, by ``NVFP4Layer.name``.
    ``padded``: what to do with an NVFP4 layer whose K is not a multiple of 16 (``error`` or ``bf16``)."""
    from nvfp4_train.kernels.nvfp4.reference import decode_scale
    from nvfp4_train.export.hf import to_hf_state

    if padded not in PADDED_POLICIES:
        raise ValueError(f"padded={padded!r} is not one of {PADDED_POLICIES}")
    unaligned = [la for la in layers if la.trained_nvfp4 and la.k_unaligned]
    if unaligned and padded == "error":
        raise _k_unaligned_error(unaligned[0])
    hf = {k: v.to(torch.bfloat16) for k, v in to_hf_state(model_cfg, state).items()}
    excluded = ["lm_head"]
    for layer in layers:
        if not layer.trained_nvfp4 or layer.k_unaligned:
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
    """The ``quantization`` section of ``hf_quant_config.json`` as ModelOpt writes it, for W4A4 NVFP4."""
    return {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": GROUP_SIZE,
            "exclude_modules": sorted(excluded)}


def modelopt_quantization_config(hf_quant_config: dict) -> dict:
    """``config.json``'s ``quantization_config`` for our ``hf_quant_config.json``: what ModelOpt's own exporter
    writes there, the output of ``modelopt.torch.export.convert_hf_config.convert_hf_quant_config_format``
    (nvidia-modelopt 0.47.0) for an NVFP4 config without KV-cache quantization. vLLM reads ``config.json``
    first and takes the unquantized modules from ``ignore``; ``group_size`` lives in ``config_groups``."""
    q = hf_quant_config["quantization"]
    if q.get("quant_algo") != "NVFP4" or q.get("kv_cache_quant_algo") is not None:
        raise ValueError(f"the export writes W4A4 NVFP4 without KV-cache quantization, not {q}")
    group_size = q.get("group_size", GROUP_SIZE)
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group_size}
    return {
        "config_groups": {"group_0": {"input_activations": dict(fp4), "weights": dict(fp4), "targets": ["Linear"]}},
        "ignore": list(q.get("exclude_modules") or []),
        "quant_algo": "NVFP4",
        "producer": hf_quant_config["producer"],
        "quant_method": "modelopt",
    }


def export_nvfp4(checkpoint: str | Path, out: str | Path, *, calib_data: str, calib_batches: int = 8,
                 calib_seq: int = 512, calib_batch_size: int = 1, padded: str = "error") -> Path:
    """``python -m nvfp4_train.export nvfp4 CKPT OUT --calib-data PREFIX``: the NVFP4 checkpoint folder
    (config.json with ``quantization_config``, ``hf_quant_config.json``, model.safetensors, tokenizer.json).
    Every check (a layer without an NVFP4 form, the calibration data) runs before the calibration pass and
    before anything is written."""
    import shutil

    from nvfp4_train.config.precision import saved_precision_config
    from nvfp4_train.data.datasets import validate_indexed_dataset
    from nvfp4_train.data.tokenizer import DEFAULT_TOKENIZER_PATH
    from nvfp4_train.evaluate import token_batches
    from nvfp4_train.export.checkpoint_io import build_model_single, load_checkpoint_model, read_run_info
    from nvfp4_train.export.hf import _tokenizer_ids, check_new_folder, hf_config, save_hf

    check_new_folder(out)
    if padded not in PADDED_POLICIES:
        raise ValueError(f"padded={padded!r} is not one of {PADDED_POLICIES}")
    if calib_batches < 1:
        raise ValueError("--calib-batches must be >= 1: input_scale needs the activation amax")
    run = read_run_info(checkpoint)
    validate_indexed_dataset(calib_data, run.model.vocab_size)  # names the file and the fix
    info, state = load_checkpoint_model(checkpoint)
    prec = saved_precision_config(info.config["precision"])
    layer_map = prec.layer_map(info.model.pattern)
    layers = nvfp4_layers(info.model, layer_map, state)
    if not any(la.trained_nvfp4 for la in layers):
        raise ValueError(f"checkpoint {info.path} was trained with precision {prec.recipe!r}: no layer is NVFP4; "
                         f"export it with `python -m nvfp4_train.export hf`")
    unaligned = [la for la in layers if la.trained_nvfp4 and la.k_unaligned]
    if unaligned and padded == "error":  # before the calibration pass
        raise _k_unaligned_error(unaligned[0])
    wanted = [la for la in layers if la.trained_nvfp4 and not la.k_unaligned]
    amax = {}
    if wanted:
        model = build_model_single(info.model, dtype=torch.bfloat16, layer_map=layer_map)
        model.load_state_dict(state, strict=False)
        batches = token_batches(calib_data, seq_length=calib_seq, batch_size=calib_batch_size,
                                max_batches=calib_batches, vocab_size=info.model.vocab_size)
        amax = calibrate_input_amax(model, wanted, (ids for ids, _ in batches))
    tensors, excluded = to_nvfp4_state(info.model, layers, state, amax, padded=padded)
    hf_quant = {"producer": dict(PRODUCER), "quantization": quant_config(excluded)}
    config = hf_config(info.model, max_position_embeddings=int(info.config.get("data", {}).get("seq_length", 4096)),
                       **_tokenizer_ids(info.config))
    config["quantization_config"] = modelopt_quantization_config(hf_quant)
    folder = save_hf(out, config, tensors, metadata={"source": str(info.path), "step": str(info.step)})
    (folder / QUANT_CONFIG_NAME).write_text(json.dumps(hf_quant, indent=2) + "\n")
    shutil.copyfile(info.config.get("data", {}).get("tokenizer") or DEFAULT_TOKENIZER_PATH, folder / "tokenizer.json")
    return folder
