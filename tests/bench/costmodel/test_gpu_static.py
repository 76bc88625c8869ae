"""`python -m clusterserve.bench.costmodel.gpu_static` for sm_90 on the shapes of one 16k-token call (B = 1, 12 heads
x 64, bfloat16): every Triton kernel compiles for an H100 with the launchers' own block
sizes, and the report's figures are read from what the compiler made.

The budget tests below are the structural ones the GPU pipeline has to meet: no spills at
d <= 64 in bfloat16, every half-precision dot on tensor cores, no acq_rel atomics. The time
budgets (grids that fill the GPU, speed-ups over exact attention) are test_gpu_model.py's.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# The kernels of the recorded calls (the refinement's _donor_kernel runs only past 256 clusters,
# which none of them has: the interpreter tests run it).
KERNELS = {"_hash_kernel", "_seed_means_kernel", "_hamming_initial_kernel", "_hamming_step_kernel", "_hamming_assign_kernel",
           "_hamming_update_kernel",
           "_sums_kernel", "_means_kernel", "_candidates_kernel", "_means_candidates_kernel", "_nearest_kernel",
           "_centroid_attention_kernel", "_centroid_combine_kernel", "_centroid_topk_kernel",
           "_centroid_topk_combine_kernel", "_layout_counts_kernel",
           "_layout_scatter_kernel", "_broadcast_kernel", "_improved_tile_kernel", "_smyrf_norms_kernel",
           "_smyrf_hash_kernel", "_smyrf_attention_kernel", "_pool_kernel", "_choice_scores_kernel",
           "_top_blocks_kernel", "_banded_kernel"}


def run_report(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it compiles: no interpreter
    return subprocess.run(
        [sys.executable, "-m", "clusterserve.bench.costmodel.gpu_static", "--arch", "90", "--lengths", "16384",
         "--head-dims", "64", "--dtypes", "bfloat16", "--out", str(out), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_static") / "report.json"
    result = run_report(out)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = json.loads(out.read_text())
    data["stdout"] = result.stdout
    return data


def violated(report: dict, budget: str) -> list[dict]:
    return [v for v in report["violations"] if v["budget"] == budget]


def test_every_kernel_compiles_for_sm90(report):
    assert {k["kernel"] for k in report["kernels"]} == KERNELS
    failed = [f"{k['kernel']}: {k['error']}" for k in report["kernels"] if not k["compiled"]]
    assert not failed, failed
    for k in report["kernels"]:
        assert k["arch"] == 90 and 0 < k["registers"] <= 255 and k["num_warps"] > 0, k
        assert k["spill_bytes"] >= 0 and k["shared_bytes"] >= 0, k


def test_every_call_is_counted(report):
    calls = {c["method"]: c for c in report["calls"]}
    assert set(calls) == {"clustered", "i-clustered (paper)", "i-clustered", "smyrf", "banded", "clustered 200",
                          "i-clustered (seeded)"}
    for call in calls.values():
        assert (call["seq_len"], call["head_dim"], call["dtype"]) == (16384, 64, "bfloat16")
        assert call["triton_launches"] == sum(call["launches_by_kernel"].values()) > 0
        assert call["kernels"] == call["triton_launches"] + call["torch_ops"]
    # 4 SMYRF rounds, one attention launch each; the Hamming K-means one launch per iteration
    # (10, as bench.common's SPECS pin) and the final assignment, two per iteration past 128
    # clusters; the refinement two per step where the means fit one tile of 128 x 64 (the
    # donors' candidates taken by the means launch), three past it (3 steps; the donors put in
    # place by the nearest-mean search up to 256 clusters, a launch of their own past them). Up
    # to 128 clusters no launch of its own sums the queries (the K-means' final launch and the
    # refinement's last step do); past them the refinement's start and the cluster means each
    # take one.
    assert calls["smyrf"]["launches_by_kernel"]["_smyrf_attention_kernel"] == 4
    # banded: one launch a stage but select's two (the scores, their top far blocks)
    assert calls["banded"]["launches_by_kernel"] == {"_pool_kernel": 1, "_choice_scores_kernel": 1,
                                                      "_top_blocks_kernel": 1, "_banded_kernel": 1}
    clustered = calls["clustered"]["launches_by_kernel"]
    assert clustered["_hamming_step_kernel"] == 11 and "_hamming_update_kernel" not in clustered
    wide = calls["clustered 200"]["launches_by_kernel"]
    assert wide["_hamming_assign_kernel"] == 11 and wide["_hamming_update_kernel"] == 10
    assert clustered["_nearest_kernel"] == clustered["_means_candidates_kernel"] == 3 and "_sums_kernel" not in clustered
    assert "_candidates_kernel" not in clustered and wide["_candidates_kernel"] == wide["_nearest_kernel"] == 3
    assert "_donor_kernel" not in clustered and "_donor_kernel" not in wide
    assert wide["_sums_kernel"] == 2
    # Without codes: the seeds, their nearest-mean step and 2 refinement steps, no hash or K-means.
    seeded = calls["i-clustered (seeded)"]["launches_by_kernel"]
    assert seeded["_seed_means_kernel"] == 1 and seeded["_nearest_kernel"] == 3 and seeded["_means_candidates_kernel"] == 2
    assert not {"_hash_kernel", "_hamming_initial_kernel", "_hamming_step_kernel"} & set(seeded)
    assert "VIOLATION" in report["stdout"] or not report["violations"]


def test_strict_exits_1_exactly_when_a_budget_is_broken(report, tmp_path):
    result = run_report(tmp_path / "strict.json", "--strict")
    assert result.returncode == (1 if report["violations"] else 0), result.stdout[-2000:] + result.stderr[-2000:]


def test_no_spills_at_head_dim_64_in_bfloat16(report):
    assert not violated(report, "no spills")


def test_every_bfloat16_dot_on_tensor_cores(report):
    assert not violated(report, "tensor cores")


def test_no_acq_rel_atomics(report):
    assert not violated(report, "no acq_rel atomics")


class _DriverConfig:
    """Triton's driver registry as versions before 3.5 keep it: the active driver in `active`."""

    def __init__(self, active):
        self.active = active

    def set_active(self, driver):
        self.active = driver


class _PrivateDriverConfig:
    """As Triton >= 3.5 keeps it: in `_active`, behind a read-only property."""

    def __init__(self, active):
        self._active = active

    @property
    def active(self):
        return self._active

    def set_active(self, driver):
        self._active = driver


@pytest.mark.parametrize("config", [_DriverConfig, _PrivateDriverConfig])
def test_targeting_restores_the_driver_of_either_triton_layout(config, monkeypatch):
    # The compile runs under the Docker image's Triton (3.4) as well as this checkout's.
    import importlib

    from clusterserve.bench.costmodel.compiling import targeting

    before = object()
    registry = config(before)
    monkeypatch.setattr(importlib.import_module("triton.runtime.driver"), "driver", registry)
    with targeting(90):
        target = registry.active.get_current_target()
        assert (target.backend, target.arch, target.warp_size) == ("cuda", 90, 32)
    assert registry.active is before
