"""The native SMYRF stages (kernels/native/native.c through native/smyrf.py) against the reference."""

import math

import pytest
import torch
from kernel_inputs import padding_mask, qkv

from clusterserve.kernels import AttentionSpec, attention, native
from clusterserve.kernels.dispatch import smyrf_stages
from clusterserve.kernels.native.smyrf import NATIVE
from clusterserve.kernels.reference.masks import token_masks
from clusterserve.kernels.reference.smyrf import REFERENCE, _cluster_attention, cluster_counts, cluster_slots, merge_by_mass

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native loops were not built (no C compiler)")

FULL = AttentionSpec(method="full")

# (n, m, d, dv, cluster_size, lengths): odd lengths, cluster sizes that do not divide N and
# are not whole vectors, N != M both ways, few keys (query clusters larger than the loop's
# group of 8, with a short last group), masks on self- and cross-attention.
SHAPES = [
    (48, 48, 16, 16, 16, None),
    (37, 37, 32, 32, 10, [37, 21]),
    (40, 72, 16, 32, 12, None),
    (72, 24, 16, 16, 8, [24, 13]),
    (64, 5, 16, 16, 8, None),
    (33, 33, 64, 48, 11, [30, 33]),
]


def smyrf(cluster_size, hash_rounds=3, seed=0):
    return AttentionSpec(method="smyrf", cluster_size=cluster_size, hash_rounds=hash_rounds, seed=seed)


def mask_for(m, lengths):
    return padding_mask(2, m, lengths) if lengths else None


def reference_with_orders(q, k, v, q_orders, k_orders, spec, mask, scale):
    """The reference's cluster attention on given orders, with each query's merged
    log-sum-exp: out (B, H, N, Dv) with padded queries 0, lse (B, H, N)."""
    key_mask, query_mask = token_masks(q, k, mask)
    n_real, m_real, n_clusters = cluster_counts(query_mask, key_mask, spec.cluster_size)
    b, h, n, _ = q.shape
    out = torch.zeros(b, h, n, v.shape[-1])
    lse = torch.full((b, h, n), float("-inf"))
    for q_order, k_order in zip(q_orders, k_orders):
        q_pos, q_valid = cluster_slots(q_order, n_real, n_clusters)
        k_pos, k_valid = cluster_slots(k_order, m_real, n_clusters)
        out, lse = merge_by_mass(out, lse, *_cluster_attention(q, k, v, q_pos, q_valid, k_pos, k_valid, scale))
    return out * query_mask[:, None, :, None], lse


def native_with_orders(q, k, v, q_orders, k_orders, spec, mask, scale):
    """native.smyrf_attention on given orders: out and the merged log-sum-exp (-inf where a
    query met no key)."""
    key_mask, query_mask = token_masks(q, k, mask)
    counts = cluster_counts(query_mask, key_mask, spec.cluster_size)
    out, top, total = native.smyrf_attention(q, k, v, q_orders, k_orders, *counts, scale)
    lse = torch.where(total > 0, top + total.log(), float("-inf"))
    return out, lse


def assert_hashes_close(got, expected):
    """Hashes equal to float32 rounding of their scale; +inf at exactly the same places."""
    assert torch.equal(torch.isinf(got), torch.isinf(expected)) and not torch.isnan(got).any()
    finite = torch.isfinite(expected)
    scale = expected[finite].abs().max().item() if finite.any() else 1.0
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-5, atol=1e-5 * scale)


def assert_unambiguous(hashes):
    """Neighbouring real hashes differ by more than 1e-4, while the hashes stay below 100 in
    size (float32 rounding ~1e-5 at most): no backend can order them differently."""
    ordered = hashes.sort(dim=-1).values
    finite = ordered[torch.isfinite(ordered)]
    gaps = ordered.diff(dim=-1)
    real_gaps = gaps[torch.isfinite(gaps)]
    assert finite.numel() == 0 or finite.abs().max() < 100
    assert real_gaps.numel() == 0 or real_gaps.min() > 1e-4, "near-tied hashes; pick another seed"


@pytest.mark.parametrize("n, m, d, dv, cluster_size, lengths", SHAPES)
def test_hashes_equal_the_reference(n, m, d, dv, cluster_size, lengths):
    q, k, _ = qkv(n=n, m=m, d=d, seed=1)
    mask = mask_for(m, lengths)
    spec = smyrf(cluster_size, hash_rounds=3, seed=5)
    got_q, got_k = NATIVE.hash(q, k, mask, spec)
    expected_q, expected_k = REFERENCE.hash(q, k, mask, spec)
    assert got_q.shape == expected_q.shape and got_k.shape == expected_k.shape
    assert_hashes_close(got_q, expected_q)
    assert_hashes_close(got_k, expected_k)


def test_hashes_of_a_row_without_real_keys():
    # The radius is the queries' max norm alone; every key hashes to +inf.
    q, k, _ = qkv(n=24, m=45, seed=3)
    mask = padding_mask(2, 45, [45, 0])
    spec = smyrf(8, hash_rounds=2, seed=1)
    got_q, got_k = NATIVE.hash(q, k, mask, spec)
    expected_q, expected_k = REFERENCE.hash(q, k, mask, spec)
    assert_hashes_close(got_q, expected_q)
    assert_hashes_close(got_k, expected_k)
    assert torch.isinf(got_k[:, 1]).all() and torch.isfinite(got_k[:, 0]).all()


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 3, 100), (4, 2500)])
def test_argsort_is_torch_stable_argsort(shape):
    # Values rounded to one decimal: many exact ties, which keep their positions' order.
    g = torch.Generator().manual_seed(sum(shape))
    values = (torch.randn(shape, generator=g) * 3).round(decimals=1)
    values[..., ::5] = float("inf")
    assert torch.equal(native.argsort(values), values.argsort(dim=-1, stable=True))


def test_argsort_orders_signs_zeros_and_infinity_as_torch():
    row = [0.0, -0.0, 1.5, -1.5, float("inf"), 0.0, -0.0, -3e38, float("inf"), 2e-40, -2e-40, 7.0]
    values = torch.tensor([row, row[::-1]])
    assert torch.equal(native.argsort(values), values.argsort(dim=-1, stable=True))


@pytest.mark.parametrize("n, m, d, dv, cluster_size, lengths", SHAPES[:4])
def test_sort_stage_equals_the_reference(n, m, d, dv, cluster_size, lengths):
    q, k, _ = qkv(n=n, m=m, d=d, seed=4)
    hashes = REFERENCE.hash(q, k, mask_for(m, lengths), smyrf(cluster_size, seed=2))
    for got, expected in zip(NATIVE.sort(*hashes), REFERENCE.sort(*hashes)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("rounds", [1, 3])
@pytest.mark.parametrize("n, m, d, dv, cluster_size, lengths", SHAPES)
def test_cluster_attention_equals_the_reference(n, m, d, dv, cluster_size, lengths, rounds):
    """Given the reference's orders, every round's clusters and the merge by mass match it."""
    q, k, v = qkv(n=n, m=m, d=d, dv=dv, seed=2)
    mask = mask_for(m, lengths)
    spec = smyrf(cluster_size, hash_rounds=rounds, seed=3)
    scale = 1 / math.sqrt(d)
    orders = REFERENCE.sort(*REFERENCE.hash(q, k, mask, spec))
    expected, expected_lse = reference_with_orders(q, k, v, *orders, spec, mask, scale)
    out, lse = native_with_orders(q, k, v, *orders, spec, mask, scale)
    assert (out - expected).abs().max() <= 1e-5
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)
    stage = NATIVE.cluster_attention(q, k, v, *orders, mask, spec, scale, torch.float32)
    assert torch.equal(stage, out)


@pytest.mark.parametrize("n, m, lengths", [(36, 36, [36, 0]), (24, 45, [45, 0]), (45, 24, [0, 24])])
def test_a_row_without_real_keys_gives_zeros(n, m, lengths):
    q, k, v = qkv(n=n, m=m, seed=6)
    mask = padding_mask(2, m, lengths)
    spec = smyrf(8, hash_rounds=2, seed=1)
    out = attention(q, k, v, spec, key_padding_mask=mask, backend="native")
    empty = lengths.index(0)
    assert not torch.isnan(out).any() and (out[empty] == 0).all() and (out[1 - empty] != 0).any()
    torch.testing.assert_close(out, attention(q, k, v, spec, key_padding_mask=mask, backend="reference"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n, m, lengths", [(40, 40, None), (37, 37, [37, 22]), (24, 45, [45, 31]), (50, 19, None)])
def test_one_cluster_is_exact_attention(n, m, lengths):
    """cluster_size >= max(N, M): every round is full attention, so any number of rounds is too."""
    q, k, v = qkv(n=n, m=m, seed=8)
    mask = mask_for(m, lengths)
    expected = attention(q, k, v, FULL, key_padding_mask=mask)
    out = attention(q, k, v, smyrf(max(n, m), hash_rounds=3), key_padding_mask=mask, backend="native")
    if mask is not None and n == m:
        expected = expected * mask[:, None, :, None]  # SMYRF's padded query rows are 0
    assert (out - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("n, m, d, dv, cluster_size, lengths", SHAPES)
def test_attention_equals_the_reference(n, m, d, dv, cluster_size, lengths):
    """End to end on inputs whose hashes are well separated: the same orders, the same output."""
    q, k, v = qkv(n=n, m=m, d=d, dv=dv, seed=11)
    mask = mask_for(m, lengths)
    spec = smyrf(cluster_size, hash_rounds=3, seed=11)
    expected_hashes = REFERENCE.hash(q, k, mask, spec)
    for hashes in expected_hashes:
        assert_unambiguous(hashes)
    for got, expected in zip(NATIVE.sort(*NATIVE.hash(q, k, mask, spec)), REFERENCE.sort(*expected_hashes)):
        assert torch.equal(got, expected)
    out = attention(q, k, v, spec, key_padding_mask=mask, backend="native")
    expected = attention(q, k, v, spec, key_padding_mask=mask, backend="reference")
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert (out - expected).abs().max() <= 1e-5
    assert not torch.allclose(expected, attention(q, k, v, FULL, key_padding_mask=mask), atol=1e-3)


def test_half_inputs_compute_in_float32_and_return_their_dtype():
    q, k, v = qkv(n=40, seed=11, dtype=torch.bfloat16)
    spec = smyrf(8, seed=11)
    out = attention(q, k, v, spec, backend="native")
    expected = attention(q.float(), k.float(), v.float(), spec, backend="reference")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


def test_padded_tokens_are_ignored():
    q, k, v = qkv(n=40, seed=10)
    mask = padding_mask(2, 40, [40, 23])
    spec = smyrf(8, hash_rounds=2)
    out = attention(q, k, v, spec, key_padding_mask=mask, backend="native")
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[1, :, 23:] = 100 * torch.randn(t[1, :, 23:].shape, generator=torch.Generator().manual_seed(1))
    assert torch.equal(out, attention(q2, k2, v2, spec, key_padding_mask=mask, backend="native"))
    assert (out[1, :, 23:] == 0).all()


def test_native_backend_runs_the_native_stages():
    assert smyrf_stages("native") is NATIVE and smyrf_stages("reference") is REFERENCE
