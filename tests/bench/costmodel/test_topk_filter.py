"""clusterserve.bench.costmodel.topk_filter's replay of the centroid top-k's filter: the kernel's rotated lanes spread
each block's keys over every lane, and keys that repeat every 512 positions over many lanes;
on random logits the threshold leaves ~1.3 TOP keys a row, and on periodic ones the rotation
keeps it under 2 TOP where key index mod 2 TOP does not; tied logits fill the candidate
buffers once, and the floor a merge leaves keeps the rest of the tie out."""

import torch

from clusterserve.bench.costmodel.topk_filter import lanes_of, replay

TOP, BLOCK_M = 32, 64


def test_rotated_lanes_permute_each_block_and_spread_periodic_keys():
    lanes = lanes_of(4096, BLOCK_M, 2 * TOP, "rotated")
    for start in range(0, 4096, BLOCK_M):
        assert sorted(lanes[start : start + BLOCK_M].tolist()) == list(range(BLOCK_M))
    repeats = lanes[7::512]  # one position of each 512-token copy
    assert len(set(repeats.tolist())) >= 6
    assert len(set(lanes_of(4096, BLOCK_M, 2 * TOP, "mod")[7::512].tolist())) == 1


def test_the_threshold_leaves_few_keys_on_random_logits_and_on_periodic_ones_with_rotation():
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(2, 8, 4096, generator=generator)
    random = replay(noise, TOP, "rotated")
    assert TOP <= random["keys_above_mean"] <= 2 * TOP
    # Every row's 64 largest logits at the first 8 positions of each 512-token period.
    periodic = noise.clone()
    for offset in range(8):
        periodic[..., offset::512] += 10.0
    rotated, mod = replay(periodic, TOP, "rotated"), replay(periodic, TOP, "mod")
    assert rotated["keys_above_mean"] <= 2 * TOP < mod["keys_above_mean"]
    assert random["merges_max"] == 0 and random["last_max"] == 1


def test_tied_logits_fill_the_buffers_once_then_the_floor_rises_above_them(monkeypatch):
    """One split a program: every key of 1024 tied logits is a candidate, TOPK_BLOCK_M a block,
    until a buffer of TOPK_BUFFER keys could not take another block's and merges; the kept
    keys are then TOP of the tie, and no later key of it enters."""
    from clusterserve.kernels.triton import helpers
    from clusterserve.kernels.triton.centroid_topk import TOPK_BLOCK_M, TOPK_BUFFER

    monkeypatch.setattr(helpers, "TARGET_PROGRAMS", 1)
    tied = replay(torch.zeros(1, 8, 1024), TOP, "rotated")
    assert tied["blocks"] == 1024 // TOPK_BLOCK_M
    assert tied["merges_max"] == 1 and tied["last_max"] == 0
    assert tied["inner_chunks_max"] == tied["chunks_max"] == TOPK_BUFFER // TOP
