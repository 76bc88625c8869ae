"""GGUF checkpoints (llama.cpp's file format): config, weights, tokenizer, pooling and prompts
read from one file, for the encoder architectures llama.cpp names "bert" and "nomic-bert".

A GGUF file carries what a HuggingFace folder spreads over config.json, *.safetensors,
tokenizer.json and the sentence-transformers files. `read_gguf` turns it into those same
pieces: a config dict in the names `EncoderConfig.from_dict` reads, a state dict in our
networks' parameter names (llama.cpp names a tensor the same in every architecture, so one
table, `TENSOR_NAMES`, maps them all), a WordPiece tokenizer built from the file's own
vocabulary and special-token ids, and the pooling the file declares, with normalisation (what
llama.cpp and Ollama return). `ARCHITECTURES` is the one table of what differs per
architecture; nothing else branches on it.

Weights in F32, F16 or BF16 load as they are stored; a quantised tensor is refused with an
error that names its type (dequantising would change the model this server claims to serve).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from clusterserve.models.config import UnsupportedArchitecture
from clusterserve.models.pooling import PoolingConfig
from clusterserve.models.prompts import Prompts

# llama.cpp's LLAMA_POOLING_TYPE values -> models.pooling modes (0 = none and 4 = rank are
# not embedding poolings).
POOLING_TYPES = {1: "mean", 2: "cls", 3: "lasttoken"}
# GGML tensor types that load without dequantising, by GGMLQuantizationType value.
_FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
# The published prompts of nomic-embed-text (v1 and v1.5), under the names sentence-transformers
# gives them (SentenceTransformer.encode_query / encode_document pick "query" / "document").
NOMIC_PROMPTS = {
    "query": "search_query: ",
    "document": "search_document: ",
    "clustering": "clustering: ",
    "classification": "classification: ",
}


@dataclass(frozen=True)
class GgufArchitecture:
    """What one GGUF architecture needs to become a checkpoint this project loads.

    model_type: EncoderConfig's model type. config: GGUF metadata key (after "<arch>.") ->
    config.json key. fixed: config.json keys the file does not carry. prompts,
    default_prompt: the model family's published prompts.
    """

    model_type: str
    config: dict[str, str]
    fixed: dict[str, Any]
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None
    published_context_factor: int = 1  # positions published beyond the trained context_length


_SIZES = {
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "feed_forward_length": "intermediate_size",
    "attention.layer_norm_epsilon": "layer_norm_eps",
    "context_length": "max_position_embeddings",
}
# GGUF tensor name (before ".weight" / ".bias"; "blk.<i>." for layer i) -> our parameter name
# (models.networks.bert, models.networks.rotary_bert). A fused attn_qkv is split by the loader;
# an MLP without ffn_gate is not gated, and its ffn_up is our mlp_in.
TENSOR_NAMES = {
    "token_embd": "embeddings.word",
    "position_embd": "embeddings.position",
    "token_types": "embeddings.token_type",
    "token_embd_norm": "embeddings.norm",
    "attn_q": "attn.q",
    "attn_k": "attn.k",
    "attn_v": "attn.v",
    "attn_qkv": "attn.qkv",
    "attn_output": "attn.out",
    "attn_output_norm": "attn_norm",
    "ffn_up": "mlp_up",
    "ffn_gate": "mlp_gate",
    "ffn_down": "mlp_out",
    "layer_output_norm": "mlp_norm",
}
_TENSOR = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)$")

ARCHITECTURES: dict[str, GgufArchitecture] = {
    "bert": GgufArchitecture(
        model_type="bert",
        config=_SIZES,
        fixed={"hidden_act": "gelu"},
    ),
    # nomic-embed-text is trained on 2,048 positions (the file's context_length) and published
    # for 8,192 with dynamic NTK scaling of factor 2 past the trained length (its model card's
    # rotary_scaling_factor=2), which the file does not record: the config says so here.
    "nomic-bert": GgufArchitecture(
        model_type="nomic_bert",
        config={
            "embedding_length": "n_embd",
            "block_count": "n_layer",
            "attention.head_count": "n_head",
            "feed_forward_length": "n_inner",
            "attention.layer_norm_epsilon": "layer_norm_epsilon",
            "context_length": "max_trained_positions",
            "rope.freq_base": "rotary_emb_base",
        },
        fixed={"activation_function": "swiglu", "rotary_scaling_factor": 2.0},
        prompts=NOMIC_PROMPTS,
        default_prompt="document",
        published_context_factor=4,
    ),
}


@dataclass(frozen=True)
class GgufCheckpoint:
    """A GGUF file read into the pieces of a checkpoint folder."""

    name: str
    config: dict[str, Any]  # config.json's keys, for EncoderConfig.from_dict
    state: dict[str, Tensor]  # checkpoint names -> tensors, as stored (F32, F16 or BF16)
    tokenizer: Any  # tokenizers.Tokenizer
    pooling: PoolingConfig
    prompts: Prompts


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def read_gguf(path: str | Path) -> GgufCheckpoint:
    """Read a GGUF encoder checkpoint. Raises UnsupportedArchitecture for an architecture,
    tokenizer or pooling not in `ARCHITECTURES`, ValueError for a quantised tensor or a file
    that is not GGUF."""
    from gguf import GGUFReader  # imported here: only GGUF checkpoints need it

    path = Path(path)
    if not is_gguf(path):
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    reader = GGUFReader(path)
    meta = {key: _value(f) for key, f in reader.fields.items() if not key.startswith("tokenizer.ggml.token")}
    arch_name = str(meta.get("general.architecture", ""))
    arch = ARCHITECTURES.get(arch_name)
    if arch is None:
        raise UnsupportedArchitecture(f"GGUF architecture {arch_name!r} (GGUF supports: {', '.join(ARCHITECTURES)})")
    vocabulary = _strings(reader.fields["tokenizer.ggml.tokens"])
    state = _state(reader, arch)
    types = state.get("embeddings.token_type.weight")
    config = _config(arch_name, arch, meta, len(vocabulary), 0 if types is None else types.shape[0])
    return GgufCheckpoint(
        name=str(meta.get("general.name") or path.stem),
        config=config,
        state=state,
        tokenizer=_tokenizer(meta, vocabulary),
        pooling=_pooling(meta, arch_name),
        prompts=Prompts(dict(arch.prompts), arch.default_prompt),
    )


def _value(f) -> Any:
    """A metadata field's value: a scalar, a string, or a list of either."""
    try:
        return f.contents()
    except (AttributeError, ValueError, IndexError):
        return None


def _strings(f) -> list[str]:
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def _config(
    arch_name: str, arch: GgufArchitecture, meta: dict[str, Any], vocab_size: int, token_types: int
) -> dict[str, Any]:
    config: dict[str, Any] = {"model_type": arch.model_type, "vocab_size": vocab_size, **arch.fixed}
    for key, name in arch.config.items():
        value = meta.get(f"{arch_name}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata: {arch_name}.{key} is missing; the file does not describe its model")
        config[name] = value
    if meta.get(f"{arch_name}.attention.causal"):
        raise UnsupportedArchitecture(f"{arch_name} with causal attention (an encoder attends both ways)")
    config["type_vocab_size"] = token_types  # the table's rows (nomic's file says 1 type and stores 2)
    config["pad_token_id"] = int(meta.get("tokenizer.ggml.padding_token_id") or 0)
    if arch.published_context_factor > 1:  # positions published beyond the trained ones (dynamic NTK)
        config["n_positions"] = int(config["max_trained_positions"]) * arch.published_context_factor
    return config


def _state(reader, arch: GgufArchitecture) -> dict[str, Tensor]:
    """The file's tensors under our parameter names (`TENSOR_NAMES`), as stored."""
    state = {}
    for tensor in reader.tensors:
        dtype = _FLOAT_TYPES.get(int(tensor.tensor_type))
        if dtype is None:
            raise ValueError(
                f"GGUF tensor {tensor.name} is {tensor.tensor_type.name}, a quantised type; load an F32, "
                "F16 or BF16 file (quantised weights are not served)"
            )
        match = _TENSOR.match(tensor.name)
        if match is None or match[2] not in TENSOR_NAMES:
            raise ValueError(f"GGUF tensor {tensor.name} has no place in a {arch.model_type} model")
        layer, name, kind = match.groups()
        name = f"{TENSOR_NAMES[name]}.{kind}" if layer is None else f"layers.{layer}.{TENSOR_NAMES[name]}.{kind}"
        # GGUF lists dimensions innermost first; numpy's array is already (outer, ..., inner).
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        data = np.ascontiguousarray(tensor.data)
        if dtype == torch.bfloat16:
            values = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
        else:
            values = torch.from_numpy(data.copy())
        state[name] = values.reshape(shape)
    if not any(".mlp_gate." in name for name in state):  # not gated: the one input projection
        state = {name.replace(".mlp_up.", ".mlp_in."): values for name, values in state.items()}
    return state


def _tokenizer(meta: dict[str, Any], vocabulary: list[str]):
    """A WordPiece tokenizer from the file's vocabulary, as BERT's uncased one: llama.cpp's
    GGUF writes a word-initial piece with a leading U+2581 and a continuation without "##"."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    model_name = meta.get("tokenizer.ggml.model")
    if model_name != "bert":
        raise UnsupportedArchitecture(f"GGUF tokenizer {model_name!r} (supported: bert's WordPiece)")

    def piece(token: str) -> str:
        if token.startswith("[") and token.endswith("]"):
            return token
        return token[1:] if token.startswith("\u2581") else "##" + token

    vocab = {}
    for index, token in enumerate(vocabulary):
        vocab.setdefault(piece(token), index)

    def special(key: str, fallback: str | None = None) -> tuple[str, int]:
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is None and fallback is not None:
            value = meta.get(f"tokenizer.ggml.{fallback}")
        if value is None:
            raise ValueError(f"GGUF metadata: tokenizer.ggml.{key} is missing")
        return vocabulary[int(value)], int(value)

    cls, sep = special("cls_token_id", "bos_token_id"), special("seperator_token_id", "eos_token_id")
    unk = special("unknown_token_id")
    tokenizer = Tokenizer(WordPiece(vocab, unk_token=unk[0], max_input_chars_per_word=100))
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls[0]} $A {sep[0]}", pair=f"{cls[0]} $A {sep[0]} $B:1 {sep[0]}:1", special_tokens=[cls, sep]
    )
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def _pooling(meta: dict[str, Any], arch_name: str) -> PoolingConfig:
    value = meta.get(f"{arch_name}.pooling_type")
    mode = POOLING_TYPES.get(int(value) if value is not None else 1)
    if mode is None:
        raise UnsupportedArchitecture(f"GGUF pooling_type {value} (supported: 1 mean, 2 cls, 3 last token)")
    return PoolingConfig(mode=mode, normalize=True)
