"""The committed offline GPU reports (bench/results/gpu_static.json, its twin compiled by the
Docker image's Triton 3.4, gpu_static-triton-3.4.json, and gpu_model.json) name only Triton
kernels that exist: a kernel renamed, fused away or deleted makes this fail until the reports
are regenerated (`python -m clusterserve.bench.gpu_static`, `python -m clusterserve.bench.gpu_model`; bench/README.md).

Nothing compiles here: the reports are read as committed and the kernels are looked up by name
in the kernels package (and bench.flash_attention, the model's validation kernel).
"""

import json
from pathlib import Path

import pytest

from clusterserve.bench.timing import triton_kernels

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def existing_kernels() -> set[str]:
    from clusterserve.bench.flash_attention import _flash_forward_kernel

    return {kernel.fn.__name__ for kernel in triton_kernels()} | {_flash_forward_kernel.fn.__name__}


def static_report_kernels(report: dict) -> set[str]:
    names = {k["kernel"] for k in report["kernels"]}
    for call in report["calls"]:
        names |= set(call["launches_by_kernel"])
    return names


def model_report_kernels(report: dict) -> set[str]:
    return {launch["kernel"] for call in report["calls"] for launch in call["launches"]}


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
                       f"(python -m clusterserve.bench.{name.removesuffix('.json').split('-')[0]})")


def test_a_stale_report_is_caught():
    report = {"calls": [{"launches": [{"kernel": "_hash_kernel"}, {"kernel": "_gone_kernel"}]}]}
    assert model_report_kernels(report) - existing_kernels() == {"_gone_kernel"}
