"""The work estimate: against every shipped table's measured times, per model and dtype, and
the budget's verdicts."""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from pathlib import Path

import pytest

from clusterserve.bench.costmodel.cost_check import as_run, ratios, table_cost
from clusterserve.kernels import APPROXIMATE_METHODS, AttentionSpec
from clusterserve.models.loader import DEFAULT_MODEL_NAME, MINILM_NAME
from clusterserve.models.planning.calibration import Calibration, load_calibration, shipped_tables
from clusterserve.models.planning.cost import BUDGET_INPUTS, CostModel, default_budget, over_budget

TABLES = shipped_tables()
EXACT = AttentionSpec(method="full")
# The loaded models' fixtures (tests/models/conftest.py); a table of another model loads it by name.
FIXTURES = {MINILM_NAME: "default_encoder", DEFAULT_MODEL_NAME: "nomic_encoder"}


@lru_cache
def _loaded_cost(model: str) -> CostModel:
    from clusterserve.models import load_encoder

    return load_encoder(model).cost


def model_cost(request: pytest.FixtureRequest, model: str, dtype: str = "float32", device: str = "cpu") -> CostModel:
    """The cost model of `model` in `dtype` on a device of kind `device`."""
    fixture = FIXTURES.get(model)
    shapes = request.getfixturevalue(fixture).cost if fixture else _loaded_cost(model)
    return dataclasses.replace(shapes, dtype=dtype, device=device)


def tables_by_model() -> dict[str, dict[str, Calibration]]:
    """The shipped CPU tables: model -> dtype -> table."""
    found: dict[str, dict[str, Calibration]] = {}
    for path in TABLES:
        table = load_calibration(path)
        if table.device == "cpu":
            found.setdefault(table.model, {})[table.dtype] = table
    return found


def test_there_are_tables_of_both_dtypes():
    dtypes = {dtype for by_dtype in tables_by_model().values() for dtype in by_dtype}
    assert {"float32", "bfloat16"} <= dtypes


@pytest.mark.parametrize("path", TABLES, ids=[p.name for p in TABLES])
def test_the_estimate_follows_each_shipped_tables_measured_times(request, path: Path):
    """Within 1/3-3x of every measured configuration, relative to exact attention in the same
    bucket, for the table's model, dtype and device kind."""
    table = load_calibration(path)
    cost = table_cost(table, model_cost(request, table.model))
    assert cost.dtype == table.dtype
    for row in ratios(cost, table):
        assert 1 / 3 <= row["ratio"] <= 3, (path.name, row)


@pytest.mark.parametrize("model", [m for m, by_dtype in tables_by_model().items() if {"float32", "bfloat16"} <= set(by_dtype)])
def test_the_estimate_moves_with_the_dtype_as_the_tables_do(request, model: str):
    """Where a model's float32 and bfloat16 tables measure a configuration's speed-up over
    exact attention 1.5x apart or more (bfloat16 speeds up the dense layers more than the
    attention loops and exact attention), the estimate's speed-up moves the same way: an
    estimate that ignored the dtype would not move at all."""
    tables = tables_by_model()[model]
    cost = {dtype: model_cost(request, model, dtype) for dtype in ("float32", "bfloat16")}

    def speedups(dtype: str, bucket_tokens: int) -> dict[AttentionSpec, tuple[float, float]]:
        """spec -> (measured, estimated) speed-up over exact attention."""
        bucket = next(b for b in tables[dtype].buckets if b.tokens == bucket_tokens)
        exact = cost[dtype].work(bucket.tokens, EXACT)
        return {
            m.spec: (bucket.exact_ms / m.ms, exact / cost[dtype].work(bucket.tokens, as_run(m.spec, bucket.tokens)))
            for m in bucket.configs
        }

    common = {b.tokens for b in tables["float32"].buckets} & {b.tokens for b in tables["bfloat16"].buckets}
    compared = 0
    for tokens in sorted(common):
        in_float32, in_bfloat16 = speedups("float32", tokens), speedups("bfloat16", tokens)
        for spec in in_float32.keys() & in_bfloat16.keys() - {s for s in in_float32 if as_run(s, tokens) == EXACT}:
            (measured32, estimated32), (measured16, estimated16) = in_float32[spec], in_bfloat16[spec]
            moved = measured16 / measured32
            if 1 / 1.5 < moved < 1.5:
                continue
            compared += 1
            assert (estimated16 > estimated32) == (moved > 1), (tokens, spec.to_json(), moved, estimated16 / estimated32)
    assert compared >= 5


def test_the_cost_model_takes_its_dtype_and_device_from_the_models_parameters(default_encoder):
    from clusterserve.models import load_encoder

    assert (default_encoder.cost.dtype, default_encoder.cost.device) == ("float32", "cpu")
    in_bfloat16 = load_encoder(MINILM_NAME, dtype="bfloat16").cost
    assert (in_bfloat16.dtype, in_bfloat16.device) == ("bfloat16", "cpu")
    assert dataclasses.replace(in_bfloat16, dtype="float32") == default_encoder.cost
    # bfloat16's dense layers run faster than float32's on the CPU, exact attention does not.
    assert in_bfloat16.work(512, EXACT) < default_encoder.cost.work(512, EXACT)
    # A device kind without tables of its own is estimated with float32's weights in any dtype.
    assert dataclasses.replace(in_bfloat16, device="cuda").weights == default_encoder.cost.weights


MODELS_AND_DTYPES = [(m, d) for m in (MINILM_NAME, DEFAULT_MODEL_NAME) for d in ("float32", "bfloat16")]


@pytest.mark.parametrize("model, dtype", MODELS_AND_DTYPES)
def test_the_default_budget_lets_every_default_and_calibrated_configuration_run_at_the_longest_input(
    request, model: str, dtype: str
):
    cost = model_cost(request, model, dtype)
    longest = request.getfixturevalue(FIXTURES[model]).max_input_tokens
    defaults = [AttentionSpec().with_knobs(method=m) for m in ("full", *APPROXIMATE_METHODS)]
    calibrated = [m.spec for table in tables_by_model().get(model, {}).values() for b in table.buckets for m in b.configs]
    budget = default_budget(cost, longest, defaults + calibrated)
    for spec in defaults + calibrated:
        assert over_budget(cost, [(longest, as_run(spec, longest))] * BUDGET_INPUTS, budget) is None, spec
    # One input more than the budget holds, at the most costly of them, is over it.
    costliest = max(defaults + calibrated, key=lambda spec: cost.work(longest, as_run(spec, longest)))
    assert over_budget(cost, [(longest, costliest)] * (BUDGET_INPUTS + 1), budget) is not None


@pytest.mark.parametrize("model, dtype", MODELS_AND_DTYPES)
def test_a_request_over_budget_names_the_knob_that_drives_it_and_the_largest_value_that_fits(request, model: str, dtype: str):
    cost = model_cost(request, model, dtype)
    # The heavy-but-legal request: every knob at a value the schema allows, on ~7k tokens.
    heavy = AttentionSpec(method="i-clustered", clusters=4096, topk=4096, iterations=100, refine=100)
    budget = default_budget(cost, 8192, [EXACT])
    verdict = over_budget(cost, [(7000, heavy)], budget)
    assert verdict is not None and verdict.work > 2 * budget
    # Clusters multiply the K-means, the refinement, the centroid pass and the top-k gathers:
    # set back to the default, they save the most.
    assert verdict.knob == "clusters"
    fits = dataclasses.replace(heavy, **verdict.others, clusters=verdict.largest)
    assert over_budget(cost, [(7000, fits)], budget) is None
    assert over_budget(cost, [(7000, dataclasses.replace(fits, clusters=verdict.largest + 1))], budget) is not None


def test_inputs_too_many_for_any_knob_are_named_as_such(default_encoder):
    cost = default_encoder.cost
    budget = default_budget(cost, 1000, [EXACT])
    verdict = over_budget(cost, [(1000, EXACT)] * (BUDGET_INPUTS + 1), budget)
    assert verdict is not None and verdict.knob is None and verdict.largest is None
