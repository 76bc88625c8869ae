"""What an input costs to embed, estimated before it runs, and the knob that drives it.

Work is counted in work units: one unit is the time of one operation of a float32 dense
matrix product on the CPU (the projections and feed-forward blocks). Every step of a forward
pass is counted in operations and weighted by what one of its operations costs in units,
by the dtype the encoder computes in. Per attending layer and head, for n tokens, head dim d,
C clusters, top-k k, SMYRF cluster size S:

    full          exact x 4 n^2 d
    clustered     hash x 2 n bits d  +  kmeans x iterations n C  +  refine x refine n C 2d
                  (bits 0: no hash, and the seeds' nearest-mean step is one refine step more)
                  +  centroid x 4 C n d                 (the centroid pass: SDPA, or vdpbf16ps)
    i-clustered   the same hashing and clustering  +  centroid_topk x 4 C n d  (the native pass
                  that also keeps each cluster's top k)  +  topk x 4 n k d  +  gather x C k d
                  (each cluster's top-k keys and values gathered, memory-bound)
    smyrf         rounds x (smyrf x 4 n S d  +  sort x n log2 n)
    banded        banded x 4 n (block (2 band + 1 + far_blocks) + n / block + sinks) d
                  +  banded x 2 n (n / block) d  with far_blocks  (each query's pooled scores)
    local window  exact x 4 n w d

and outside attention, dense x 2 x the layers' parameters per token. The weights (WEIGHTS)
were fitted to the measured times of the shipped CPU calibration tables, all at once
(`python -m clusterserve.bench.costmodel.cost_check --fit`: least squares of every configuration's time on a log
scale, each table at its own device speed), with one weight per step for every dtype except
the four steps whose code depends on it: the dense layers (bfloat16 GEMMs run ~3.5x faster
than float32's on a CPU with AVX512-BF16), exact attention (SDPA keeps float32's pace in
bfloat16), clustered attention's centroid pass (SDPA in float32, the native vdpbf16ps
pass in bfloat16) and banded attention (its band and far blocks on vdpbf16ps in bfloat16);
the other native loops read bfloat16 and compute in float32 at about float32's pace. That
is why the dtype matters: in bfloat16 the dense layers are a smaller part of every input,
so exact attention costs relatively more and the approximate methods save relatively more,
and their fixed costs (clustering, gathers) weigh more at short lengths.
`python -m clusterserve.bench.costmodel.cost_check` compares the estimate with every table, as estimated over
measured cost relative to exact attention in the same bucket (1.0 is exact):

    all-MiniLM-L6-v2        float32    1k-32k tokens    72 configurations   0.43-1.12
    all-MiniLM-L6-v2        bfloat16   512-32k tokens   84 configurations   0.67-1.36
    nomic-embed-text-v1.5   float32    512-8k tokens    32 configurations   0.87-1.14
    nomic-embed-text-v1.5   bfloat16   512-8k tokens    32 configurations   0.81-1.18

(tables measured on 2-core AMD EPYCs; tests hold every shipped table to 1/3-3x).

A device turns units into seconds at its own rate (`Throughput`, measured once at start-up
by a forward pass in the served dtype), so a budget in units holds the same work on every
device. On other device kinds (CUDA), and in dtypes without a table, the float32 CPU weights
serve: no table measured there says otherwise, and the ranking is coarser there (within the
factor of a few a budget needs). The bfloat16 weights assume a CPU that multiplies bfloat16
natively (the CPUs `dtype="auto"` serves bfloat16 on).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from torch import nn

from clusterserve.kernels import KNOB_RANGES, METHOD_KNOBS, AttentionSpec
from clusterserve.models.config import EncoderConfig
from clusterserve.models.timing import alternated_seconds

# Work units per operation of each step, by the dtype an encoder computes in on a CPU (see the
# module docstring); one unit is one operation of float32 dense layers.
# Written by `python -m clusterserve.bench.costmodel.cost_check --fit --write`, which replaces this assignment.
WEIGHTS: dict[str, dict[str, float]] = {
    "float32": {
        "dense": 1.0, "exact": 0.85, "centroid": 1.7, "banded": 1.0,
        "hash": 0.78, "kmeans": 2.7, "refine": 0.52, "centroid_topk": 1.2, "topk": 1.4, "gather": 1500.0,
        "smyrf": 0.5, "sort": 24.0,
    },
    "bfloat16": {
        "dense": 0.3, "exact": 0.82, "centroid": 0.15, "banded": 0.38,
        "hash": 0.78, "kmeans": 2.7, "refine": 0.52, "centroid_topk": 1.2, "topk": 1.4, "gather": 1500.0,
        "smyrf": 0.5, "sort": 24.0,
    },
}  # fmt: skip


def weights_for(device: str, dtype: str) -> dict[str, float]:
    """The step weights of an encoder on a device of kind `device` ("cpu", "cuda") computing in
    `dtype` ("float32", "bfloat16", ...): the CPU's row for its dtype; float32's row for a dtype
    without one and on other devices, where no table has been measured."""
    return WEIGHTS.get(dtype, WEIGHTS["float32"]) if device == "cpu" else WEIGHTS["float32"]


@dataclass(frozen=True)
class CostModel:
    """The facts of one encoder that its work depends on: its shape, and the dtype and device
    kind it computes in (they set the weights of the steps)."""

    per_token: float  # operations per token of the dense layers (projections, feed-forward), every layer
    heads: int
    head_dim: int
    global_layers: int  # layers that attend by the request's spec
    local_layers: int = 0  # layers of exact windowed attention (ModernBERT)
    window: int = 0
    dtype: str = "float32"
    device: str = "cpu"  # the device kind

    @classmethod
    def of(cls, config: EncoderConfig, model: nn.Module) -> CostModel:
        """The cost model of `model` as it is: its dtype and device kind are its parameters'."""
        layer_parameters = sum(p.numel() for name, p in model.named_parameters() if name.startswith("layers."))
        global_layers = sum(1 for i in range(config.num_layers) if config.is_global_layer(i))
        first = next(model.parameters())
        return cls(
            per_token=2.0 * layer_parameters,
            heads=config.num_heads,
            head_dim=config.head_dim,
            global_layers=global_layers,
            local_layers=config.num_layers - global_layers,
            window=config.local_attention,
            dtype=str(first.dtype).removeprefix("torch."),
            device=first.device.type,
        )

    @property
    def weights(self) -> dict[str, float]:
        return weights_for(self.device, self.dtype)

    def attention(self, tokens: int, spec: AttentionSpec) -> dict[str, float]:
        """Operations of each step (WEIGHTS' keys) of one attending layer and head over `tokens`
        tokens, attending by `spec` as given (a caller that runs an approximate spec that is
        exact by its knobs as exact attention, as the server does, passes exact attention's)."""
        n, d = float(tokens), float(self.head_dim)
        if spec.method == "full":
            return {"exact": 4 * n * n * d}
        if spec.method == "smyrf":
            size = min(spec.cluster_size, tokens)
            return {"smyrf": spec.hash_rounds * 4 * n * size * d, "sort": spec.hash_rounds * n * math.log2(max(n, 2))}
        if spec.method == "banded":  # the band's keys and the far blocks', one pooled key per block, the sinks
            blocks = -(-tokens // spec.block)
            keys = min((2 * spec.band + 1 + spec.far_blocks) * spec.block, tokens) + blocks + spec.sinks + 1
            select = 2 * n * blocks * d if spec.far_blocks else 0.0  # choosing the far blocks
            return {"banded": 4 * n * min(keys, tokens) * d + select}
        if spec.method not in ("clustered", "i-clustered"):
            raise ValueError(f"spec: a concrete method, got {spec.method!r}")
        clusters = min(spec.clusters, tokens)
        steps = {
            "hash": 2 * n * spec.bits * d,
            "kmeans": spec.iterations * n * clusters,
            "refine": (spec.refine + (0 if spec.bits else 1)) * n * clusters * 2 * d,
        }
        if spec.method == "clustered":
            return {**steps, "centroid": 4 * clusters * n * d}
        topk = min(spec.topk, tokens)
        return {**steps, "centroid_topk": 4 * clusters * n * d, "topk": 4 * n * topk * d, "gather": clusters * topk * d}

    def operations(self, tokens: int, spec: AttentionSpec) -> dict[str, float]:
        """Operations of each step (WEIGHTS' keys) of one input of `tokens` tokens attending by
        a concrete `spec`, over every layer and head."""
        operations = {"dense": self.per_token * tokens}
        for step, count in self.attention(tokens, spec).items():
            operations[step] = operations.get(step, 0.0) + self.heads * self.global_layers * count
        if self.local_layers:
            local = self.heads * self.local_layers * 4.0 * tokens * min(self.window, tokens) * self.head_dim
            operations["exact"] = operations.get("exact", 0.0) + local
        return operations

    def work(self, tokens: int, spec: AttentionSpec) -> float:
        """Work units of one input of `tokens` tokens attending by a concrete `spec`."""
        weights = self.weights
        return sum(weights[step] * count for step, count in self.operations(tokens, spec).items())


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
        best = min(alternated_seconds({"run": run}, repeats)["run"])
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
    """The knobs a spec's work may be capped by: not the seed, and not `bits`, whose hash is a
    sliver of the work and whose 0 changes how the clusters start (and refuses Hamming iterations)."""
    return tuple(knob for knob in METHOD_KNOBS.get(spec.method, ()) if knob not in ("seed", "bits"))


def _knobs(inputs: Sequence[tuple[int, AttentionSpec]]) -> list[str]:
    return sorted({knob for _, spec in inputs for knob in _used(spec)})


def _capped(spec: AttentionSpec, caps: dict[str, int]) -> AttentionSpec:
    """`spec` with each knob it reads at most its cap."""
    lower = {knob: cap for knob, cap in caps.items() if knob in _used(spec) and getattr(spec, knob) > cap}
    return dataclasses.replace(spec, **lower) if lower else spec
