"""A GPU without a calibration table of its own: the CPU's table's fidelities, ranked by the
offline end-to-end estimate of each method's speed-up on a GPU (models.planning.gpu_estimate):
exact attention wherever no configuration meeting the target is estimated >= 1.1x faster."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_calibration import TABLE

from clusterserve.models.loader import _calibration
from clusterserve.models.planning.calibration import SHIPPED_DIR, parse_calibration
from clusterserve.models.planning.gpu_estimate import estimate_name, estimated_speedup, load_gpu_speedups

SPEEDUPS = {"i-clustered": ((2048, 0.8), (8192, 1.5), (16384, 1.2)), "smyrf": ((8192, 1.05),)}


def test_estimated_speedup_interpolates_and_holds_its_ends():
    points = SPEEDUPS["i-clustered"]
    assert estimated_speedup(SPEEDUPS, "i-clustered", 1000) == 0.8
    assert estimated_speedup(SPEEDUPS, "i-clustered", 5120) == pytest.approx(1.15)
    assert estimated_speedup(SPEEDUPS, "i-clustered", 65536) == points[-1][1]
    assert estimated_speedup(SPEEDUPS, "banded", 8192) == 0.0  # no estimate: never faster


def test_the_estimate_ranks_and_gates_the_tables_configurations():
    cpu = parse_calibration(TABLE, "test")
    gpu = dataclasses.replace(cpu, gpu_speedups=SPEEDUPS)
    # The CPU's times pick SMYRF at 0.9; on the GPU its estimate (1.05x) is under 1.1x, and
    # i-clustered's 1.5x wins, its faster configuration by the table first.
    assert cpu.choose(8192, 0.9).spec.method == "smyrf"
    chosen = gpu.choose(8192, 0.9)
    assert chosen.spec.method == "i-clustered" and chosen.spec.clusters == 100 and chosen.speedup == 1.5
    assert gpu.choose(8192, 0.99).spec.clusters == 200  # only the 200-cluster one meets 0.99
    assert gpu.choose(3000, 0.9).spec.method == "full"  # estimated 0.98x there: exact
    assert dataclasses.replace(cpu, gpu_speedups={}).choose(8192, 0.9).spec.method == "full"
    assert gpu.info()["gpu_speedups"]["i-clustered"][1] == [8192, 1.5] and "speed_from" in gpu.info()
    assert "gpu_speedups" not in cpu.info()


def test_a_gpu_takes_the_cpu_table_with_the_shipped_estimate():
    name = "nomic-embed-text-v1.5"
    table = _calibration(name, SHIPPED_DIR, None, "cuda", torch.bfloat16)
    assert table.device == "cpu" and table.gpu_speedups == load_gpu_speedups(name) != {}
    assert _calibration(name, SHIPPED_DIR, None, "cpu", torch.float32).gpu_speedups is None
    # The shipped estimate: no method pays at 2k; the default model's at 8k.
    for method, points in table.gpu_speedups.items():
        assert dict(points)[2048] < 1.0, method
    raw = json.loads((SHIPPED_DIR / estimate_name(name)).read_text())
    assert raw["model"] == name and raw["label"].startswith("estimate")
