"""Row-wise layers a block of tokens at a time on a CPU, whole on a GPU: the same rows either way."""

from __future__ import annotations

import torch

from clusterserve.models.networks import rows
from clusterserve.models.networks.rows import ROWS, block_rows, by_rows


def test_a_cpu_takes_blocks_and_a_gpu_the_whole_input():
    assert block_rows(torch.device("cpu")) == ROWS
    assert block_rows(torch.device("cuda", 0)) is None


def test_blocks_give_the_rows_the_whole_input_gives_and_call_once_a_block(monkeypatch):
    monkeypatch.setattr(rows, "ROWS", 8)
    layer = torch.nn.Linear(4, 6)
    x = torch.randn(3, 10, 4)  # 30 rows: blocks of 8, 8, 8 and 6
    calls = []

    def fn(part):
        calls.append(part.shape[0])
        return layer(part)

    with torch.inference_mode():
        blocked = by_rows(fn, x)
        torch.testing.assert_close(blocked, layer(x), atol=1e-6, rtol=0)
    assert calls == [8, 8, 8, 6] and blocked.shape == (3, 10, 6)
