"""The names a served model answers to: its own (Encoder.name), Ollama's library name and the
short names `--model` takes (models.loader.MODEL_ALIASES: nomic, minilm), each with or without
Ollama's default tag, in any case (Ollama's names are case-insensitive)."""

from __future__ import annotations

from clusterserve.models.loader import MODEL_ALIASES

# Ollama's library name for a model this server can serve (Encoder.name -> Ollama's name).
OLLAMA_NAMES = {"nomic-embed-text-v1.5": "nomic-embed-text", "all-MiniLM-L6-v2": "all-minilm"}
DEFAULT_TAG = ":latest"


def served_names(served: str) -> list[str]:
    """The names the served model answers to, as /api/tags lists them: Ollama's first, then its
    own, each with Ollama's default tag."""
    names = [OLLAMA_NAMES[served], served] if served in OLLAMA_NAMES else [served]
    return [name + DEFAULT_TAG for name in names]


def answers_to(served: str, asked: str) -> bool:
    """Whether a request for model `asked` is for the model named `served`."""
    name = asked.strip().lower().removesuffix(DEFAULT_TAG)
    if MODEL_ALIASES.get(name) == served:
        return True
    return name in {served.lower(), OLLAMA_NAMES.get(served, served).lower()}
