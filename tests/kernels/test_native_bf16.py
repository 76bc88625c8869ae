"""The native backend on bfloat16 q, k, v.

The loops widen each bfloat16 row as they read it (exact) and compute in float32, so every
stage must give what the float32 loops give on the same values upcast, bit for bit, and the
output that result rounded to bfloat16. Where the CPU has AVX512-BF16 (native.bf16_dot()),
three parts multiply bfloat16 as it is: SMYRF's logits (summed in another order, within
float32 rounding), clustered attention's centroid pass (native.bf16_centroid_pass: the centroids
and the probabilities rounded to bfloat16, as a bfloat16 SDPA computes, within CENTROID_PASS_TOL
of exact attention) and banded attention's band and far blocks (logits in another order,
weights rounded to bfloat16). Against the reference run on those values in float32 (float64 where the
method is exact), discrete decisions follow the tie rules of ties.py and outputs agree to the
output's bfloat16 rounding. No stage may make a float32 copy of q, k or v.
"""

import math

import pytest
import torch
from kernel_inputs import padding_mask, qkv
from ties import assert_codes_agree, assert_refinement_agrees, assert_topk_agree
from torch.utils._python_dispatch import TorchDispatchMode

from clusterserve.kernels import AttentionSpec, attention, native
from clusterserve.kernels.native.clustered import NATIVE
from clusterserve.kernels.native.smyrf import NATIVE as SMYRF_NATIVE
from clusterserve.kernels.reference.clustered import REFERENCE, _centroid_attention
from clusterserve.kernels.reference.full import full_attention
from clusterserve.kernels.reference.hashing import hash_planes
from clusterserve.kernels.reference.masks import token_masks
from clusterserve.kernels.reference.smyrf import REFERENCE as SMYRF_REFERENCE
from clusterserve.kernels.reference.smyrf import cluster_counts
from clusterserve.kernels.stages import run_clustered, run_smyrf

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native loops were not built (no C compiler)")

BF16 = torch.bfloat16
# The output is float32 arithmetic rounded once to bfloat16 (half a unit in its 8-bit
# significand, 2^-9 relative): one unit of margin.
OUT_RTOL, OUT_ATOL = 2**-8, 1e-6
SCALE = 0.25
# The bfloat16 centroid pass weighs each value row by its probability rounded to bfloat16
# (within 2^-9 relative) and divides by the sum of those weights: each weight is off by at
# most 2^-8 relative, exponential included, so V^c moves by at most 2^-7 of the largest |v|.
CENTROID_PASS_TOL = 2**-7

SPECS = {
    "clustered": AttentionSpec(method="clustered", clusters=6, iterations=5, refine=2, seed=9),
    "i-clustered": AttentionSpec(method="i-clustered", clusters=6, topk=8, iterations=5, refine=2, seed=9),
    "smyrf": AttentionSpec(method="smyrf", hash_rounds=3, cluster_size=16, seed=11),
}


def bf16_qkv(**shape):
    return tuple(t.to(BF16) for t in qkv(**shape))


def upcast(*tensors):
    return tuple(t.float() for t in tensors)


def stage_outputs(stages, q, k, v, spec, mask):
    """Every stage's output of one run of the pipeline, by stage name."""
    outputs = {}

    def record(name, stage, *args):
        outputs[name] = stage(*args)
        return outputs[name]

    run = run_smyrf if spec.method == "smyrf" else run_clustered
    outputs["out"] = run(stages, q, k, v, spec, mask, SCALE, observe=record)
    return outputs


def assert_same(got, want, name):
    if isinstance(want, tuple):  # the hashes, the orders, the centroid pass
        for g, w in zip(got, want):
            assert_same(g, w, name)
    elif want is not None:
        assert got.dtype == want.dtype and torch.equal(got, want), f"{name} differs"


@pytest.mark.parametrize("method", list(SPECS))
@pytest.mark.parametrize("n, m, lengths, dv", [(96, 96, None, 16), (96, 96, [96, 50], 24), (40, 72, [72, 33], 16)])
def test_every_stage_equals_the_float32_loops_on_the_same_values(method, n, m, lengths, dv):
    q, k, v = bf16_qkv(n=n, m=m, dv=dv)
    mask = None if lengths is None else padding_mask(2, m, lengths)
    stages = SMYRF_NATIVE if method == "smyrf" else NATIVE
    got = stage_outputs(stages, q, k, v, SPECS[method], mask)
    want = stage_outputs(stages, *upcast(q, k, v), SPECS[method], mask)
    assert got.keys() == want.keys()
    last = {"clustered": "broadcast", "i-clustered": "sparse", "smyrf": "cluster_attention"}[method]
    bf16_pass = method == "clustered" and native.bf16_centroid_pass(k, v)
    for name in got:
        if name in (last, "out") and method == "smyrf" and native.bf16_dot():  # logits summed by pairs
            assert got[name].dtype == BF16
            torch.testing.assert_close(got[name].float(), want[name], rtol=OUT_RTOL, atol=OUT_ATOL)
        elif name in ("centroid_attention", last, "out") and bf16_pass:  # V^c from bfloat16 products
            tolerance = CENTROID_PASS_TOL * v.abs().max().item()
            values = got[name].values if name == "centroid_attention" else got[name]
            expected = want[name].values if name == "centroid_attention" else want[name]
            torch.testing.assert_close(values.float(), expected, rtol=OUT_RTOL, atol=tolerance)
        elif name in (last, "out"):  # the output, in q's dtype
            assert_same(got[name], want[name].to(BF16), name)
        else:
            assert_same(got[name], want[name], name)


# (n, m, d, dv, cluster_size, lengths): an odd D (no pairs of dimensions for vdpbf16ps: the
# widening loop), N != M both ways, few keys, padding.
SMYRF_SHAPES = [(48, 48, 32, 32, 16, None), (37, 37, 15, 16, 10, [37, 21]), (40, 72, 16, 32, 12, None),
                (72, 24, 64, 48, 8, [24, 13])]


@pytest.mark.parametrize("n, m, d, dv, cluster_size, lengths", SMYRF_SHAPES)
def test_smyrf_logits_agree_with_the_reference_in_float32(n, m, d, dv, cluster_size, lengths):
    """On the reference's orders: each query's merged log-sum-exp to float32 rounding of the
    logits (vdpbf16ps or widened rows), the output to its bfloat16 rounding."""
    q, k, v = bf16_qkv(n=n, m=m, d=d, dv=dv, seed=2)
    q32, k32, v32 = upcast(q, k, v)
    mask = None if lengths is None else padding_mask(2, m, lengths)
    spec = AttentionSpec(method="smyrf", hash_rounds=3, cluster_size=cluster_size, seed=3)
    key_mask, query_mask = token_masks(q, k, mask)
    counts = cluster_counts(query_mask, key_mask, spec.cluster_size)
    orders = SMYRF_REFERENCE.sort(*SMYRF_REFERENCE.hash(q32, k32, mask, spec))
    out, top, total = native.smyrf_attention(q, k, v, *orders, *counts, 1 / math.sqrt(d))
    want, want_top, want_total = native.smyrf_attention(q32, k32, v32, *orders, *counts, 1 / math.sqrt(d))
    expected = SMYRF_REFERENCE.cluster_attention(q32, k32, v32, *orders, mask, spec, 1 / math.sqrt(d), torch.float32)
    assert out.dtype == BF16
    torch.testing.assert_close(out.float(), expected, rtol=OUT_RTOL, atol=OUT_ATOL)
    lse = torch.where(total > 0, top + total.log(), float("-inf"))
    want_lse = torch.where(want_total > 0, want_top + want_total.log(), float("-inf"))
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    if not native.bf16_dot() or d % 2:  # widened rows: the float32 loop's arithmetic
        assert torch.equal(out, want.to(BF16)) and torch.equal(top, want_top) and torch.equal(total, want_total)


@pytest.mark.parametrize("level", native.runnable_levels())
@pytest.mark.parametrize("d", [32, 15])
def test_banded_reads_bfloat16_at_every_level(level, d, monkeypatch, reloaded):
    """Banded attention's band and far blocks run on vdpbf16ps where the level has it (an even
    D): logits summed in another order (within float32 rounding), and their weights rounded to
    bfloat16 before they meet the values, divided by the sum of the rounded weights, as the
    centroid pass's are: the output within CENTROID_PASS_TOL of the largest |v| of the float32
    loop's. Elsewhere (and for the pooled keys and sinks always) the float32 loop's arithmetic
    on the widened rows, bit for bit."""
    monkeypatch.setenv(native.ISA_VARIABLE, level)
    assert native.level() == level
    q, k, v = bf16_qkv(n=200, d=d, dv=24, seed=d)
    mask = padding_mask(2, 200, [200, 151])
    spec = AttentionSpec(method="banded", band=1, block=16, sinks=3, far_blocks=2)
    out = attention(q, k, v, spec, key_padding_mask=mask, backend="native")
    want = attention(*upcast(q, k, v), spec, key_padding_mask=mask, backend="native")
    if native.bf16_dot() and d % 2 == 0:
        assert (out.float() - want).abs().max() <= CENTROID_PASS_TOL * v.float().abs().max()
    else:
        assert torch.equal(out, want.to(BF16))


@pytest.mark.parametrize("level", native.runnable_levels())
def test_every_level_this_cpu_runs_reads_bfloat16(level, monkeypatch, reloaded):
    # The AVX-512 library with and without vdpbf16ps runs the same source as AVX2 and the
    # baseline: each level this CPU runs is checked here, whatever level the suite runs on.
    monkeypatch.setenv(native.ISA_VARIABLE, level)
    assert native.level() == level
    q, k, v = bf16_qkv(n=64, dv=24, seed=7)
    mask = padding_mask(2, 64, [64, 41])
    for method, spec in SPECS.items():
        out = attention(q, k, v, spec, key_padding_mask=mask, backend="native")
        want = attention(*upcast(q, k, v), spec, key_padding_mask=mask, backend="native")
        if method == "smyrf" and native.bf16_dot():
            torch.testing.assert_close(out.float(), want, rtol=OUT_RTOL, atol=OUT_ATOL)
        else:
            assert torch.equal(out, want.to(BF16)), f"{method} at {level}"


@pytest.mark.parametrize("lengths", [None, [96, 61]])
def test_clustered_stages_agree_with_the_reference_in_float32(lengths):
    q, k, v = bf16_qkv(n=96, dv=24)
    q32, k32, v32 = upcast(q, k, v)
    mask = None if lengths is None else padding_mask(2, 96, lengths)
    key_mask, query_mask = token_masks(q, k, mask)
    spec = AttentionSpec(method="i-clustered", clusters=10, topk=12, iterations=10, refine=3, seed=4)
    codes = REFERENCE.hash(q32, spec)
    assert_codes_agree(NATIVE.hash(q, spec), codes, q32, hash_planes(2, 16, spec.bits, spec.seed))
    assign = REFERENCE.cluster(codes, query_mask, spec)
    assert torch.equal(NATIVE.cluster(codes, query_mask, spec), assign)

    def refine_bf16(x, *args):  # the reference's float32 q is exactly the bfloat16 q upcast
        return native.refine_clusters(x.to(BF16), *args)

    assert_refinement_agrees(refine_bf16, q32, assign, query_mask, spec.clusters, spec.refine)
    assign = REFERENCE.refine(q32, assign, query_mask, spec)
    centroids = REFERENCE.centroids(q32, assign, spec.clusters)
    torch.testing.assert_close(NATIVE.centroids(q, assign, spec.clusters), centroids, rtol=1e-6, atol=1e-6)
    expected = REFERENCE.centroid_attention(centroids, k32, v32, key_mask, SCALE, spec.topk)
    got = NATIVE.centroid_attention(centroids, k, v, key_mask, SCALE, spec.topk)
    torch.testing.assert_close(got.values, expected.values, rtol=1e-5, atol=1e-6)
    assert_topk_agree(got.top_index, expected.top_index, _centroid_attention(centroids, k32, key_mask, SCALE))
    torch.testing.assert_close(got.top_probs.sort(-1).values, expected.top_probs.sort(-1).values, rtol=1e-5, atol=1e-7)
    clustered_values = NATIVE.centroid_attention(centroids, k, v, key_mask, SCALE, 0).values
    torch.testing.assert_close(clustered_values, expected.values, rtol=1e-5, atol=1e-6)
    out = NATIVE.sparse(q, k, v, assign, expected, key_mask, SCALE, BF16)
    want = REFERENCE.sparse(q32, k32, v32, assign, expected, key_mask, SCALE, torch.float32)
    assert out.dtype == BF16
    torch.testing.assert_close(out.float(), want, rtol=OUT_RTOL, atol=OUT_ATOL)


@pytest.mark.parametrize("method", list(SPECS))
@pytest.mark.parametrize("n, m, lengths", [(64, 64, None), (64, 64, [64, 23]), (40, 24, [24, 5])])
def test_attention_equals_the_reference_in_float32_on_the_same_values(method, n, m, lengths):
    q, k, v = bf16_qkv(n=n, m=m, dv=16, seed=11)
    mask = None if lengths is None else padding_mask(2, m, lengths)
    spec = SPECS[method]
    if method == "smyrf":  # hashes well apart: the same orders on every backend
        q_hashes, k_hashes = SMYRF_REFERENCE.hash(*upcast(q, k), mask, spec)
        for hashes in (q_hashes, k_hashes):
            gaps = hashes.sort(dim=-1).values.diff(dim=-1)
            assert gaps[torch.isfinite(gaps)].min() > 1e-4, "near-tied hashes; pick another seed"
    out = attention(q, k, v, spec, key_padding_mask=mask, backend="native")
    expected = attention(*upcast(q, k, v), spec, key_padding_mask=mask, backend="reference")
    assert out.dtype == BF16
    bf16_pass = method == "clustered" and native.bf16_centroid_pass(k, v)
    atol = CENTROID_PASS_TOL * v.abs().max().item() if bf16_pass else OUT_ATOL
    torch.testing.assert_close(out.float(), expected, rtol=OUT_RTOL, atol=atol)


@pytest.mark.parametrize("method", list(SPECS))
@pytest.mark.parametrize("lengths", [None, [30, 17]])
def test_exact_cases_equal_float64_attention(method, lengths):
    # One query per cluster (every top-k key kept), or one SMYRF cluster: exact attention.
    q, k, v = bf16_qkv(n=30, dv=24, seed=3)
    mask = None if lengths is None else padding_mask(2, 30, lengths)
    spec = AttentionSpec(method=method, clusters=30, topk=30, hash_rounds=2, cluster_size=30, iterations=3, refine=1)
    out = attention(q, k, v, spec, key_padding_mask=mask, backend="native")
    exact = full_attention(*(t.double() for t in (q, k, v)), mask, 1 / 4)
    assert out.dtype == BF16
    torch.testing.assert_close(out.double(), exact, rtol=OUT_RTOL, atol=1e-5)


class Float32Tensors(TorchDispatchMode):
    """Records the size of every float32 tensor an op makes."""

    def __init__(self):
        super().__init__()
        self.sizes = [0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.sizes.append(t.numel())
        return out


@pytest.mark.parametrize("method", list(SPECS))
def test_no_stage_makes_a_float32_copy_of_q_k_v(method):
    q, k, v = bf16_qkv(n=512, m=512, d=16, dv=16)
    mask = padding_mask(2, 512, [512, 400])
    spec = AttentionSpec(method=method, clusters=8, topk=8, iterations=3, refine=2, hash_rounds=3, cluster_size=32)
    seen = []

    def record(name, stage, *args):
        seen.extend((name, t.dtype) for t in args if isinstance(t, torch.Tensor) and t.shape in (q.shape, k.shape))
        return stage(*args)

    run = run_smyrf if method == "smyrf" else run_clustered
    with Float32Tensors() as made:
        out = run(SMYRF_NATIVE if method == "smyrf" else NATIVE, q, k, v, spec, mask, SCALE, observe=record)
    assert out.dtype == BF16
    assert seen and all(dtype == BF16 for _, dtype in seen), seen  # every stage takes q, k, v as they are
    assert max(made.sizes) < q.numel() // 2, f"a float32 tensor of {max(made.sizes)} elements, q has {q.numel()}"
    with Float32Tensors() as made:  # the check sees a copy where one is made: the reference upcasts
        run(SMYRF_REFERENCE if method == "smyrf" else REFERENCE, q, k, v, spec, mask, SCALE)
    assert max(made.sizes) >= q.numel()


def test_float16_is_computed_in_float32_and_returned_in_float16():
    q, k, v = qkv(n=40, seed=5, dtype=torch.float16)
    for spec in SPECS.values():
        out = attention(q, k, v, spec, backend="native")
        assert out.dtype == torch.float16
        assert torch.equal(out, attention(*upcast(q, k, v), spec, backend="native").to(torch.float16))


needs_bf16_dot = pytest.mark.skipif(not native.bf16_dot(), reason="no AVX512-BF16: the centroid pass is SDPA in float32")


def rounded_centroid_attention(centroids, k, v, mask, scale):
    """What the bfloat16 centroid pass approximates, in float64: exact attention of the
    centroids scaled and rounded to bfloat16 (rows of 0 where no key is real)."""
    rounded = (centroids * scale).to(BF16).double()
    return _centroid_attention(rounded, k.double(), mask, 1.0) @ v.double()


# (b, h, c, m, d, dv, lengths, packed): a short last block of keys (M % 16), an odd M, padding,
# a batch row with no real key, groups of rows that cross (batch, head) slices (C % 16), other
# models' D and Dv, and k, v as strided views of the packed (T, H, D) layout.
CENTROID_PASS_SHAPES = [(1, 2, 20, 100, 32, 32, None, False), (2, 3, 13, 77, 16, 16, [77, 30], True),
                        (2, 2, 9, 40, 32, 64, [0, 17], False), (1, 2, 40, 517, 64, 48, None, True)]


@needs_bf16_dot
@pytest.mark.parametrize("b, h, c, m, d, dv, lengths, packed", CENTROID_PASS_SHAPES)
def test_the_bfloat16_centroid_pass_is_attention_of_the_rounded_centroids(b, h, c, m, d, dv, lengths, packed):
    g = torch.Generator().manual_seed(c)
    centroids = torch.randn(b, h, c, d, generator=g)
    if packed:
        k, v = (torch.randn(b, m, h, e, generator=g).to(BF16).transpose(1, 2) for e in (d, dv))
    else:
        k, v = (torch.randn(b, h, m, e, generator=g).to(BF16) for e in (d, dv))
    mask = torch.ones(b, m, dtype=torch.bool) if lengths is None else padding_mask(b, m, lengths)
    assert native.bf16_centroid_pass(k, v)
    got = native.centroid_values_bf16(centroids, k, v, mask, SCALE)
    want = rounded_centroid_attention(centroids, k, v, mask, SCALE)
    assert got.dtype == torch.float32 and got.shape == (b, h, c, dv)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=CENTROID_PASS_TOL * v.abs().max().item())
    assert not got[~mask.any(1)].any()  # no real key: rows of 0


@needs_bf16_dot
def test_the_bfloat16_centroid_pass_follows_logits_past_float32s_range():
    # Logits that rise key by key to 100 (exp(100) overflows float32): each row's reference
    # must move up with them. Row 1's padded keys have the largest logits and must get no weight.
    m, d = 200, 16
    k = torch.zeros(2, 1, m, d)
    k[..., 0] = torch.arange(m) * 0.5  # exact in bfloat16
    k, v = k.to(BF16), torch.randn(2, 1, m, 16, generator=torch.Generator().manual_seed(1)).to(BF16)
    centroids = torch.zeros(2, 1, 3, d)
    centroids[..., 0] = torch.tensor([1.0, 0.5, -1.0]) / SCALE  # the maximum last, halfway, first
    mask = padding_mask(2, m, [m, 150])
    got = native.centroid_values_bf16(centroids, k, v, mask, SCALE)
    want = rounded_centroid_attention(centroids, k, v, mask, SCALE)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=CENTROID_PASS_TOL * v.abs().max().item())
