"""The work estimate: against the shipped table's measured times, and the budget's verdicts."""

from __future__ import annotations

import dataclasses

import pytest

from kernels import APPROXIMATE_METHODS, AttentionSpec
from models.cost import BUDGET_INPUTS, CostModel, default_budget, over_budget


@pytest.fixture(scope="module")
def cost(default_encoder) -> CostModel:
    return default_encoder.cost


def test_the_estimate_follows_the_shipped_tables_measured_times(default_encoder, cost):
    table = default_encoder.calibration
    assert table is not None and table.device == "cpu"
    for bucket in table.buckets:
        exact = cost.work(bucket.tokens, AttentionSpec(method="full"))
        for measured in bucket.configs:
            estimated = cost.work(bucket.tokens, measured.spec) / exact
            ratio = estimated / (measured.ms / bucket.exact_ms)
            assert 1 / 3 <= ratio <= 3, (bucket.tokens, measured.spec.to_json(), ratio)


def test_the_default_budget_lets_every_default_and_calibrated_configuration_run_at_the_longest_input(
    default_encoder, cost
):
    longest = default_encoder.max_input_tokens
    defaults = [dataclasses.replace(AttentionSpec(), method=m) for m in ("full", *APPROXIMATE_METHODS)]
    calibrated = [m.spec for b in default_encoder.calibration.buckets for m in b.configs]
    budget = default_budget(cost, longest, defaults + calibrated)
    for spec in defaults + calibrated:
        assert over_budget(cost, [(longest, spec)] * BUDGET_INPUTS, budget) is None, spec


def test_a_request_over_budget_names_the_knob_that_drives_it_and_the_largest_value_that_fits(cost):
    # The heavy-but-legal request: every knob at a value the schema allows, on ~14k tokens.
    heavy = AttentionSpec(method="i-clustered", clusters=4096, topk=4096, iterations=100, refine=100)
    budget = default_budget(cost, 32768, [AttentionSpec(method="full")])
    verdict = over_budget(cost, [(14000, heavy)], budget)
    assert verdict is not None and verdict.work > 2 * budget
    # Clusters multiply the K-means, the refinement and the centroid pass: set back to the
    # default, they save the most.
    assert verdict.knob == "clusters"
    fits = dataclasses.replace(heavy, clusters=verdict.largest)
    assert over_budget(cost, [(14000, fits)], budget) is None
    assert over_budget(cost, [(14000, dataclasses.replace(fits, clusters=verdict.largest + 1))], budget) is not None


def test_inputs_too_many_for_any_knob_are_named_as_such(cost):
    budget = default_budget(cost, 1000, [AttentionSpec(method="full")])
    verdict = over_budget(cost, [(1000, AttentionSpec(method="full"))] * (BUDGET_INPUTS + 1), budget)
    assert verdict is not None and verdict.knob is None and verdict.largest is None
