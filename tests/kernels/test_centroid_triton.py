"""The Triton centroid pass of the clustered methods against the PyTorch reference: the
centroids' attention over keys split across programs, its top-k (ties, full buffers, the
off-chip fallback), the improved method's per-query part and the key splits, on CPU through
Triton's interpreter (small shapes). Nothing here needs a GPU. The clustering stages are in
test_clustering_triton.py, whole calls in test_clustered_triton.py.

As there, every test runs with row tiles of 16 (several programs per head), and the stage
tests with torch.empty poisoned, so an element a kernel fails to write shows up."""

import os

# Before triton is imported anywhere: the kernels are decorated as interpreted functions.
os.environ["TRITON_INTERPRET"] = "1"

import logging  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from kernel_inputs import padding_mask, poison_empty, qkv, several_programs_per_head  # noqa: E402
from ties import assert_topk_agree  # noqa: E402

from clusterserve.kernels import AttentionSpec  # noqa: E402
from clusterserve.kernels.reference.clustered import REFERENCE, _centroid_attention  # noqa: E402
from clusterserve.kernels.reference.kmeans import cluster_means  # noqa: E402
from clusterserve.kernels.stages import CentroidAttention, cluster_queries  # noqa: E402

triton_clustered = pytest.importorskip("clusterserve.kernels.triton.clustered")
from clusterserve.kernels.triton import centroid as centroid_triton  # noqa: E402
from clusterserve.kernels.triton import centroid_topk as centroid_topk_triton  # noqa: E402
from clusterserve.kernels.triton import helpers as triton_helpers  # noqa: E402


@pytest.fixture(autouse=True)
def _several_programs_per_head(monkeypatch):
    several_programs_per_head(monkeypatch)


@pytest.fixture
def poisoned(monkeypatch):
    poison_empty(monkeypatch)


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
