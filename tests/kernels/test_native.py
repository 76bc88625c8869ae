"""The native CPU loops (kernels/native.c) against the pure PyTorch reference they replace."""

import logging

import pytest
import torch
from kernel_inputs import padding_mask, qkv

from kernels import AttentionSpec, attention, native
from kernels.clustered import _centroid_attention, cluster_queries
from kernels.hashing import hash_codes, hash_planes, hash_signs
from kernels.kmeans import hamming_kmeans, initial_centroid_positions, initial_offsets, refine_clusters

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the native loops are not built")


def reference(monkeypatch):
    """Switch the native loops off for the rest of the test."""
    monkeypatch.setenv("CLUSTERSERVE_NATIVE", "0")


def with_duplicates(q, copies):
    """Queries with runs of identical rows: equal distances, empty clusters to re-seed."""
    if copies:
        q = q.clone()
        q[:, :, 1:copies] = q[:, :, :1]
    return q


@pytest.mark.parametrize("n, d, bits", [(40, 16, 1), (41, 16, 8), (43, 32, 63), (3, 8, 63)])
def test_hash_codes_equal_the_reference(n, d, bits):
    # Odd lengths: the loop hashes queries in groups, with a short last group.
    q, _, _ = qkv(n=n, d=d)
    planes = hash_planes(2, d, bits, seed=3)
    assert torch.equal(native.hash_codes(q, planes), hash_codes(q, planes))


@pytest.mark.parametrize(
    "n, lengths, clusters, iterations, bits, copies",
    [
        (64, [64, 64], 5, 10, 63, 0),
        (64, [64, 37], 8, 3, 63, 0),
        (50, [50, 9], 12, 10, 16, 20),  # more clusters than real queries; duplicate codes
        (40, [40, 40], 6, 0, 63, 0),  # no iteration: the nearest initial centroid
        (300, [300, 280], 270, 4, 63, 0),  # more than 256 clusters: several blocks of them
        (64, [64, 64], 4, 10, 2, 0),  # 2 bits: many equal distances, ties to the lowest index
    ],
)
def test_hamming_kmeans_equals_the_reference(n, lengths, clusters, iterations, bits, copies):
    q, _, _ = qkv(n=n)
    q = with_duplicates(q, copies)
    mask = padding_mask(2, n, lengths)
    planes = hash_planes(2, 16, bits, seed=1)
    offsets = initial_offsets(2, seed=1)
    expected = hamming_kmeans(hash_signs(q, planes), mask, clusters, iterations, offsets)
    codes = hash_codes(q, planes)
    initial = codes.gather(2, initial_centroid_positions(mask, clusters, offsets))
    assert torch.equal(native.hamming_kmeans(codes, mask, initial, iterations, bits), expected)


@pytest.mark.parametrize(
    "n, lengths, clusters, iterations, copies",
    [(64, [64, 64], 5, 3, 0), (64, [64, 30], 7, 5, 0), (48, [48, 11], 9, 3, 12), (70, [70, 70], 20, 10, 40)],
)
def test_refinement_equals_the_reference(n, lengths, clusters, iterations, copies):
    q, _, _ = qkv(n=n)
    q = with_duplicates(q, copies)
    mask = padding_mask(2, n, lengths)
    planes = hash_planes(2, 16, 63, seed=2)
    start = hamming_kmeans(hash_signs(q, planes), mask, clusters, 2, initial_offsets(2, seed=2))
    expected = refine_clusters(q, start, mask, clusters, iterations)
    assert torch.equal(native.refine_clusters(q, start, mask, clusters, iterations), expected)


def test_refinement_ties_go_to_the_lowest_cluster_across_blocks_of_lanes():
    # Queries 5 and 18 are the same vector, each alone in its cluster: both clusters are
    # equally near to both queries, and the lower index wins, even across vector blocks.
    q = torch.randn(1, 1, 20, 16, generator=torch.Generator().manual_seed(0))
    q[0, 0, 18] = q[0, 0, 5]
    start = torch.arange(20).reshape(1, 1, 20)
    mask = torch.ones(1, 20, dtype=torch.bool)
    expected = refine_clusters(q, start, mask, 20, 1)
    assert expected[0, 0, 18] == 5 and expected[0, 0, 5] == 5
    assert torch.equal(native.refine_clusters(q, start, mask, 20, 1), expected)


def test_clusters_of_the_whole_pipeline_equal_the_reference(monkeypatch):
    q, _, _ = qkv(n=96)
    mask = padding_mask(2, 96, [96, 70])
    spec = AttentionSpec(method="i-clustered", clusters=10, iterations=10, refine=3, seed=4)
    fast = cluster_queries(q, mask, spec)
    reference(monkeypatch)
    assert torch.equal(fast, cluster_queries(q, mask, spec))


@pytest.mark.parametrize("m, lengths, topk", [(80, [80, 80], 8), (80, [80, 5], 8), (20, [20, 0], 4), (33, [33, 33], 33)])
def test_softmax_and_top_k_equal_the_reference(m, lengths, topk):
    _, k, _ = qkv(m=m, n=m)
    centroids = torch.randn(2, 2, 6, 16, generator=torch.Generator().manual_seed(0)) * 0.5
    key_mask = padding_mask(2, m, lengths)
    expected = _centroid_attention(centroids, k, key_mask, 0.25)
    logits = (centroids @ k.transpose(-1, -2)).mul_(0.25)
    probs, index, top_probs, valid = native.softmax_topk(logits, key_mask, topk)
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-7)
    want_probs, want_index = expected.topk(topk, dim=-1)
    real = key_mask.sum(-1).clamp(max=topk)  # per batch row: how many of the k are real keys
    for b in range(2):
        r = int(real[b])
        assert valid[b, :, :, :r].all() and not valid[b, :, :, r:].any()
        assert torch.equal(index[b, ..., :r], want_index[b, ..., :r])
        torch.testing.assert_close(top_probs[b, ..., :r], want_probs[b, ..., :r], rtol=1e-5, atol=1e-7)
        assert (top_probs[b, ..., r:] == 0).all()


@pytest.mark.parametrize("method", ["clustered", "i-clustered"])
@pytest.mark.parametrize(
    "n, m, lengths, topk, dv",
    [(64, 64, None, 8, 16), (64, 64, [64, 23], 8, 16), (40, 24, [24, 5], 8, 8), (30, 30, [30, 30], 64, 16)],
)
def test_attention_equals_the_reference(monkeypatch, method, n, m, lengths, topk, dv):
    q, k, v = qkv(n=n, m=m, dv=dv)
    mask = None if lengths is None else padding_mask(2, m, lengths)
    spec = AttentionSpec(method=method, clusters=6, topk=topk, iterations=5, refine=2, seed=9)
    fast = attention(q, k, v, spec, key_padding_mask=mask)
    reference(monkeypatch)
    expected = attention(q, k, v, spec, key_padding_mask=mask)
    torch.testing.assert_close(fast, expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(expected, attention(q, k, v, AttentionSpec(method="full"), key_padding_mask=mask))


def test_float32_only(monkeypatch):
    x = torch.zeros(1, 1, 2, 4)
    assert native.usable(x)
    assert not native.usable(x.double()) and not native.usable(x.bfloat16())
    reference(monkeypatch)
    assert not native.usable(x)


@pytest.fixture
def rebuilt():
    """native.library() forgets the loaded library now and after the test."""
    native.library.cache_clear()
    yield
    native.library.cache_clear()


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path, rebuilt):
    """An empty build cache: the next native.library() compiles native.c into it."""
    monkeypatch.setenv("CLUSTERSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_no_compiler_falls_back_to_the_reference(monkeypatch, caplog, rebuilt):
    q, k, v = qkv(n=48)
    spec = AttentionSpec(method="i-clustered", clusters=5, topk=8)
    expected = attention(q, k, v, spec)
    monkeypatch.setenv("CC", "no-such-compiler")
    native.library.cache_clear()
    with caplog.at_level(logging.WARNING, logger="kernels.native"):
        assert native.library() is None and not native.usable(q)
        torch.testing.assert_close(attention(q, k, v, spec), expected, rtol=1e-5, atol=1e-6)
    assert "no C compiler" in caplog.text


def test_loading_the_library_leaves_subnormal_floats_alone(fresh_cache):
    # A library linked with -ffast-math would switch on flush-to-zero for the whole process.
    assert native.library() is not None
    tiny = 5e-324  # the smallest subnormal double
    assert tiny * 1.0 > 0.0
    assert torch.tensor(1e-40, dtype=torch.float32) * 1.0 > 0


def test_the_library_is_built_once_into_the_cache(fresh_cache):
    assert native.library() is not None
    built = list(fresh_cache.glob("*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    native.library.cache_clear()
    assert native.library() is not None and built[0].stat().st_mtime_ns == stamp
    assert sorted(fresh_cache.iterdir()) == built  # no half-built or object-file leftovers
