"""EncoderConfig: the architecture of a checkpoint, parsed from a HuggingFace config.json.

One dataclass covers the BERT family (BERT, RoBERTa, XLM-RoBERTa), ModernBERT, the rotary
post-norm BERTs (NomicBERT, GTE's "new" architecture, Jina v3) and EuroBERT; fields a family does
not use keep their defaults. Both the configs transformers writes and those the published
remote-code checkpoints ship are read (nomic's n_embd / rotary_emb_base, GTE's model_type "new",
Jina v3's "xlm-roberta" with rotary positions and LoRA adaptations). Anything we cannot reproduce exactly raises
`UnsupportedArchitecture` naming it, rather than loading into a subtly wrong model.
`ARCHITECTURES` is the one table of the model types implemented here: each one's network
(a module of models.networks) and how its config.json reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from clusterserve.kernels.reference.rowwise import ACTIVATIONS

# Rotary position schedules (models.networks.rotary).
ROPE_TYPES = ("default", "linear", "dynamic", "ntk")


class UnsupportedArchitecture(ValueError):
    """The checkpoint's architecture (model_type or a feature of it) is not implemented here."""

    def __init__(self, what: str):
        super().__init__(
            f"unsupported architecture: {what}; supported model types are {', '.join(ARCHITECTURES)}"
        )
        self.what = what


@dataclass(frozen=True)
class EncoderConfig:
    """Architecture of an encoder checkpoint (names follow HF's config.json where they can)."""

    model_type: str  # a key of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    activation: str = "gelu"
    norm_eps: float = 1e-12
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    pad_token_id: int = 0
    # RoBERTa numbers positions from padding_idx + 1, so its first rows are never used for real
    # tokens: a 514-row table holds 512 positions. 0 for BERT and ModernBERT.
    position_offset: int = 0
    # ModernBERT. Layer i is global when i % global_attn_every_n_layers == 0 unless config.json
    # lists layer_types itself; the others see keys within local_attention // 2 of the query.
    global_attn_every_n_layers: int = 1
    local_attention: int = 0
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" per layer
    norm_bias: bool = True
    attention_bias: bool = True
    mlp_bias: bool = True  # the MLP's input projections (ModernBERT: both)
    mlp_out_bias: bool = True
    # Rotary families (see models.networks.rotary for the schedules).
    rope_theta: float = 10_000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_positions: int = 0  # where "dynamic" scaling starts
    rope_interleaved: bool = False
    mlp_gated: bool = False  # act(gate(x)) * up(x) instead of act(fc1(x))
    num_kv_heads: int = 0  # grouped-query attention (EuroBERT); 0 = num_heads
    # Per-task LoRA adapters (Jina v3): delta W = B[t] @ A[t] * lora_alpha / lora_rank.
    adapters: tuple[str, ...] = ()
    lora_rank: int = 0
    lora_alpha: float = 1.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def native_positions(self) -> int:
        """Tokens the checkpoint was trained to take (for RoPE models: max_position_embeddings)."""
        return self.max_position_embeddings - self.position_offset

    @property
    def network(self) -> str:
        """The module of models.networks that runs this architecture."""
        return ARCHITECTURES[self.model_type].network

    @property
    def uses_rope(self) -> bool:
        return self.network != "bert"

    def is_global_layer(self, index: int) -> bool:
        """True when layer `index` attends over the whole sequence (always for the BERT family)."""
        if not self.layer_types:
            return True
        return self.layer_types[index] == "full_attention"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> EncoderConfig:
        """Parse a HuggingFace config.json dict; raises UnsupportedArchitecture."""
        model_type = str(raw.get("model_type", "")).replace("_", "-")
        if model_type == "new":  # GTE's remote-code name for its architecture
            model_type = "gte"
        if model_type == "xlm-roberta" and raw.get("position_embedding_type") == "rotary":
            model_type = "jina-embeddings-v3"  # Jina's remote-code XLM-R with rotary positions
        if model_type not in ARCHITECTURES:
            raise UnsupportedArchitecture(f"model_type {raw.get('model_type')!r}")
        config = ARCHITECTURES[model_type].read(raw, model_type)
        if config.activation not in ACTIVATIONS:
            raise UnsupportedArchitecture(f"activation {config.activation!r} in {model_type}")
        if config.hidden_size % config.num_heads or config.num_heads % (config.num_kv_heads or config.num_heads):
            raise ValueError(
                f"config.json: hidden_size {config.hidden_size} is not a multiple of "
                f"num_attention_heads {config.num_heads}, or that of num_key_value_heads "
                f"{config.num_kv_heads}; the checkpoint's config is inconsistent"
            )
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> EncoderConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def _sizes(raw: dict[str, Any]) -> dict[str, int]:
    """The model's sizes under the names transformers saves them."""
    return {
        "vocab_size": int(raw["vocab_size"]),
        "hidden_size": int(raw["hidden_size"]),
        "num_layers": int(raw["num_hidden_layers"]),
        "num_heads": int(raw["num_attention_heads"]),
        "intermediate_size": int(raw["intermediate_size"]),
    }


def _bert_config(raw: dict[str, Any], model_type: str) -> EncoderConfig:
    position_type = raw.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise UnsupportedArchitecture(f"position_embedding_type {position_type!r} in {model_type}")
    if raw.get("is_decoder") or raw.get("add_cross_attention"):
        raise UnsupportedArchitecture(f"{model_type} decoder (is_decoder / add_cross_attention)")
    pad = int(raw.get("pad_token_id") if raw.get("pad_token_id") is not None else 0)
    return EncoderConfig(
        model_type=model_type,
        **_sizes(raw),
        activation=str(raw.get("hidden_act", "gelu")),
        norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 512)),
        type_vocab_size=int(raw.get("type_vocab_size", 2)),
        pad_token_id=pad,
        position_offset=0 if model_type == "bert" else pad + 1,
    )


def _modernbert_config(raw: dict[str, Any], model_type: str) -> EncoderConfig:
    num_layers = int(raw["num_hidden_layers"])
    every_n = int(raw.get("global_attn_every_n_layers", 3))
    layer_types = raw.get("layer_types") or [
        "full_attention" if i % every_n == 0 else "sliding_attention" for i in range(num_layers)
    ]
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown or len(layer_types) != num_layers:
        raise UnsupportedArchitecture(f"modernbert layer_types {layer_types!r}")

    # Older checkpoints (answerdotai/ModernBERT-*) store global_/local_rope_theta; configs
    # saved by transformers >= 5 store rope_parameters per layer type instead.
    global_theta = float(raw.get("global_rope_theta", 160_000.0))
    local_theta = float(raw.get("local_rope_theta") or 10_000.0)
    rope = raw.get("rope_parameters") or {}
    for layer_type, params in rope.items():
        if not params:
            continue
        if params.get("rope_type", "default") != "default":
            raise UnsupportedArchitecture(f"modernbert rope_type {params['rope_type']!r}")
        if layer_type == "full_attention":
            global_theta = float(params.get("rope_theta", global_theta))
        elif layer_type == "sliding_attention":
            local_theta = float(params.get("rope_theta", local_theta))
    if raw.get("rope_scaling"):
        raise UnsupportedArchitecture(f"modernbert rope_scaling {raw['rope_scaling']!r}")
    local_attention = int(raw.get("local_attention", 128))
    if local_attention < 2 and "sliding_attention" in layer_types:
        raise ValueError(f"config.json: local_attention must be >= 2, got {local_attention}")

    pad = raw.get("pad_token_id")
    return EncoderConfig(
        model_type="modernbert",
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_layers=num_layers,
        num_heads=int(raw["num_attention_heads"]),
        intermediate_size=int(raw["intermediate_size"]),
        activation=str(raw.get("hidden_activation", "gelu")),
        norm_eps=float(raw.get("norm_eps", 1e-5)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
        type_vocab_size=0,
        pad_token_id=int(pad) if pad is not None else 0,
        global_attn_every_n_layers=every_n,
        local_attention=local_attention,
        global_rope_theta=global_theta,
        local_rope_theta=local_theta,
        layer_types=tuple(layer_types),
        norm_bias=bool(raw.get("norm_bias", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
    )


def _rope(raw: dict[str, Any], model_type: str, default_theta: float, positions: int) -> dict[str, Any]:
    """Rotary fields from transformers' rope_parameters or the legacy rope_theta / rope_scaling."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    if rope_type not in ROPE_TYPES or legacy.get("mixed_b") is not None:
        raise UnsupportedArchitecture(f"{model_type} rope scaling {params or legacy!r}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedArchitecture(f"{model_type} partial rotary factor {params['partial_rotary_factor']}")
    return dict(
        rope_theta=float(params.get("rope_theta", raw.get("rope_theta", default_theta))),
        rope_type=rope_type,
        rope_factor=float(params.get("factor", legacy.get("factor", 1.0))),
        rope_original_positions=positions,
    )


def _rotary_bert_config(raw: dict[str, Any], model_type: str) -> EncoderConfig:
    if "n_embd" in raw:  # nomic's remote-code config (GPT-2 style names)
        return _nomic_remote_config(raw)
    if raw.get("position_embedding_type", "rope") not in ("rope", "rotary"):
        raise UnsupportedArchitecture(f"{model_type} position_embedding_type {raw['position_embedding_type']!r}")
    if raw.get("logn_attention_scale") or raw.get("logn_attention_clip1"):
        raise UnsupportedArchitecture(f"{model_type} logn attention scaling")
    if raw.get("layer_norm_type", "layer_norm") != "layer_norm":
        raise UnsupportedArchitecture(f"{model_type} layer_norm_type {raw['layer_norm_type']!r}")
    if raw.get("rotary_emb_fraction", 1.0) != 1.0 or raw.get("rotary_emb_scale_base"):
        raise UnsupportedArchitecture(f"{model_type} partial or xPos rotary embeddings")
    jina, nomic = model_type == "jina-embeddings-v3", model_type == "nomic-bert"
    default_theta = {"nomic-bert": 1000.0, "gte": 160_000.0, "jina-embeddings-v3": 20_000.0}[model_type]
    if "rotary_emb_base" in raw:  # Jina's remote-code config
        default_theta = float(raw["rotary_emb_base"])
    positions = int(raw.get("max_position_embeddings", 8192))
    adapters = tuple(raw.get("lora_adaptations") or ()) if jina else ()
    pad = raw.get("pad_token_id")
    return EncoderConfig(
        model_type=model_type,
        **_sizes(raw),
        activation=str(raw.get("hidden_act", "silu" if nomic else "gelu")),
        norm_eps=float(raw.get("layer_norm_eps", 1e-5 if jina else 1e-12)),
        max_position_embeddings=positions,
        type_vocab_size=int(raw.get("type_vocab_size", 1)),
        pad_token_id=int(pad) if pad is not None else (0 if nomic else 1),
        attention_bias=not nomic,
        mlp_bias=jina,  # GTE's and nomic's gate / up projections have no bias
        mlp_out_bias=not nomic,
        mlp_gated=not jina,
        rope_interleaved=bool(raw.get("rotary_emb_interleaved", False)),
        adapters=adapters,
        lora_rank=int(raw.get("lora_rank", 4)) if adapters else 0,
        lora_alpha=float(raw.get("lora_alpha", 1.0)),
        **_rope(raw, model_type, default_theta, positions),
    )


def _nomic_remote_config(raw: dict[str, Any]) -> EncoderConfig:
    activation = raw.get("activation_function", "swiglu")
    gated = {"swiglu": "silu", "geglu": "gelu"}
    if activation not in gated or raw.get("prenorm") or raw.get("rotary_emb_fraction", 1.0) != 1.0:
        raise UnsupportedArchitecture(
            f"nomic-bert activation_function {activation!r} / prenorm / partial rotary embeddings"
        )
    if raw.get("rotary_emb_scale_base") or raw.get("qkv_proj_bias") or raw.get("mlp_fc1_bias"):
        raise UnsupportedArchitecture("nomic-bert with xPos rotary or biased q/k/v or MLP input projections")
    factor = raw.get("rotary_scaling_factor")
    hidden = int(raw["n_embd"])
    return EncoderConfig(
        model_type="nomic-bert",
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(raw["n_layer"]),
        num_heads=int(raw["n_head"]),
        intermediate_size=int(raw.get("n_inner") or 4 * hidden),
        activation=gated[activation],
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-12)),
        max_position_embeddings=int(raw.get("n_positions", 2048)),
        type_vocab_size=int(raw.get("type_vocab_size", 2)),
        pad_token_id=int(raw.get("pad_token_id") or 0),
        attention_bias=False,
        mlp_bias=False,
        mlp_out_bias=bool(raw.get("mlp_fc2_bias", False)),
        mlp_gated=True,
        rope_theta=float(raw.get("rotary_emb_base", 10_000.0)),
        rope_type="dynamic" if factor else "default",
        rope_factor=float(factor or 1.0),
        # Dynamic NTK scaling starts past the length nomic trained on, not past n_positions.
        rope_original_positions=int(raw.get("max_trained_positions", 2048)),
        rope_interleaved=bool(raw.get("rotary_emb_interleaved", False)),
    )


def _eurobert_config(raw: dict[str, Any], model_type: str) -> EncoderConfig:
    if raw.get("head_dim") not in (None, int(raw["hidden_size"]) // int(raw["num_attention_heads"])):
        raise UnsupportedArchitecture(f"eurobert head_dim {raw['head_dim']} != hidden_size / heads")
    positions = int(raw.get("max_position_embeddings", 8192))
    pad = raw.get("pad_token_id")
    mlp_bias = bool(raw.get("mlp_bias", False))
    return EncoderConfig(
        model_type="eurobert",
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=int(raw["num_attention_heads"]),
        num_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
        intermediate_size=int(raw["intermediate_size"]),
        activation=str(raw.get("hidden_act", "silu")),
        norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=positions,
        type_vocab_size=0,
        pad_token_id=int(pad) if pad is not None else 0,
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=mlp_bias,
        mlp_out_bias=mlp_bias,
        mlp_gated=True,
        **_rope(raw, "eurobert", 250_000.0, positions),
    )


@dataclass(frozen=True)
class Architecture:
    """One model type: the module of models.networks that runs it, and how its config.json
    reads (raw dict, model type -> EncoderConfig)."""

    network: str
    read: Callable[[dict[str, Any], str], EncoderConfig]


# model_type (config.json's, "_" read as "-") -> its architecture: the one table of what this
# package implements. Post-norm BERTs with rotary positions and no position table share
# models.networks.rotary_bert.
ARCHITECTURES: dict[str, Architecture] = {
    "bert": Architecture("bert", _bert_config),
    "roberta": Architecture("bert", _bert_config),
    "xlm-roberta": Architecture("bert", _bert_config),
    "modernbert": Architecture("modernbert", _modernbert_config),
    "nomic-bert": Architecture("rotary_bert", _rotary_bert_config),
    "gte": Architecture("rotary_bert", _rotary_bert_config),
    "jina-embeddings-v3": Architecture("rotary_bert", _rotary_bert_config),
    "eurobert": Architecture("eurobert", _eurobert_config),
}
