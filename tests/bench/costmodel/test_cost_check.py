"""clusterserve.bench.costmodel.cost_check's fit of the work estimate's weights, on tables made from known weights,
and --write's rewrite of models/planning/cost.py's WEIGHTS block, on a copy of the file."""

from __future__ import annotations

import ast
import dataclasses

import pytest

from clusterserve.bench.costmodel.cost_check import COST_FILE, EXACT, fit, ratios, write_weights
from clusterserve.kernels import AttentionSpec
from clusterserve.models.planning.calibration import Bucket, Calibration, Measured
from clusterserve.models.planning.cost import WEIGHTS, CostModel

# all-MiniLM-L6-v2's shape: 6 layers of 12 heads x 32.
SHAPE = CostModel(per_token=21293568.0, heads=12, head_dim=32, global_layers=6)
GRID = [
    AttentionSpec(method="clustered", clusters=200, iterations=3, refine=2),
    AttentionSpec(method="clustered", clusters=800),
    AttentionSpec(method="i-clustered", clusters=100, topk=32, iterations=10),
    AttentionSpec(method="i-clustered", clusters=400, topk=64, refine=0),
    AttentionSpec(method="i-clustered", clusters=200, topk=256),
    AttentionSpec(method="smyrf", hash_rounds=4, cluster_size=64),
    AttentionSpec(method="smyrf", hash_rounds=8, cluster_size=128),
]


def made_table(cost: CostModel, weights: dict[str, float], speed: float) -> Calibration:
    """A table whose times are `weights`' estimate exactly, on a device of `speed` units per ms."""

    def ms(tokens: int, spec: AttentionSpec) -> float:
        return sum(weights[step] * count for step, count in cost.operations(tokens, spec).items()) / speed

    buckets = tuple(
        Bucket(tokens, ms(tokens, EXACT), tuple(Measured(spec, 0.99, 0.99, ms(tokens, spec)) for spec in GRID))
        for tokens in (1024, 2048, 4096, 8192, 16384)
    )
    return Calibration("all-MiniLM-L6-v2", "cpu", "made", "made", {"dtype": cost.dtype}, buckets)


def test_the_fit_finds_the_weights_a_table_was_made_with():
    truth = {dtype: dict(row) for dtype, row in WEIGHTS.items()}
    truth["bfloat16"]["dense"] *= 1.5  # bfloat16's dense layers slower than the shipped weights say
    for row in truth.values():
        row["gather"] *= 0.6  # the gathers cheaper, in both dtypes
    tables = [
        (cost, made_table(cost, truth[cost.dtype], speed))
        for cost, speed in ((SHAPE, 1e8), (dataclasses.replace(SHAPE, dtype="bfloat16"), 3e8))
    ]
    for cost, table in tables:  # the shipped weights are off for these tables
        assert max(abs(row["ratio"] - 1) for row in ratios(cost, table)) > 0.1
    fitted = fit(tables)
    assert fitted["bfloat16"]["dense"] == pytest.approx(truth["bfloat16"]["dense"], rel=0.1)
    assert fitted["float32"]["gather"] == pytest.approx(truth["float32"]["gather"], rel=0.1)
    assert fitted["float32"]["dense"] == 1.0  # the unit
    for cost, table in tables:
        assert all(row["ratio"] == pytest.approx(1, abs=0.05) for row in ratios(cost, table, fitted[cost.dtype]))


def weights_of(source: str) -> dict:
    """The WEIGHTS literal of a cost.py source, as Python reads it."""
    (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "WEIGHTS"]
    return ast.literal_eval(node.value)


def test_write_replaces_the_weights_block_and_nothing_else(tmp_path):
    copy = tmp_path / "cost.py"
    copy.write_text(COST_FILE.read_text())
    assert not write_weights(WEIGHTS, copy)  # the shipped block is what --write writes for its weights
    fitted = {dtype: dict(row, sort=row["sort"] * 2, gather=1234.0) for dtype, row in WEIGHTS.items()}
    fitted["float16"] = dict(WEIGHTS["float32"], dense=0.5)
    assert write_weights(fitted, copy)
    assert weights_of(copy.read_text()) == fitted
    before, after = COST_FILE.read_text(), copy.read_text()
    start = before.index("WEIGHTS: dict")
    assert after[:start] == before[:start]  # the docstring, the imports and the marker stay
    tail = before[before.index("}  # fmt: skip\n", start):]
    assert after.endswith(tail[len("}  # fmt: skip\n"):])  # every line after the block stays
    assert write_weights(WEIGHTS, copy) and copy.read_text() == before  # and back


def test_write_refuses_a_file_without_one_weights_block(tmp_path):
    copy = tmp_path / "cost.py"
    copy.write_text("WEIGHTS = {}\n")
    with pytest.raises(ValueError, match="one WEIGHTS block"):
        write_weights(WEIGHTS, copy)
