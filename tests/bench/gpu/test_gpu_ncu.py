"""clusterserve.bench.gpu.ncu on Triton's interpreter at tiny sizes: the script runs one call per method and
length (on a GPU, the bracketed one that Nsight Compute profiles)."""

import pytest

from clusterserve.bench.gpu import ncu


def test_the_script_runs_each_method_at_each_length(capsys):
    assert ncu.main(["--lengths", "48", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{label}, {n} tokens: one call bracketed" for n in (48, 64) for label in ncu.METHODS]


HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def metric(launch: int, kernel: str, name: str, unit: str, value: str) -> str:
    return (f'"{launch}","1","python3","host","{kernel}","1","7","(128, 1, 1)","(16, 12, 1)","0","9.0",'
            f'"Section","{name}","{unit}","{value}"')


def test_the_summary_has_a_row_a_launch_in_the_summarys_units_labelled_by_call(tmp_path):
    table = tmp_path / "details.csv"
    table.write_text("\n".join([
        HEADER,
        metric(0, "_means_kernel", "Duration", "us", "13.60"),
        metric(0, "_means_kernel", "Dynamic Shared Memory Per Block", "Kbyte/block", "8.19"),
        metric(0, "_means_kernel", "SM Frequency", "Ghz", "1.85"),  # not summarised
        metric(1, "_banded_kernel", "Duration", "ms", "1.25"),
        metric(1, "_banded_kernel", "Local Memory Spilling Requests", "", "73,536"),
        metric(1, "_banded_kernel", "Memory Throughput", "Tbyte/s", "1.28"),
    ]) + "\n")
    log = "\n".join(['==PROF== Profiling "_means_kernel": 0%....100% - 18 passes', "a, 64 tokens: one call bracketed",
                     '==PROF== Profiling "_banded_kernel": 0%....100% - 18 passes', "b, 64 tokens: one call bracketed"])
    rows = ncu.summarise(table, log)
    assert [r["call"] for r in rows] == ["a, 64 tokens", "b, 64 tokens"]
    assert rows[0]["duration_us"] == 13.6 and rows[0]["shared_kb"] == round(8190 / 1024, 3)
    assert "SM Frequency" not in rows[0] and len(rows[0]) == 6
    assert rows[1]["duration_us"] == 1250.0 and rows[1]["spill_requests"] == 73536 and rows[1]["memory_gb_per_s"] == 1280.0
    with pytest.raises(SystemExit, match="names 3 profiled launches, the table has 2"):
        ncu.summarise(table, log + '\n==PROF== Profiling "_x_kernel"\nc, 64 tokens: one call bracketed')
