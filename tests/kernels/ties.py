"""Comparing discrete decisions (codes, clusters, top-k sets) across backends on any CPU.

Two backends sum in different orders (torch picks other vector kernels on AVX2 than on
AVX-512; native.c is built per x86-64 level), so a decision whose margin is within float
rounding may go either way. These helpers recompute the margin in float64: a decision with a
larger margin must agree exactly, one within `tolerance` of a tie may differ and is counted.
Exact ties that every backend computes with identical arithmetic (the lowest-index rule) are
tested with constructed inputs elsewhere, with plain equality.
"""

from __future__ import annotations

import torch
from torch import Tensor

from clusterserve.kernels.reference.hashing import pack_codes
from clusterserve.kernels.reference.kmeans import _count_members, _rows, cluster_means, refine_clusters
from clusterserve.kernels.reference.kmeans import _reseed_empty as reseed_empty

# Relative margin under which two float32 computations of the same decision may disagree:
# ~100x float32's epsilon, far below the margins of real decisions.
TOLERANCE = 1e-5


def unsure_bits(x: Tensor, planes: Tensor, tolerance: float = 1e-4) -> Tensor:
    """Code bits whose projection is within `tolerance` of 0 (either sign may come out):
    x (B, H, N, D), planes (H, D + 1, bits) -> (B, H, N) int64 masks."""
    projections = x.double() @ planes[:, :-1].double() + planes[:, -1:].double()
    return pack_codes(torch.where(projections.abs() < tolerance, 1.0, -1.0))


def assert_codes_agree(got: Tensor, expected: Tensor, x: Tensor, planes: Tensor) -> int:
    """Codes equal on every bit with a clear sign; returns how many bits were too close to call."""
    unsure = unsure_bits(x, planes)
    assert (unsure == 0).float().mean() > 0.9, "too many projections near 0 for a meaningful test"
    assert torch.equal(got & ~unsure, expected & ~unsure)
    return int(((got ^ expected) & unsure).count_nonzero())


def assert_nearest_agree(got: Tensor, expected: Tensor, distances: Tensor, tolerance: float = TOLERANCE) -> int:
    """Nearest-centroid choices (B, H, N) of two backends, given the float64 distances of every
    query to every centroid (B, H, N, C): where they differ, both choices must be within
    `tolerance` (relative to the distances' scale) of each other. Returns the number of ties."""
    differ = got != expected
    if not differ.any():
        return 0
    padded = expected == distances.shape[-1]
    assert not (differ & padded).any(), "a padded query changed cluster"
    d_got = distances.gather(-1, got.clamp(max=distances.shape[-1] - 1)[..., None])[..., 0]
    d_expected = distances.gather(-1, expected.clamp(max=distances.shape[-1] - 1)[..., None])[..., 0]
    scale = distances.abs().amax(-1).clamp(min=1.0)
    gap = ((d_got - d_expected).abs() / scale)[differ]
    assert gap.max() <= tolerance, f"a nearest-centroid choice differs by a margin of {gap.max():.2e} (not a tie)"
    return int(differ.sum())


def refinement_step(q: Tensor, assign: Tensor, query_mask: Tensor, clusters: int) -> tuple[Tensor, Tensor]:
    """What one reference refinement step decides from `assign`, measured in float64.

    Returns the squared distances (B, H, N, C) of every query to the centroids the reference
    uses (its float32 member means, empty clusters re-seeded by its rule), and which (B, H)
    slices re-seed by a decision within rounding: when the farthest queries that donate to
    empty clusters are as far as each other (copies of one vector, or clusters whose members
    are all equal, at distance ~0), any of them may donate, and the step's outcome for that
    slice is a tie as a whole.
    """
    centroids = cluster_means(q, assign, clusters)
    members = _count_members(assign, clusters)
    distance = lambda: ((q - _rows(centroids, assign)) ** 2).sum(-1)  # noqa: E731
    centroids = reseed_empty(centroids, members, distance, ~query_mask[:, None, :], q)
    q64, c64 = q.double(), centroids.double()
    distances = ((q64[..., :, None, :] - c64[..., None, :, :]) ** 2).sum(-1)
    to_own = ((q64 - _rows(cluster_means(q, assign, clusters).double(), assign)) ** 2).sum(-1)
    to_own = to_own.masked_fill(~query_mask[:, None, :], float("-inf"))
    empty = (members == 0).sum(-1)  # (B, H)
    ranked = to_own.sort(dim=-1, descending=True).values
    scale = (q64 * q64).sum(-1).amax(-1).clamp(min=1.0)  # (B, H)
    ambiguous = torch.zeros_like(empty, dtype=torch.bool)
    for b, h in (empty > 0).nonzero().tolist():
        donors = ranked[b, h, : int(empty[b, h]) + 1]
        donors = donors[torch.isfinite(donors)]
        ambiguous[b, h] = bool((donors.diff().abs() <= TOLERANCE * scale[b, h]).any()) if donors.numel() > 1 else False
    return distances, ambiguous


def assert_refinement_agrees(refine, q: Tensor, start: Tensor, query_mask: Tensor, clusters: int, iterations: int) -> int:
    """`refine(q, assign, query_mask, clusters, iterations)` of a backend against the reference,
    one Lloyd step at a time along the reference's path: every step agrees up to ties (a
    nearest-centroid choice within rounding, or a whole slice whose re-seeding is a tie).
    With no tie met, the whole run must equal the reference's. Returns the number of ties."""
    ties, assign = 0, start
    for _ in range(iterations):
        expected = refine_clusters(q, assign, query_mask, clusters, 1)
        got = refine(q, assign, query_mask, clusters, 1)
        distances, ambiguous = refinement_step(q, assign, query_mask, clusters)
        assert torch.equal(got == clusters, expected == clusters), "padded queries must stay at index C"
        ambiguous_slices = ambiguous[..., None].expand_as(got)
        ties += int((ambiguous & (got != expected).any(-1)).sum())
        clear = torch.where(ambiguous_slices, expected, got)
        ties += assert_nearest_agree(clear, expected, distances)
        if torch.equal(expected, assign):
            break
        assign = expected
    if ties == 0:
        whole_run = refine(q, start, query_mask, clusters, iterations)
        assert torch.equal(whole_run, refine_clusters(q, start, query_mask, clusters, iterations))
    return ties


def assert_topk_agree(got_index: Tensor, want_index: Tensor, probs: Tensor, tolerance: float = 1e-6) -> int:
    """Top-k index lists (..., k) of two backends over the same distribution probs (..., M):
    rank by rank the probabilities they pick agree within `tolerance`, so any difference in
    the sets is among near-equal probabilities. Returns the number of rows whose sets differ."""
    p64 = probs.double()
    got_p = p64.gather(-1, got_index).sort(dim=-1, descending=True).values
    want_p = p64.gather(-1, want_index).sort(dim=-1, descending=True).values
    gap = (got_p - want_p).abs().max() if got_p.numel() else 0.0
    assert gap <= tolerance, f"top-k sets differ by a probability of {float(gap):.2e} (not a tie)"
    same = got_index.sort(dim=-1).values == want_index.sort(dim=-1).values
    return int((~same.all(-1)).sum())


def assert_exact_ties_go_to_the_lowest_cluster(refine, first: int, second: int, n: int) -> None:
    """Queries `first` and `second` of n are the same vector, each alone in its cluster: both
    clusters are exactly as near to both queries (identical arithmetic on identical numbers),
    and `refine(q, assign, query_mask, clusters, iterations)` must give both to `first`, as
    the reference does."""
    q = torch.randn(1, 1, n, 16, generator=torch.Generator().manual_seed(0))
    q[0, 0, second] = q[0, 0, first]
    start = torch.arange(n).reshape(1, 1, n)
    mask = torch.ones(1, n, dtype=torch.bool)
    expected = refine_clusters(q, start, mask, n, 1)
    assert expected[0, 0, second] == first and expected[0, 0, first] == first
    assert torch.equal(refine(q, start, mask, n, 1), expected)
