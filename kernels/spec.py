"""AttentionSpec: which attention method to run and with which knobs.

One frozen dataclass, validated once on construction and passed down whole. Every knob has
a default that works for long documents; a method ignores the knobs it does not use.
Papers: clustered / improved clustered attention, Vyas et al. 2020 (arXiv:2007.04825);
SMYRF, Daras et al. 2020 (arXiv:2010.05315).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


class FieldError(ValueError):
    """A bad value of one named field: `field` (a knob, an argument), `detail` (what is wrong),
    and `within`, the object the field belongs to ("attention", "chunking"; None: an argument).
    str() is "field: detail". The service answers it as a 422 naming the field where the
    request holds it (`within.field`); no caller parses the message."""

    def __init__(self, field: str, detail: str, within: str | None = None):
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail
        self.within = within


METHODS = ("full", "clustered", "i-clustered", "smyrf", "banded", "auto")
ATTENTION = "attention"  # FieldError.within for an AttentionSpec knob
APPROXIMATE_METHODS = ("clustered", "i-clustered", "smyrf", "banded")

# (low, high) inclusive ranges of the integer knobs; the service publishes these on /info.
KNOB_RANGES: dict[str, tuple[int, int]] = {
    "clusters": (1, 4096),
    "topk": (1, 4096),
    "bits": (0, 63),  # codes are packed into one int64 per query; 0: no codes
    "iterations": (0, 100),
    "refine": (0, 100),
    "hash_rounds": (1, 64),
    "cluster_size": (1, 65536),
    "band": (0, 4096),
    "block": (1, 4096),
    "sinks": (0, 64),
    "far_blocks": (0, 1024),
    "seed": (0, 2**53 - 1),  # the integers a JSON number carries exactly
    "auto_threshold": (0, 1 << 20),
}

# The knobs whose default depends on how the clusters start (`start_defaults`).
START_KNOBS = ("bits", "refine")


def start_defaults(method: str, iterations: int, bits: int | None = None) -> tuple[int, int]:
    """The defaults of `bits` and `refine` for a method, its Hamming `iterations` and, when
    given, its `bits`: i-clustered starts from the seed queries without LSH codes (bits 0)
    unless Hamming iterations ask for codes; clustered, whose top-k-free output loses 0.005 of
    cosine that way on the default model, starts from codes (bits 63). Two refinement steps
    follow the seeds and three a Hamming pass: the fewest that keep the defaults' fidelity on
    nomic-embed-text-v1.5 at 2k-8k tokens (bench/results/seeding-nomic-embed-text-v1.5.json)."""
    if bits is None:
        bits = 0 if method == "i-clustered" and not iterations else 63
    return bits, 2 if bits == 0 else 3


# Which knobs each method reads (DESIGN.md's method table).
METHOD_KNOBS: dict[str, tuple[str, ...]] = {
    "full": (),
    "clustered": ("clusters", "bits", "iterations", "refine", "seed"),
    "i-clustered": ("clusters", "topk", "bits", "iterations", "refine", "seed"),
    "smyrf": ("hash_rounds", "cluster_size", "seed"),
    "banded": ("band", "block", "sinks", "far_blocks"),
}


# Knobs a calibrated choice sets: a request that names target_fidelity leaves them out.
CALIBRATED_KNOBS = (
    "clusters", "topk", "bits", "iterations", "refine", "hash_rounds", "cluster_size", "band", "block", "sinks",
    "far_blocks",
)


# The attention object's cross-field rules, each a function of its fields (given or resolved)
# that returns the FieldError a breaking object gets, else None. A missing field may be
# whatever its default turns out to be, so a rule says "broken" only when it is for any.
# models.planning.rules lists them with the chunking rules; the service's OpenAPI document
# and the fuzz hooks read that list.
def iterations_without_codes(values: Mapping[str, Any]) -> FieldError | None:
    """Hamming iterations need LSH codes: with bits 0 (no codes), iterations must be 0 where
    the method that runs reads them (an absent method, or "auto" without its auto_method, may)."""
    bits, iterations = _integer(values.get("bits")), _integer(values.get("iterations"))
    if bits != 0 or iterations is None or iterations <= 0:
        return None
    method = values.get("method")
    if method == "auto" or method is None:
        method = values.get("auto_method")
    if method is not None and "bits" not in METHOD_KNOBS.get(method, ("bits",)):
        return None
    detail = f"Hamming iterations need LSH codes: with bits 0 (no codes) it must be 0, got {iterations}"
    return FieldError("iterations", detail, ATTENTION)


def target_without_auto(values: Mapping[str, Any]) -> FieldError | None:
    """target_fidelity applies to method "auto" only (an absent method runs "auto")."""
    method = values.get("method")
    if values.get("target_fidelity") is None or method is None or method == "auto":
        return None
    detail = f'applies to method "auto" only, got method {method!r}; set method to "auto" or leave it out'
    return FieldError("target_fidelity", detail, ATTENTION)


def knobs_beside_target(values: Mapping[str, Any]) -> FieldError | None:
    """With target_fidelity (and method "auto" or absent) the calibration table chooses every
    knob but seed: the object names none of CALIBRATED_KNOBS."""
    if values.get("target_fidelity") is None or values.get("method") not in (None, "auto"):
        return None
    named = [name for name in CALIBRATED_KNOBS if values.get(name) is not None]
    if not named:
        return None
    detail = ("is chosen by target_fidelity from the calibration table; leave it out, "
              "or drop target_fidelity to choose the knobs yourself")
    return FieldError(named[0], detail, ATTENTION)


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class AttentionSpec:
    """An attention method and its knobs.

    method: "full" | "clustered" | "i-clustered" | "smyrf" | "banded" | "auto".
    clusters: query clusters per (batch, head) for the clustered methods.
    topk: keys per cluster recomputed exactly by i-clustered (paper eq. 10).
    bits: LSH bits of the query codes used by Hamming K-means; 0 = no codes: each query starts
        in the cluster of its nearest seed query (the same evenly spaced seeds) in Euclidean
        space, then the refinement below (`iterations` must be 0). None (unset): the method's
        default (`start_defaults`): 0 for i-clustered without Hamming iterations, else 63.
    iterations: Lloyd iterations in Hamming space after each query joins its nearest initial
        centroid (the paper uses 10). 0 by default: after the refinement below, five measured no
        better on nomic-embed-text-v1.5 at 2k-8k tokens and are ~20% of a GPU call (docs/methods.md).
    refine: Lloyd iterations on the real query vectors after the Hamming pass or the seeds;
        0 is the paper's method. None (unset): 2 from the seeds, 3 after a Hamming pass, the
        fewest that keep the defaults' fidelity on the default model (docs/methods.md).
    hash_rounds: SMYRF hashing rounds merged by softmax mass (paper eq. 15).
    cluster_size: SMYRF queries per balanced cluster.
    band: banded: neighbouring blocks on each side of a query's block attended exactly.
    block: banded: tokens per block; every block outside the band is one pooled key.
    sinks: banded: the first `sinks` tokens and the last token are attended exactly by every
        query ([CLS], the prompt's tokens, [SEP]); 0 = none.
    far_blocks: banded: blocks outside the band that each query block attends exactly instead
        of pooled, those whose pooled key scores highest for some query of the block; 0 = none.
        8 (with band 4) keeps 0.99 of exact attention at 4k on nomic-embed-text-v1.5, where
        pooling alone keeps 0.95 (docs/methods.md).
    seed: seeds the random planes, projections and initial centroids: same seed, same output.
    auto_threshold: "auto" runs "full" for sequences shorter than this many tokens ...
    auto_method: ... and this approximate method from that length on (`resolve_auto`).
    """

    method: str = "i-clustered"
    clusters: int = 100
    topk: int = 32
    bits: int | None = None  # type: ignore[assignment]  # an int once constructed
    iterations: int = 0
    refine: int | None = None  # type: ignore[assignment]
    hash_rounds: int = 4
    cluster_size: int = 64
    band: int = 4
    block: int = 64
    sinks: int = 8
    far_blocks: int = 8
    seed: int = 0
    auto_threshold: int = 1024
    auto_method: str = "i-clustered"
    # The knobs that were unset and took their method's default, which `with_knobs` lets
    # follow a new method (not compared: two specs that run the same are equal).
    defaulted: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        unset = frozenset(name for name in START_KNOBS if getattr(self, name) is None)
        if unset:
            method = self.auto_method if self.method == "auto" else self.method
            bits, refine = start_defaults(method, self.iterations, self.bits)  # a given bits comes back as is
            object.__setattr__(self, "bits", bits)
            if self.refine is None:
                object.__setattr__(self, "refine", refine)
        object.__setattr__(self, "defaulted", unset)
        if self.method not in METHODS:
            raise FieldError("method", f"must be one of {', '.join(METHODS)}, got {self.method!r}", ATTENTION)
        if self.auto_method not in APPROXIMATE_METHODS:
            raise FieldError(
                "auto_method", f"must be one of {', '.join(APPROXIMATE_METHODS)}, got {self.auto_method!r}", ATTENTION
            )
        for name, (low, high) in KNOB_RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise FieldError(name, f"must be an integer, got {value!r}", ATTENTION)
            if not low <= value <= high:
                raise FieldError(name, f"must be in [{low}, {high}], got {value}", ATTENTION)
        error = iterations_without_codes(self.as_dict())
        if error is not None:
            raise error

    def as_dict(self) -> dict[str, Any]:
        """The method and every knob, resolved (a report's record of what ran)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def with_knobs(self, **knobs: Any) -> AttentionSpec:
        """A copy with these knobs (and method) changed, validated anew. A knob this spec left
        to its method's default (`bits`, `refine`) takes the new method's default unless it is
        named; dataclasses.replace would keep the old method's value."""
        return AttentionSpec(**{**self.as_dict(), **dict.fromkeys(self.defaulted), **knobs})

    def used_knobs(self) -> dict[str, Any]:
        """The method and only the knobs it reads, e.g. for echoing back to a client."""
        names = METHOD_KNOBS.get(self.method, tuple(KNOB_RANGES) + ("auto_method",))
        return {"method": self.method, **{name: getattr(self, name) for name in names}}

    def to_json(self) -> str:
        """Compact JSON of `used_knobs()` (the service's `x-attention` header)."""
        return json.dumps(self.used_knobs(), separators=(",", ":"))


@dataclass(frozen=True)
class Resolved:
    """How one input runs: its concrete spec (never "auto") and what a response echoes of it."""

    spec: AttentionSpec
    echo: dict[str, Any]


class AutoTable(Protocol):
    """What `resolve_auto` needs of a calibration table (models.planning.calibration.Calibration is one):
    `choose` returns an object with the chosen `spec` and an `echo(target)` dict; `chunks`
    asks for a choice judged by the fidelity of late chunks rather than of a whole input."""

    def choose(self, tokens: int, target: float, seed: int = 0, chunks: bool = False) -> Any: ...


def exact_by_knobs(spec: AttentionSpec, tokens: int) -> bool:
    """Whether a concrete approximate spec computes exact self-attention over `tokens` tokens:
    clusters >= tokens (every query its own cluster), top-k >= tokens (i-clustered recomputes
    every key), one SMYRF cluster (cluster_size >= tokens), or a band of blocks that covers
    the sequence with the far blocks attended exactly (banded: band + far_blocks >= blocks - 1)."""
    if spec.method == "banded":
        return spec.band + spec.far_blocks >= -(-tokens // spec.block) - 1
    if spec.method in ("clustered", "i-clustered") and spec.clusters >= tokens:
        return True
    if spec.method == "i-clustered" and spec.topk >= tokens:
        return True
    return spec.method == "smyrf" and spec.cluster_size >= tokens


def resolve_auto(
    spec: AttentionSpec, tokens: int, table: AutoTable | None = None, target: float | None = None, chunks: bool = False
) -> Resolved:
    """The one place "auto" is decided, for an input of `tokens` tokens: what `choose_auto`
    chooses, except that an approximate spec that is exact by its knobs at this length
    (`exact_by_knobs`) runs exact attention directly, the cheaper way to the same result, and
    the echo says so (`"method": "full"`, `"exact_by_knobs"`: what was asked).
    `kernels.attention` decides "auto" here too, with no table, per batch row; a concrete
    method it runs as given, so that the methods' exact cases stay testable through it."""
    return _exact_if_exact(choose_auto(spec, tokens, table, target, chunks), tokens)


def choose_auto(
    spec: AttentionSpec,
    tokens: int,
    table: AutoTable | None = None,
    target: float | None = None,
    chunks: bool = False,
) -> Resolved:
    """What "auto" chooses for an input of `tokens` tokens (before `resolve_auto`'s shortcut
    to exact attention).

    A concrete method stays as it is. "auto" with a `target` fidelity and a `table` runs what
    the table chooses (the fastest configuration measured to meet the target at that length);
    otherwise "full" below `spec.auto_threshold` tokens and `spec.auto_method` from there on.
    A target without a table falls back to the threshold, and the echo says so
    (`"calibrated_fidelity": null`). chunks: the input is a late-chunking window, and the
    table judges its choice by the chunk vectors (`AutoTable.choose`).
    """
    if spec.method != "auto":
        error = target_without_auto({"method": spec.method, "target_fidelity": target})
        if error is not None:
            raise error
        return Resolved(spec, spec.used_knobs())
    if target is not None and table is not None:
        choice = table.choose(tokens, target, seed=spec.seed, chunks=chunks)
        return Resolved(choice.spec, choice.echo(target))
    # "auto" resolved bits and refine for auto_method already: a plain copy keeps them
    concrete = dataclasses.replace(spec, method="full" if tokens < spec.auto_threshold else spec.auto_method)
    echo = concrete.used_knobs()
    if target is not None:
        echo = {**echo, "target_fidelity": target, "calibrated_fidelity": None}
    return Resolved(concrete, echo)


def _exact_if_exact(resolved: Resolved, tokens: int) -> Resolved:
    if resolved.spec.method not in APPROXIMATE_METHODS or not exact_by_knobs(resolved.spec, tokens):
        return resolved
    asked = {name: value for name, value in resolved.echo.items() if name != "method"}
    exact = dataclasses.replace(resolved.spec, method="full")
    return Resolved(exact, {"method": "full", "exact_by_knobs": {"method": resolved.spec.method, **asked}})
