"""EncoderConfig: the architecture of a checkpoint, parsed from a HuggingFace config.json.

One dataclass covers the BERT family (BERT, RoBERTa, XLM-RoBERTa) and ModernBERT; fields a
family does not use keep their defaults. Anything we cannot reproduce exactly raises
`UnsupportedArchitecture` naming it, rather than loading into a subtly wrong model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.nn.functional as F
from torch import Tensor

BERT_FAMILY = ("bert", "roberta", "xlm-roberta")
SUPPORTED_MODEL_TYPES = BERT_FAMILY + ("modernbert",)

# HF activation names -> functions. "gelu" is the exact erf GELU; the tanh variants agree
# with HF's "gelu_new" to ~1e-7.
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


class UnsupportedArchitecture(ValueError):
    """The checkpoint's architecture (model_type or a feature of it) is not implemented here."""

    def __init__(self, what: str):
        super().__init__(
            f"unsupported architecture: {what}; supported model types are "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
        self.what = what


@dataclass(frozen=True)
class EncoderConfig:
    """Architecture of an encoder checkpoint (names follow HF's config.json where they can)."""

    model_type: str  # one of SUPPORTED_MODEL_TYPES
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
    mlp_bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def native_positions(self) -> int:
        """Tokens the checkpoint was trained to take (for RoPE models: max_position_embeddings)."""
        return self.max_position_embeddings - self.position_offset

    @property
    def uses_rope(self) -> bool:
        return self.model_type == "modernbert"

    def is_global_layer(self, index: int) -> bool:
        """True when layer `index` attends over the whole sequence (always for the BERT family)."""
        if not self.layer_types:
            return True
        return self.layer_types[index] == "full_attention"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> EncoderConfig:
        """Parse a HuggingFace config.json dict; raises UnsupportedArchitecture."""
        model_type = str(raw.get("model_type", "")).replace("_", "-")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitecture(f"model_type {raw.get('model_type')!r}")
        if model_type == "modernbert":
            config = _modernbert_config(raw)
        else:
            config = _bert_config(raw, model_type)
        if config.activation not in ACTIVATIONS:
            raise UnsupportedArchitecture(f"activation {config.activation!r} in {model_type}")
        if config.hidden_size % config.num_heads:
            raise ValueError(
                f"config.json: hidden_size {config.hidden_size} is not a multiple of "
                f"num_attention_heads {config.num_heads}; the checkpoint's config is inconsistent"
            )
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> EncoderConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def _bert_config(raw: dict[str, Any], model_type: str) -> EncoderConfig:
    position_type = raw.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise UnsupportedArchitecture(f"position_embedding_type {position_type!r} in {model_type}")
    if raw.get("is_decoder") or raw.get("add_cross_attention"):
        raise UnsupportedArchitecture(f"{model_type} decoder (is_decoder / add_cross_attention)")
    pad = int(raw.get("pad_token_id") if raw.get("pad_token_id") is not None else 0)
    return EncoderConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=int(raw["num_attention_heads"]),
        intermediate_size=int(raw["intermediate_size"]),
        activation=str(raw.get("hidden_act", "gelu")),
        norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 512)),
        type_vocab_size=int(raw.get("type_vocab_size", 2)),
        pad_token_id=pad,
        position_offset=0 if model_type == "bert" else pad + 1,
    )


def _modernbert_config(raw: dict[str, Any]) -> EncoderConfig:
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
