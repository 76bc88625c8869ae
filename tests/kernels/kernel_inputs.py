"""Shared inputs for the kernel tests."""

import torch

APPROXIMATE = ("clustered", "i-clustered", "smyrf")


def qkv(b=2, h=2, n=48, m=None, d=16, dv=None, dtype=torch.float32, seed=0, structured=True):
    """Random q, k, v (B, H, N|M, D). `structured` draws queries around a few centres, as real
    queries are, so clustering has something to find."""
    g = torch.Generator().manual_seed(seed)
    m = n if m is None else m
    dv = d if dv is None else dv
    if structured:
        centres = torch.randn(b, h, 6, d, generator=g, dtype=torch.float64) * 2
        pick = torch.randint(0, 6, (b, h, n), generator=g)
        noise = 0.3 * torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
        q = centres.gather(2, pick[..., None].expand(-1, -1, -1, d)) + noise
    else:
        q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, h, m, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, h, m, dv, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def padding_mask(b, m, lengths):
    """(B, M) bool, True for the first lengths[i] tokens of row i."""
    return torch.arange(m)[None, :] < torch.tensor(lengths)[:, None]


def several_programs_per_head(monkeypatch):
    """Shrink the row tiles of the Triton kernels that cut a head into chunks to 16 rows (32
    for the layout's counts), so
    the few dozen tokens of a test give each head several programs: the per-chunk partials
    and the launches that reduce them across programs really run; and their sums over the
    chunks (the layout's scatter's too) to 2 chunks a load, so those loops take several steps."""
    from clusterserve.kernels.triton import cluster_layout as cluster_layout_triton
    from clusterserve.kernels.triton import hamming as hamming_triton
    from clusterserve.kernels.triton import hashing as hashing_triton
    from clusterserve.kernels.triton import helpers as triton_helpers
    from clusterserve.kernels.triton import means as means_triton
    from clusterserve.kernels.triton import seeding as seeding_triton
    from clusterserve.kernels.triton import smyrf as smyrf_triton

    for module, name in ((hamming_triton, "BLOCK_N"), (means_triton, "BLOCK_N"), (cluster_layout_triton, "BLOCK_N"),
                         (hashing_triton, "BLOCK_N"), (seeding_triton, "BLOCK_N"), (smyrf_triton, "HASH_TILE")):
        monkeypatch.setattr(module, name, 16)
    for module, name in ((triton_helpers, "CHUNK_GROUP"), (means_triton, "SUMS_GROUP")):
        monkeypatch.setattr(module, name, 2)
    monkeypatch.setattr(cluster_layout_triton, "COUNT_BLOCK_N", 32)  # two tiles of a chunk of 64
    monkeypatch.setattr(cluster_layout_triton, "SCAN_COUNTS", 32)  # 2 chunks a load at 16 clusters a step


def poison_empty(monkeypatch, integers_high: bool = False):
    """Make torch.empty return filled tensors (NaN for floats, the most negative integer, or
    with integers_high the largest, True), so an output element or a scratch entry that a
    kernel reads without writing it shows up in the results."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        if out.dtype.is_floating_point:
            return out.fill_(float("nan"))
        if out.dtype == torch.bool:
            return out.fill_(True)
        limits = torch.iinfo(out.dtype)
        return out.fill_(limits.max if integers_high else limits.min)

    monkeypatch.setattr(torch, "empty", poisoned)


def tile_positions(layout, n_tiles: int, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the tile kernel reads from a layout, as clustered.cluster_tiles gives it: positions
    (B * H, T, tile) int64 (-1 in unused slots) and each tile's cluster (B * H, T) in [0, C]."""
    tiles = torch.arange(n_tiles, device=layout.order.device)
    clusters = layout.size.shape[1]
    cluster = (layout.tile_end[:, None, :] <= tiles[None, :, None]).sum(-1)
    c = cluster.clamp(max=clusters - 1)
    first_tile = layout.tile_end.gather(1, c) - (layout.size.gather(1, c) + tile - 1) // tile
    slot = (tiles[None, :] - first_tile)[..., None] * tile + torch.arange(tile, device=tiles.device)
    valid = (slot < layout.size.gather(1, c)[..., None]) & (cluster < clusters)[..., None]
    rank = (layout.start.gather(1, c)[..., None] + slot).clamp(0, layout.order.shape[1] - 1)
    positions = layout.order.long().gather(1, rank.flatten(1)).view_as(rank)
    return torch.where(valid, positions, -1), cluster


def packed_rotary_tables(t: int, d: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, 1, D) of one sequence of t tokens, as the encoders get them (packed_rotary:
    strided views of one table)."""
    from clusterserve.kernels import AttentionSpec
    from clusterserve.models.batch.packing import pack
    from clusterserve.models.networks.rotary import packed_rotary

    cpu = torch.device("cpu")
    _, packed = pack([[1] * t], [AttentionSpec()], cpu)
    return packed_rotary(packed, d, 1000.0, cpu, interleaved=interleaved)
