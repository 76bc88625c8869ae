"""`Network`: what the loader needs of one encoder network, beside its config."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Network:
    """The module the loader builds from an EncoderConfig, and how HuggingFace checkpoints
    name its parameters.

    anchor: the word embedding's checkpoint name, by which the loader finds the checkpoint's
    prefix ("bert.", "model.", or none). names: (checkpoint name pattern, our name), the first
    match wins; a name no pattern matches is kept as it is. ignored: checkpoint names we do not
    load (old buffers, the NSP pooler). fused: a fused projection's name -> its parts' names,
    in the order they are stacked along the output dimension (split by the loader).
    """

    model: type[nn.Module]
    anchor: str
    names: tuple[tuple[str, str], ...] = ()
    ignored: tuple[str, ...] = ()
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
