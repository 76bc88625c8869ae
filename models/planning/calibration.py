"""Calibration tables: measured fidelity and time of attention configurations per input length.

`python -m clusterserve.bench.calibration.build` embeds real long text with exact attention and with a grid of
approximate configurations, per length bucket, on one device, and writes a table:

    {"format": "clusterserve-calibration/1", "model": "all-MiniLM-L6-v2", "device": "cpu",
     "device_name": "...", "dtype": "float32", "seed": 0, "docs": 2, "texts": "...",
     "buckets": [{"tokens": 4096, "exact_ms": 1130.0,
                  "configs": [{"attention": {"method": "i-clustered", "clusters": 100, ...},
                               "fidelity_min": 0.991, "fidelity_mean": 0.993, "ms": 640.0}, ...]},
                 ...]}

Fidelity is the cosine of a document's embedding to its exact-attention embedding in
float32 (whatever dtype the table was measured in, so that it says what a user gets; a
bucket's `exact_fidelity_min` is exact attention's own, below 1 in bfloat16);
`fidelity_min` is the worst over the calibration documents, and it is what a target is
checked against. A table may also record `chunk_fidelity_min` per configuration: the worst
cosine of the mean token state over each `chunk_tokens`-token span of a document (late
chunking's chunk vectors) to exact attention's, over every span of every document; a chunk
averages fewer tokens' errors than a whole document, so it keeps less. `choose(..., chunks=True)`
judges late-chunked sequences by it, and by `fidelity_min` in a table without it.
`Calibration.choose(tokens, target)` judges an input by the buckets around
its length (the longest at most as long and the shortest at least as long; the longest
bucket alone past it) and picks the fastest configuration that meets the target and is at
least MIN_SPEEDUP times faster than exact in each of them, or exact attention when none is:
a gain inside one measurement's timing noise does not pay for the fidelity it costs, and
neither fidelity nor speed-up is monotone in length (a document's pooled vector averages its
tokens' errors, so 200 clusters keep less fidelity at 512 tokens than at 1024). An input
shorter than every bucket runs exact attention: the table says nothing about it. The table
is only as good as the texts and device it was measured on: a table measured on a CPU says
little about a GPU's times.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusterserve.kernels import APPROXIMATE_METHODS, AttentionSpec
from clusterserve.models.planning.gpu_estimate import SHIPPED_DIR, estimated_speedup

FORMAT = "clusterserve-calibration/1"
GPU_SPEED_SOURCE = ("the offline end-to-end estimate for a GPU (bench.costmodel.gpu_e2e_model): this GPU has no table "
                    "of its own; fidelities are the table's, speed-ups the estimate's, exact where none is >= 1.1x")
EXACT = AttentionSpec(method="full")
# An approximation is chosen only where its measured time beats exact by this factor.
MIN_SPEEDUP = 1.1
# The cosine to exact attention `auto` aims at when nothing names a target (service.settings' default).
DEFAULT_TARGET_FIDELITY = 0.98


class CalibrationError(ValueError):
    """A calibration table that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Measured:
    """One configuration at one length: its spec, worst and mean fidelity, time per document."""

    spec: AttentionSpec
    fidelity_min: float
    fidelity_mean: float
    ms: float
    chunk_fidelity_min: float | None = None  # late chunks' worst cosine; None where not measured

    def fidelity(self, chunks: bool) -> float:
        """The worst fidelity a choice is judged by: of late chunks where `chunks` and the table
        measured them, else of the document's pooled vector."""
        return self.chunk_fidelity_min if chunks and self.chunk_fidelity_min is not None else self.fidelity_min

    def summary(self, exact_ms: float) -> dict[str, Any]:
        chunk = {} if self.chunk_fidelity_min is None else {"chunk_fidelity_min": round(self.chunk_fidelity_min, 5)}
        return {
            "attention": self.spec.used_knobs(),
            "fidelity_min": round(self.fidelity_min, 5),
            "fidelity_mean": round(self.fidelity_mean, 5),
            **chunk,
            "ms": round(self.ms, 2),
            "speedup": round(exact_ms / self.ms, 3),
        }


@dataclass(frozen=True)
class Bucket:
    tokens: int
    exact_ms: float
    configs: tuple[Measured, ...]
    # Exact attention in the table's dtype against exact attention in float32 (1.0 in float32).
    exact_fidelity: float = 1.0
    exact_chunk_fidelity: float | None = None

    def exact(self) -> Measured:
        return Measured(EXACT, self.exact_fidelity, self.exact_fidelity, self.exact_ms, self.exact_chunk_fidelity)

    def measured(self, spec: AttentionSpec) -> Measured | None:
        """This bucket's measurement of `spec`, None where the grid did not run it here."""
        return next((m for m in self.configs if m.spec == spec), None)

    def frontier(self) -> list[Measured]:
        """The Pareto set, fastest first: no other entry is both faster and at least as faithful."""
        entries = sorted((self.exact(), *self.configs), key=lambda m: (m.ms, -m.fidelity_min))
        frontier: list[Measured] = []
        for entry in entries:
            if not frontier or entry.fidelity_min > frontier[-1].fidelity_min:
                frontier.append(entry)
        return frontier


@dataclass(frozen=True)
class Choice:
    """What `choose` picked: the spec to run and the measurement that justified it."""

    spec: AttentionSpec
    bucket: int  # tokens of the bucket the input fell in
    fidelity: float  # the calibrated worst-case fidelity (1.0 for exact)
    speedup: float  # calibrated exact time / this configuration's time
    chunks: bool = False  # judged by the fidelity of late chunks (the table measured it)

    def echo(self, target: float) -> dict[str, Any]:
        return {
            **self.spec.used_knobs(),
            "target_fidelity": target,
            "calibrated_fidelity": round(self.fidelity, 5),
            **({"calibrated_for": "late chunks"} if self.chunks else {}),
            "calibrated_speedup": round(self.speedup, 3),
            "calibration_bucket": self.bucket,
        }


@dataclass(frozen=True)
class Calibration:
    model: str
    device: str  # "cpu" or "cuda": the kind of device the times were measured on
    device_name: str
    source: str  # where the table was read from
    meta: dict[str, Any]
    buckets: tuple[Bucket, ...]  # ascending tokens
    # On a device the table was not measured on (a GPU taking the CPU's): method -> estimated
    # end-to-end speed-ups there, which rank configurations instead of the table's times
    # (models.planning.gpu_estimate); None where the table's own times hold.
    gpu_speedups: dict | None = None

    @property
    def dtype(self) -> str:
        """The dtype the table was measured in ("float32" for tables that do not say)."""
        return str(self.meta.get("dtype", "float32"))

    def bucket_for(self, tokens: int) -> Bucket:
        """The smallest bucket at least `tokens` long, or the longest bucket for longer inputs:
        the longer of the buckets `around` an input, the one its echo names."""
        return next((b for b in self.buckets if b.tokens >= tokens), self.buckets[-1])

    def around(self, tokens: int) -> tuple[Bucket, ...]:
        """The buckets an input of `tokens` tokens is judged by: the longest at most as long and
        the shortest at least as long (one bucket at a bucket's length, the longest bucket past
        it), none for an input shorter than every bucket."""
        if tokens < self.buckets[0].tokens:
            return ()
        lower = max((b for b in self.buckets if b.tokens <= tokens), key=lambda b: b.tokens)
        upper = self.bucket_for(tokens)
        return (lower,) if lower is upper else (lower, upper)

    @functools.cached_property
    def has_chunk_fidelity(self) -> bool:
        """Whether every configuration of every bucket has its late chunks' fidelity measured."""
        return all(m.chunk_fidelity_min is not None for b in self.buckets for m in b.configs)

    def choose(self, tokens: int, target: float, seed: int = 0, chunks: bool = False) -> Choice:
        """The fastest calibrated configuration for an input of `tokens` tokens whose measured
        fidelity is >= target in every bucket around the input (`around`; the worst of them is
        its fidelity) and whose speed-up at the input's length (`speedup_at`) is at least
        MIN_SPEEDUP; exact attention when none is. Speed is compared in the longer bucket; with
        `gpu_speedups`, by the estimate for the configuration's method at `tokens` instead.
        chunks: the input is a late-chunking window, judged by the fidelity of its chunks
        where the table measured it (`has_chunk_fidelity`)."""
        chunks = chunks and self.has_chunk_fidelity
        upper = self.bucket_for(tokens)
        judged = self.around(tokens)
        best = Choice(EXACT, upper.tokens, upper.exact().fidelity(chunks), 1.0, chunks)
        best_ms = upper.exact_ms
        for entry in upper.configs:
            measured = [bucket.measured(entry.spec) for bucket in judged]
            if not judged or None in measured or (self.gpu_speedups is None and entry.ms >= best_ms):
                continue
            fidelity = min(m.fidelity(chunks) for m in measured)
            if self.gpu_speedups is None:
                speedup = speedup_at(tokens, [(b.tokens, b.exact_ms / m.ms) for b, m in zip(judged, measured)])
            else:  # one estimate a method: its configurations rank by the table's times among themselves
                speedup = estimated_speedup(self.gpu_speedups, entry.spec.method, tokens)
                if speedup < best.speedup or (speedup == best.speedup and entry.ms >= best_ms):
                    continue
            if fidelity >= target and speedup >= MIN_SPEEDUP:
                spec = dataclasses.replace(entry.spec, seed=seed)
                best, best_ms = Choice(spec, upper.tokens, fidelity, speedup, chunks), entry.ms
        return best

    def info(self) -> dict[str, Any]:
        """For GET /info: where the table came from and each bucket's Pareto frontier."""
        return {
            "source": self.source,
            "model": self.model,
            "device": self.device,
            "device_name": self.device_name,
            **({} if self.gpu_speedups is None else {"speed_from": GPU_SPEED_SOURCE,
                                                     "gpu_speedups": {m: [list(p) for p in points]
                                                                      for m, points in self.gpu_speedups.items()}}),
            **{
                k: self.meta[k]
                for k in ("measured", "docs", "texts", "dtype", "fidelity_reference", "chunk_tokens")
                if k in self.meta
            },
            "frontier": [
                {
                    "tokens": b.tokens,
                    "exact_ms": round(b.exact_ms, 2),
                    "points": [m.summary(b.exact_ms) for m in b.frontier()],
                }
                for b in self.buckets
            ],
        }


def speedup_at(tokens: int, points: list[tuple[int, float]]) -> float:
    """A configuration's speed-up over exact attention at `tokens`, from its measured speed-ups
    at the lengths around it (`points`: (tokens, speed-up), one or two, shorter first): the
    one, or the line through the two. Exact attention costs a token more the longer the input
    while the approximations cost about the same, so the speed-up grows about linearly with
    length between buckets; the shorter bucket's alone would hold an input just short of a
    bucket to the speed-up of one half its length."""
    if len(points) == 1:
        return points[0][1]
    (lo, at_lo), (hi, at_hi) = points
    return at_lo + (at_hi - at_lo) * (tokens - lo) / (hi - lo)


def load_calibration(path: str | Path) -> Calibration:
    """Read and validate a table; CalibrationError (naming the file and field) if it is unusable."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CalibrationError(f"calibration table {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"calibration table {path} is not readable JSON: {exc}") from None
    return parse_calibration(raw, str(path))


def parse_calibration(raw: Any, source: str) -> Calibration:
    """A table's JSON (already decoded) -> Calibration; CalibrationError on any defect."""
    read = _Fields(source)
    if not isinstance(raw, dict):
        raise read.fail("(top level)", "must be a JSON object")
    if raw.get("format") != FORMAT:
        raise read.fail("format", f"must be {FORMAT!r}, got {raw.get('format')!r}")
    for name in ("model", "device"):
        if not isinstance(raw.get(name), str) or not raw[name]:
            raise read.fail(name, "must be a non-empty string")
    buckets_raw = raw.get("buckets")
    if not isinstance(buckets_raw, list) or not buckets_raw:
        raise read.fail("buckets", "must be a non-empty list")
    buckets = [read.bucket(b, f"buckets[{i}]") for i, b in enumerate(buckets_raw)]
    if len({b.tokens for b in buckets}) != len(buckets):
        raise read.fail("buckets", "two buckets have the same tokens")
    meta = {k: v for k, v in raw.items() if k not in ("buckets", "format")}
    return Calibration(
        model=raw["model"],
        device=raw["device"],
        device_name=str(raw.get("device_name", "")),
        source=source,
        meta=meta,
        buckets=tuple(sorted(buckets, key=lambda b: b.tokens)),
    )


@dataclass(frozen=True)
class _Fields:
    """Reads a table's fields, each error naming the file and the field's path."""

    source: str

    def fail(self, field: str, message: str) -> CalibrationError:
        return CalibrationError(f"calibration table {self.source}: {field}: {message}")

    def number(self, value: Any, field: str, low: float, high: float = math.inf) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise self.fail(field, f"must be a number in [{low}, {high}], got {value!r}")
        return float(value)

    def optional(self, entry: dict, name: str, where: str) -> float | None:
        return None if entry.get(name) is None else self.number(entry[name], f"{where}.{name}", -1.0, 1.0)

    def bucket(self, b: Any, where: str) -> Bucket:
        if not isinstance(b, dict) or not isinstance(b.get("configs"), list):
            raise self.fail(where, "must be an object with tokens, exact_ms and a list of configs")
        tokens = b.get("tokens")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise self.fail(f"{where}.tokens", f"must be a positive integer, got {tokens!r}")
        configs = tuple(self.measured(c, f"{where}.configs[{j}]") for j, c in enumerate(b["configs"]))
        exact_fidelity = self.number(b.get("exact_fidelity_min", 1.0), f"{where}.exact_fidelity_min", -1.0, 1.0)
        exact_chunk_fidelity = self.optional(b, "exact_chunk_fidelity_min", where)
        if exact_chunk_fidelity is None and all(m.chunk_fidelity_min is not None for m in configs):
            exact_chunk_fidelity = exact_fidelity  # float32 tables: exact attention is its own reference
        exact_ms = self.number(b.get("exact_ms"), f"{where}.exact_ms", 1e-9)
        return Bucket(tokens, exact_ms, configs, exact_fidelity, exact_chunk_fidelity)

    def measured(self, c: Any, at: str) -> Measured:
        if not isinstance(c, dict) or not isinstance(c.get("attention"), dict):
            raise self.fail(at, "must be an object with an attention object")
        try:
            spec = AttentionSpec(**c["attention"])
        except (TypeError, ValueError) as exc:
            raise self.fail(f"{at}.attention", str(exc)) from None
        if spec.method not in APPROXIMATE_METHODS:
            raise self.fail(f"{at}.attention.method", f"must be one of {', '.join(APPROXIMATE_METHODS)}")
        return Measured(
            spec,
            self.number(c.get("fidelity_min"), f"{at}.fidelity_min", -1.0, 1.0),
            self.number(c.get("fidelity_mean"), f"{at}.fidelity_mean", -1.0, 1.0),
            self.number(c.get("ms"), f"{at}.ms", 1e-9),
            self.optional(c, "chunk_fidelity_min", at),
        )


# A table is measured in one dtype: float32 tables have no suffix.
DTYPE_SUFFIXES = {"float32": "", "bfloat16": "-bf16", "float16": "-fp16"}


def shipped_tables() -> list[Path]:
    """The calibration tables shipped in SHIPPED_DIR (beside them: GPU estimates, not tables)."""
    return sorted(SHIPPED_DIR.glob("*.calibration.*.json"))


def table_name(model: str, device: str, dtype: str = "float32") -> str:
    """File name of a model's table for a device kind ("cpu" or "cuda") and the dtype it
    serves in: all-MiniLM-L6-v2.calibration.cpu.json, ....calibration.cpu-bf16.json."""
    return f"{model}.calibration.{device}{DTYPE_SUFFIXES[dtype]}.json"


def find_calibration(model: str, folder: Path | None, device: str, dtype: str = "float32") -> Path | None:
    """Where a table for this model, device kind and dtype is, if anywhere: in the model's
    folder (calibration.<device>[-bf16].json), else among the tables shipped with clusterserve
    (models/calibrations/); where neither has one for `dtype`, the float32 table of the same
    device kind: its fidelities hold in another dtype within what a second seed moves a
    vector, and its times rank configurations by float32's costs. A device kind with no table
    (CUDA, where none is shipped) takes the CPU's, float32's first whatever its own dtype: its
    fidelities are the reference's, which the GPU kernels give (tests/gpu); the loader ranks its
    configurations there by the GPU's end-to-end estimate instead of the CPU's times
    (models.planning.gpu_estimate). The server logs where and in which dtype a table was
    measured."""
    orders = [(device, (dtype, "float32"))] + ([("cpu", ("float32", dtype))] if device != "cpu" else [])
    candidates = []
    for kind_of_device, kinds in orders:
        for kind in dict.fromkeys(kinds):
            if folder is not None:
                candidates.append(folder / f"calibration.{kind_of_device}{DTYPE_SUFFIXES[kind]}.json")
            candidates.append(SHIPPED_DIR / table_name(model, kind_of_device, kind))
    return next((p for p in candidates if p.is_file()), None)
