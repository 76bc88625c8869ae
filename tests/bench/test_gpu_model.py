"""`python -m bench.gpu_model` on the budget's shapes (B = 1, 12 heads x 64, bfloat16, sm_90, no
GPU): the offline cost model runs on every launch the pipelines record, every loop of every
kernel gets a trip count, its validation kernel stays within its published figures' band, and
the time budgets of the GPU path hold (DESIGN.md, "The GPU path"):

- every launch at 16k has at least 132 programs or an estimated time of at most 10 us;
- estimated speed-up over FlashAttention-2 at the same shape: i-clustered 100/32 >= 3x at 16k and
  >= 10x at 64k, clustered 200 >= 3x at 16k, SMYRF 4x64 >= 4x at 16k.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUDGET_METHODS = ["clustered 100", "i-clustered 100/32 (paper)", "i-clustered 100/32", "smyrf 4x64", "clustered 200"]
SMS = 132
NEGLIGIBLE_US = 10.0

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_model") / "model.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it compiles: no interpreter
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu_model", "--lengths", "16384", "65536", "--head-dims", "64",
         "--methods", *BUDGET_METHODS, "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(out.read_text())


def call(model: dict, method: str, seq_len: int) -> dict:
    (found,) = [c for c in model["calls"] if c["method"] == method and c["seq_len"] == seq_len]
    return found


def test_report_is_an_estimate_with_the_stable_fields(model):
    assert model["label"] == "estimate, sm_90 offline, no GPU"
    assert {(c["method"], c["seq_len"]) for c in model["calls"]} == {
        (m, n) for m in BUDGET_METHODS for n in (16384, 65536)}
    for c in model["calls"]:
        assert c["head_dim"] == 64 and c["dtype"] == "bfloat16"
        assert c["launches"] and c["est_ms"] > 0 and c["exact_fa2_ms"] > c["exact_fa3_ms"] > 0
        assert c["est_speedup_fa2"] == pytest.approx(c["exact_fa2_ms"] / c["est_ms"], rel=1e-3)  # 4 digits
        for launch in c["launches"]:
            assert launch["kernel"] and launch["programs"] >= 1 and launch["est_us"] > 0, launch
        total_us = sum(r["est_us"] for r in c["launches"]) + sum(op["us"] for op in c["torch_ops"])
        assert c["est_ms"] == pytest.approx(total_us / 1e3, rel=1e-3)


def test_every_loop_of_every_kernel_has_a_trip_count(model):
    kernels = set()
    for c in model["calls"]:
        for launch in c["launches"]:
            kernels.add(launch["kernel"])
            for loop in launch["loops"]:
                counted = re.fullmatch(r"\w+\.py:\d+( < \w+\.py:\d+)*: ([\d.e+-]+) trips, (\d+) instructions a trip, "
                                       r"[\d.e+-]+ runs a program", loop)
                assert counted and float(counted[2]) >= 0 and int(counted[3]) > 0, (launch["kernel"], loop)
    assert {"_hash_kernel", "_hamming_assign_kernel", "_smyrf_attention_kernel"} <= kernels


def test_exact_attention_is_flash_attention_published_throughput(model):
    # 4 N^2 d x 12 heads at 324 (FA2) and 497 (FA3) TFLOP/s, FlashAttention-3's figure at 16k, d = 64.
    c = call(model, "i-clustered 100/32", 16384)
    assert c["exact_fa2_ms"] == pytest.approx(4 * 12 * 16384**2 * 64 / 324e9, rel=1e-3)
    assert c["exact_fa3_ms"] == pytest.approx(4 * 12 * 16384**2 * 64 / 497e9, rel=1e-3)


def test_model_within_half_of_published_flash_attention_throughput(model):
    assert len(model["validation"]) >= 4
    for row in model["validation"]:
        assert -0.5 <= row["error"] <= 0.5, row


@pytest.mark.parametrize("method", BUDGET_METHODS)
def test_every_launch_at_16k_fills_the_gpu_or_is_negligible(model, method):
    small = [(r["kernel"], r["programs"], round(r["est_us"], 1)) for r in call(model, method, 16384)["launches"]
             if r["programs"] < SMS and r["est_us"] > NEGLIGIBLE_US]
    assert not small, small


def test_i_clustered_3x_exact_at_16k(model):
    assert call(model, "i-clustered 100/32", 16384)["est_speedup_fa2"] >= 3


def test_i_clustered_10x_exact_at_64k(model):
    assert call(model, "i-clustered 100/32", 65536)["est_speedup_fa2"] >= 10


def test_clustered_200_3x_exact_at_16k(model):
    assert call(model, "clustered 200", 16384)["est_speedup_fa2"] >= 3


def test_smyrf_4x_exact_at_16k(model):
    assert call(model, "smyrf 4x64", 16384)["est_speedup_fa2"] >= 4
