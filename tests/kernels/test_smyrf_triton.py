"""SMYRF Triton kernels against the PyTorch reference, on CPU through Triton's interpreter.

Every test runs with hash tiles of 16 rows, so the norms and hashes of a head spread over
several programs and the largest norm is reduced across them; the hash test runs with
torch.empty poisoned (NaN), so a hash a kernel fails to write shows up."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import math

import pytest
import torch
from kernel_inputs import padding_mask, poison_empty, qkv, several_programs_per_head

from clusterserve.kernels import AttentionSpec, attention
from clusterserve.kernels.reference.smyrf import (
    _cluster_attention,
    asymmetric_hashes,
    cluster_slots,
    merge_by_mass,
    smyrf_projections,
)
from clusterserve.kernels.triton import helpers as triton_helpers
from clusterserve.kernels.triton import smyrf as smyrf_triton
from clusterserve.kernels.triton.smyrf import hash_block, smyrf_cluster_attention_triton, smyrf_hashes_triton

FULL = AttentionSpec(method="full")


@pytest.fixture(autouse=True)
def _several_programs_per_head(monkeypatch):
    several_programs_per_head(monkeypatch)


def smyrf(cluster_size, hash_rounds=2, seed=0):
    return AttentionSpec(method="smyrf", cluster_size=cluster_size, hash_rounds=hash_rounds, seed=seed)


def masks_and_counts(b, n, m, key_padding_mask, cluster_size):
    """The reference's query/key masks, real counts and cluster counts (smyrf.cluster_counts)."""
    key_mask = key_padding_mask if key_padding_mask is not None else torch.ones(b, m, dtype=torch.bool)
    query_mask = key_mask if n == m else torch.ones(b, n, dtype=torch.bool)
    n_real, m_real = query_mask.sum(1), key_mask.sum(1)
    n_clusters = torch.minimum(
        (torch.maximum(n_real, m_real) + cluster_size - 1) // cluster_size, torch.minimum(n_real, m_real)
    ).clamp(min=1)
    return query_mask, key_mask, n_real, m_real, n_clusters


def reference_hashes(q, k, spec, key_padding_mask):
    b, h, n, d = q.shape
    query_mask, key_mask, *_ = masks_and_counts(b, n, k.shape[2], key_padding_mask, spec.cluster_size)
    projections = smyrf_projections(spec.hash_rounds, h, d, spec.seed)
    return asymmetric_hashes(q.float(), k.float(), query_mask, key_mask, projections)


def assert_unambiguous(hashes):
    """Real hashes are 1e-4 apart, 10x the float32 rounding seen, so no backend can reorder them."""
    ordered = hashes.sort(dim=-1).values
    gaps = ordered.diff(dim=-1)
    real_gaps = gaps[torch.isfinite(gaps)]
    assert real_gaps.numel() == 0 or real_gaps.min() > 1e-4, "inputs have near-tied hashes; pick another seed"


def reference_with_orders(q, k, v, q_orders, k_orders, spec, key_padding_mask, scale, dtype):
    """The reference's cluster attention and merge in `dtype`, on given sort orders."""
    b, h, n, _ = q.shape
    query_mask, _, n_real, m_real, n_clusters = masks_and_counts(b, n, k.shape[2], key_padding_mask, spec.cluster_size)
    qx, kx, vx = q.to(dtype), k.to(dtype), v.to(dtype)
    out = torch.zeros(b, h, n, v.shape[-1], dtype=dtype)
    lse = torch.full((b, h, n), float("-inf"), dtype=dtype)
    for q_order, k_order in zip(q_orders, k_orders):
        q_pos, q_valid = cluster_slots(q_order, n_real, n_clusters)
        k_pos, k_valid = cluster_slots(k_order, m_real, n_clusters)
        round_out, round_lse = _cluster_attention(qx, kx, vx, q_pos, q_valid, k_pos, k_valid, scale)
        out, lse = merge_by_mass(out, lse, round_out, round_lse)
    return out * query_mask[:, None, :, None], lse


def sorted_orders(hashes):
    return hashes.argsort(dim=-1, stable=True)


# Input and projection seeds under which every shape below hashes without near-ties.
UNAMBIGUOUS_SEED = {torch.float32: 11, torch.float16: 11, torch.bfloat16: 13}

# (n, m, d, dv, cluster_size, lengths): odd lengths, sizes that do not divide N, N != M both
# ways, few keys (large query clusters), masks on self- and cross-attention.
SHAPES = [
    (48, 48, 16, 16, 16, None),
    (37, 37, 32, 32, 10, [37, 21]),
    (40, 72, 16, 32, 12, None),
    (72, 24, 16, 16, 8, [24, 13]),
    (64, 5, 16, 16, 8, None),
    (33, 33, 64, 64, 32, [30, 33]),
]


@pytest.mark.parametrize("n, m, d, dv, cluster_size, lengths", SHAPES)
def test_hashes_match_reference(n, m, d, dv, cluster_size, lengths, monkeypatch):
    poison_empty(monkeypatch)
    q, k, _ = qkv(n=n, m=m, d=d, seed=1)
    mask = padding_mask(2, m, lengths) if lengths else None
    spec = smyrf(cluster_size, hash_rounds=3, seed=5)
    expected_q, expected_k = reference_hashes(q, k, spec, mask)
    projections = smyrf_projections(spec.hash_rounds, q.shape[1], d, spec.seed)
    got_q, got_k = smyrf_hashes_triton(q, k, mask, projections)
    torch.testing.assert_close(got_q, expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, expected_k, rtol=1e-5, atol=1e-5)
    if mask is not None:
        key_mask = mask[None, :, None, :].expand_as(got_k)
        assert torch.isinf(got_k[~key_mask]).all() and torch.isfinite(got_k[key_mask]).all()


@pytest.mark.parametrize("most", [32, 128])
@pytest.mark.parametrize("n, m, d, lengths", [(72, 24, 16, [24, 13]), (37, 37, 32, [37, 21])])
def test_larger_hash_tiles_give_the_same_hashes(n, m, d, lengths, most, monkeypatch):
    """A long sequence's hash tiles outgrow the norms' (HASH_TILE): with a target of one program
    they grow to HASH_MAX_ROWS, several tiles a head at 32 rows, one part-filled at 128."""
    poison_empty(monkeypatch)
    monkeypatch.setattr(triton_helpers, "TARGET_PROGRAMS", 1)
    monkeypatch.setattr(smyrf_triton, "HASH_MAX_ROWS", most)
    assert hash_block(n, m, 2, d) == most
    q, k, _ = qkv(n=n, m=m, d=d, seed=1)
    mask = padding_mask(2, m, lengths)
    spec = smyrf(8, hash_rounds=3, seed=5)
    expected_q, expected_k = reference_hashes(q, k, spec, mask)
    got_q, got_k = smyrf_hashes_triton(q, k, mask, smyrf_projections(spec.hash_rounds, q.shape[1], d, spec.seed))
    torch.testing.assert_close(got_q, expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, expected_k, rtol=1e-5, atol=1e-5)


def test_hash_tiles_are_the_largest_that_fill_the_gpu(monkeypatch):
    """At 12 heads: 256 rows at 4k (384 programs; 512 would leave 192 of 264), 512 from 8k,
    and no larger than HASH_TILE_ELEMENTS allows (256 at head dim 128); short inputs keep
    HASH_TILE."""
    monkeypatch.setattr(smyrf_triton, "HASH_TILE", 64)
    assert [hash_block(n, n, 12, 64) for n in (512, 4096, 8192, 65536)] == [64, 256, 512, 512]
    assert hash_block(65536, 65536, 12, 128) == 256
    for n, m in ((4096, 4096), (16384, 1000), (3000, 70000)):
        block = hash_block(n, m, 12, 64)
        tiles = -(-n // block) + -(-m // block)
        assert tiles * 12 >= triton_helpers.TARGET_PROGRAMS > (-(-n // (2 * block)) + -(-m // (2 * block))) * 12 \
            or block == smyrf_triton.HASH_MAX_ROWS


@pytest.mark.parametrize("rounds", [1, 3])
@pytest.mark.parametrize("n, m, d, dv, cluster_size, lengths", SHAPES)
def test_cluster_attention_matches_reference(n, m, d, dv, cluster_size, lengths, rounds):
    """Given the reference's sort orders, each round and the merge by mass match it."""
    q, k, v = qkv(n=n, m=m, d=d, dv=dv, seed=2)
    mask = padding_mask(2, m, lengths) if lengths else None
    spec = smyrf(cluster_size, hash_rounds=rounds, seed=3)
    scale = 1 / math.sqrt(d)
    q_orders, k_orders = map(sorted_orders, reference_hashes(q, k, spec, mask))
    expected_out, expected_lse = reference_with_orders(q, k, v, q_orders, k_orders, spec, mask, scale, torch.float32)
    out, lse = smyrf_cluster_attention_triton(q, k, v, q_orders, k_orders, mask, cluster_size, scale)
    assert (out - expected_out).abs().max() <= 1e-5
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("n, m, d, dv, cluster_size, lengths", SHAPES)
def test_end_to_end_float32_matches_torch(n, m, d, dv, cluster_size, lengths, transposed):
    seed = UNAMBIGUOUS_SEED[torch.float32]
    q, k, v = qkv(n=n, m=m, d=d, dv=dv, seed=seed)
    if transposed:  # (B, N, H, D) storage, as a model's projections produce
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    mask = padding_mask(2, m, lengths) if lengths else None
    spec = smyrf(cluster_size, hash_rounds=3, seed=seed)
    expected_q, expected_k = reference_hashes(q, k, spec, mask)
    assert_unambiguous(expected_q)
    assert_unambiguous(expected_k)
    projections = smyrf_projections(spec.hash_rounds, q.shape[1], d, spec.seed)
    got_q, got_k = smyrf_hashes_triton(q, k, mask, projections)
    assert torch.equal(sorted_orders(got_q), sorted_orders(expected_q))
    assert torch.equal(sorted_orders(got_k), sorted_orders(expected_k))
    out = attention(q, k, v, spec, key_padding_mask=mask, backend="triton")
    expected = attention(q, k, v, spec, key_padding_mask=mask, backend="reference")
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert (out - expected).abs().max() <= 1e-4


# Slack beyond twice the reference's error, relative to the output's scale: one unit roundoff,
# for the probabilities rounded to the value dtype before P @ V (as flash attention does).
HALF_EPS = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, m, d, dv, cluster_size, lengths", [SHAPES[1], SHAPES[2], SHAPES[5]])
def test_half_precision_within_twice_torch_error(n, m, d, dv, cluster_size, lengths, dtype):
    """Both backends in `dtype` against float64 attention on the same clusters."""
    seed = UNAMBIGUOUS_SEED[dtype]
    q, k, v = qkv(n=n, m=m, d=d, dv=dv, dtype=dtype, seed=seed)
    mask = padding_mask(2, m, lengths) if lengths else None
    spec = smyrf(cluster_size, hash_rounds=3, seed=seed)
    scale = 1 / math.sqrt(d)
    expected_q, expected_k = reference_hashes(q, k, spec, mask)
    assert_unambiguous(expected_q)
    assert_unambiguous(expected_k)
    projections = smyrf_projections(spec.hash_rounds, q.shape[1], d, spec.seed)
    got_q, got_k = smyrf_hashes_triton(q, k, mask, projections)
    assert torch.equal(sorted_orders(got_q), sorted_orders(expected_q))
    assert torch.equal(sorted_orders(got_k), sorted_orders(expected_k))
    exact, _ = reference_with_orders(
        q, k, v, sorted_orders(expected_q), sorted_orders(expected_k), spec, mask, scale, torch.float64
    )
    out = attention(q, k, v, spec, key_padding_mask=mask, backend="triton")
    torch_out = attention(q, k, v, spec, key_padding_mask=mask, scale=scale, backend="reference")
    assert out.dtype == dtype
    triton_error = (out.double() - exact).abs().max().item()
    torch_error = (torch_out.double() - exact).abs().max().item()
    assert triton_error <= 2 * torch_error + HALF_EPS[dtype] * exact.abs().max().item()


@pytest.mark.parametrize("n, m, lengths", [(40, 40, None), (37, 37, [37, 22]), (24, 45, [45, 31])])
def test_one_cluster_is_exact_attention(n, m, lengths):
    """cluster_size >= max(N, M): every round is full attention, so any number of rounds is too."""
    q, k, v = qkv(n=n, m=m, d=16, seed=8)
    mask = padding_mask(2, m, lengths) if lengths else None
    expected = attention(q, k, v, FULL, key_padding_mask=mask)
    out = attention(q, k, v, smyrf(max(n, m), hash_rounds=3), key_padding_mask=mask, backend="triton")
    assert (out - expected).abs().max() <= 1e-5


def scramble_padded(x, mask, generator):
    """x (B, H, N, D) with large random values at the padded positions of mask (B, N)."""
    x = x.clone()
    rows = x.transpose(1, 2)  # (B, N, H, D) view: boolean indexing by (B, N)
    rows[~mask] = 100 * torch.randn(rows[~mask].shape, generator=generator)
    return x


@pytest.mark.parametrize(
    "n, m, lengths", [(40, 40, [40, 23]), (36, 36, [36, 0]), (24, 45, [45, 17]), (24, 45, [45, 0])]
)
def test_padding_is_ignored(n, m, lengths):
    """Padded keys and values (and queries, when N == M) do not change real outputs; padded
    query rows are 0; a batch element without real keys gives 0, as in the reference."""
    q, k, v = qkv(n=n, m=m, d=16, seed=10)
    mask = padding_mask(2, m, lengths)
    spec = smyrf(8, hash_rounds=2)
    out = attention(q, k, v, spec, key_padding_mask=mask, backend="triton")
    g = torch.Generator().manual_seed(11)
    k2, v2 = scramble_padded(k, mask, g), scramble_padded(v, mask, g)
    q2 = scramble_padded(q, mask, g) if n == m else q
    out2 = attention(q2, k2, v2, spec, key_padding_mask=mask, backend="triton")
    assert torch.equal(out, out2)
    if n == m:
        assert (out.transpose(1, 2)[~mask] == 0).all()
    expected = attention(q, k, v, spec, key_padding_mask=mask, backend="reference")
    assert (out - expected).abs().max() <= 1e-4


@pytest.mark.parametrize("d", [16, 64])
def test_same_seed_same_output_and_seed_matters(d):
    q, k, v = qkv(n=40, d=d, seed=12)
    first = attention(q, k, v, smyrf(8, seed=1), backend="triton")
    assert torch.equal(first, attention(q, k, v, smyrf(8, seed=1), backend="triton"))
    assert not torch.equal(first, attention(q, k, v, smyrf(8, seed=2), backend="triton"))


def test_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    q, k, v = qkv(n=16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        attention(q, k, v, smyrf(8), backend="triton")


def test_float64_is_refused():
    q, k, v = qkv(n=16, dtype=torch.float64)
    with pytest.raises(ValueError, match="backend='reference'"):
        attention(q, k, v, smyrf(8), backend="triton")
