"""The PyTorch reference of every attention method: exactness, Proposition 2, padding,
determinism, dtypes and unequal query/key lengths."""

import pytest
import torch
from kernel_inputs import APPROXIMATE, padding_mask, qkv

from clusterserve.kernels import AttentionSpec, attention

FULL = AttentionSpec(method="full")
# Specs under which each approximate method must equal exact attention for N, M <= 64.
EXACT = {
    "clustered": AttentionSpec(method="clustered", clusters=64),
    "i-clustered": AttentionSpec(method="i-clustered", clusters=3, topk=64),
    "smyrf": AttentionSpec(method="smyrf", cluster_size=64, hash_rounds=3),
}
TOL = {torch.float64: 1e-10, torch.float32: 2e-6}


def torch_attention(q, k, v, spec, mask=None):
    return attention(q, k, v, spec, key_padding_mask=mask, backend="reference")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("method", APPROXIMATE)
@pytest.mark.parametrize("n, m", [(48, 48), (37, 53), (64, 20)])
def test_exact_cases_equal_full_attention(method, n, m, dtype):
    q, k, v = qkv(n=n, m=m, dtype=dtype)
    expected = torch_attention(q, k, v, FULL)
    assert torch.allclose(torch_attention(q, k, v, EXACT[method]), expected, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("method", APPROXIMATE)
def test_exact_cases_with_padding(method):
    q, k, v = qkv(n=40, dtype=torch.float64)
    mask = padding_mask(2, 40, [40, 23])
    expected = torch_attention(q, k, v, FULL, mask)
    assert torch.allclose(torch_attention(q, k, v, EXACT[method], mask), expected, atol=1e-10, rtol=0)


def test_approximations_are_not_exact_with_few_clusters():
    """Guards the exactness tests: with coarse knobs the methods do differ from full."""
    q, k, v = qkv(n=64, dtype=torch.float64, structured=False)
    expected = torch_attention(q, k, v, FULL)
    for spec in (
        AttentionSpec(method="clustered", clusters=4),
        AttentionSpec(method="i-clustered", clusters=4, topk=4),
        AttentionSpec(method="smyrf", cluster_size=8, hash_rounds=1),
    ):
        assert (torch_attention(q, k, v, spec) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("refine", [0, 2])
def test_proposition_2_improved_is_never_worse_per_query(seed, refine):
    """Vyas et al. Prop. 2: each row of i-clustered attention is no farther (L1) from the
    exact attention row than the clustered row. With V = I the output is the attention matrix."""
    n = 64
    q, k, _ = qkv(b=1, h=2, n=n, d=8, dtype=torch.float64, seed=seed, structured=False)
    identity = torch.eye(n, dtype=torch.float64).expand(1, 2, n, n)
    exact = torch_attention(q, k, identity, FULL)
    common = dict(clusters=5, iterations=5, refine=refine, seed=seed)
    clustered = torch_attention(q, k, identity, AttentionSpec(method="clustered", **common))
    improved = torch_attention(q, k, identity, AttentionSpec(method="i-clustered", topk=6, **common))
    err_c = (clustered - exact).abs().sum(-1)
    err_i = (improved - exact).abs().sum(-1)
    assert (err_i <= err_c + 1e-12).all()
    assert (err_i < err_c - 1e-6).any()  # and it does improve somewhere
    assert torch.allclose(improved.sum(-1), torch.ones_like(err_i))  # rows stay distributions


@pytest.mark.parametrize("method", APPROXIMATE + ("full",))
def test_padded_keys_have_no_influence_and_padded_queries_are_zero(method):
    spec = AttentionSpec(method=method, clusters=4, topk=5, cluster_size=8, hash_rounds=2)
    q, k, v = qkv(n=40)
    mask = padding_mask(2, 40, [40, 29])
    out = torch_attention(q, k, v, spec, mask)
    noisy_q, noisy_k, noisy_v = q.clone(), k.clone(), v.clone()
    for t in (noisy_q, noisy_k, noisy_v):
        t[1, :, 29:] = torch.randn_like(t[1, :, 29:]) * 100
    out2 = torch_attention(noisy_q, noisy_k, noisy_v, spec, mask)
    assert torch.equal(out[:, :, :29], out2[:, :, :29])
    assert torch.equal(out[0], out2[0])
    assert (out[1, :, 29:] == 0).all()


@pytest.mark.parametrize("method", APPROXIMATE)
def test_same_seed_same_output_other_seed_other_output(method):
    q, k, v = qkv(n=64, structured=False)
    spec = AttentionSpec(method=method, clusters=6, topk=4, cluster_size=8, hash_rounds=1, seed=3)
    first = torch_attention(q, k, v, spec)
    assert torch.equal(first, torch_attention(q.clone(), k.clone(), v.clone(), spec))
    other = AttentionSpec(method=method, clusters=6, topk=4, cluster_size=8, hash_rounds=1, seed=4)
    assert not torch.equal(first, torch_attention(q, k, v, other))


@pytest.mark.parametrize("method", APPROXIMATE)
def test_batch_rows_do_not_depend_on_their_neighbours(method):
    """A request gives the same output whatever else shares its batch (and its padding)."""
    spec = AttentionSpec(method=method, clusters=5, topk=4, cluster_size=8, hash_rounds=2)
    q, k, v = qkv(b=2, n=50, dtype=torch.float64)
    mask = padding_mask(2, 50, [50, 31])
    batched = torch_attention(q, k, v, spec, mask)
    alone = torch_attention(q[1:, :, :31], k[1:, :, :31], v[1:, :, :31], spec)
    assert torch.allclose(batched[1:, :, :31], alone, atol=1e-12, rtol=0)


@pytest.mark.parametrize("method", APPROXIMATE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_compute_in_float32(method, dtype):
    spec = AttentionSpec(method=method, clusters=5, topk=4, cluster_size=8)
    q, k, v = qkv(n=40, dtype=dtype)
    out = torch_attention(q, k, v, spec)
    assert out.dtype == dtype
    upcast = torch_attention(q.float(), k.float(), v.float(), spec).to(dtype)
    assert torch.equal(out, upcast)


@pytest.mark.parametrize("method", APPROXIMATE)
def test_queries_and_keys_of_different_lengths(method):
    spec = AttentionSpec(method=method, clusters=4, topk=6, cluster_size=8, hash_rounds=2)
    q, k, v = qkv(n=19, m=45, dv=24)
    mask = padding_mask(2, 45, [45, 30])
    out = torch_attention(q, k, v, spec, mask)
    assert out.shape == (2, 2, 19, 24) and torch.isfinite(out).all()
    # With N != M the mask marks keys only: every query row gets an output.
    assert (out.abs().sum(-1) > 0).all()


def test_all_keys_padded_gives_zero_rows_not_nan():
    q, k, v = qkv(n=16)
    mask = padding_mask(2, 16, [16, 0])
    for method in APPROXIMATE + ("full",):
        out = torch_attention(q, k, v, AttentionSpec(method=method, clusters=4, cluster_size=4), mask)
        assert torch.isfinite(out).all() and (out[1] == 0).all()


def test_auto_runs_full_below_threshold_and_the_approximation_above():
    q, k, v = qkv(n=64, structured=False)
    auto = AttentionSpec(method="auto", auto_threshold=65, auto_method="clustered", clusters=4)
    assert torch.equal(torch_attention(q, k, v, auto), torch_attention(q, k, v, FULL))
    auto = AttentionSpec(method="auto", auto_threshold=64, auto_method="clustered", clusters=4)
    clustered = AttentionSpec(method="clustered", clusters=4)
    assert torch.equal(torch_attention(q, k, v, auto), torch_attention(q, k, v, clustered))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(q=torch.zeros(2, 2, 8)), "q: expected 4 dims"),
        (dict(k=torch.zeros(2, 3, 8, 16)), "k: shape"),
        (dict(v=torch.zeros(2, 2, 9, 16)), "v: shape"),
        (dict(key_padding_mask=torch.ones(2, 7, dtype=torch.bool)), "key_padding_mask: expected shape"),
        (dict(backend="cuda"), "backend: must be one of"),
        (dict(q=torch.zeros(2, 2, 8, 16, dtype=torch.int64)), "q: expected a floating-point"),
    ],
)
def test_bad_inputs_raise_value_errors_that_name_them(kwargs, message):
    q, k, v = qkv(n=8)
    args = dict(q=q, k=k, v=v, key_padding_mask=None, backend="reference") | kwargs
    with pytest.raises(ValueError, match=message):
        attention(args.pop("q"), args.pop("k"), args.pop("v"), AttentionSpec(), **args)


def test_padded_exact_attention_through_varlen_gives_the_masked_result(monkeypatch):
    """The varlen path's plumbing (token rows, sequence starts, each row's used keys, the output
    back to (B, H, N, D)) on a CPU, with torch's varlen kernel (CUDA only) stood in for by
    per-sequence SDPA over the first seqused_k keys: the masked SDPA's result, padded queries 0."""
    import torch.nn.attention.varlen as varlen

    from clusterserve.kernels.reference import full

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, seqused_k=None, **_):
        out = torch.empty_like(q)
        for i in range(len(cu_q) - 1):
            qs, ks, used = slice(cu_q[i], cu_q[i + 1]), int(cu_k[i]), int(seqused_k[i])
            sub = [t.transpose(0, 1)[None] for t in (q[qs], k[ks : ks + used], v[ks : ks + used])]
            out[qs] = torch.nn.functional.scaled_dot_product_attention(*sub, scale=scale)[0].transpose(0, 1)
        return out

    monkeypatch.setattr(varlen, "varlen_attn", stand_in)
    monkeypatch.setattr(full, "takes_varlen", lambda q: True)
    generator = torch.Generator().manual_seed(3)
    # (B, N, H, D) transposed: the (B, H, N, D) views Packed.attend hands a group.
    q, k, v = (torch.randn(3, 10, 2, 8, generator=generator).transpose(1, 2) for _ in range(3))
    mask = torch.arange(10)[None, :] < torch.tensor([10, 7, 3])[:, None]
    got = full.full_attention(q, k, v, mask, 8**-0.5)
    monkeypatch.setattr(full, "takes_varlen", lambda q: False)
    want = full.full_attention(q, k, v, mask, 8**-0.5)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch.all(got[1, :, 7:] == 0) and not torch.allclose(got[1, :, :7], torch.zeros(()))
