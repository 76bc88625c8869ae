"""clusterserve.bench.gpu.shapes on Triton's interpreter at tiny sizes: the script runs every method under a
variant beside the shipped shape, and a variant's constants hold for its calls only."""

import json

import torch

from clusterserve.bench.gpu import shapes
from clusterserve.kernels.triton import banded, helpers


def test_a_variant_patches_its_constants_and_restores_them():
    before = helpers.TARGET_PROGRAMS, banded.key_tile
    with shapes.patched(shapes.VARIANTS["programs x2"][1] | shapes.VARIANTS["banded 128-key tiles"][1]):
        assert helpers.TARGET_PROGRAMS == 528 and banded.key_tile(64, torch.bfloat16, False) == 128
    assert (helpers.TARGET_PROGRAMS, banded.key_tile) == before


def test_the_script_times_each_method_under_its_variants(tmp_path):
    assert shapes.main(["--lengths", "48", "--repeats", "1", "--variants", "programs x2", "banded 128-key tiles",
                            "--out", str(tmp_path), "--name", "dry"]) == 0
    rows = json.loads((tmp_path / "dry-shapes.json").read_text())
    got = {(r["method"], r["variant"]) for r in rows}
    assert got == {(m, "shipped") for m in (*shapes.CLUSTERED, "banded")} | \
        {(m, "programs x2") for m in shapes.CLUSTERED} | {("banded", "banded 128-key tiles")}
    for row in rows:
        assert row["graph_ms"] > 0 and 0 <= row["err_to_exact"] < 3
        # one chunk a head at 48 tokens: every variant computes what the shipped shape does
        assert row["err_to_shipped"] == 0 and row["vs_shipped"] > 0
