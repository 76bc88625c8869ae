"""The native backend (kernels/native/native.c through native/clustered.py) against the reference."""

import ctypes
import logging

import pytest
import torch
from kernel_inputs import padding_mask, qkv
from ties import (
    assert_codes_agree,
    assert_exact_ties_go_to_the_lowest_cluster,
    assert_refinement_agrees,
    assert_topk_agree,
)

from clusterserve.kernels import AttentionSpec, attention, backend_for, native
from clusterserve.kernels.native.clustered import NATIVE
from clusterserve.kernels.reference.clustered import REFERENCE, _centroid_attention
from clusterserve.kernels.reference.hashing import hash_codes, hash_planes, hash_signs
from clusterserve.kernels.reference.kmeans import hamming_kmeans, initial_centroid_positions, initial_offsets
from clusterserve.kernels.reference.masks import token_masks

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native loops were not built (no C compiler)")


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
    assert_codes_agree(native.hash_codes(q, planes), hash_codes(q, planes), q, planes)


@pytest.mark.parametrize(
    "n, lengths, clusters, iterations, bits, copies",
    [
        (64, [64, 64], 5, 10, 63, 0),
        (64, [64, 37], 8, 3, 63, 0),
        (50, [50, 9], 12, 10, 16, 20),  # more clusters than real queries; duplicate codes
        (50, [50, 2], 12, 3, 63, 0),  # more empty clusters than real queries: padded donors
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
    [
        (64, [64, 64], 5, 3, 0), (64, [64, 30], 7, 5, 0), (48, [48, 11], 9, 3, 12), (70, [70, 70], 20, 10, 40),
        (48, [48, 2], 9, 3, 0),  # more empty clusters than real queries: padded donors
    ],
)
def test_refinement_equals_the_reference(n, lengths, clusters, iterations, copies):
    q, _, _ = qkv(n=n)
    q = with_duplicates(q, copies)
    mask = padding_mask(2, n, lengths)
    planes = hash_planes(2, 16, 63, seed=2)
    start = hamming_kmeans(hash_signs(q, planes), mask, clusters, 2, initial_offsets(2, seed=2))
    ties = assert_refinement_agrees(native.refine_clusters, q, start, mask, clusters, iterations)
    print(f"ties within float rounding: {ties}")


@pytest.mark.parametrize("first, second", [(5, 18), (3, 19)])
def test_refinement_ties_go_to_the_lowest_cluster_across_lanes_and_blocks(first, second):
    # Clusters 5 and 18 sit in different lanes of different blocks of 16; 3 and 19 in the same
    # lane of two blocks.
    assert_exact_ties_go_to_the_lowest_cluster(native.refine_clusters, first, second, 24)


def test_every_stage_equals_the_reference_given_the_same_inputs():
    q, k, v = qkv(n=96, dv=24)
    mask = padding_mask(2, 96, [96, 70])
    key_mask, query_mask = token_masks(q, k, mask)
    spec = AttentionSpec(method="i-clustered", clusters=10, topk=12, iterations=10, refine=3, seed=4)
    codes = REFERENCE.hash(q, spec)
    assert_codes_agree(NATIVE.hash(q, spec), codes, q, hash_planes(2, 16, spec.bits, spec.seed))
    assign = REFERENCE.cluster(codes, query_mask, spec)
    assert torch.equal(NATIVE.cluster(codes, query_mask, spec), assign)  # integer distances: no rounding
    assert_refinement_agrees(native.refine_clusters, q, assign, query_mask, spec.clusters, spec.refine)
    assign = REFERENCE.refine(q, assign, query_mask, spec)
    centroids = REFERENCE.centroids(q, assign, spec.clusters)
    expected = REFERENCE.centroid_attention(centroids, k, v, key_mask, 0.25, spec.topk)
    got = NATIVE.centroid_attention(centroids, k, v, key_mask, 0.25, spec.topk)
    torch.testing.assert_close(got.values, expected.values, rtol=1e-5, atol=1e-6)
    assert_topk_agree(got.top_index, expected.top_index, _centroid_attention(centroids, k, key_mask, 0.25))
    torch.testing.assert_close(got.top_probs.sort(-1).values, expected.top_probs.sort(-1).values, rtol=1e-5, atol=1e-7)
    out = NATIVE.sparse(q, k, v, assign, expected, key_mask, 0.25, torch.float32)
    want = REFERENCE.sparse(q, k, v, assign, expected, key_mask, 0.25, torch.float32)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "m, lengths, topk, clusters, spread",
    [
        (80, [80, 80], 8, 6, 0.5),
        (80, [80, 5], 8, 11, 0.5),  # groups of 8 rows that cross (batch, head) boundaries
        (20, [20, 0], 4, 6, 0.5),  # a batch row without real keys: rows of 0
        (33, [33, 33], 33, 9, 0.5),  # every key in the top k
        (70, [70, 61], 5, 10, 6.0),  # logits of +-50: the running maximum moves and rescales
    ],
)
def test_centroid_pass_equals_the_reference(m, lengths, topk, clusters, spread):
    _, k, v = qkv(m=m, n=m, dv=24)
    centroids = torch.randn(2, 2, clusters, 16, generator=torch.Generator().manual_seed(0)) * spread
    key_mask = padding_mask(2, m, lengths)
    probs = _centroid_attention(centroids, k, key_mask, 0.25)
    values, index, top_probs, valid = native.centroid_attention(centroids, k, v, key_mask, 0.25, topk)
    torch.testing.assert_close(values, probs @ v, rtol=1e-5, atol=1e-6)
    want_probs, want_index = probs.topk(topk, dim=-1)
    real = key_mask.sum(-1).clamp(max=topk)  # per batch row: how many of the k are real keys
    for b in range(2):
        r = int(real[b])
        assert valid[b, :, :, :r].all() and not valid[b, :, :, r:].any()
        assert_topk_agree(index[b, ..., :r], want_index[b, ..., :r], probs[b])
        torch.testing.assert_close(top_probs[b, ..., :r], want_probs[b, ..., :r], rtol=1e-5, atol=1e-7)
        assert (top_probs[b, ..., r:] == 0).all() and (index[b, ..., r:] == 0).all()


@pytest.mark.parametrize("iterations", [5, AttentionSpec().iterations])  # and the served count
@pytest.mark.parametrize("method", ["clustered", "i-clustered"])
@pytest.mark.parametrize(
    "n, m, lengths, topk, dv",
    [(64, 64, None, 8, 16), (64, 64, [64, 23], 8, 16), (40, 24, [24, 5], 8, 8), (30, 30, [30, 30], 64, 16)],
)
def test_attention_equals_the_reference(method, n, m, lengths, topk, dv, iterations):
    q, k, v = qkv(n=n, m=m, dv=dv)
    mask = None if lengths is None else padding_mask(2, m, lengths)
    spec = AttentionSpec(method=method, clusters=6, topk=topk, iterations=iterations, refine=2, seed=9)
    fast = attention(q, k, v, spec, key_padding_mask=mask, backend="native")
    expected = attention(q, k, v, spec, key_padding_mask=mask, backend="reference")
    torch.testing.assert_close(fast, expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(expected, attention(q, k, v, AttentionSpec(method="full"), key_padding_mask=mask))


def test_auto_runs_the_native_loops_for_float_cpu_tensors_and_the_reference_for_float64():
    assert backend_for("cpu", torch.float32) == "native" and backend_for("cpu", torch.bfloat16) == "native"
    assert backend_for("cpu", torch.float64) == "reference"
    with pytest.raises(ValueError, match="backend='reference'"):
        backend_for("cpu", torch.float64, "native")


def test_without_a_built_library_auto_runs_the_reference(monkeypatch, caplog, reloaded, tmp_path):
    q, k, v = qkv(n=48)
    spec = AttentionSpec(method="i-clustered", clusters=5, topk=8)
    expected = attention(q, k, v, spec, backend="reference")
    monkeypatch.setattr(native, "FOLDER", tmp_path)  # an install made without a C compiler
    with caplog.at_level(logging.WARNING, logger="clusterserve.kernels.native"):
        assert native.library() is None and backend_for("cpu", torch.float32) == "reference"
        assert torch.equal(attention(q, k, v, spec), expected)
    assert "were not built" in caplog.text
    with pytest.raises(ValueError, match="not built"):
        attention(q, k, v, spec, backend="native")


@pytest.mark.skipif(native.level() == "generic", reason="x86-64 levels only")
def test_every_x86_64_level_is_built_and_the_cap_selects_the_baseline(monkeypatch, reloaded):
    built = {path.name.split(".")[0] for path in native.FOLDER.glob("_native_*.so")}
    assert {"_native_x86_64", "_native_x86_64_v3"} <= built
    monkeypatch.setenv(native.ISA_VARIABLE, "x86_64")
    assert native.level() == "x86_64"
    q, k, v = qkv(n=64)
    spec = AttentionSpec(method="i-clustered", clusters=6, topk=8, iterations=5, refine=2)
    torch.testing.assert_close(
        attention(q, k, v, spec, backend="native"), attention(q, k, v, spec, backend="reference"), rtol=1e-5, atol=1e-6
    )
    monkeypatch.setenv(native.ISA_VARIABLE, "avx9000")
    native.library.cache_clear()
    with pytest.raises(ValueError, match=native.ISA_VARIABLE):
        native.library()


def test_loading_the_libraries_leaves_subnormal_floats_alone():
    # A library linked with -ffast-math would switch on flush-to-zero for the whole process.
    for path in native.FOLDER.glob("_native_*.so"):
        if path.name.split(".")[0].removeprefix("_native_") in native.runnable_levels():
            ctypes.CDLL(str(path))
    tiny = 5e-324  # the smallest subnormal double
    assert tiny * 1.0 > 0.0
    assert torch.tensor(1e-40, dtype=torch.float32) * 1.0 > 0
