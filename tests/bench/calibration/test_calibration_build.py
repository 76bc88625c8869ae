"""clusterserve.bench.calibration.build's measurement on a small model: what it times and what the table records."""

from __future__ import annotations

import pytest

from clusterserve.bench.calibration.build import measure
from clusterserve.bench.common import CALIBRATION_TEXTS, LICENSE_DIR
from clusterserve.kernels import AttentionSpec
from clusterserve.models import load_encoder
from clusterserve.models.planning.calibration import parse_calibration


@pytest.mark.skipif(not (LICENSE_DIR / CALIBRATION_TEXTS[0]).is_file(), reason="needs Debian's license texts")
@pytest.mark.parametrize("repeats, calls", [(None, 3), (2, 2)])
def test_every_bucket_records_how_many_calls_its_times_are_the_median_of(repeats, calls):
    encoder = load_encoder("all-MiniLM-L6-v2")
    grid = [AttentionSpec(method="banded", band=1, block=32, sinks=1, far_blocks=0)]
    raw = measure(encoder, [256], docs=1, grid=grid, repeats=repeats)
    (bucket,) = raw["buckets"]
    assert bucket["tokens"] == 256 and bucket["timed_calls"] == calls
    (config,) = bucket["configs"]
    assert config["attention"]["method"] == "banded" and 0 < config["fidelity_min"] <= 1 and config["ms"] > 0
    table = parse_calibration(raw, "measured here")
    assert table.choose(256, 0.5).spec.method in ("banded", "full")


def test_every_shipped_table_has_its_recipe():
    """`make calibrate` (--shipped) measures again exactly the tables the package ships."""
    from clusterserve.bench.calibration.build import SHIPPED
    from clusterserve.models.planning.calibration import SHIPPED_DIR, load_calibration, shipped_tables, table_name

    names = {table_name(r["model"], "cpu", r["dtype"]) for r in SHIPPED}
    assert names == {p.name for p in shipped_tables()}
    for recipe in SHIPPED:
        table = load_calibration(SHIPPED_DIR / table_name(recipe["model"], "cpu", recipe["dtype"]))
        assert [b.tokens for b in table.buckets] == recipe["lengths"], recipe
        assert "grid" not in recipe or recipe["grid"].is_file()


@pytest.mark.parametrize("model, dtype, count", [(None, None, 4), ("minilm", None, 2), ("nomic", "bfloat16", 1),
                                                 ("all-MiniLM-L6-v2", "float32", 1), ("unknown", None, 0)])
def test_the_shipped_recipes_are_picked_by_model_alias_and_dtype(model, dtype, count):
    from clusterserve.bench.calibration.build import shipped_recipes

    assert len(shipped_recipes(model, dtype)) == count
