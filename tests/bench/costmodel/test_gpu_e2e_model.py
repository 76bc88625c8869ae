"""clusterserve.bench.costmodel.gpu_e2e_model: the end-to-end cost model of nomic-embed-text-v1.5
on an H100 reads its constants off the committed session (bench/results/h100-2026-11-27-2.json)
and gpu_model.json, reproduces the rows it was fitted to, bounds every estimate by its limit, and
a wrong constant shows in its validation. bench/results/gpu_e2e_model.json is what the committed
inputs give (regenerate it with `python -m clusterserve.bench.costmodel.gpu_e2e_model --json`).
No GPU, nothing compiled."""

import dataclasses
import json

import pytest

from clusterserve.bench.costmodel import gpu_e2e_parts as parts
from clusterserve.bench.costmodel.gpu_e2e_model import (
    DEFAULT_JSON,
    LENGTHS,
    MODEL,
    ROW_FIELDS,
    TARGET_ERROR,
    THROUGHPUT,
    build_report,
    committed,
    embed_checks,
    gpu_estimate,
)
from clusterserve.models.planning.gpu_estimate import SHIPPED_DIR, estimate_name


@pytest.fixture(scope="module")
def inputs():
    session, estimates = parts.load_inputs()
    return session, parts.calibrate(session, estimates)


@pytest.fixture(scope="module")
def report(inputs):
    session, costs = inputs
    return json.loads(committed(build_report(costs, session)))


def errors(validation: list[dict]) -> dict[str, float]:
    return {v["what"]: v["estimate_ms"] / v["measured_ms"] - 1.0 for v in validation}


def test_the_report_has_its_fields(report):
    assert set(report) >= {"rows", "validation"}
    assert all(set(row) == set(ROW_FIELDS) for row in report["rows"])
    assert all({"what", "measured_ms", "estimate_ms", "fit"} <= set(v) for v in report["validation"])
    methods = {r["method"] for r in report["rows"] if r["batch"] == 1}
    assert {"full", "banded", "clustered (default)"} <= methods
    singles = {(r["method"], r["tokens"], r["code"]) for r in report["rows"] if r["batch"] == 1}
    assert singles == {(m, n, code) for m in methods for n in LENGTHS for code in parts.CODES}
    assert {(r["tokens"], r["batch"]) for r in report["rows"] if r["batch"] > 1} == set(THROUGHPUT)
    assert {t["what"] for t in report["targets"]} >= {"exact 2048 ms", "exact 8192 ms", "exact 16384 ms"}


def test_the_current_code_is_estimated_no_slower_and_its_row_wise_ops_cheaper(inputs):
    """Fused row-wise kernels, one QKV and gate/up product and no key mask where nothing is
    padded: never slower than the measured code, for every method, length and batch."""
    _, costs = inputs
    for method in costs.specs:
        for n, batch in [(n, 1) for n in LENGTHS] + list(THROUGHPUT):
            before, after = (parts.estimate(costs, method, n, batch, code) for code in parts.CODES)
            assert after["estimate_ms"] <= before["estimate_ms"], (method, n, batch)
            row_wise = [sum(v for k, v in e["parts_ms"].items() if k in (*parts.ROW_OPS, *parts.FUSED_RATES))
                        for e in (before, after)]
            assert row_wise[1] < 0.8 * row_wise[0], (method, n, batch, row_wise)
    assert parts.dense_launches(parts.NOMIC, 16384, "current") == 48 < parts.dense_launches(parts.NOMIC, 16384)


def test_the_committed_report_is_current(report):
    assert DEFAULT_JSON.name == "gpu_e2e_model.json"
    assert json.loads(DEFAULT_JSON.read_text()) == report, (
        "bench/results/gpu_e2e_model.json is stale: python -m clusterserve.bench.costmodel.gpu_e2e_model --json")


def test_the_shipped_gpu_estimate_is_current(inputs):
    """models/calibrations/<model>.gpu-estimate.json, which `auto` ranks by on a GPU without a
    table, is what the current code's rows give."""
    session, costs = inputs
    path = SHIPPED_DIR / estimate_name(MODEL)
    assert json.loads(path.read_text()) == gpu_estimate(build_report(costs, session)["rows"]), (
        f"{path.name} is stale: python -m clusterserve.bench.costmodel.gpu_e2e_model --json")


def test_the_fitted_rows_are_reproduced_and_exact_held_out_rows_meet_the_target(report):
    error = errors(report["validation"])
    fitted = [v["what"] for v in report["validation"] if v["fit"]]
    assert {"full 2048 eager", "full 16384 eager", "full 2048 graph", "full 16384 graph"} <= set(fitted)
    # The host and masked-SDPA constants solve the exact rows; the row-wise rates are their ops' own.
    solved = [what for what in fitted if what.startswith("full ") and "GEMM" not in what]
    assert all(abs(error[what]) < 1e-3 for what in solved), {what: error[what] for what in solved}
    assert abs(error["full 8192 eager"]) <= TARGET_ERROR and abs(error["full 8192 graph"]) <= TARGET_ERROR


def test_the_limit_bounds_every_estimate(report):
    for row in report["rows"]:
        assert 0 < row["limit_ms"] <= row["estimate_ms"], row
        assert row["host_ms"] < row["estimate_ms"], row


def test_the_limit_is_near_the_reckoned_one_for_exact(report):
    for check in report["limit_check"]:
        assert check["limit_ms"] == pytest.approx(check["reckoned_ms"], rel=0.1), check


def test_exact_grows_with_tokens(inputs):
    _, costs = inputs
    times = [parts.estimate(costs, "full", n) for n in (1024, 2048, 4096, 8192, 16384, 32768)]
    for key in ("eager_ms", "graph_ms", "limit_ms", "device_ms"):
        values = [t[key] for t in times]
        assert values == sorted(values) and len(set(values)) == len(values), (key, values)


@pytest.mark.parametrize("name, factor", [("sdpa_flops_per_s", 0.5), ("dense_flops_per_s", 0.33), ("host_op_s", 5.0)])
def test_a_wrong_constant_shows_in_the_validation(inputs, name, factor):
    session, costs = inputs
    right = errors(embed_checks(costs, session))
    wrong = errors(embed_checks(dataclasses.replace(costs, **{name: getattr(costs, name) * factor}), session))
    exact = [what for what in right if what.startswith("full ") and "eager" in what]
    assert max(abs(right[what]) for what in exact) <= TARGET_ERROR
    assert max(abs(wrong[what]) for what in exact) > TARGET_ERROR, {what: wrong[what] for what in exact}


def test_the_approximate_attention_is_gpu_models_estimate(inputs):
    _, costs = inputs
    estimates = json.loads(parts.ATTENTION_ESTIMATES.read_text())
    call = next(c for c in estimates["calls"] if c["spec"] == costs.specs["banded"] and c["seq_len"] == 8192)
    attention = parts.attention_s(costs, "banded", 8192, batch=2, masked=False)
    assert attention == pytest.approx(2 * 12 * call["device_ms"] * 1e-3)
