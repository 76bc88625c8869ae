"""Each Triton stage at 16k and 64k tokens, fed the reference's own inputs, on a GPU.

    python -m pytest -m gpu tests/gpu/test_gpu_stages.py -rA -s      # on a CUDA machine

A stage that gets the reference's inputs must give the reference's outputs: the Hamming
K-means is integer arithmetic and must be equal; the layout of the sparse part must be equal;
the refinement agrees up to ties within float rounding (tests/kernels/ties.py); means, the
centroid pass and the sparse part agree within float32 rounding. Each stage runs with
torch.empty poisoned (NaN, the most negative integer), so an element a kernel fails to write
shows up. Also: the calibration settings (200 to 1600 clusters, top-k 64), a batch of three
ragged sequences, and two calls giving the same bits. Nothing here is timed: bench.gpu.speed
measures each method against exact attention (SDPA), eagerly and from CUDA graphs.

Without CUDA the module skips; with GPU_TEST_DRY_RUN=1 and TRITON_INTERPRET=1 it runs on CPU
through the interpreter at 64 tokens with tiny knobs (tests/bench runs it so).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from test_gpu_acceptance import DEVICE, DRY_RUN, LENGTHS, compare, spec_of, text_qkv

from clusterserve.bench.common import exact_attention
from clusterserve.kernels import AttentionSpec, attention
from clusterserve.kernels.reference.clustered import REFERENCE, cluster_tiles
from clusterserve.kernels.reference.kmeans import cluster_means
from clusterserve.kernels.reference.masks import token_masks
from clusterserve.kernels.reference.smyrf import asymmetric_hashes, smyrf_projections

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))  # the kernel tests' helpers
from kernel_inputs import poison_empty, tile_positions  # noqa: E402
from ties import assert_refinement_agrees, assert_topk_agree  # noqa: E402

pytestmark = pytest.mark.gpu

LONG = [n for n in LENGTHS if n >= 16384] or LENGTHS
# (clusters, top-k): the benchmark's, and the calibration table's range.
SETTINGS = [(4, 8), (6, 16)] if DRY_RUN else [(100, 32), (200, 64), (1600, 64)]
# The float64 tie checks hold (B, H, N, C) distances or (B, H, C, M) probabilities: up to this.
CHECKED_PAIRS = 16384 * 200 if not DRY_RUN else 1 << 30


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.inference_mode():
        yield


@pytest.fixture
def poisoned(monkeypatch):
    poison_empty(monkeypatch)


def spec(clusters: int, topk: int) -> AttentionSpec:
    return dataclasses.replace(spec_of("i-clustered"), clusters=clusters, topk=topk)


def inputs(n: int, batch: int = 1):
    """bfloat16 q, k, v of real text (B, H, N, 64); with batch > 1 the same text at lengths
    n, 0.7 n, 0.3 n, right-padded, and its mask (B, N), else None."""
    q, k, v = (t.to(torch.bfloat16) for t in text_qkv(n))
    if batch == 1:
        return q, k, v, None
    q, k, v = (torch.cat([t] * batch) for t in (q, k, v))
    lengths = torch.tensor([n, int(0.7 * n), int(0.3 * n)][:batch], device=DEVICE)
    return q, k, v, torch.arange(n, device=DEVICE)[None, :] < lengths[:, None]


def reference_clusters(q, mask, s):
    """The reference's codes and Hamming assignments on the float32 values of q."""
    query_mask = token_masks(q, q, mask)[1]
    codes = REFERENCE.hash(q.float(), s)
    return query_mask, codes, REFERENCE.cluster(codes, query_mask, s)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("clusters, topk", SETTINGS)
@pytest.mark.parametrize("n", LONG)
def test_hamming_kmeans_equals_the_reference(n, clusters, topk, batch, poisoned):
    from clusterserve.kernels.triton.clustered import cluster_codes_triton, hash_queries_triton

    q, _, _, mask = inputs(n, batch)
    s = spec(clusters, topk)
    query_mask, codes, expected = reference_clusters(q, mask, s)
    assert torch.equal(cluster_codes_triton(codes, query_mask, s), expected)
    different = (hash_queries_triton(q, s) != codes).float().mean().item()
    print(f"\nN={n} B={batch} C={clusters}: Hamming K-means equal; codes differing in a bit within rounding "
          f"{different:.2%}")


@pytest.mark.parametrize("clusters, topk", SETTINGS)
@pytest.mark.parametrize("n", LONG)
def test_refinement_agrees_with_the_reference(n, clusters, topk, poisoned):
    from clusterserve.kernels.triton.lloyd import refine_clusters_triton

    if n * clusters > CHECKED_PAIRS:
        pytest.skip("the float64 tie check would hold too many distances")
    q, _, _, mask = inputs(n)
    s = spec(clusters, topk)
    query_mask, _, start = reference_clusters(q, mask, s)
    ties = assert_refinement_agrees(lambda x, *rest: refine_clusters_triton(x.to(torch.bfloat16), *rest),
                                    q.float(), start, query_mask, clusters, s.refine)
    print(f"\nN={n} C={clusters}: refinement agrees, {ties} ties within float rounding")


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("clusters, topk", SETTINGS)
@pytest.mark.parametrize("n", LONG)
def test_means_centroid_pass_layout_and_sparse_part(n, clusters, topk, batch, poisoned):
    """From the reference's assignments: cluster means, the centroid pass, the layout (equal)
    and the sparse part."""
    from clusterserve.kernels.reference.clustered import TILE
    from clusterserve.kernels.triton.centroid import centroid_attention_triton
    from clusterserve.kernels.triton.cluster_layout import cluster_layout_triton
    from clusterserve.kernels.triton.clustered import TRITON
    from clusterserve.kernels.triton.means import cluster_means_triton

    q, k, v, mask = inputs(n, batch)
    s = spec(clusters, topk)
    key_mask, query_mask = token_masks(q, k, mask)
    assign = REFERENCE.refine(q.float(), reference_clusters(q, mask, s)[2], query_mask, s)
    means, members = cluster_means_triton(q, assign, clusters)
    expected_means = cluster_means(q.float(), assign, clusters)
    assert torch.allclose(means, expected_means, atol=1e-5 * expected_means.abs().max().item(), rtol=0)

    n_tiles = -(-n // TILE) + clusters
    positions, valid, tile_cluster = cluster_tiles(assign, clusters, TILE, n_tiles)
    got_positions, got_cluster = tile_positions(cluster_layout_triton(assign, clusters, TILE), n_tiles, TILE)
    assert torch.equal(got_positions, torch.where(valid, positions, -1).flatten(0, 1))
    assert torch.equal(got_cluster, tile_cluster.flatten(0, 1))

    scale = q.shape[-1] ** -0.5
    got = centroid_attention_triton(expected_means, k, v, key_mask, scale, topk)
    if batch * clusters * n <= CHECKED_PAIRS:
        expected = REFERENCE.centroid_attention(expected_means, k.float(), v.float(), key_mask, scale, topk)
        # The logits take the centroids in two bfloat16 parts (relative error <= 2^-17 each): a
        # logit within 2^-17 sum_i |c_i k_i| x scale, a probability within twice that (relative).
        logit_bound = (expected_means.abs() @ k.float().abs().transpose(-1, -2)).max().item() * scale
        relative = 2**-16 * logit_bound
        # The probabilities meet V rounded to bfloat16 (relative error <= 2^-9), as in flash attention.
        v_max = v.float().abs().max().item()
        assert torch.allclose(got.values, expected.values, atol=1e-4 + (2**-9 + relative) * v_max, rtol=0)
        assert torch.allclose(got.top_probs, expected.top_probs, atol=1e-5, rtol=relative)
        probs = torch.softmax((expected_means @ k.float().transpose(-1, -2) * scale)
                              .masked_fill(~key_mask[:, None, None, :], float("-inf")), dim=-1)
        different = assert_topk_agree(got.top_index, expected.top_index, probs, tolerance=1e-5)
        print(f"\nN={n} B={batch} C={clusters} top-{topk}: centroid pass agrees, {different} rows with tied top-k sets")
        centroid = expected
    else:  # the Triton pass leaves top_real out (its sparse kernel reads the key mask); the reference reads it
        top_real = key_mask[:, None, None, :].expand(*got.top_index.shape[:3], n).gather(-1, got.top_index)
        centroid = got._replace(top_real=top_real)
    out = TRITON.sparse(q, k, v, assign, centroid, key_mask, scale, torch.float32)
    want = REFERENCE.sparse(q.float(), k.float(), v.float(), assign, centroid, key_mask, scale, torch.float32)
    assert (out - want).abs().max().item() <= 1e-3 * want.abs().max().item() + 2**-9 * v.float().abs().max().item()


@pytest.mark.parametrize("n", LONG)
def test_smyrf_hashes_equal_the_reference(n, poisoned):
    from clusterserve.kernels.triton.smyrf import smyrf_hashes_triton

    q, k, _, _ = inputs(n)
    s = spec_of("smyrf")
    projections = smyrf_projections(s.hash_rounds, q.shape[1], q.shape[-1], s.seed)
    key_mask, query_mask = token_masks(q, k, None)
    want_q, want_k = asymmetric_hashes(q.float(), k.float(), query_mask, key_mask, projections)
    got_q, got_k = smyrf_hashes_triton(q, k, None, projections.to(DEVICE))
    for got, want in ((got_q, want_q), (got_k, want_k)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


METHODS = ["clustered", "i-clustered", "smyrf"]


@pytest.mark.parametrize("label", METHODS)
def test_two_calls_give_the_same_bits(label):
    q, k, v, _ = inputs(LONG[0])
    s = spec_of(label)
    first = attention(q, k, v, s, backend="triton")
    assert torch.equal(first, attention(q, k, v, s, backend="triton"))


@pytest.mark.parametrize("label", METHODS)
def test_ragged_batch_matches_the_reference(label):
    q, k, v, mask = inputs(LONG[0], batch=3)
    compare(f"N={LONG[0]} B=3 ragged bfloat16 {label}", q, k, v, label, mask, exact_attention(q, k, v, mask, 1 / 8))

