"""Pooling token states into one vector per input, as sentence-transformers configures it.

`read_pooling(folder)` reads `modules.json` and the Pooling module's `config.json` (both the
legacy `pooling_mode_*_tokens` flags and the newer `pooling_mode` string); a folder without
them gets mean pooling and no normalisation. `pool` reduces a packed batch's (T, C) token
states to one (B, C) row per sequence.
`include_prompt: false` (pool without the prompt's tokens) is read so that the encoder can
refuse a prompt it would pool differently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from clusterserve.kernels import FieldError
from clusterserve.models.batch.packing import Packed
from clusterserve.models.config import UnsupportedArchitecture

POOLING_MODES = ("mean", "cls", "lasttoken", "max")
_LEGACY_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# sentence-transformers modules that need no weights of their own here.
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "mean"  # one of POOLING_MODES
    normalize: bool = False  # the checkpoint ends in a Normalize module
    include_prompt: bool = True  # the prompt's tokens are pooled with the text's

    def check_prompt(self, prompt: str) -> None:
        """FieldError naming prompt_name when a prompt is given and this pooling would leave its
        tokens out, which is not implemented."""
        if prompt and not self.include_prompt:
            raise FieldError(
                "prompt_name",
                "this checkpoint pools without its prompt's tokens (include_prompt: false), "
                "which is not implemented; embed without a prompt",
            )


@dataclass(frozen=True)
class Output:
    """What one sequence of a forward pass returns: a (k, C) float32 tensor whose rows are

    kind "pooled": the checkpoint's pooling over the whole sequence, k = 1;
    kind "spans":  the mean of the token states over each [start, stop) of `spans` (token
                   indices of the sequence, special tokens included), k = len(spans);
    kind "tokens": every token's state, k = the sequence's length.
    """

    kind: str = "pooled"
    spans: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in OUTPUT_KINDS:
            raise ValueError(f"kind: must be one of {', '.join(OUTPUT_KINDS)}, got {self.kind!r}")
        if (self.kind == "spans") != bool(self.spans):
            raise ValueError('spans: kind "spans" needs at least one span, and the other kinds none')
        if any(not 0 <= start < stop for start, stop in self.spans):
            raise ValueError(f"spans: each must be (start, stop) with 0 <= start < stop, got {self.spans}")

    def rows(self, tokens: int) -> int:
        """k, for a sequence of `tokens` tokens."""
        return 1 if self.kind == "pooled" else len(self.spans) if self.kind == "spans" else tokens


OUTPUT_KINDS = ("pooled", "spans", "tokens")
POOLED = Output()
EVERY_TOKEN = Output("tokens")


def read_pooling(folder: Path) -> PoolingConfig:
    """The pooling of a sentence-transformers folder; mean and no Normalize without modules.json."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig()
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    mode, normalize, include_prompt = "mean", False, True
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _KNOWN_MODULES:
            raise UnsupportedArchitecture(f"sentence-transformers module {module.get('type')!r}")
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            config_file = folder / module.get("path", "") / "config.json"
            if config_file.is_file():
                pooling = json.loads(config_file.read_text(encoding="utf-8"))
                mode, include_prompt = _pooling_mode(pooling), bool(pooling.get("include_prompt", True))
    return PoolingConfig(mode=mode, normalize=normalize, include_prompt=include_prompt)


def _pooling_mode(config: dict) -> str:
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for flag, mode in _LEGACY_FLAGS.items() if config.get(flag)] or ["mean"]
    if isinstance(modes, str):
        modes = [modes]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise UnsupportedArchitecture(f"pooling mode {modes!r}; supported: {', '.join(POOLING_MODES)}")
    return modes[0]


def pool(hidden: Tensor, packed: Packed, mode: str) -> Tensor:
    """hidden: (T, C) token states of a packed batch -> (B, C) float32, one row per sequence
    in the caller's order (`Packed.unsort`), over its real tokens only."""
    if mode not in POOLING_MODES:
        raise ValueError(f"pooling mode: must be one of {', '.join(POOLING_MODES)}, got {mode!r}")
    hidden = hidden.float()
    parts = packed.parts(hidden)
    pooled = torch.cat([pool_one(part, mode) for part in parts])
    if len(parts) == 1:
        return pooled
    result = torch.empty_like(pooled)
    result[torch.tensor(packed.order, device=hidden.device)] = pooled
    return result


def pool_each(hidden: Tensor, packed: Packed, mode: str, outputs: Sequence[Output]) -> list[Tensor]:
    """hidden: (T, C) token states of a packed batch -> per sequence, in the caller's order,
    the (k_i, C) float32 rows its output asks for (`Output`; outputs[i] for sequence i)."""
    if len(outputs) != len(packed.lengths):
        raise ValueError(f"outputs: need one per sequence, got {len(outputs)} for {len(packed.lengths)}")
    if mode not in POOLING_MODES:
        raise ValueError(f"pooling mode: must be one of {', '.join(POOLING_MODES)}, got {mode!r}")
    if all(output.kind == "pooled" for output in outputs):
        return list(pool(hidden, packed, mode).split(1))
    result = []
    for part, output in zip(packed.split(hidden.float()), outputs):
        if output.kind == "tokens":
            result.append(part.clone())  # not a view that keeps the whole batch's states alive
        elif output.kind == "spans":
            if max(stop for _, stop in output.spans) > part.shape[0]:
                raise ValueError(f"spans: beyond the sequence's {part.shape[0]} tokens: {output.spans}")
            result.append(torch.stack([part[start:stop].mean(dim=0) for start, stop in output.spans]))
        else:
            result.append(pool_one(part, mode))
    return result


def pool_one(part: Tensor, mode: str) -> Tensor:
    """(n, C) states of one sequence -> (1, C), by the checkpoint's pooling."""
    if mode == "cls":
        return part[:1]
    if mode == "lasttoken":
        return part[-1:]
    if mode == "max":
        return part.amax(dim=0, keepdim=True)
    return part.mean(dim=0, keepdim=True)
