"""clusterserve.bench.quality.convergence's starts and counts on small random codes (native backend): a warm start
from a layer's own converged clusters is already converged, an empty cluster starts as the
cold start's, and a start that needs iterations is counted as needing them."""

from __future__ import annotations

import torch

from clusterserve.bench.quality.convergence import CAP, cold_initial, iterations_to_converge, warm_initial
from clusterserve.kernels import AttentionSpec
from clusterserve.kernels.native import hamming_kmeans

SPEC = AttentionSpec(method="i-clustered", clusters=8, topk=4, bits=16)


def codes_and_mask(n: int = 300, heads: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 2**SPEC.bits, (1, heads, n), generator=generator), torch.ones(1, n, dtype=torch.bool)


def test_a_warm_start_from_converged_clusters_needs_no_iteration():
    codes, mask = codes_and_mask()
    cold = iterations_to_converge(codes, mask, cold_initial(codes, mask, SPEC), SPEC)
    assert max(cold) > 0 and max(cold) < CAP, cold  # the cold start moves, then settles
    converged = hamming_kmeans(codes, mask, cold_initial(codes, mask, SPEC), CAP, SPEC.bits)
    assert (torch.bincount(converged[0, 0], minlength=SPEC.clusters) > 0).all()  # no empty cluster to re-seed
    assert iterations_to_converge(codes, mask, warm_initial(codes, mask, converged, SPEC), SPEC) == [0, 0]


def test_a_warm_centroid_is_its_clusters_majority_and_an_empty_one_starts_cold():
    codes, mask = codes_and_mask(n=40, heads=1)
    previous = torch.arange(40).remainder(SPEC.clusters - 1)[None, None, :]  # the last cluster has no member
    initial = warm_initial(codes, mask, previous, SPEC)
    members = codes[0, 0, previous[0, 0] == 3]
    bits = (members[:, None] >> torch.arange(SPEC.bits)) & 1
    majority = ((2 * bits.sum(0) > len(members)).long() << torch.arange(SPEC.bits)).sum()
    assert initial[0, 0, 3] == majority
    assert initial[0, 0, -1] == cold_initial(codes, mask, SPEC)[0, 0, -1]
