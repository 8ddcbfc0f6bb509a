"""Model sizes of the hybrid Mamba-Transformer, from a CPU test model to the paper's 12B (RECIPE.md §6).

:class:`ModelConfig` is plain data (also the Hydra schema of the ``model`` config group; the YAML files in
``configs/model/`` mirror :data:`SIZES`, a test keeps them equal). :func:`count_parameters` counts the
parameters analytically, block kind by block kind, without building anything. Pure Python.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nvfp4_train.models.pattern import ATTENTION, MAMBA, MLP, HybridPattern

__all__ = [
    "ModelConfig",
    "SIZES",
    "model_config",
    "size_names",
    "block_parameters",
    "parameter_breakdown",
    "count_parameters",
    "PATTERN_12B",
    "PATTERN_8B",
]

ACTIVATIONS = ("squared_relu", "swiglu", "gelu")
POSITION_EMBEDDINGS = ("none", "rope")


@dataclass(kw_only=True)
class ModelConfig:
    """The architecture of one model (no parallelism, no precision: those are other config sections)."""

    name: str = "custom"
    """A label for logs and tables."""
    pattern: str
    """Hybrid layout (``nvfp4_train.models.pattern``): ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``|`` pipeline stage."""
    num_layers: int | None = None
    """Number of blocks (pattern characters other than ``|``); checked against the pattern when given."""
    hidden_size: int
    """Model width h (residual stream)."""
    vocab_size: int
    """Rows of the embedding and of the output layer (>= the tokenizer's vocabulary)."""

    # MLP blocks ('-')
    ffn_hidden_size: int | None = None
    """MLP inner width (fc1 output per branch). Required when the pattern has '-' blocks."""
    activation: str = "squared_relu"
    """MLP non-linearity: ``squared_relu`` (no gate, Nemotron-H), ``swiglu`` (gated: fc1 is 2x wide), ``gelu``."""

    # attention blocks ('*')
    num_attention_heads: int | None = None
    """Query heads. Required when the pattern has '*' blocks."""
    num_query_groups: int | None = None
    """Key/value heads (GQA groups); must divide num_attention_heads."""
    kv_channels: int | None = None
    """Head dimension of queries, keys and values."""
    position_embedding: str = "none"
    """``none`` (Nemotron-H: the Mamba blocks carry position) or ``rope`` (rotary, attention only)."""
    rotary_base: float = 10000.0
    """RoPE base (used when position_embedding is ``rope``)."""

    # Mamba-2 blocks ('M')
    mamba_num_heads: int | None = None
    """SSM heads. d_inner = mamba_num_heads * mamba_head_dim. Required when the pattern has 'M' blocks."""
    mamba_head_dim: int | None = None
    """Channels per SSM head."""
    mamba_num_groups: int = 8
    """B/C groups (shared by mamba_num_heads / mamba_num_groups heads each); must divide mamba_num_heads."""
    mamba_state_dim: int = 128
    """SSM state size per group (d_state)."""
    mamba_conv_kernel: int = 4
    """Width of the depthwise causal conv over (x, B, C)."""
    mamba_conv_bias: bool = True
    """Bias of the depthwise conv (Mamba-2 and Nemotron-H have one; the linear layers have none)."""
    mamba_chunk_size: int = 128
    """Chunk length of the chunked SSD scan (a speed knob, not a parameter)."""

    # everywhere
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon (pre-norms, final norm, Mamba's gated norm)."""
    add_bias_linear: bool = False
    """Biases in the linear layers (Nemotron-H: none)."""
    untie_embeddings_and_output_weights: bool = True
    """Separate output-layer weight (True) or reuse the embedding (False)."""
    init_method_std: float = 0.02
    """Std of the normal init of the linear and embedding weights."""

    def __post_init__(self) -> None:
        pattern = HybridPattern.parse(self.pattern, num_layers=self.num_layers)
        if self.num_layers is None:
            self.num_layers = pattern.num_blocks
        _positive(self, "hidden_size", "vocab_size")
        if pattern.num_mlp:
            _positive(self, "ffn_hidden_size", why="the pattern has MLP blocks ('-')")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.activation={self.activation!r} is not one of {ACTIVATIONS}")
        if pattern.num_attention:
            why = "the pattern has attention blocks ('*')"
            _positive(self, "num_attention_heads", "num_query_groups", "kv_channels", why=why)
            if self.num_attention_heads % self.num_query_groups:
                raise ValueError(
                    f"ModelConfig.num_query_groups={self.num_query_groups} must divide "
                    f"num_attention_heads={self.num_attention_heads}"
                )
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"ModelConfig.position_embedding={self.position_embedding!r} is not one of {POSITION_EMBEDDINGS}"
            )
        if pattern.num_mamba:
            why = "the pattern has Mamba blocks ('M')"
            _positive(
                self, "mamba_num_heads", "mamba_head_dim", "mamba_num_groups", "mamba_state_dim",
                "mamba_conv_kernel", "mamba_chunk_size", why=why,
            )  # fmt: skip
            if self.mamba_num_heads % self.mamba_num_groups:
                raise ValueError(
                    f"ModelConfig.mamba_num_groups={self.mamba_num_groups} must divide "
                    f"mamba_num_heads={self.mamba_num_heads}"
                )
        if not self.norm_epsilon > 0 or not self.init_method_std > 0:
            raise ValueError("ModelConfig.norm_epsilon and init_method_std must be > 0")

    # --- derived sizes ------------------------------------------------------------------------------------
    def hybrid_pattern(self, pp_size: int | None = None) -> HybridPattern:
        """The validated pattern (and its stage count checked against ``pp_size`` when given)."""
        return HybridPattern.parse(self.pattern, num_layers=self.num_layers, pp_size=pp_size)

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the depthwise conv: x, B and C (d_inner + 2 * groups * state)."""
        return self.mamba_d_inner + 2 * self.mamba_num_groups * self.mamba_state_dim

    @property
    def mamba_in_proj_width(self) -> int:
        """Output width of in_proj: z, x, B, C, dt = 2*d_inner + 2*groups*state + heads (12B: 22656)."""
        return 2 * self.mamba_d_inner + 2 * self.mamba_num_groups * self.mamba_state_dim + self.mamba_num_heads

    @property
    def attention_q_width(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def attention_qkv_width(self) -> int:
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels

    @property
    def mlp_fc1_width(self) -> int:
        return (2 if self.activation == "swiglu" else 1) * self.ffn_hidden_size

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _positive(cfg: ModelConfig, *names: str, why: str = "") -> None:
    for name in names:
        v = getattr(cfg, name)
        if v is None or isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(
                f"ModelConfig.{name}={v!r} must be a positive int" + (f" ({why})" if why else "")
            )


# --- parameter count ----------------------------------------------------------------------------------------
def block_parameters(cfg: ModelConfig, kind: str) -> dict[str, int]:
    """Parameters of one block of ``kind`` (``M``, ``*``, ``-``), tensor by tensor. Every block is
    ``x + mixer(RMSNorm(x))``; the pre-norm weight is counted with the block."""
    h = cfg.hidden_size
    bias = cfg.add_bias_linear
    if kind == MAMBA:
        d_in, heads = cfg.mamba_d_inner, cfg.mamba_num_heads
        conv = cfg.mamba_conv_dim
        return {
            "norm": h,
            "in_proj": h * cfg.mamba_in_proj_width + (cfg.mamba_in_proj_width if bias else 0),
            "conv1d": conv * cfg.mamba_conv_kernel + (conv if cfg.mamba_conv_bias else 0),
            "dt_bias": heads,
            "A_log": heads,
            "D": heads,
            "gated_norm": d_in,
            "out_proj": d_in * h + (h if bias else 0),
        }
    if kind == ATTENTION:
        qkv, q = cfg.attention_qkv_width, cfg.attention_q_width
        return {
            "norm": h,
            "qkv": h * qkv + (qkv if bias else 0),
            "proj": q * h + (h if bias else 0),
        }
    if kind == MLP:
        fc1, f = cfg.mlp_fc1_width, cfg.ffn_hidden_size
        return {
            "norm": h,
            "fc1": h * fc1 + (fc1 if bias else 0),
            "fc2": f * h + (h if bias else 0),
        }
    raise ValueError(f"block kind {kind!r} is not one of 'M', '*', '-'")


def parameter_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Parameter totals by part: embedding, each block kind (all blocks of it), final norm, output layer."""
    pattern = cfg.hybrid_pattern()
    out = {"embedding": cfg.vocab_size * cfg.hidden_size}
    for kind, label in ((MAMBA, "mamba blocks"), (ATTENTION, "attention blocks"), (MLP, "mlp blocks")):
        n = pattern.count(kind)
        out[label] = n * sum(block_parameters(cfg, kind).values()) if n else 0
    out["final_norm"] = cfg.hidden_size
    out["output_layer"] = cfg.vocab_size * cfg.hidden_size if cfg.untie_embeddings_and_output_weights else 0
    return out


def count_parameters(cfg: ModelConfig) -> int:
    """Total parameters of the model described by ``cfg`` (12b: 12,309,991,292; 8b: 8,100,852,736)."""
    return sum(parameter_breakdown(cfg).values())


# --- sizes ----------------------------------------------------------------------------------------------------
# RECIPE §6 (Nemotron-Nano-12B-v2-Base): 62 blocks, 28 M, 28 -, 6 *.
PATTERN_12B = "M-M-M-M*-" * 6 + "M-M-M-M-"
# Nemotron-H-8B-Base: 52 blocks, 24 M, 24 -, 4 * (attention at blocks 7, 18, 29, 40).
PATTERN_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


def _sizes() -> dict[str, ModelConfig]:
    return {
        # CPU tests and the default CPU run: all three block kinds, every width a multiple of 128, heads and
        # groups divisible by a tensor-parallel size of 2.
        "tiny": ModelConfig(
            name="tiny", pattern="M-*-M-", num_layers=6, hidden_size=128, vocab_size=32768,
            ffn_hidden_size=512, num_attention_heads=4, num_query_groups=2, kv_channels=64,
            mamba_num_heads=8, mamba_head_dim=32, mamba_num_groups=2, mamba_state_dim=32,
            mamba_chunk_size=32,
        ),
        # The GPU convergence model: the 12B's pattern shape (M-M-M-M*- groups, an attention-free tail)
        # at ~81M parameters, our 32k tokenizer.
        "small": ModelConfig(
            name="small", pattern="M-M-M-M*-" * 2 + "M-M-M-M-", num_layers=26, hidden_size=512,
            vocab_size=32768, ffn_hidden_size=2048, num_attention_heads=8, num_query_groups=4,
            kv_channels=64, mamba_num_heads=16, mamba_head_dim=64, mamba_num_groups=4, mamba_state_dim=128,
        ),
        # The convergence model of docs/experiments.md: the 12B's pattern shape (one M-M-M-M*- group and the
        # attention-free tail) at width 128, sized so one run on one H200 reaches >= 20 tokens per
        # non-embedding parameter (1.91M non-embedding, 8.39M embedding + output layer) in minutes.
        "10m": ModelConfig(
            name="10m", pattern="M-M-M-M*-M-M-M-", num_layers=15, hidden_size=128, vocab_size=32768,
            ffn_hidden_size=512, num_attention_heads=4, num_query_groups=2, kv_channels=32,
            mamba_num_heads=8, mamba_head_dim=32, mamba_num_groups=2, mamba_state_dim=64,
        ),
        # A hybrid at the classic 125M size (one M-M-M-M*- group and the tail), our 32k tokenizer.
        "125m": ModelConfig(
            name="125m", pattern="M-M-M-M*-M-M-M-M-", num_layers=17, hidden_size=768, vocab_size=32768,
            ffn_hidden_size=3072, num_attention_heads=12, num_query_groups=4, kv_channels=64,
            mamba_num_heads=24, mamba_head_dim=64, mamba_num_groups=4, mamba_state_dim=128,
        ),
        # The paper's ablation model: a plain Transformer of 20 layers (each an attention and an MLP block),
        # RoPE, squared ReLU, the paper's 131072 vocabulary (~1.29B parameters with untied output).
        "1.2b": ModelConfig(
            name="1.2b", pattern="*-" * 20, num_layers=40, hidden_size=2048, vocab_size=131072,
            ffn_hidden_size=6144, num_attention_heads=16, num_query_groups=8, kv_channels=128,
            position_embedding="rope",
        ),
        # RECIPE §6 8B comparison model (Nemotron-H-8B-Base): Mamba 128 heads x 64 = 8192.
        "8b": ModelConfig(
            name="8b", pattern=PATTERN_8B, num_layers=52, hidden_size=4096, vocab_size=131072,
            ffn_hidden_size=21504, num_attention_heads=32, num_query_groups=8, kv_channels=128,
            mamba_num_heads=128, mamba_head_dim=64, mamba_num_groups=8, mamba_state_dim=128,
            init_method_std=0.0125,
        ),
        # RECIPE §6: the paper's 12B (Nemotron-Nano-12B-v2-Base).
        "12b": ModelConfig(
            name="12b", pattern=PATTERN_12B, num_layers=62, hidden_size=5120, vocab_size=131072,
            ffn_hidden_size=20480, activation="squared_relu", num_attention_heads=40, num_query_groups=8,
            kv_channels=128, position_embedding="none", mamba_num_heads=128, mamba_head_dim=80,
            mamba_num_groups=8, mamba_state_dim=128, mamba_conv_kernel=4, norm_epsilon=1e-5,
            add_bias_linear=False, untie_embeddings_and_output_weights=True, init_method_std=0.0125,
        ),
    }  # fmt: skip


SIZES: dict[str, ModelConfig] = _sizes()


def size_names() -> tuple[str, ...]:
    return tuple(SIZES)


def model_config(name: str, **overrides) -> ModelConfig:
    """A fresh copy of size ``name`` with ``overrides`` applied (validated again)."""
    if name not in SIZES:
        raise ValueError(f"unknown model size {name!r}: use one of {size_names()}")
    return dataclasses.replace(SIZES[name], **overrides)
