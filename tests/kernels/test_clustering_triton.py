"""The Triton clustering stages of the clustered methods against the PyTorch reference: LSH
codes, the Hamming K-means, the seeds, the Euclidean refinement, the cluster means and the
tile layout, on CPU through Triton's interpreter (small shapes: it runs numpy per program).
Nothing here needs a GPU. The centroid pass is in test_centroid_triton.py, whole calls in
test_clustered_triton.py.

The interpreter runs a launch's programs one after another, so it cannot show a race: the
kernels are race-free by construction (one writer per element). What it does show: every
test runs with row tiles of 16 (several programs per head, so the per-chunk partials and the
launches that reduce them really run), and with torch.empty poisoned (NaN, the most negative
integer), so an element a kernel fails to write shows up."""

import os

# Before triton is imported anywhere: the kernels are decorated as interpreted functions.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from kernel_inputs import padding_mask, poison_empty, qkv, several_programs_per_head, tile_positions  # noqa: E402
from ties import (  # noqa: E402
    assert_codes_agree,
    assert_exact_ties_go_to_the_lowest_cluster,
    assert_refinement_agrees,
)

from clusterserve.kernels import AttentionSpec  # noqa: E402
from clusterserve.kernels.reference.clustered import REFERENCE, cluster_tiles  # noqa: E402
from clusterserve.kernels.reference.hashing import hash_codes, hash_planes, hash_signs, pack_codes  # noqa: E402
from clusterserve.kernels.reference.kmeans import (  # noqa: E402
    _count_members,
    _nearest,
    cluster_means,
    hamming_kmeans,
    initial_centroid_positions,
    initial_offsets,
    one_query_per_cluster,
    refine_clusters,
    seeded_clusters,
)
from clusterserve.kernels.stages import cluster_queries  # noqa: E402

triton_clustered = pytest.importorskip("clusterserve.kernels.triton.clustered")
from clusterserve.kernels.triton import cluster_layout as cluster_layout_module  # noqa: E402
from clusterserve.kernels.triton import hamming as hamming_triton  # noqa: E402
from clusterserve.kernels.triton import helpers as triton_helpers  # noqa: E402
from clusterserve.kernels.triton import lloyd as lloyd_triton  # noqa: E402
from clusterserve.kernels.triton import seeding as seeding_triton  # noqa: E402
from clusterserve.kernels.triton.cluster_layout import cluster_layout_triton  # noqa: E402
from clusterserve.kernels.triton.hamming import hamming_kmeans_triton  # noqa: E402
from clusterserve.kernels.triton.hashing import hash_codes_triton  # noqa: E402
from clusterserve.kernels.triton.helpers import chunking  # noqa: E402
from clusterserve.kernels.triton.lloyd import refine_clusters_triton, seed_clusters_triton  # noqa: E402
from clusterserve.kernels.triton.means import cluster_means_triton  # noqa: E402


@pytest.fixture(autouse=True)
def _several_programs_per_head(monkeypatch):
    several_programs_per_head(monkeypatch)


@pytest.fixture
def poisoned(monkeypatch):
    poison_empty(monkeypatch)


@pytest.mark.parametrize(
    "d, bits, dtype",
    [(16, 63, torch.float32), (24, 5, torch.float32), (64, 63, torch.float32), (32, 1, torch.float16),
     (16, 40, torch.bfloat16)],
)
@pytest.mark.parametrize("one_program_a_head", [False, True])
def test_hash_codes_equal_the_reference(d, bits, dtype, one_program_a_head, monkeypatch):
    """Each chunk's tiles, several chunks a head or one chunk of several tiles."""
    if one_program_a_head:
        monkeypatch.setattr(triton_helpers, "TARGET_PROGRAMS", 2)
    q, _, _ = qkv(n=37, d=d, dtype=dtype, structured=False)
    planes = hash_planes(2, d, bits, seed=3)
    got = hash_codes_triton(q, planes)
    assert_codes_agree(got, hash_codes(q, planes), q, planes)
    assert got.shape == (2, 2, 37) and ((got >> bits) == 0).all()


def _signs(n, d=16, bits=63, seed=0, duplicates=None):
    """+-1 hash signs of random queries; with `duplicates`, only that many distinct queries."""
    q, _, _ = qkv(n=n, d=d, seed=seed, structured=duplicates is None)
    if duplicates is not None:
        q = q[:, :, torch.arange(n) % duplicates]
    return q, hash_signs(q, hash_planes(2, d, bits, seed=seed))


@pytest.mark.parametrize(
    "n, lengths, clusters, iterations, bits, duplicates",
    [
        (48, [48, 30], 5, 10, 63, None),
        (37, [37, 37], 1, 3, 63, None),
        (40, [40, 33], 6, 4, 8, 3),  # copies of 3 queries: clusters empty out and get re-seeded
        (20, [20, 6], 8, 3, 63, None),  # more clusters than real queries in row 1
        (30, [30, 30], 4, 0, 1, None),
        (48, [48, 29], 5, 0, 63, None),  # no iteration, a padded row: ranks of the initial centroids
        (64, [64, 50], 40, 4, 6, None),  # many ties, donors from several chunks
        (20, [20, 6], 24, 3, 63, None),  # more empty clusters than queries: the rest take the last donor
        (64, [64, 50], 40, 4, 8, "blocks of 16"),  # clusters in several blocks: votes in a second pass
    ],
)
def test_hamming_kmeans_equals_the_reference(n, lengths, clusters, iterations, bits, duplicates, poisoned, monkeypatch):
    assert chunking(n, 2, hamming_triton.BLOCK_N)[0] >= 2  # the votes and donors cross programs
    if duplicates == "blocks of 16":
        monkeypatch.setattr(hamming_triton, "BLOCK_C", 16)
        duplicates = None
    _, signs = _signs(n, bits=bits, duplicates=duplicates)
    mask = padding_mask(2, n, lengths)
    offsets = initial_offsets(2, seed=1)
    expected = hamming_kmeans(signs, mask, clusters, iterations, offsets)
    got = hamming_kmeans_triton(pack_codes(signs), mask, clusters, iterations, offsets, bits)
    assert torch.equal(got, expected)
    if duplicates is not None:  # the case does exercise the re-seeding
        first = signs.gather(2, initial_centroid_positions(mask, clusters, offsets)[..., None].expand(-1, -1, -1, bits))
        members = _count_members(_nearest(signs, first, None, ~mask[:, None, :]), clusters)
        assert (members == 0).any()


@pytest.mark.parametrize(
    "n, lengths, clusters, duplicates", [(48, [48, 35], 5, None), (40, [40, 31], 6, 4), (64, [64, 60], 36, None)]
)
def test_refinement_equals_the_reference(n, lengths, clusters, duplicates, poisoned):
    q, signs = _signs(n, d=24, duplicates=duplicates)
    mask = padding_mask(2, n, lengths)
    start = hamming_kmeans(signs, mask, clusters, 3, initial_offsets(2, seed=0))
    assert not torch.equal(refine_clusters(q, start, mask, clusters, 3), start)  # refinement moves something
    ties = assert_refinement_agrees(refine_clusters_triton, q, start, mask, clusters, 3)
    print(f"ties within float rounding: {ties}")


@pytest.mark.parametrize("path", ["one launch", "candidates launch", "donor launch"])
@pytest.mark.parametrize("n, lengths, clusters", [(40, [40, 31], 20), (20, [20, 6], 24)])
def test_refinement_reseeds_empty_clusters_as_the_reference(n, lengths, clusters, path, poisoned, monkeypatch):
    """A start that uses 2 of the clusters: each step re-seeds the empty ones (the e-th
    farthest query for the e-th, the last query of all past the 20 queries). The donors'
    candidates come from the means launch (each chunk's program summing the means itself) or
    from a launch of their own (over 16 clusters here); the nearest-mean search puts the
    donors in place with all the means in one tile, the donor launch with tiles of 16."""
    if path != "one launch":
        monkeypatch.setattr(lloyd_triton, "CANDIDATES_FUSED_TILE", 16 * 32)  # d = 24: 16 clusters
    if path == "donor launch":
        monkeypatch.setattr(lloyd_triton, "NEAREST_BLOCK_C", 16)
        monkeypatch.setattr(lloyd_triton, "NEAREST_NARROW_C", 16)
    q, _ = _signs(n, d=24)
    mask = padding_mask(2, n, lengths)
    start = torch.where(mask[:, None, :], torch.arange(n) % 2, clusters).expand(2, 2, n).contiguous()
    moved = refine_clusters(q, start, mask, clusters, 1)
    assert (_count_members(moved, clusters)[..., 2:] > 0).any()  # the first step re-seeds
    ties = assert_refinement_agrees(refine_clusters_triton, q, start, mask, clusters, 3)
    print(f"ties within float rounding: {ties}")


@pytest.mark.parametrize("clusters", [8, 20])
def test_a_sequence_of_no_more_real_queries_than_clusters_gives_each_its_own(clusters, poisoned):
    """Row 1 has 6 real queries, copies of 3, and 8 or 20 clusters: the K-means' last launch and
    the refinement's give each real query its own cluster, its rank (duplicates would share
    one). Row 0's 40 do not fit: a chunk of more real queries than clusters settles it (8), or
    the whole row is counted (20: chunks of 16)."""
    q, signs = _signs(40, d=24, duplicates=3)
    mask = padding_mask(2, 40, [40, 6])
    offsets = initial_offsets(2, seed=1)
    expected = one_query_per_cluster(hamming_kmeans(signs, mask, clusters, 3, offsets), mask, clusters)
    got = hamming_kmeans_triton(pack_codes(signs), mask, clusters, 3, offsets, 63, exact_case=True)
    assert torch.equal(got, expected)
    assert torch.equal(got[1, :, :6], torch.arange(6).expand(2, 6))
    refined = refine_clusters_triton(q, expected, mask, clusters, 2, exact_case=True)
    assert torch.equal(refined[1], got[1])
    assert torch.equal(refined[0], refine_clusters_triton(q, expected, mask, clusters, 2)[0])


@pytest.mark.parametrize(
    "n, lengths, clusters, blocks",
    [
        (48, [48, 35], 5, None),
        (64, [64, 50], 36, None),  # the seeds' search in two blocks of clusters
        (64, [64, 64], 20, "of 8"),  # blocks of 8 clusters: a chunk's seeds span blocks
        (20, [20, 6], 8, None),  # row 1: more clusters than real queries, seeds among the padded
    ],
)
def test_seeded_clusters_equal_the_reference(n, lengths, clusters, blocks, poisoned, monkeypatch):
    """Without LSH codes (bits 0) each query joins its nearest seed query, the seeds at the
    ranks the Hamming K-means starts from: found by the program whose chunk holds each (in
    a padded row by counting the chunk's ranks), then one nearest-mean step."""
    if blocks:
        monkeypatch.setattr(seeding_triton, "BLOCK_C", 8)
    q, _ = _signs(n, d=24)
    mask = padding_mask(2, n, lengths)
    offsets = initial_offsets(2, seed=3)
    assert chunking(n, 2, triton_clustered.means.BLOCK_N)[0] >= 2  # the seeds cross programs
    expected = seeded_clusters(q, mask, clusters, offsets)
    assert torch.equal(seed_clusters_triton(q, mask, clusters, offsets), expected)
    exact = seed_clusters_triton(q, mask, clusters, offsets, exact_case=True)
    assert torch.equal(exact, one_query_per_cluster(expected, mask, clusters))
    positions = initial_centroid_positions(mask, clusters, offsets)
    seeds = q.gather(2, positions[..., None].expand(-1, -1, -1, 24))
    brute = torch.cdist(q, seeds).argmin(-1).masked_fill(~mask[:, None, :], clusters)
    assert (expected == brute).float().mean() > 0.99  # the reference: nearest in Euclidean distance


@pytest.mark.parametrize("refine", [0, 1, 3])
@pytest.mark.parametrize("n, lengths, clusters", [(48, [48, 35], 5), (40, [40, 40], 12), (20, [20, 6], 8)])
def test_seeded_cluster_means_equal_the_reference(n, lengths, clusters, refine, poisoned):
    """The seeds, their nearest-mean step and `refine` steps in one (cluster_means_triton_stages
    with bits 0: the seeds' step sums the chunks for the first step), against the reference's
    stages: the assignments, with the exact case in row 1 of the last, and the member means."""
    q, _ = _signs(n, d=24)
    mask = padding_mask(2, n, lengths)
    spec = AttentionSpec(method="i-clustered", clusters=clusters, bits=0, refine=refine, seed=1)
    expected = cluster_queries(REFERENCE, q, mask, spec)
    assign, means = triton_clustered.cluster_means_triton_stages(q, mask, spec)
    assert torch.equal(assign, expected)
    assert torch.equal(cluster_queries(triton_clustered.TRITON, q, mask, spec), expected)
    assert torch.allclose(means, cluster_means(q, expected, clusters), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block", [32, 256])
@pytest.mark.parametrize("first, second", [(5, 18), (3, 35)])
def test_refinement_ties_go_to_the_lowest_cluster_within_and_across_blocks(first, second, block, monkeypatch):
    # Blocks of 32 means: 5 and 18 share one, 3 and 35 do not; 256 holds all 40 (read once).
    monkeypatch.setattr(lloyd_triton, "NEAREST_BLOCK_C", block)
    monkeypatch.setattr(lloyd_triton, "NEAREST_NARROW_C", min(block, lloyd_triton.NEAREST_NARROW_C))
    assert_exact_ties_go_to_the_lowest_cluster(refine_clusters_triton, first, second, 40)


def test_cluster_means_equal_the_reference(poisoned):
    q, _, _ = qkv(n=45, d=24, structured=False)
    assign = torch.randint(0, 7, (2, 2, 45), generator=torch.Generator().manual_seed(0))
    assign[:, :, ::5] = 6  # C = 6: every fifth query padded, and cluster 6 is not a cluster
    assign[1, 1][assign[1, 1] == 2] = 3  # an empty cluster
    means, members = cluster_means_triton(q, assign, 6)
    assert torch.allclose(means, cluster_means(q, assign, 6), atol=1e-6, rtol=0)
    assert torch.equal(members, _count_members(assign, 6).long())


@pytest.mark.parametrize("n, clusters, lengths, tile", [(50, 4, [50, 37], 4), (45, 7, [45, 45], 8), (40, 3, [40, 0], 32)])
@pytest.mark.parametrize("programs, block_c", [(None, None), (1, None), (None, 4)])
def test_cluster_layout_equals_the_reference(n, clusters, lengths, tile, programs, block_c, poisoned, monkeypatch):
    """The counting sort across programs lays out the tiles exactly as clustered.cluster_tiles;
    with one program a head (TARGET_PROGRAMS 1) a chunk is several tiles, each loaded a tile
    ahead by the scatter; with 4 clusters a step the scatter's offsets carry over steps."""
    if programs:
        monkeypatch.setattr(triton_helpers, "TARGET_PROGRAMS", programs)
    if block_c:
        monkeypatch.setattr(cluster_layout_module, "BLOCK_C", block_c)
    assign = torch.randint(0, clusters, (2, 2, n), generator=torch.Generator().manual_seed(3))
    assign = torch.where(padding_mask(2, n, lengths)[:, None, :], assign, clusters)
    assign[0, 1][assign[0, 1] == 1] = 2  # an empty cluster
    layout = cluster_layout_triton(assign, clusters, tile)
    n_tiles = triton_clustered.triton.cdiv(n, tile) + clusters
    positions, valid, tile_cluster = cluster_tiles(assign, clusters, tile, n_tiles)
    got_positions, got_cluster = tile_positions(layout, n_tiles, tile)
    assert torch.equal(got_positions, torch.where(valid, positions, -1).flatten(0, 1))
    assert torch.equal(got_cluster, tile_cluster.flatten(0, 1))
