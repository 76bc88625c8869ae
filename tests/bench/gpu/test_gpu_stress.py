"""clusterserve.bench.gpu.stress on Triton's interpreter at tiny sizes: the script runs, repeats a case, and
counts a changed element as a change."""

import torch

from clusterserve.bench.gpu import stress


def test_one_case_runs_and_finds_nothing_changed(capsys):
    assert stress.main(["--tokens", "48", "--repeats", "1", "--dtypes", "float32", "--methods", "i-clustered"]) == 0
    out = capsys.readouterr().out
    assert "cases with a change: 0" in out and out.count("over 1 repeats") == 2


def test_differing_counts_changed_elements_and_takes_nan_as_equal():
    a = torch.tensor([1.0, float("nan"), 3.0, 4.0])
    assert stress.differing(a, torch.tensor([1.0, float("nan"), 0.0, 4.0])) == 1
    assert stress.differing(torch.tensor([1, 2]), torch.tensor([1, 3])) == 1
