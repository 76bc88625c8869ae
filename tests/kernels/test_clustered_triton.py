"""The Triton clustered / improved clustered kernels against the PyTorch reference, stage by
stage and end to end, on CPU through Triton's interpreter (small shapes: it runs numpy per
program). Nothing here needs a GPU.

The interpreter runs a launch's programs one after another, so it cannot show a race: the
kernels are race-free by construction (one writer per element). What it does show: every
test runs with row tiles of 16 (several programs per head, so the per-chunk partials and the
launches that reduce them really run), and the stage tests with torch.empty poisoned (NaN,
the most negative integer), so an element a kernel fails to write shows up."""

import os

# Before triton is imported anywhere: the kernels are decorated as interpreted functions.
os.environ["TRITON_INTERPRET"] = "1"

import logging  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from kernel_inputs import padding_mask, poison_empty, qkv, several_programs_per_head, tile_positions  # noqa: E402
from ties import (  # noqa: E402
    assert_codes_agree,
    assert_exact_ties_go_to_the_lowest_cluster,
    assert_refinement_agrees,
    assert_topk_agree,
)

from clusterserve.kernels import AttentionSpec, attention  # noqa: E402
from clusterserve.kernels.reference.clustered import REFERENCE, _centroid_attention  # noqa: E402
from clusterserve.kernels.reference.full import full_attention  # noqa: E402
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
from clusterserve.kernels.stages import CentroidAttention, cluster_queries  # noqa: E402

triton_clustered = pytest.importorskip("clusterserve.kernels.triton.clustered")
from clusterserve.kernels.reference.clustered import cluster_tiles  # noqa: E402
from clusterserve.kernels.triton import centroid as centroid_triton  # noqa: E402
from clusterserve.kernels.triton import centroid_topk as centroid_topk_triton  # noqa: E402
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

METHODS = ("clustered", "i-clustered")


@pytest.fixture(autouse=True)
def _several_programs_per_head(monkeypatch):
    several_programs_per_head(monkeypatch)


@pytest.fixture
def poisoned(monkeypatch):
    poison_empty(monkeypatch)


def run(q, k, v, spec, mask=None, backend="triton"):
    return attention(q, k, v, spec, key_padding_mask=mask, backend=backend)


# ---- stages --------------------------------------------------------------------------------


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


@pytest.mark.parametrize("d, dv, m, topk", [(24, 16, 37, 4), (128, 32, 20, 4), (16, 16, 300, 4), (16, 16, 300, 16),
                                            (16, 16, 600, 4), (16, 16, 1100, 4)])
def test_centroid_attention_equals_the_reference(d, dv, m, topk, poisoned):
    """The keys split across programs (m = 300 makes 5 splits, 600 makes 10, 1,100 makes 18:
    more than the merge loads a step, COMBINE_SPLITS at a time): each split's online softmax
    and lane maxima, merged, then each row's keys above its threshold kept and merged."""
    if m == 1100:
        assert triton_helpers.key_splits(m, 4, 64)[0] > centroid_triton.COMBINE_SPLITS
    _, k, v = qkv(m=m, d=d, dv=dv)
    centroids = torch.randn(2, 2, 5, d, generator=torch.Generator().manual_seed(1))
    mask = padding_mask(2, m, [m - 3, 0])  # row 1 has no real key at all
    scale = d**-0.5
    got = centroid_triton.centroid_attention_triton(centroids, k, v, mask, scale, topk)
    expected = _centroid_attention(centroids, k, mask, scale)
    assert torch.allclose(got.values, expected @ v, atol=1e-5, rtol=0)
    want_probs, want_index = expected.topk(topk, dim=-1)
    assert_topk_agree(got.top_index[0], want_index[0], expected[0])
    assert torch.allclose(got.top_probs, want_probs, atol=1e-6, rtol=0)
    assert (got.top_probs[1] == 0).all() and (got.values[1] == 0).all()
    assert centroid_triton.centroid_attention_triton(centroids, k, v, mask, scale, 0).top_index is None


def test_top_k_over_the_on_chip_limit_falls_back_counted_and_logged(caplog):
    """topk over MAX_TOPK_ON_CHIP runs torch's A^c and top-k (same result), and says so: the
    process-wide count goes up by one per call, the first call logs a warning."""
    from clusterserve.kernels import fallbacks

    topk = centroid_triton.MAX_TOPK_ON_CHIP + 1
    _, k, v = qkv(m=300, d=16)
    centroids = torch.randn(2, 2, 3, 16, generator=torch.Generator().manual_seed(3))
    mask = padding_mask(2, 300, [300, 290])
    key = ("centroid_triton", "topk_over_on_chip")
    before = fallbacks.counts()[key]
    with caplog.at_level(logging.WARNING, logger="clusterserve.kernels"):
        got = centroid_triton.centroid_attention_triton(centroids, k, v, mask, 0.25, topk)
        centroid_triton.centroid_attention_triton(centroids, k, v, mask, 0.25, topk)
    assert fallbacks.counts()[key] == before + 2
    if before == 0:
        assert sum("topk_over_on_chip" in r.getMessage() for r in caplog.records) == 1
    expected = _centroid_attention(centroids, k, mask, 0.25)
    assert torch.allclose(got.values, expected @ v, atol=1e-5, rtol=0)
    assert got.top_index.shape[-1] == topk
    centroid_triton.centroid_attention_triton(centroids, k, v, mask, 0.25, 8)
    assert fallbacks.counts()[key] == before + 2  # on chip: not counted


def test_centroid_top_k_of_tied_logits_equals_the_reference(poisoned):
    """Keys repeated: many logits tie (and equal the threshold); the top-k takes the lowest
    indices among equals, as torch.topk over the probabilities does here."""
    _, k, v = qkv(m=200, d=16)
    k = k[:, :, torch.arange(200) % 7]
    centroids = torch.randn(2, 2, 3, 16, generator=torch.Generator().manual_seed(2))
    mask = padding_mask(2, 200, [200, 150])
    got = centroid_triton.centroid_attention_triton(centroids, k, v, mask, 0.25, 8)
    expected = _centroid_attention(centroids, k, mask, 0.25)
    assert torch.allclose(got.top_probs, expected.topk(8, dim=-1).values, atol=1e-6, rtol=0)
    assert_topk_agree(got.top_index, expected.topk(8, dim=-1).indices, expected)


@pytest.mark.parametrize("tied", [300, 150])
def test_centroid_top_k_merges_full_buffers_within_a_split(tied, monkeypatch):
    """One split a head (TARGET_PROGRAMS 1): its first `tied` keys are one vector, so the first
    blocks put all their keys in the candidate buffers; full buffers merge into the kept keys
    mid-split (after the second block), where the lowest indices among the equal keys must
    survive, after the keys above them. With all 300 tied, every row's floor then rises above
    the tie: no later key enters (the last merge read the 128 of the first). Integer scratch
    starts at the largest key, so a kept key or a buffer slot read before it is written shows."""
    monkeypatch.setattr(triton_helpers, "TARGET_PROGRAMS", 1)
    poison_empty(monkeypatch, integers_high=True)  # integer scratch read unwritten would win the top-k
    scratch = []
    allocate = centroid_topk_triton._topk_scratch
    monkeypatch.setattr(centroid_topk_triton, "_topk_scratch", lambda *a: scratch.append(allocate(*a)) or scratch[-1])
    _, k, v = qkv(m=300, d=16)
    k = k.clone()
    k[:, :, :tied] = k[:, :, :1]
    centroids = torch.randn(2, 2, 3, 16, generator=torch.Generator().manual_seed(4))
    centroids[:, :, 0] = k[:, :, 0] * 4  # row 0 of each head: the tied keys are its largest
    mask = padding_mask(2, 300, [300, 280])
    assert triton_helpers.key_splits(300, 4, 64) == (1, 320)
    got = centroid_triton.centroid_attention_triton(centroids, k, v, mask, 0.25, 8)
    expected = _centroid_attention(centroids, k, mask, 0.25)
    assert torch.allclose(got.top_probs, expected.topk(8, dim=-1).values, atol=1e-6, rtol=0)
    assert_topk_agree(got.top_index, expected.topk(8, dim=-1).indices, expected)
    for b, h in ((0, 0), (0, 1), (1, 0), (1, 1)):  # row 0: the keys above the tie, then the lowest tied ones
        probs = expected[b, h, 0]
        above = (probs > probs[0]).nonzero().flatten()
        want = torch.cat([above, torch.arange(8 - len(above))]).sort().values
        assert torch.equal(got.top_index[b, h, 0].sort().values, want)
    if tied == 300:
        _, counts, floors = scratch[0]
        assert torch.equal(counts[:, 0, :3], torch.full((4, 3), 128, dtype=torch.int32))
        logits = (centroids @ k[:, :, :1].transpose(-1, -2)).flatten(0, 1)[:, :, 0] * 0.25 * centroid_triton.LOG2E
        assert torch.allclose(floors[:, 0, :3], logits, rtol=1e-5, atol=1e-6)  # the tie's, an ulp up


def test_centroid_top_k_takes_a_later_key_between_the_kept_ones(monkeypatch):
    """All keys on one line, their logits scaled by the key: keys 0-3 at 1.2, 4-127 tied at 1.0
    fill the buffers and merge after the second block; key 200 at 1.1 comes later, above the
    least kept key (1.0) but below the greatest (1.2), and must enter: a row's floor rises to
    its least kept key, no higher."""
    monkeypatch.setattr(triton_helpers, "TARGET_PROGRAMS", 1)
    line = torch.randn(16, generator=torch.Generator().manual_seed(5))
    scales = torch.full((300,), 0.5)
    scales[:128], scales[:4], scales[200] = 1.0, 1.2, 1.1
    k = (scales[:, None] * line).expand(1, 1, 300, 16).contiguous()
    centroids = (line * 2).expand(1, 1, 2, 16).contiguous()
    mask = padding_mask(1, 300, [300])
    got = centroid_triton.centroid_attention_triton(centroids, k, k, mask, 0.25, 8)
    assert torch.equal(got.top_index[0, 0].sort().values, torch.tensor([[0, 1, 2, 3, 4, 5, 6, 200]] * 2))


def test_centroid_attention_beyond_the_on_chip_topk_equals_the_reference(monkeypatch):
    monkeypatch.setattr(centroid_triton, "MAX_TOPK_ON_CHIP", 4)
    _, k, v = qkv(m=30, d=16)
    centroids = torch.randn(2, 2, 5, 16, generator=torch.Generator().manual_seed(1))
    mask = padding_mask(2, 30, [30, 21])
    got = centroid_triton.centroid_attention_triton(centroids, k, v, mask, 0.25, 6)
    expected = _centroid_attention(centroids, k, mask, 0.25)
    assert torch.allclose(got.values, expected @ v, atol=1e-5, rtol=0)
    assert_topk_agree(got.top_index, expected.topk(6, dim=-1).indices, expected)


@pytest.mark.parametrize("n, m, topk, lengths", [(45, 45, 6, [45, 31]), (30, 100, 80, [100, 70]),
                                                 (300, 300, 6, [300, 213])])
def test_improved_sparse_part_equals_the_reference(n, m, topk, lengths, poisoned):
    """The fused tile kernel, given the reference's clusters and centroid attention. The second
    case has more top-k keys than one block and than row 1's real keys; in the third, 300
    queries in 4 clusters, some cluster spans several tiles."""
    q, k, v = qkv(n=n, m=m, d=16, dv=24)
    key_mask = padding_mask(2, m, lengths)
    query_mask = key_mask if n == m else torch.ones(2, n, dtype=torch.bool)
    spec = AttentionSpec(method="i-clustered", clusters=4, topk=topk, iterations=3, refine=1)
    assign = cluster_queries(REFERENCE, q, query_mask, spec)
    if n > 4 * triton_clustered.TILE:
        full = assign[0]  # no padding: its largest cluster spans tiles
        assert (full == full.mode(-1, keepdim=True).values).sum(-1).max() > triton_clustered.TILE
    centroid = REFERENCE.centroid_attention(cluster_means(q, assign, 4), k, v, key_mask, 0.25, min(topk, m))
    expected = REFERENCE.sparse(q, k, v, assign, centroid, key_mask, 0.25, torch.float32)
    got = triton_clustered.TRITON.sparse(q, k, v, assign, centroid, key_mask, 0.25, torch.float32)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)
    assert isinstance(centroid, CentroidAttention)


# ---- end to end -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "n, m, d, dv, lengths, refine",
    [
        (37, 37, 16, 16, [37, 26], 2),
        (50, 23, 24, 24, None, 0),
        (64, 64, 64, 64, [64, 41], 2),
        (19, 45, 32, 16, [45, 30], 1),
        (24, 24, 128, 128, None, 1),
    ],
)
def test_float32_matches_the_reference(method, n, m, d, dv, lengths, refine):
    q, k, v = qkv(n=n, m=m, d=d, dv=dv)
    mask = None if lengths is None else padding_mask(2, m, lengths)
    spec = AttentionSpec(method=method, clusters=5, topk=7, iterations=6, refine=refine, seed=2)
    got = run(q, k, v, spec, mask)
    assert got.shape == (2, 2, n, dv) and got.dtype == torch.float32
    assert (got - run(q, k, v, spec, mask, backend="reference")).abs().max() <= 1e-4


@pytest.mark.parametrize("method", METHODS)
def test_the_default_knobs_match_the_reference(method):
    # The served Lloyd counts: no Hamming iteration (each query joins its nearest initial
    # centroid, the final launch sums the vectors), then the refinement; a padded row included.
    q, k, v = qkv(n=56, d=32, seed=4)
    mask = padding_mask(2, 56, [56, 33])
    spec = AttentionSpec(method=method, clusters=6, topk=7, seed=5)
    assert spec.iterations == 0 and spec.refine > 0
    got = run(q, k, v, spec, mask)
    assert (got - run(q, k, v, spec, mask, backend="reference")).abs().max() <= 1e-4


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_error_at_most_twice_the_reference(method, dtype):
    q, k, v = qkv(n=40, d=32, dtype=dtype)
    mask = padding_mask(2, 40, [40, 27])
    spec = AttentionSpec(method=method, clusters=5, topk=6, iterations=5, refine=2)
    exact = run(q.double(), k.double(), v.double(), spec, mask, backend="reference")
    got = run(q, k, v, spec, mask)
    assert got.dtype == dtype
    torch_error = (run(q, k, v, spec, mask, backend="reference").double() - exact).abs().max()
    triton_error = (got.double() - exact).abs().max()
    assert triton_error <= 2 * torch_error + 1e-5, (triton_error, torch_error)


@pytest.mark.parametrize("n, m, lengths", [(40, 40, [40, 23]), (37, 53, [53, 30])])
def test_exact_cases_equal_full_attention(n, m, lengths):
    q, k, v = qkv(n=n, m=m)
    mask = padding_mask(2, m, lengths)
    expected = full_attention(q, k, v, mask, 16**-0.5)
    one_per_cluster = AttentionSpec(method="clustered", clusters=64, iterations=2, refine=1)
    all_keys = AttentionSpec(method="i-clustered", clusters=3, topk=64, iterations=3, refine=1)
    for spec in (one_per_cluster, all_keys):
        assert (run(q, k, v, spec, mask) - expected).abs().max() <= 1e-5, spec.method


@pytest.mark.parametrize("method", METHODS)
def test_padded_tokens_have_no_influence_and_padded_queries_are_zero(method):
    spec = AttentionSpec(method=method, clusters=4, topk=5, iterations=4, refine=2)
    q, k, v = qkv(n=40)
    mask = padding_mask(2, 40, [40, 29])
    out = run(q, k, v, spec, mask)
    noisy = [t.clone() for t in (q, k, v)]
    for t in noisy:
        t[1, :, 29:] = torch.randn_like(t[1, :, 29:]) * 100
    out2 = run(*noisy, spec, mask)
    assert torch.equal(out[:, :, :29], out2[:, :, :29]) and torch.equal(out[0], out2[0])
    assert (out[1, :, 29:] == 0).all()


@pytest.mark.parametrize("method", METHODS)
def test_two_runs_are_bitwise_equal(method, poisoned):
    """Every cross-program sum is reduced in a fixed order: the same call gives the same bits."""
    q, k, v = qkv(n=44, dtype=torch.bfloat16)
    mask = padding_mask(2, 44, [44, 30])
    spec = AttentionSpec(method=method, clusters=6, topk=5, iterations=4, refine=2)
    assert torch.equal(run(q, k, v, spec, mask), run(q, k, v, spec, mask))


def test_strided_inputs_give_the_same_output():
    """The model hands over (B, N, H, D) tensors transposed to (B, H, N, D): the kernels read
    them through their strides."""
    q, k, v = qkv(n=33, m=29)
    spec = AttentionSpec(method="i-clustered", clusters=4, topk=5, iterations=3, refine=1)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not strided[0].is_contiguous()
    assert torch.equal(run(*strided, spec), run(q, k, v, spec))


def test_all_keys_padded_gives_zero_rows_not_nan():
    q, k, v = qkv(n=16)
    mask = padding_mask(2, 16, [16, 0])
    for method in METHODS:
        out = run(q, k, v, AttentionSpec(method=method, clusters=4, topk=3, iterations=2, refine=1), mask)
        assert torch.isfinite(out).all() and (out[1] == 0).all()


# ---- no host synchronisation, errors ----------------------------------------------------------


def test_no_host_synchronisation(monkeypatch):
    """Outside the kernels nothing reads a tensor's value on the host (.item(), bool(t), ...)
    or compares tensors there; with CUDA tensors each of these would wait for the device."""
    from triton.runtime.interpreter import InterpretedFunction

    guarded = {"on": True}

    def refuse(name):
        original = getattr(torch.Tensor, name)

        def check(self, *args, **kwargs):
            if guarded["on"]:
                raise AssertionError(f"host synchronisation: Tensor.{name}")
            return original(self, *args, **kwargs)

        return check

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    monkeypatch.setattr(torch, "equal", lambda *a: (_ for _ in ()).throw(AssertionError("torch.equal")))
    launch = InterpretedFunction.run

    def unguarded_launch(self, *args, **kwargs):  # the interpreter itself reads tensors, as a GPU would
        guarded["on"] = False
        try:
            return launch(self, *args, **kwargs)
        finally:
            guarded["on"] = True

    monkeypatch.setattr(InterpretedFunction, "run", unguarded_launch)
    q, k, v = qkv(n=24)
    mask = padding_mask(2, 24, [24, 17])
    for method in METHODS:
        run(q, k, v, AttentionSpec(method=method, clusters=4, topk=4, iterations=3, refine=2), mask)


def test_cpu_tensors_without_the_interpreter_raise(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    q, k, v = qkv(n=8)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        run(q, k, v, AttentionSpec(method="clustered"))


def test_float64_is_refused_with_a_pointer_to_the_reference():
    q, k, v = qkv(n=8, dtype=torch.float64)
    with pytest.raises(ValueError, match="backend='reference'"):
        run(q, k, v, AttentionSpec(method="i-clustered"))


@pytest.mark.parametrize("per_split, resident, splits", [(12, 1, 11), (24, 1, 11), (48, 1, 5), (48, 2, 5), (12, 2, 22)])
def test_key_splits_fill_whole_waves(per_split, resident, splits):
    """The splits of 4,096 keys leave an SM the fewest keys, its waves taken whole: one program
    an SM at 12 programs a split is 11 splits (one wave of 132), not 22 (two waves, the same
    keys an SM and twice the partial results); 48 a split at two an SM is 5 (240, one wave),
    not 6 (288: a second wave for 24 programs). No other count up to TARGET_PROGRAMS does
    better, and none as well with fewer splits."""
    got, chunk = triton_helpers.key_splits(4096, per_split, 64, resident)
    assert (got, chunk) == (splits, triton.cdiv(triton.cdiv(4096, splits), 64) * 64)

    def per_sm(s):  # keys an SM runs: its waves x a split's keys
        return triton.cdiv(per_split * s, triton_helpers.SMS * resident) * triton.cdiv(4096, s)

    most = triton.cdiv(triton_helpers.TARGET_PROGRAMS, per_split)
    assert all(per_sm(s) > per_sm(got) or (s > got and per_sm(s) >= per_sm(got)) for s in range(1, most + 1)
               if s != got)
