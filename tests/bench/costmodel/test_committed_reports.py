"""The committed offline GPU reports (bench/results/gpu_static.json, its twin compiled by the
Docker image's Triton 3.4, gpu_static-triton-3.4.json, and gpu_model.json) name only Triton
kernels that exist: a kernel renamed, fused away or deleted makes this fail until the reports
are regenerated (`python -m clusterserve.bench.costmodel.gpu_static`,
`python -m clusterserve.bench.costmodel.gpu_model`; bench/README.md).

Nothing compiles here: the reports are read as committed and the kernels are looked up by name
in the kernels package (and bench.costmodel.flash_attention, the model's validation kernel).
"""

import json
from pathlib import Path

import pytest

from clusterserve.bench.timing import triton_kernels

RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results"


def existing_kernels() -> set[str]:
    from clusterserve.bench.costmodel.flash_attention import _flash_forward_kernel

    return {kernel.fn.__name__ for kernel in triton_kernels()} | {_flash_forward_kernel.fn.__name__}


def static_report_kernels(report: dict) -> set[str]:
    names = {k["kernel"] for k in report["kernels"]}
    for call in report["calls"]:
        names |= set(call["launches_by_kernel"])
    return names


def model_report_kernels(report: dict) -> set[str]:
    return {kernel for call in report["calls"] for kernel in call["kernels"]}


def test_the_kernel_lookup_finds_the_pipelines_kernels():
    # The check below cannot pass vacuously: the lookup sees the kernels the pipelines launch.
    found = existing_kernels()
    assert {"_hash_kernel", "_hamming_assign_kernel", "_smyrf_attention_kernel", "_flash_forward_kernel"} <= found
    assert "_no_such_kernel" not in found


@pytest.mark.parametrize("name, kernels_of", [("gpu_static.json", static_report_kernels),
                                              ("gpu_static-triton-3.4.json", static_report_kernels),
                                              ("gpu_model.json", model_report_kernels)])
def test_committed_report_names_only_existing_kernels(name, kernels_of):
    report = json.loads((RESULTS / name).read_text())
    named = kernels_of(report)
    assert named, f"bench/results/{name} names no kernel"
    stale = sorted(named - existing_kernels())
    assert not stale, (f"bench/results/{name} names kernels that no longer exist: {stale}; regenerate it "
                       f"(python -m clusterserve.bench.costmodel.{name.removesuffix('.json').split('-')[0]})")


def test_a_stale_report_is_caught():
    one = {"launches": 1, "est_us": 1.0}
    report = {"calls": [{"kernels": {"_hash_kernel": one, "_gone_kernel": one}}]}
    assert model_report_kernels(report) - existing_kernels() == {"_gone_kernel"}


def test_the_committed_reports_are_the_compact_form():
    """What the commands write without --detail: the model's calls by kernel totals, no launch
    by launch; the static report's kernels by variant, without constexprs, dots or users."""
    model = json.loads((RESULTS / "gpu_model.json").read_text())
    assert all("launches" not in call and call["kernels"] for call in model["calls"])
    assert all("parts" not in op for call in model["calls"] for op in call["torch_ops"])
    for name in ("gpu_static.json", "gpu_static-triton-3.4.json"):
        for row in json.loads((RESULTS / name).read_text())["kernels"]:
            assert "variant" in row and not {"constexprs", "used_by"} & set(row), (name, row)
