"""What an input costs to embed, estimated before it runs, and the knob that drives it.

Work is counted in work units: one unit is a floating-point operation of a dense matrix
product (the feed-forward blocks, the projections, exact attention). The other steps of the
approximate methods run below that rate (popcounts, gathers, sorts), so each is weighted by
how many GEMM operations it costs, chosen against the measured times of the shipped CPU
calibration table (`python -m bench.cost_check`: the estimate is within 0.34x-1.26x of every
measured configuration there, relative to exact attention, 1k-32k tokens). Per attending layer and head, for n tokens, head dim d:

    full          4 n^2 d
    clustered     hash 9 x 2 n bits d  +  Hamming K-means 23 x iterations n C
                  + refinement 1.3 x refine n C 2d  +  centroid attention 0.47 x 4 C n d
    i-clustered   clustered  +  top-k part 20 x (4 n k d + C n)
    smyrf         rounds x (1.5 x 4 n S d  +  280 x n log2 n)
    local window  4 n w d

and outside attention, 2 x the layers' parameters per token. A device turns units into
seconds at its own rate (`Throughput`, measured once at start-up), so a budget in units holds
the same work on every device; the per-step weights are those of the CPU loops, which makes
the estimate coarser on a GPU (within the factor of a few a budget needs).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from torch import nn

from kernels import KNOB_RANGES, METHOD_KNOBS, AttentionSpec

from .config import EncoderConfig

# Work units per operation of each approximate step (see the module docstring).
WEIGHTS = {"hash": 9.0, "kmeans": 23.0, "refine": 1.3, "centroid": 0.47, "topk": 20.0, "smyrf": 1.5, "sort": 280.0}


@dataclass(frozen=True)
class CostModel:
    """The shape facts of one encoder that its work depends on."""

    per_token: float  # work units per token outside attention, every layer
    heads: int
    head_dim: int
    global_layers: int  # layers that attend by the request's spec
    local_layers: int = 0  # layers of exact windowed attention (ModernBERT)
    window: int = 0

    @classmethod
    def of(cls, config: EncoderConfig, model: nn.Module) -> CostModel:
        layer_parameters = sum(p.numel() for name, p in model.named_parameters() if name.startswith("layers."))
        global_layers = sum(1 for i in range(config.num_layers) if config.is_global_layer(i))
        return cls(
            per_token=2.0 * layer_parameters,
            heads=config.num_heads,
            head_dim=config.head_dim,
            global_layers=global_layers,
            local_layers=config.num_layers - global_layers,
            window=config.local_attention,
        )

    def attention(self, tokens: int, spec: AttentionSpec) -> float:
        """Work units of one attending layer and head over `tokens` tokens."""
        n, d = float(tokens), float(self.head_dim)
        if spec.method == "full":
            return 4 * n * n * d
        if spec.method == "smyrf":
            size = min(spec.cluster_size, tokens)
            return spec.hash_rounds * (WEIGHTS["smyrf"] * 4 * n * size * d + WEIGHTS["sort"] * n * math.log2(max(n, 2)))
        if spec.method not in ("clustered", "i-clustered"):
            raise ValueError(f"spec: a concrete method, got {spec.method!r}")
        clusters = min(spec.clusters, tokens)
        work = (
            WEIGHTS["hash"] * 2 * n * spec.bits * d
            + WEIGHTS["kmeans"] * spec.iterations * n * clusters
            + WEIGHTS["refine"] * spec.refine * n * clusters * 2 * d
            + WEIGHTS["centroid"] * 4 * clusters * n * d
        )
        if spec.method == "i-clustered":
            work += WEIGHTS["topk"] * (4 * n * min(spec.topk, tokens) * d + clusters * n)
        return work

    def work(self, tokens: int, spec: AttentionSpec) -> float:
        """Work units of one input of `tokens` tokens attending by a concrete `spec`."""
        local = 4.0 * tokens * min(self.window, tokens) * self.head_dim
        attention = self.global_layers * self.attention(tokens, spec) + self.local_layers * local
        return self.per_token * tokens + self.heads * attention


@dataclass(frozen=True)
class Throughput:
    """Work units a device runs per second, measured once."""

    units_per_s: float

    def seconds(self, units: float) -> float:
        return units / self.units_per_s

    def units(self, seconds: float) -> float:
        return seconds * self.units_per_s

    @classmethod
    def measure(cls, run: Callable[[], object], units: float, repeats: int = 2) -> Throughput:
        """The rate of `run`, which does `units` of work: the best of `repeats` timed calls
        after one untimed one."""
        run()
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        return cls(units / max(best, 1e-9))


# The default budget per request: this many inputs of the model's longest length, each at the
# most costly of the configurations a server offers by default.
BUDGET_INPUTS = 2


def default_budget(cost: CostModel, tokens: int, specs: Sequence[AttentionSpec]) -> float:
    """Work units of BUDGET_INPUTS inputs of `tokens` tokens at the most costly of `specs`
    (every method at its default knobs, every calibrated configuration): so that each of them
    runs at the longest input with room to spare, and a request whose knobs cost many times
    more does not."""
    return BUDGET_INPUTS * max(cost.work(tokens, spec) for spec in specs)


@dataclass(frozen=True)
class OverBudget:
    """Why a request is over its budget: the knob that drives its work and the largest value
    of it that fits, with `others` (more knobs, each at most the value given) where that knob
    alone cannot bring it within; knob None: not even the default knobs fit (the inputs are
    too many or too long)."""

    work: float
    budget: float
    knob: str | None
    largest: int | None
    others: dict[str, int] = field(default_factory=dict)


def over_budget(
    cost: CostModel, inputs: Sequence[tuple[int, AttentionSpec]], budget: float, defaults: AttentionSpec | None = None
) -> OverBudget | None:
    """None when the inputs' work, (tokens, resolved spec) each, is within `budget` units.

    Otherwise: the knobs ordered by the work each saves at its value in `defaults` (the
    server's default knobs; AttentionSpec()'s when None); the first is the one that drives the
    work. As few of the next ones as needed are set to their defaults (`others`) for the
    request to fit, and the largest value of the first that then fits is found."""
    def total(caps: dict[str, int]) -> float:
        return sum(cost.work(n, _capped(spec, caps)) for n, spec in inputs)

    work = total({})
    if work <= budget:
        return None
    defaults = defaults or AttentionSpec()
    knobs = sorted(_knobs(inputs), key=lambda knob: total({knob: getattr(defaults, knob)}))
    caps: dict[str, int] = {}
    for knob in knobs:
        if total({**caps, knobs[0]: KNOB_RANGES[knobs[0]][0]}) <= budget:
            break
        if knob != knobs[0]:
            caps[knob] = getattr(defaults, knob)
    if not knobs or total({**caps, knobs[0]: KNOB_RANGES[knobs[0]][0]}) > budget:
        return OverBudget(work, budget, None, None)
    knob = knobs[0]
    low, high = KNOB_RANGES[knob][0], max(getattr(spec, knob) for _, spec in inputs if knob in _used(spec))
    while low < high:  # the largest value within the budget; work grows with every knob
        middle = (low + high + 1) // 2
        if total({**caps, knob: middle}) <= budget:
            low = middle
        else:
            high = middle - 1
    return OverBudget(work, budget, knob, low, caps)


def _used(spec: AttentionSpec) -> tuple[str, ...]:
    return tuple(knob for knob in METHOD_KNOBS.get(spec.method, ()) if knob != "seed")


def _knobs(inputs: Sequence[tuple[int, AttentionSpec]]) -> list[str]:
    return sorted({knob for _, spec in inputs for knob in _used(spec)})


def _capped(spec: AttentionSpec, caps: dict[str, int]) -> AttentionSpec:
    """`spec` with each knob it reads at most its cap."""
    lower = {knob: cap for knob, cap in caps.items() if knob in _used(spec) and getattr(spec, knob) > cap}
    return dataclasses.replace(spec, **lower) if lower else spec
