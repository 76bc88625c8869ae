"""Chunking defaults measured per model: whether `chunking` runs late chunking when a request
does not say, and late chunking's context window.

A model not listed keeps the general defaults: late chunking, in windows of the positions the
checkpoint was trained on. A listed one has what bench.quality.late_chunking measured on its
development set of man pages (docs/benchmarks.md#late-chunking-on-the-served-model), with the
reason, which GET /info states.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkDefaults:
    """late: chunking's default `late`; window: late chunking's default window in tokens (None:
    the checkpoint's trained positions); finding: why, in a sentence ("" for the general ones)."""

    late: bool = True
    window: int | None = None
    finding: str = ""


GENERAL = ChunkDefaults()

MEASURED = {
    "nomic-embed-text-v1.5": ChunkDefaults(
        late=False,
        window=512,
        finding=(
            "late chunks retrieve worse than naive chunks of the same size on this model, and worse the longer "
            "the window (256-token chunks on man pages of 4k-8k tokens: recall@1 0.92 in windows of 512 tokens, "
            "0.62 in windows of 8,192, naive 0.97): chunks are embedded alone unless a request sets late, and "
            "late chunking runs windows of 512 tokens"
        ),
    ),
}


def chunk_defaults(model: str) -> ChunkDefaults:
    """The chunking defaults of the model named `model` (a checkpoint's name)."""
    return MEASURED.get(model, GENERAL)
