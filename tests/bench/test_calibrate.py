"""clusterserve.bench.calibrate's measurement on a small model: what it times and what the table records."""

from __future__ import annotations

import pytest

from clusterserve.bench.calibrate import measure
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
