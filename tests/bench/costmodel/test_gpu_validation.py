"""clusterserve.bench.costmodel.gpu_validation: the profiler tables parse into per-kernel device times, and each
committed device session's comparison of the cost model with its measurements (its record's
`vs_model`) is what the committed files give (regenerate it with
`python -m clusterserve.bench.costmodel.gpu_validation --session ...` after regenerating gpu_model.json)."""

import json
from pathlib import Path

import pytest

from clusterserve.bench.common import MEASURED as SPECS
from clusterserve.bench.costmodel.gpu_validation import (
    LIBRARY,
    compare,
    fixed_launch_cost,
    parse_profile,
    profiles_of,
    session_comparison,
)
from clusterserve.bench.gpu.profiles import profile_tables

RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results"
# Each H100 session's record, and the (method, length) calls it profiled that the model estimates.
RUNS = {"h100-2026-11-26.json": 15, "h100-2026-11-27.json": 7, "h100-2026-11-27-2.json": 21}

def row(name: str, self_cpu: str, self_cuda: str, calls: int) -> str:
    """A line of torch.profiler's table: its 11 columns, two spaces or more apart."""
    cells = [name, "0.00%", self_cpu, "0.00%", self_cpu, "0.000us", self_cuda, "0.07%", self_cuda, "1.0us", str(calls)]
    return "  ".join(cell.rjust(12) for cell in cells)


TABLE = "\n".join([
    "== i-clustered, 4096 tokens ==",
    "-" * 40,
    row("Name", "Self CPU", "Self CUDA", 0).replace(" 0", "# of Calls"),
    row("_hamming_assign_kernel", "0.000us", "260.485us", 11),
    row("void at::native::vectorized_elementwise_kernel<4, at...", "0.000us", "1.500ms", 1),
    row("aten::fill_", "10.304us", "2.000us", 2),
    row("cudaLaunchKernel", "167.675us", "0.000us", 48),
    "-" * 40,
])


def test_a_profile_table_gives_each_kernels_device_time_and_launches():
    kernels = parse_profile(TABLE)[("i-clustered", 4096)]
    # Kernel rows only (no CPU time of their own): not the op that launched them, not the API call.
    assert kernels == {"_hamming_assign_kernel": (260.485, 11), LIBRARY: (1500.0, 1)}


def test_a_profile_table_gives_every_device_kernel_with_its_category():
    (table,) = profile_tables(TABLE + "\nSelf CUDA time total: 1.763ms\n")
    assert (table["kind"], table["method"], table["tokens"], table["device_us"]) == ("attention", "i-clustered", 4096, 1763.0)
    assert [(k["kernel"], k["launches"], k["category"]) for k in table["kernels"]] == [
        ("_hamming_assign_kernel", 11, "triton"), ("void at::native::vectorized_elementwise_kernel<4, at...", 1, "elementwise")]
    assert table["unlisted_us"] == pytest.approx(1763.0 - 260.485 - 1500.0)
    assert profiles_of([table]) == parse_profile(TABLE)


@pytest.mark.parametrize("record, calls", RUNS.items())
def test_the_committed_comparison_is_what_the_committed_files_give(record, calls):
    session = json.loads((RESULTS / record).read_text())
    model = json.loads((RESULTS / "gpu_model.json").read_text())
    fresh = session_comparison(session, model)
    assert session["vs_model"] == fresh
    # Every approximate method's profiled call was found in the model.
    compared = {(c["method"], c["tokens"]) for c in fresh["calls"] if c["method"] != "full"}
    assert len(compared) == calls


def test_a_launch_splits_into_a_fixed_cost_and_a_multiple_of_the_model():
    # on a line: the intercept and the slope
    fixed, slope = fixed_launch_cost([(10.0, 25.0), (40.0, 85.0), (160.0, 325.0)])
    assert fixed == pytest.approx(5.0) and slope == pytest.approx(2.0)
    # a model that hardly moves with length: all the excess is fixed, the slope 1
    assert fixed_launch_cost([(4.0, 11.0), (4.2, 13.4), (4.2, 14.0)]) == (pytest.approx(26.0 / 3), 1.0)
    # a negative intercept is no cost: the slope alone, through the origin
    fixed, slope = fixed_launch_cost([(10.0, 5.0), (20.0, 25.0), (40.0, 65.0)])
    assert fixed == 0.0 and slope == pytest.approx((50 + 500 + 2600) / (100 + 400 + 1600))


def test_a_kernel_launched_a_different_number_of_times_gets_no_ratio():
    """The measured call ran one kernel three times where the model launches it once (kernels
    fused since): its times are of different work, so it has no ratio and no fit."""
    model = {"calls": [{"spec": SPECS["smyrf"].used_knobs(), "seq_len": 4096, "head_dim": 64, "method": "smyrf 4x64",
                        "kernels": {"_a_kernel": {"launches": 1, "est_us": 10.0}, "_b_kernel": {"launches": 1, "est_us": 4.0}},
                        "torch_ops": [], "device_ms": 0.014, "est_ms": 0.024}]}
    profiles = {("smyrf", 4096): {"_a_kernel": (20.0, 1), "_b_kernel": (12.0, 3)}}
    rows = [{"method": "smyrf", "seq_len": 4096, "head_dim": 64, "graph_ms": 0.05}]
    report = compare(rows, profiles, model)
    ratios = {r["kernel"]: (r["launches"], r["model_launches"], r["ratio"]) for r in report["kernels"]}
    assert ratios == {"_a_kernel": (1, 1, 2.0), "_b_kernel": (3, 1, None)}
    assert report["spread"]["kernels"] == 1 and report["fits"] == []
