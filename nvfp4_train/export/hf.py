"""Our hybrid model <-> Hugging Face ``transformers``' Nemotron-H (``model_type: nemotron_h``,
``NemotronHForCausalLM``), both ways, exactly.

What maps onto what (facts read from transformers 5.x ``models/nemotron_h``):

==============================================  ===============================================================
ours (megatron names, global block i)           Hugging Face
==============================================  ===============================================================
``embedding.word_embeddings.weight``            ``model.embeddings.weight``
block pre-norm (``norm`` / ``input_layernorm``  ``model.layers.i.norm.weight`` (one pre-norm per block, every
/ ``pre_mlp_layernorm``)                        kind)
``mixer.in_proj`` [z, x, B, C, dt]              ``mixer.in_proj`` (same row order: gate, x B C, dt)
``mixer.conv1d.{weight,bias}``, ``A_log``,      the same names and shapes
``D``, ``dt_bias``, ``mixer.norm.weight``
``mixer.out_proj``                              ``mixer.out_proj``
``self_attention.linear_qkv`` (rows grouped     ``mixer.q_proj``, ``k_proj``, ``v_proj`` (megatron stores, per
per KV group: q of its heads, k, v)             KV group, that group's query heads, then its key, then its value)
``self_attention.linear_proj``                  ``mixer.o_proj``
``mlp.linear_fc1`` / ``linear_fc2``             ``mixer.up_proj`` / ``down_proj``
``decoder.final_norm.weight``                   ``model.norm_f.weight``
``output_layer.weight``                         ``lm_head.weight``
==============================================  ===============================================================

The computations agree: pre-norm blocks ``x + mixer(RMSNorm(x))`` with fp32 RMSNorm (eps ``norm_epsilon`` =
``layer_norm_epsilon``, also in the gated norm), the gated norm ``rmsnorm(y * silu(z)) * w`` over groups of
``d_inner / n_groups`` channels (``norm_before_gate=False``), depthwise causal conv + SiLU over x B C, the SSD
scan with ``softplus(dt + dt_bias)``, per-head ``D`` skip, causal GQA with scale ``1/sqrt(head_dim)`` and no
position embedding, squared ReLU (``relu2``) without a gate, no biases, a final RMSNorm.

The differences, and what the mapping does about each:

- transformers clamps ``dt`` from below at ``time_step_min`` (its mixer's ``time_step_limit`` is
  ``(time_step_min, inf)``; the released Nemotron-H configs say 0.001); ours does not clamp. The export
  writes ``time_step_min`` = the smallest normal fp32 (1.18e-38): the clamp then moves only a dt below that,
  i.e. a softplus argument under -87, whose contribution is below fp32 resolution (0.0 would be exact, but
  transformers' initialiser takes its log). Importing a config whose ``time_step_min`` is larger warns: our
  model does not clamp.
- transformers' Nemotron-H attention applies no rotary embedding: a ``rope`` model is refused.
- Its MLP has no gate and takes one activation: ``squared_relu`` -> ``relu2``, ``gelu`` -> ``gelu``;
  ``swiglu`` is refused.
- ``NemotronHForCausalLM`` never ties ``lm_head`` to the embedding (its tied-weights table is empty): the
  export always writes ``lm_head.weight`` (a copy of the embedding for a tied model) and records
  ``tie_word_embeddings`` as the model has it; the import checks that a tied model's two tensors are equal.
- Initialisation-only fields (``initializer_range``, ``time_step_max``/``floor``, ``rescale_prenorm_residual``)
  do not change the function; ``initializer_range`` carries ``init_method_std``.
- Mixture-of-experts blocks (``E``) and multi-token prediction layers have no counterpart here: refused.

Dtypes: the tensors are written in the dtype they have (bf16 for a trained checkpoint); the import keeps them.

The import checks every tensor's shape and dtype from the safetensors headers (the JSON header, no tensor data)
against ``config.json`` before it reads a tensor or builds a model (:func:`check_hf_shapes`): a wrong width in
either is one error naming the file, the tensor, both shapes and the fix, not a 17 GB allocation.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import torch

from nvfp4_train.models.config import ModelConfig
from nvfp4_train.models.pattern import ATTENTION, MAMBA, MLP

__all__ = ["MODEL_TYPE", "hf_config", "model_config_from_hf", "expected_hf_shapes", "to_hf_state", "from_hf_state",
           "save_hf", "check_new_folder", "read_hf_folder", "read_safetensors_header", "check_hf_shapes", "load_hf",
           "export_hf", "import_hf", "ARCHITECTURE_FIELDS", "TensorHeader"]

MODEL_TYPE = "nemotron_h"
_ACT_TO_HF = {"squared_relu": "relu2", "gelu": "gelu"}
_ACT_FROM_HF = {v: k for k, v in _ACT_TO_HF.items()}
SAFETENSORS_NAME = "model.safetensors"
TIME_STEP_MIN = float(torch.finfo(torch.float32).tiny)  # 1.1754943508222875e-38

#: ModelConfig fields that change the function a checkpoint computes (``name``, ``init_method_std`` and the
#: speed-only ``mamba_chunk_size`` do not).
ARCHITECTURE_FIELDS = ("pattern", "num_layers", "hidden_size", "vocab_size", "ffn_hidden_size", "activation",
                       "num_attention_heads", "num_query_groups", "kv_channels", "position_embedding",
                       "mamba_num_heads", "mamba_head_dim", "mamba_num_groups", "mamba_state_dim",
                       "mamba_conv_kernel", "mamba_conv_bias", "norm_epsilon", "add_bias_linear",
                       "untie_embeddings_and_output_weights")


def _check_exportable(cfg: ModelConfig) -> None:
    pattern = cfg.hybrid_pattern()
    if cfg.position_embedding != "none":
        raise ValueError(f"model {cfg.name!r} uses position_embedding={cfg.position_embedding!r}: transformers' "
                         f"Nemotron-H attention applies no position embedding; only 'none' exports")
    if pattern.num_mlp and cfg.activation not in _ACT_TO_HF:
        raise ValueError(f"model {cfg.name!r} uses activation={cfg.activation!r}: Nemotron-H's MLP has no gate; "
                         f"only {sorted(_ACT_TO_HF)} export")
    if cfg.add_bias_linear:
        raise ValueError(f"model {cfg.name!r} has add_bias_linear=true: the export covers bias-free models "
                         f"(Nemotron-H has no linear biases)")


def hf_config(cfg: ModelConfig, *, bos_token_id: int | None = None, eos_token_id: int | None = None,
              pad_token_id: int | None = None, max_position_embeddings: int = 4096,
              dtype: str = "bfloat16") -> dict:
    """The ``config.json`` of ``cfg`` as transformers' ``NemotronHConfig`` reads it."""
    _check_exportable(cfg)
    pattern = cfg.hybrid_pattern()
    heads = cfg.num_attention_heads or 1
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": MODEL_TYPE,
        "hybrid_override_pattern": pattern.blocks,
        "num_hidden_layers": pattern.num_blocks,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "intermediate_size": cfg.ffn_hidden_size or 4 * cfg.hidden_size,
        "mlp_hidden_act": _ACT_TO_HF.get(cfg.activation, cfg.activation),
        "mlp_bias": False,
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.num_query_groups or heads,
        "head_dim": cfg.kv_channels or cfg.hidden_size // heads,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": max_position_embeddings,
        "mamba_num_heads": cfg.mamba_num_heads or 1,
        "mamba_head_dim": cfg.mamba_head_dim or 1,
        "n_groups": cfg.mamba_num_groups,
        "ssm_state_size": cfg.mamba_state_dim,
        "conv_kernel": cfg.mamba_conv_kernel,
        "use_conv_bias": cfg.mamba_conv_bias,
        "chunk_size": cfg.mamba_chunk_size,
        "mamba_hidden_act": "silu",
        "mamba_proj_bias": False,
        "use_bias": False,
        # the smallest normal fp32: transformers' dt clamp (time_step_min, inf) then changes no dt a trained
        # model produces (softplus falls below it only for arguments under -87); 0.0 would be exact but
        # transformers' initialiser takes log(time_step_min)
        "time_step_min": TIME_STEP_MIN,
        "time_step_max": 0.1,
        "time_step_floor": 1e-4,
        "layer_norm_epsilon": cfg.norm_epsilon,
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "initializer_range": cfg.init_method_std,
        "hidden_dropout": 0.0,
        "use_cache": True,
        "num_logits_to_keep": 1,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "dtype": dtype,
    }


def model_config_from_hf(config: dict, *, name: str = "hf") -> ModelConfig:
    """Our ``ModelConfig`` of a Nemotron-H ``config.json`` (dense models: the pattern's ``M``, ``*``, ``-``)."""
    if config.get("model_type") != MODEL_TYPE:
        raise ValueError(f"config.json has model_type={config.get('model_type')!r}: only {MODEL_TYPE!r} "
                         f"(Nemotron-H) imports")
    pattern = config.get("hybrid_override_pattern")
    if pattern is None and config.get("layers_block_type"):
        names = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION,
                 "mlp": MLP, "moe": "E"}
        pattern = "".join(names.get(t, "?") for t in config["layers_block_type"])
    if not pattern:
        raise ValueError("config.json names no layer pattern (hybrid_override_pattern or layers_block_type)")
    if set(pattern) - {MAMBA, ATTENTION, MLP}:
        raise ValueError(f"config.json pattern {pattern!r} has blocks other than M, *, - (mixture-of-experts "
                         f"'E' or unknown kinds): only dense Nemotron-H imports")
    if config.get("num_nextn_predict_layers", 0):
        raise ValueError("config.json has multi-token prediction layers (num_nextn_predict_layers > 0): not "
                         "supported; those weights would be dropped")
    for key in ("use_bias", "mlp_bias", "attention_bias", "mamba_proj_bias"):
        if config.get(key):
            raise ValueError(f"config.json has {key}=true: our model has no linear biases")
    act = config.get("mlp_hidden_act", "relu2")
    if act not in _ACT_FROM_HF:
        raise ValueError(f"config.json mlp_hidden_act={act!r}: only {sorted(_ACT_FROM_HF)} map onto our MLP")
    if config.get("mamba_hidden_act", "silu") != "silu":
        raise ValueError(f"config.json mamba_hidden_act={config['mamba_hidden_act']!r}: our mixer uses silu")
    if config.get("time_step_min", 0.0) > TIME_STEP_MIN:
        warnings.warn(f"config.json time_step_min={config['time_step_min']}: transformers clamps the Mamba dt "
                      f"from below at it, our mixer does not clamp (same function while dt stays above it)",
                      stacklevel=2)
    missing = [k for k in ("hidden_size", "vocab_size") if not isinstance(config.get(k), int)]
    if missing:
        raise ValueError(f"config.json has no integer {' or '.join(missing)}: it does not describe a Nemotron-H "
                         f"model; give the folder's original config.json")
    eps = config.get("layer_norm_epsilon", config.get("rms_norm_eps", 1e-5))
    has = {k: k in pattern for k in (MAMBA, ATTENTION, MLP)}
    heads = config.get("num_attention_heads")
    return ModelConfig(
        name=name, pattern=pattern, num_layers=len(pattern), hidden_size=config["hidden_size"],
        vocab_size=config["vocab_size"],
        ffn_hidden_size=config.get("intermediate_size") if has[MLP] else None,
        activation=_ACT_FROM_HF[act],
        num_attention_heads=heads if has[ATTENTION] else None,
        num_query_groups=(config.get("num_key_value_heads") or heads) if has[ATTENTION] else None,
        kv_channels=(config.get("head_dim") or config.get("attention_head_dim")) if has[ATTENTION] else None,
        position_embedding="none",
        mamba_num_heads=config.get("mamba_num_heads") if has[MAMBA] else None,
        mamba_head_dim=config.get("mamba_head_dim") if has[MAMBA] else None,
        mamba_num_groups=config.get("n_groups", config.get("mamba_n_groups", 8)),
        mamba_state_dim=config.get("ssm_state_size", 128),
        mamba_conv_kernel=config.get("conv_kernel", config.get("mamba_d_conv", 4)),
        mamba_conv_bias=bool(config.get("use_conv_bias", config.get("mamba_conv_bias", True))),
        mamba_chunk_size=config.get("chunk_size", config.get("mamba_chunk_size", 128)),
        norm_epsilon=float(eps), add_bias_linear=False,
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        init_method_std=float(config.get("initializer_range", 0.02)),
    )


# ------------------------------------------------------------------------------------------------ tensors
_NORM_KEYS = {MAMBA: "norm.weight", ATTENTION: "input_layernorm.weight", MLP: "pre_mlp_layernorm.weight"}
_MAMBA_SAME = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias", "norm.weight",
               "out_proj.weight")


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face folder of ``cfg`` with its shape, in the order :func:`to_hf_state` writes
    them, computed from the config alone (nothing allocated; ``tests/export/test_hf.py`` checks it against the
    built model's tensors)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embeddings.weight": (v, h)}
    for i, kind in enumerate(cfg.hybrid_pattern().blocks):
        p = f"model.layers.{i}."
        out[p + "norm.weight"] = (h,)
        if kind == MAMBA:
            heads, d_in, conv = cfg.mamba_num_heads, cfg.mamba_d_inner, cfg.mamba_conv_dim
            out.update({p + "mixer.in_proj.weight": (cfg.mamba_in_proj_width, h),
                        p + "mixer.conv1d.weight": (conv, 1, cfg.mamba_conv_kernel)})
            if cfg.mamba_conv_bias:
                out[p + "mixer.conv1d.bias"] = (conv,)
            out.update({p + "mixer.A_log": (heads,), p + "mixer.D": (heads,), p + "mixer.dt_bias": (heads,),
                        p + "mixer.norm.weight": (d_in,), p + "mixer.out_proj.weight": (h, d_in)})
        elif kind == ATTENTION:
            kv = cfg.num_query_groups * cfg.kv_channels
            out.update({p + "mixer.q_proj.weight": (cfg.attention_q_width, h), p + "mixer.k_proj.weight": (kv, h),
                        p + "mixer.v_proj.weight": (kv, h), p + "mixer.o_proj.weight": (h, cfg.attention_q_width)})
        else:
            out.update({p + "mixer.up_proj.weight": (cfg.ffn_hidden_size, h),
                        p + "mixer.down_proj.weight": (h, cfg.ffn_hidden_size)})
    out["model.norm_f.weight"] = (h,)
    out["lm_head.weight"] = (v, h)
    return out


def _qkv_rows(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row indices of q, k, v in megatron's fused ``linear_qkv`` weight (per KV group: its query heads, its
    key, its value), each in Hugging Face's head order."""
    g, hn = cfg.num_query_groups, cfg.kv_channels
    rep = cfg.num_attention_heads // g
    per = (rep + 2) * hn
    base = torch.arange(g)[:, None] * per
    q = (base + torch.arange(rep * hn)[None]).reshape(-1)
    k = (base + rep * hn + torch.arange(hn)[None]).reshape(-1)
    v = (base + (rep + 1) * hn + torch.arange(hn)[None]).reshape(-1)
    return q, k, v


def to_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict (TP = PP = 1, megatron names) -> transformers' Nemotron-H names. Every tensor of
    ``state`` is used exactly once (a leftover or a missing key is an error)."""
    _check_exportable(cfg)
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in state:
            raise ValueError(f"state dict has no {key!r}: it is not a checkpoint of model {cfg.name!r}")
        used.add(key)
        return state[key]

    out = {"model.embeddings.weight": take("embedding.word_embeddings.weight")}
    for i, kind in enumerate(cfg.hybrid_pattern().blocks):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[hf + "norm.weight"] = take(ours + _NORM_KEYS[kind])
        if kind == MAMBA:
            for name in _MAMBA_SAME:
                if name == "conv1d.bias" and not cfg.mamba_conv_bias:
                    continue
                out[hf + "mixer." + name] = take(ours + "mixer." + name)
        elif kind == ATTENTION:
            qkv = take(ours + "self_attention.linear_qkv.weight")
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), _qkv_rows(cfg)):
                out[hf + f"mixer.{part}.weight"] = qkv[rows].contiguous()
            out[hf + "mixer.o_proj.weight"] = take(ours + "self_attention.linear_proj.weight")
        else:
            out[hf + "mixer.up_proj.weight"] = take(ours + "mlp.linear_fc1.weight")
            out[hf + "mixer.down_proj.weight"] = take(ours + "mlp.linear_fc2.weight")
    out["model.norm_f.weight"] = take("decoder.final_norm.weight")
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = take("output_layer.weight")
    else:  # transformers' NemotronHForCausalLM does not tie: write the shared matrix twice
        out["lm_head.weight"] = out["model.embeddings.weight"].clone()
    left = sorted(set(state) - used)
    if left:
        raise ValueError(f"state dict has tensors model {cfg.name!r} does not have: {left[:6]}")
    return out


def from_hf_state(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' Nemotron-H tensors -> our state dict (TP = PP = 1); the inverse of :func:`to_hf_state`.
    A tensor of another shape than ``cfg`` gives it is an error naming it."""
    _check_exportable(cfg)
    used: set[str] = set()
    shapes = expected_hf_shapes(cfg)

    def take(key: str) -> torch.Tensor:
        if key not in hf:
            raise ValueError(f"Hugging Face weights have no {key!r}: they are not model {cfg.name!r}")
        if tuple(hf[key].shape) != shapes[key]:
            raise ValueError(f"Hugging Face tensor {key} has shape {list(hf[key].shape)}, model {cfg.name!r} needs "
                             f"{list(shapes[key])}")
        used.add(key)
        return hf[key]

    out = {"embedding.word_embeddings.weight": take("model.embeddings.weight")}
    for i, kind in enumerate(cfg.hybrid_pattern().blocks):
        ours, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[ours + _NORM_KEYS[kind]] = take(h + "norm.weight")
        if kind == MAMBA:
            for name in _MAMBA_SAME:
                if name == "conv1d.bias" and not cfg.mamba_conv_bias:
                    continue
                out[ours + "mixer." + name] = take(h + "mixer." + name)
        elif kind == ATTENTION:
            q, k, v = (take(h + f"mixer.{p}.weight") for p in ("q_proj", "k_proj", "v_proj"))
            rows_q, rows_k, rows_v = _qkv_rows(cfg)
            qkv = q.new_empty((q.shape[0] + k.shape[0] + v.shape[0], q.shape[1]))
            qkv[rows_q], qkv[rows_k], qkv[rows_v] = q, k, v
            out[ours + "self_attention.linear_qkv.weight"] = qkv
            out[ours + "self_attention.linear_proj.weight"] = take(h + "mixer.o_proj.weight")
        else:
            out[ours + "mlp.linear_fc1.weight"] = take(h + "mixer.up_proj.weight")
            out[ours + "mlp.linear_fc2.weight"] = take(h + "mixer.down_proj.weight")
    out["decoder.final_norm.weight"] = take("model.norm_f.weight")
    if cfg.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = take("lm_head.weight")
    elif "lm_head.weight" in hf:
        take("lm_head.weight")
        if not torch.equal(hf["lm_head.weight"], out["embedding.word_embeddings.weight"]):
            raise ValueError("config.json says tie_word_embeddings=true but lm_head.weight differs from "
                             "model.embeddings.weight")
    left = sorted(k for k in set(hf) - used if not re.match(r"^mtp\.", k))
    if left:
        raise ValueError(f"Hugging Face weights have tensors model {cfg.name!r} does not use: {left[:6]}")
    return out


# ------------------------------------------------------------------------------------------------ files
def check_new_folder(out: str | Path) -> Path:
    """``out`` as a folder the export may write: new or empty (checked before any work, so that nothing already
    there is overwritten)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a folder: give a new folder for the export")
    if (out / "config.json").exists() or (out / SAFETENSORS_NAME).exists():
        raise ValueError(f"{out} already holds a model (config.json / {SAFETENSORS_NAME}): give a new folder")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty ({', '.join(sorted(p.name for p in out.iterdir())[:3])}, ...): give a "
                         f"new or empty folder, so that no file there is overwritten")
    return out


def save_hf(out: str | Path, config: dict, tensors: dict[str, torch.Tensor], *, metadata: dict | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``out`` (created; must not hold a model already)."""
    from safetensors.torch import save_file

    out = check_new_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (SAFETENSORS_NAME + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
              metadata={"format": "pt", **(metadata or {})})
    tmp.chmod(0o644)
    tmp.replace(out / SAFETENSORS_NAME)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


# safetensors dtype names -> bytes per element; the import takes the floating-point ones
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_ST_FLOAT = ("BF16", "F16", "F32", "F64")
_ST_MAX_HEADER = 100_000_000  # the safetensors library's own limit on the JSON header


@dataclasses.dataclass(frozen=True)
class TensorHeader:
    """One tensor as a safetensors header describes it (no data read)."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def read_safetensors_header(path: str | Path) -> dict[str, TensorHeader]:
    """The tensors a ``.safetensors`` file holds, from its JSON header alone (8-byte little-endian length, then
    the JSON), checked against the file's size: an error names the file, the problem and the fix."""
    path = Path(path)
    fix = "re-download or re-save the file"
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: {size} bytes, shorter than a safetensors header's 8-byte length: not a "
                             f"safetensors file; {fix}")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, _ST_MAX_HEADER):
            raise ValueError(f"{path}: its header length field says {n} bytes, the file has {size}: truncated or "
                             f"not a safetensors file; {fix}")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: the safetensors header is not valid JSON ({e}); {fix}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object; {fix}")
    data_size = size - 8 - n
    out: dict[str, TensorHeader] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            ok = isinstance(dtype, str) and all(isinstance(d, int) and d >= 0 for d in shape) and \
                isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{path}: tensor {name!r} has no valid dtype/shape/data_offsets in the header "
                             f"({entry!r:.120}); {fix}")
        if dtype not in _ST_ITEMSIZE:
            raise ValueError(f"{path}: tensor {name} has dtype {dtype}, which the import does not read (it takes "
                             f"{', '.join(_ST_FLOAT)}): import the high-precision (bf16) weights")
        need = _ST_ITEMSIZE[dtype]
        for d in shape:
            need *= d
        if end - begin != need:
            raise ValueError(f"{path}: tensor {name} is {dtype} {list(shape)} ({need} bytes) but its data_offsets "
                             f"span {end - begin} bytes: a corrupt header; {fix}")
        if end > data_size:
            raise ValueError(f"{path}: tensor {name} ends at data byte {end}, the file holds {data_size}: "
                             f"truncated; {fix}")
        out[name] = TensorHeader(file=path, dtype=dtype, shape=shape)
    return out


def read_hf_folder(folder: str | Path) -> tuple[dict, dict[str, TensorHeader]]:
    """(config.json, every tensor's header) of a Hugging Face Nemotron-H folder (one or several
    ``*.safetensors``); reads no tensor data. Errors name the file and the fix."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder: give a Hugging Face model folder")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: give a Hugging Face model folder")
    try:
        config = json.loads(cfg_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_path} is not valid JSON ({e}): give the folder's original config.json") from None
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_path} is not a JSON object: give the folder's original config.json")
    if config.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{cfg_path}: model_type={config.get('model_type')!r}, not {MODEL_TYPE!r} (Nemotron-H): "
                         f"only Nemotron-H folders import")
    if config.get("quantization_config"):
        raise ValueError(f"{cfg_path} describes a quantized checkpoint ({config['quantization_config']}): import "
                         f"the high-precision (bf16) weights")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files: give the folder with the model's weights")
    headers: dict[str, TensorHeader] = {}
    for f in files:
        for name, t in read_safetensors_header(f).items():
            if name in headers:
                raise ValueError(f"tensor {name} is in both {headers[name].file} and {f}: remove the stale file")
            headers[name] = t
    return config, headers


def check_hf_shapes(cfg: ModelConfig, headers: dict[str, TensorHeader], *, config_name: str = "config.json") -> None:
    """Every tensor the model of ``cfg`` needs is in ``headers`` with its shape and a floating-point dtype, and
    nothing else is (multi-token-prediction ``mtp.*`` tensors aside; a tied model's ``lm_head`` is optional).
    Checked on the headers, before any model or tensor is allocated; the error (one line) names the file, the
    tensor, the expected and the found shape, and the fix."""
    expected = expected_hf_shapes(cfg)
    folder = next(iter(headers.values())).file.parent if headers else Path(".")
    problems: list[str] = []
    for name, shape in expected.items():
        t = headers.get(name)
        if t is None:
            if name == "lm_head.weight" and not cfg.untie_embeddings_and_output_weights:
                continue
            problems.append(f"{folder}: no file has tensor {name}, which {config_name} gives shape {list(shape)}: "
                            f"the weights are incomplete or of another model")
        elif t.shape != shape:
            problems.append(f"{t.file}: tensor {name} has shape {list(t.shape)}, {config_name} gives it "
                            f"{list(shape)}: {config_name} does not describe these weights; use the "
                            f"config.json they were saved with")
        elif t.dtype not in _ST_FLOAT:
            problems.append(f"{t.file}: tensor {name} is {t.dtype}, not a floating-point type: import the "
                            f"high-precision (bf16) weights")
    for name, t in headers.items():
        if name not in expected and not name.startswith("mtp."):
            problems.append(f"{t.file}: tensor {name} {list(t.shape)} is not part of the model {config_name} "
                            f"describes: the weights are of another model, or {config_name} is not theirs")
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise ValueError(problems[0] + more)


def _load_tensors(headers: dict[str, TensorHeader]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted({t.file for t in headers.values()}):
        try:
            tensors.update(load_file(str(f)))
        except SafetensorError as e:
            raise ValueError(f"{f}: safetensors cannot read it ({e}); re-download or re-save the file") from None
    return tensors


def load_hf(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, all tensors) of a Hugging Face model folder (one or several ``*.safetensors``)."""
    config, headers = read_hf_folder(folder)
    return config, _load_tensors(headers)


def _tokenizer_ids(run_config: dict) -> dict:
    """bos/eos/pad ids for config.json from the run's tokenizer (its end-of-document id ends a text)."""
    from nvfp4_train.data.tokenizer import load_tokenizer

    data = run_config.get("data", {})
    tok = load_tokenizer(data.get("tokenizer"), eod_token=data.get("eod_token"))
    return {"bos_token_id": tok.eod, "eos_token_id": tok.eod, "pad_token_id": tok.eod}


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """``python -m nvfp4_train.export hf CKPT OUT``: a training checkpoint (any TP/PP layout) as a Hugging Face
    Nemotron-H folder (config.json, model.safetensors, and the run's tokenizer.json)."""
    import shutil

    from nvfp4_train.export.checkpoint_io import load_checkpoint_model

    check_new_folder(out)
    info, state = load_checkpoint_model(checkpoint)
    ids = _tokenizer_ids(info.config)
    seq = int(info.config.get("data", {}).get("seq_length", 4096))
    config = hf_config(info.model, max_position_embeddings=seq, **ids)
    folder = save_hf(out, config, to_hf_state(info.model, state),
                     metadata={"source": str(info.path), "step": str(info.step)})
    tok = info.config.get("data", {}).get("tokenizer")
    from nvfp4_train.data.tokenizer import DEFAULT_TOKENIZER_PATH

    shutil.copyfile(tok or DEFAULT_TOKENIZER_PATH, folder / "tokenizer.json")
    return folder


def import_hf(folder: str | Path, out: str | Path, *, model: str | None = None,
              overrides: tuple[str, ...] = ()) -> Path:
    """``python -m nvfp4_train.export import-hf HF_DIR OUT_CKPT``: a Nemotron-H folder as a step-0 training
    checkpoint that ``train.py ... checkpoint.resume=OUT_CKPT/step_0000000`` continues from.

    ``model``: one of our sizes (``12b``, ...) the folder must match on every architecture field; the
    checkpoint then records that size's config (so ``train.py model=12b`` resumes it). Without it the config is
    derived from config.json (name ``hf``)."""
    from nvfp4_train.models.config import model_config
    from nvfp4_train.export.checkpoint_io import check_new_checkpoint_root, write_training_checkpoint

    check_new_checkpoint_root(out)
    config, headers = read_hf_folder(folder)
    derived = model_config_from_hf(config)
    if model is not None:
        target = model_config(model)
        diff = [f"{k}: config.json gives {getattr(derived, k)!r}, {model} has {getattr(target, k)!r}"
                for k in ARCHITECTURE_FIELDS if getattr(derived, k) != getattr(target, k)]
        if diff:
            raise ValueError(f"{folder} is not our {model!r}: " + "; ".join(diff))
        derived = target
    check_hf_shapes(derived, headers)  # from the headers, before any tensor or model is allocated
    state = from_hf_state(derived, _load_tensors(headers))
    recorded = [f"model={model}"] if model is not None else []
    if not any(o.startswith("data.seq_length=") for o in overrides):  # the export writes it back
        recorded.append(f"data.seq_length={int(config.get('max_position_embeddings', 4096))}")
    return write_training_checkpoint(out, derived, state, overrides=(*recorded, *overrides),
                                     meta_extra={"imported_from": str(folder)})
