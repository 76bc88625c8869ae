"""AttentionSpec: which attention method to run and with which knobs.

One frozen dataclass, validated once on construction and passed down whole. Every knob has
a default that works for long documents; a method ignores the knobs it does not use.
Papers: clustered / improved clustered attention, Vyas et al. 2020 (arXiv:2007.04825);
SMYRF, Daras et al. 2020 (arXiv:2010.05315).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

METHODS = ("full", "clustered", "i-clustered", "smyrf", "auto")
APPROXIMATE_METHODS = ("clustered", "i-clustered", "smyrf")

# (low, high) inclusive ranges of the integer knobs; the service publishes these on /info.
KNOB_RANGES: dict[str, tuple[int, int]] = {
    "clusters": (1, 4096),
    "topk": (1, 4096),
    "bits": (1, 63),  # codes are packed into one int64 per query
    "iterations": (0, 100),
    "refine": (0, 100),
    "hash_rounds": (1, 64),
    "cluster_size": (1, 65536),
    "seed": (0, 2**63 - 1),
    "auto_threshold": (0, 1 << 20),
}

# Which knobs each method reads (DESIGN.md's method table).
METHOD_KNOBS: dict[str, tuple[str, ...]] = {
    "full": (),
    "clustered": ("clusters", "bits", "iterations", "refine", "seed"),
    "i-clustered": ("clusters", "topk", "bits", "iterations", "refine", "seed"),
    "smyrf": ("hash_rounds", "cluster_size", "seed"),
}


@dataclass(frozen=True)
class AttentionSpec:
    """An attention method and its knobs.

    method: "full" | "clustered" | "i-clustered" | "smyrf" | "auto".
    clusters: query clusters per (batch, head) for the clustered methods.
    topk: keys per cluster recomputed exactly by i-clustered (paper eq. 10).
    bits: LSH bits of the query codes used by Hamming K-means.
    iterations: Lloyd iterations in Hamming space (the paper uses 10).
    refine: Lloyd iterations on the real query vectors after the Hamming pass; 0 is the
        paper's method. 3 measured best for cost on the default model (README, fidelity).
    hash_rounds: SMYRF hashing rounds merged by softmax mass (paper eq. 15).
    cluster_size: SMYRF queries per balanced cluster.
    seed: seeds the random planes, projections and initial centroids: same seed, same output.
    auto_threshold: "auto" runs "full" for sequences shorter than this many tokens ...
    auto_method: ... and this approximate method from that length on.
    """

    method: str = "i-clustered"
    clusters: int = 100
    topk: int = 32
    bits: int = 63
    iterations: int = 10
    refine: int = 3
    hash_rounds: int = 4
    cluster_size: int = 64
    seed: int = 0
    auto_threshold: int = 1024
    auto_method: str = "i-clustered"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method: must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.auto_method not in APPROXIMATE_METHODS:
            raise ValueError(
                f"auto_method: must be one of {', '.join(APPROXIMATE_METHODS)}, got {self.auto_method!r}"
            )
        for name, (low, high) in KNOB_RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: must be an integer, got {value!r}")
            if not low <= value <= high:
                raise ValueError(f"{name}: must be in [{low}, {high}], got {value}")

    def resolve(self, seq_len: int) -> AttentionSpec:
        """The concrete spec for a sequence of `seq_len` tokens ("auto" picks a method)."""
        if self.method != "auto":
            return self
        method = "full" if seq_len < self.auto_threshold else self.auto_method
        return dataclasses.replace(self, method=method)

    def used_knobs(self) -> dict[str, Any]:
        """The method and only the knobs it reads, e.g. for echoing back to a client."""
        names = METHOD_KNOBS.get(self.method, tuple(KNOB_RANGES) + ("auto_method",))
        return {"method": self.method, **{name: getattr(self, name) for name in names}}

    def to_json(self) -> str:
        """Compact JSON of `used_knobs()` (the service's `x-attention` header)."""
        return json.dumps(self.used_knobs(), separators=(",", ":"))
