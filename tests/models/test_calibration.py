"""Calibration tables: parsing, validation errors, the choice for a target, the frontier."""

from __future__ import annotations

import copy
import json

import pytest

from clusterserve.kernels import AttentionSpec
from clusterserve.models.planning.calibration import (
    FORMAT,
    SHIPPED_DIR,
    CalibrationError,
    find_calibration,
    load_calibration,
    parse_calibration,
    speedup_at,
    table_name,
)


def config(method: str, fidelity: float, ms: float, **knobs) -> dict:
    return {"attention": {"method": method, **knobs}, "fidelity_min": fidelity, "fidelity_mean": fidelity, "ms": ms}


TABLE = {
    "format": FORMAT,
    "model": "m",
    "device": "cpu",
    "buckets": [
        # Short: every approximation is slower than exact.
        {"tokens": 1024, "exact_ms": 100.0, "configs": [config("smyrf", 0.95, 150.0), config("i-clustered", 0.99, 300.0)]},
        {
            "tokens": 8192,
            "exact_ms": 4000.0,
            "configs": [
                config("smyrf", 0.95, 1000.0),
                config("i-clustered", 0.985, 2000.0, clusters=100),
                config("i-clustered", 0.993, 2500.0, clusters=200),
                config("clustered", 0.98, 2600.0, clusters=200),  # dominated: slower and worse than 100 clusters
            ],
        },
    ],
}


def test_choose_fastest_meeting_target_per_bucket():
    table = parse_calibration(TABLE, "test")
    assert table.choose(8192, 0.9).spec == AttentionSpec(method="smyrf")
    assert table.choose(100_000, 0.98).spec == AttentionSpec(method="i-clustered", clusters=100)
    chosen = table.choose(8192, 0.99)
    assert chosen.spec == AttentionSpec(method="i-clustered", clusters=200)
    assert (chosen.bucket, chosen.fidelity, chosen.speedup) == (8192, 0.993, 4000.0 / 2500.0)
    # None meets the target: exact. Short input: exact is fastest whatever the target.
    assert table.choose(8192, 0.995).spec.method == "full"
    assert table.choose(1024, 0.9).spec.method == "full"
    assert table.choose(1024, 0.9).fidelity == 1.0


def test_an_approximation_within_a_tenth_of_exact_is_not_chosen():
    near = {**TABLE, "buckets": [{"tokens": 1024, "exact_ms": 100.0, "configs": [config("clustered", 0.99, 95.0)]}]}
    assert parse_calibration(near, "test").choose(1024, 0.98).spec.method == "full"
    pays = {**TABLE, "buckets": [{"tokens": 1024, "exact_ms": 100.0, "configs": [config("clustered", 0.99, 90.0)]}]}
    chosen = parse_calibration(pays, "test").choose(1024, 0.98)
    assert chosen.spec.method == "clustered" and chosen.speedup == 100.0 / 90.0


def test_bucket_is_the_next_longer_one_and_the_longest_beyond():
    table = parse_calibration(TABLE, "test")
    assert [table.bucket_for(n).tokens for n in (1, 1024, 1025, 8192, 100_000)] == [1024, 1024, 8192, 8192, 8192]


def test_an_input_between_buckets_is_judged_by_both():
    # 200 clusters meet 0.98 at 2048 but not at 1024 (a short document's vector averages fewer
    # tokens' errors): an input in between takes only what meets the target at both. Its
    # speed-up is the line between the two buckets': SMYRF pays 2.67x at 2048 and not at 1024,
    # so it runs from where the line crosses 1.1x.
    between = {**TABLE, "buckets": [
        {"tokens": 1024, "exact_ms": 100.0, "configs": [config("clustered", 0.97, 80.0, clusters=200),
                                                        config("clustered", 0.99, 85.0, clusters=400),
                                                        config("smyrf", 0.99, 99.0)]},
        {"tokens": 2048, "exact_ms": 400.0, "configs": [config("clustered", 0.985, 200.0, clusters=200),
                                                        config("clustered", 0.99, 250.0, clusters=400),
                                                        config("smyrf", 0.99, 150.0)]},
    ]}  # fmt: skip
    table = parse_calibration(between, "test")
    assert [b.tokens for b in table.around(1500)] == [1024, 2048]
    assert [b.tokens for b in table.around(2048)] == [2048] and [b.tokens for b in table.around(9000)] == [2048]
    assert table.around(1000) == ()
    assert table.choose(2048, 0.98).spec == AttentionSpec(method="smyrf")
    near_short = table.choose(1030, 0.98)  # smyrf ~1.02x here; 200 clusters miss the target at 1024
    assert near_short.spec == AttentionSpec(method="clustered", clusters=400)
    assert (near_short.bucket, near_short.fidelity) == (2048, 0.99)
    assert near_short.speedup == pytest.approx(100 / 85 + (400 / 250 - 100 / 85) * 6 / 1024)
    middle = table.choose(1500, 0.98)
    assert middle.spec == AttentionSpec(method="smyrf")
    assert middle.speedup == pytest.approx(100 / 99 + (400 / 150 - 100 / 99) * 476 / 1024)
    assert table.choose(1500, 0.995).spec.method == "full"
    assert table.choose(1000, 0.5).spec.method == "full"  # shorter than every bucket: exact


def test_the_speedup_between_buckets_is_the_line_through_theirs():
    assert speedup_at(3000, [(2048, 1.5)]) == 1.5
    assert speedup_at(1024, [(1024, 1.0), (2048, 1.4)]) == 1.0
    assert speedup_at(1536, [(1024, 1.0), (2048, 1.4)]) == pytest.approx(1.2)
    assert speedup_at(2048, [(1024, 1.0), (2048, 1.4)]) == pytest.approx(1.4)


def test_choice_keeps_the_request_seed():
    table = parse_calibration(TABLE, "test")
    assert table.choose(8192, 0.98, seed=7).spec.seed == 7
    assert table.choose(1024, 0.98, seed=7).spec == AttentionSpec(method="full")


def test_late_chunks_are_judged_by_their_own_fidelity_where_the_table_measured_it():
    chunked = copy.deepcopy(TABLE)
    late = {"smyrf": 0.9, "i-clustered": 0.97, "clustered": 0.96}  # a chunk keeps less than its document
    for bucket in chunked["buckets"]:
        for entry in bucket["configs"]:
            knobs = entry["attention"]
            entry["chunk_fidelity_min"] = 0.995 if knobs.get("clusters") == 200 else late[knobs["method"]]
    table = parse_calibration(chunked, "test")
    assert table.has_chunk_fidelity
    assert table.choose(8192, 0.98).spec == AttentionSpec(method="i-clustered", clusters=100)  # the document's
    chosen = table.choose(8192, 0.98, chunks=True)  # 100 clusters keep 0.97 of a chunk: 200 are needed
    assert chosen.spec == AttentionSpec(method="i-clustered", clusters=200) and chosen.chunks
    assert (chosen.fidelity, chosen.echo(0.98)["calibrated_for"]) == (0.995, "late chunks")
    assert table.choose(8192, 0.996, chunks=True).spec.method == "full"
    assert "calibrated_for" not in table.choose(8192, 0.98).echo(0.98)
    point = next(p for p in table.info()["frontier"][1]["points"] if p["attention"]["method"] == "smyrf")
    assert point["chunk_fidelity_min"] == 0.9
    # A table without the column judges late chunks by the document's fidelity, as before it.
    plain = parse_calibration(TABLE, "test")
    assert not plain.has_chunk_fidelity
    assert plain.choose(8192, 0.98, chunks=True) == plain.choose(8192, 0.98)
    # Partly measured: the column is not used at all, not half-used.
    del chunked["buckets"][0]["configs"][0]["chunk_fidelity_min"]
    assert parse_calibration(chunked, "test").choose(8192, 0.98, chunks=True).spec.clusters == 100


def test_frontier_is_the_pareto_set_fastest_first():
    bucket = parse_calibration(TABLE, "test").buckets[1]
    frontier = bucket.frontier()
    assert [(m.spec.method, m.ms) for m in frontier] == [
        ("smyrf", 1000.0),
        ("i-clustered", 2000.0),
        ("i-clustered", 2500.0),
        ("full", 4000.0),
    ]
    everything = (bucket.exact(), *bucket.configs)
    for point in frontier:  # nothing is both faster and at least as faithful
        assert not any(o.ms < point.ms and o.fidelity_min >= point.fidelity_min for o in everything)


def test_info_lists_each_bucket_frontier_with_speedups():
    info = parse_calibration(TABLE, "test").info()
    assert [b["tokens"] for b in info["frontier"]] == [1024, 8192]
    short = info["frontier"][0]["points"]
    assert [p["attention"]["method"] for p in short] == ["full"] and short[0]["speedup"] == 1.0
    assert info["frontier"][1]["points"][0]["speedup"] == 4.0


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda t: t.update(format="other/9"), "format"),
        (lambda t: t.pop("model"), "model"),
        (lambda t: t.update(buckets=[]), "buckets"),
        (lambda t: t["buckets"][0].update(tokens=0), "buckets[0].tokens"),
        (lambda t: t["buckets"][0].update(exact_ms="fast"), "buckets[0].exact_ms"),
        (lambda t: t["buckets"][1]["configs"][1].update(fidelity_min=1.5), "buckets[1].configs[1].fidelity_min"),
        (lambda t: t["buckets"][1]["configs"][1].pop("ms"), "buckets[1].configs[1].ms"),
        (lambda t: t["buckets"][1]["configs"][1].update(chunk_fidelity_min="high"), "configs[1].chunk_fidelity_min"),
        (lambda t: t["buckets"][1].update(exact_chunk_fidelity_min=2), "buckets[1].exact_chunk_fidelity_min"),
        (lambda t: t["buckets"][1]["configs"][1]["attention"].update(clusters=0), "buckets[1].configs[1].attention"),
        (lambda t: t["buckets"][1]["configs"][1]["attention"].update(cluster=3), "buckets[1].configs[1].attention"),
        (lambda t: t["buckets"][1]["configs"][0]["attention"].update(method="full"), "configs[0].attention.method"),
        (lambda t: t["buckets"][1].update(tokens=1024), "buckets: two buckets"),
    ],
)
def test_malformed_table_names_file_and_field(edit, field):
    raw = copy.deepcopy(TABLE)
    edit(raw)
    with pytest.raises(CalibrationError, match=r"calibration table test: .*") as caught:
        parse_calibration(raw, "test")
    assert field in str(caught.value)


def test_missing_or_unreadable_file_is_a_calibration_error(tmp_path):
    with pytest.raises(CalibrationError, match="does not exist"):
        load_calibration(tmp_path / "nope.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(CalibrationError, match="not readable JSON"):
        load_calibration(broken)


def test_find_prefers_the_model_folder_then_the_shipped_table(tmp_path):
    assert find_calibration("no-such-model", tmp_path, "cpu") is None
    (tmp_path / "calibration.cpu.json").write_text(json.dumps(TABLE))
    assert find_calibration("no-such-model", tmp_path, "cpu") == tmp_path / "calibration.cpu.json"
    shipped = SHIPPED_DIR / table_name("all-MiniLM-L6-v2", "cpu")
    assert find_calibration("all-MiniLM-L6-v2", None, "cpu") == shipped
    assert find_calibration("all-MiniLM-L6-v2", None, "cpu", "bfloat16") == SHIPPED_DIR / table_name(
        "all-MiniLM-L6-v2", "cpu", "bfloat16"
    )


def test_without_a_table_for_the_dtype_the_float32_one_of_the_device_kind_serves(tmp_path):
    (tmp_path / "calibration.cpu.json").write_text(json.dumps(TABLE))
    assert find_calibration("no-such-model", tmp_path, "cpu", "bfloat16") == tmp_path / "calibration.cpu.json"
    (tmp_path / "calibration.cpu-bf16.json").write_text(json.dumps(TABLE))
    assert find_calibration("no-such-model", tmp_path, "cpu", "bfloat16") == tmp_path / "calibration.cpu-bf16.json"


def test_a_device_kind_without_a_table_takes_the_cpus(tmp_path):
    """On a GPU with no CUDA table, auto's choices keep the CPU table's measured fidelities
    instead of falling back to the length threshold (i-clustered from 1,024 tokens, which an
    H100 ran 5-10x slower than exact attention up to 4k, at fidelity nobody measured)."""
    assert find_calibration("no-such-model", tmp_path, "cuda", "bfloat16") is None
    (tmp_path / "calibration.cpu.json").write_text(json.dumps(TABLE))
    assert find_calibration("no-such-model", tmp_path, "cuda", "bfloat16") == tmp_path / "calibration.cpu.json"
    (tmp_path / "calibration.cpu-bf16.json").write_text(json.dumps(TABLE))
    # The CPU's float32 table before its bfloat16 one: the choices an H100 ran end to end.
    assert find_calibration("no-such-model", tmp_path, "cuda", "bfloat16") == tmp_path / "calibration.cpu.json"
    (tmp_path / "calibration.cpu.json").unlink()
    assert find_calibration("no-such-model", tmp_path, "cuda", "bfloat16") == tmp_path / "calibration.cpu-bf16.json"
    (tmp_path / "calibration.cuda.json").write_text(json.dumps(TABLE))
    assert find_calibration("no-such-model", tmp_path, "cuda", "bfloat16") == tmp_path / "calibration.cuda.json"
    # The shipped CPU tables serve on a GPU, float32's though both models ship a bfloat16 one.
    for model in ("nomic-embed-text-v1.5", "all-MiniLM-L6-v2"):
        assert (SHIPPED_DIR / table_name(model, "cpu", "bfloat16")).is_file()
        assert find_calibration(model, None, "cuda", "bfloat16") == SHIPPED_DIR / table_name(model, "cpu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shipped_default_tables_pick_exact_short_and_approximate_long(dtype):
    table = load_calibration(SHIPPED_DIR / table_name("all-MiniLM-L6-v2", "cpu", dtype))
    assert (table.model, table.device, table.dtype) == ("all-MiniLM-L6-v2", "cpu", dtype)
    assert [b.tokens for b in table.buckets][-5:] == [2048, 4096, 8192, 16384, 32768]
    # Inputs shorter than the first bucket take its choice: it must be exact attention, which
    # is the fastest there (clustered at a few hundred tokens is slower than exact).
    assert table.buckets[0].tokens <= 1024
    for target in (0.95, 0.98, 0.99, 0.995):
        assert table.choose(300, target).spec.method == "full"
    long = table.choose(16384, 0.98)
    assert long.spec.method != "full" and long.speedup > 1 and long.fidelity >= 0.98
