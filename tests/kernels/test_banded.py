"""Banded attention (kernels/reference/banded.py): the reference against its definition written out key by
key, every backend against the reference, and exact attention where the band covers the
sequence. The Triton kernel runs under Triton's interpreter (small shapes)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import math

import pytest
import torch
from kernel_inputs import padding_mask, qkv

from clusterserve.kernels import AttentionSpec, attention, native
from clusterserve.kernels.spec import exact_by_knobs, resolve_auto

FULL = AttentionSpec(method="full")


def banded(band, block, sinks=0, far_blocks=0):
    return AttentionSpec(method="banded", band=band, block=block, sinks=sinks, far_blocks=far_blocks)


def chosen_blocks(q, k, real, sink, t, spec, scale):
    """The far blocks query block t attends exactly: the `far_blocks` blocks outside the band,
    holding a real non-sink key, whose mean key scores highest for some real query of t
    (q . mean * scale + log count)."""
    n, size = q.shape[0], spec.block
    scores = {}
    for c in range(-(-n // size)):
        members = [j for j in range(c * size, min(n, (c + 1) * size)) if real[j] and not sink[j]]
        queries = [i for i in range(t * size, min(n, (t + 1) * size)) if real[i]]
        if abs(t - c) > spec.band and members and queries:
            key = k[members].mean(0)
            scores[c] = max(float(q[i] @ key) for i in queries) * scale + math.log(len(members))
    return set(sorted(scores, key=scores.get, reverse=True)[: spec.far_blocks])


def definition(q, k, v, spec, mask, scale):
    """The method written out per query and key (float64): exact logits on the band's blocks,
    on the sinks and on the real non-sink keys of the chosen far blocks, one pooled key (mean
    key, mean value of the block's real non-sink keys, logit + log count) per other block
    outside the band, one softmax."""
    b, h, n, _ = q.shape
    size, band = spec.block, spec.band
    blocks = -(-n // size)
    out = torch.zeros(b, h, n, v.shape[-1], dtype=torch.float64)
    q, k, v = q.double(), k.double(), v.double()
    for row in range(b):
        real = mask[row] if mask is not None else torch.ones(n, dtype=torch.bool)
        sink = torch.zeros(n, dtype=torch.bool)
        if spec.sinks:
            sink[: spec.sinks] = True
            sink[int(real.nonzero().max())] = True
        sink &= real
        for head in range(h):
            chosen = [chosen_blocks(q[row, head], k[row, head], real, sink, t, spec, scale) for t in range(blocks)]
            for i in range(n):
                if not real[i]:
                    continue
                logits, values = [], []
                for j in range(n):
                    if real[j] and (abs(i // size - j // size) <= band or sink[j] or j // size in chosen[i // size]):
                        logits.append(q[row, head, i] @ k[row, head, j] * scale)
                        values.append(v[row, head, j])
                for c in range(blocks):
                    members = [j for j in range(c * size, min(n, (c + 1) * size)) if real[j] and not sink[j]]
                    if abs(i // size - c) > band and members and c not in chosen[i // size]:
                        key = k[row, head, members].mean(0)
                        logits.append(q[row, head, i] @ key * scale + math.log(len(members)))
                        values.append(v[row, head, members].mean(0))
                probs = torch.softmax(torch.stack(logits), 0)
                out[row, head, i] = (probs[:, None] * torch.stack(values)).sum(0)
    return out


# (n, block, band, sinks, far_blocks, lengths): blocks that do not divide N, a last block of one
# token, sinks inside and outside the band, padded rows, a band of 0, far blocks chosen among
# blocks of sinks, of padding and of one token, more far blocks than a row has.
CASES = [
    (37, 8, 1, 3, 0, None),
    (37, 8, 1, 3, 0, [37, 22]),
    (33, 16, 0, 0, 0, [33, 30]),
    (50, 7, 2, 5, 0, [41, 50]),
    (25, 4, 0, 2, 0, [25, 3]),
    (37, 8, 0, 3, 2, [37, 22]),
    (50, 7, 1, 5, 3, [41, 50]),
    (25, 4, 0, 2, 4, [25, 3]),
    (41, 4, 1, 0, 1, None),
]


@pytest.mark.parametrize("n, block, band, sinks, far, lengths", CASES)
def test_reference_is_the_definition(n, block, band, sinks, far, lengths):
    q, k, v = qkv(n=n, d=8, dtype=torch.float64, seed=n)
    mask = padding_mask(2, n, lengths) if lengths else None
    spec = banded(band, block, sinks, far)
    out = attention(q, k, v, spec, mask, backend="reference")
    assert torch.allclose(out, definition(q, k, v, spec, mask, 8**-0.5), atol=1e-10)
    assert not torch.allclose(out, attention(q, k, v, FULL, mask), atol=1e-3)  # it is an approximation


def native_missing():
    return native.library() is None


# Native only: more sinks and pooled blocks than one tile of keys holds (a second tile of
# extras), and blocks of 50 (runs that start and end inside a panel) with far blocks.
NATIVE_CASES = [(130, 16, 2, 8, 0, [130, 97]), (130, 16, 1, 8, 3, [130, 97]), (200, 4, 1, 3, 2, [200, 150]),
                (300, 50, 1, 2, 2, [300, 260])]


@pytest.mark.skipif(native_missing(), reason="the native loops were not built (no C compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, block, band, sinks, far, lengths", CASES + NATIVE_CASES)
def test_native_matches_reference(n, block, band, sinks, far, lengths, dtype):
    q, k, v = qkv(n=n, d=32, dv=24, dtype=dtype, seed=n + 1)
    mask = padding_mask(2, n, lengths) if lengths else None
    spec = banded(band, block, sinks, far)
    expected = attention(q, k, v, spec, mask, backend="reference")
    out = attention(q, k, v, spec, mask, backend="native")
    assert out.dtype == dtype
    tol = 2e-6 if dtype == torch.float32 else 1e-2  # bfloat16 outputs: one rounding apart at most
    assert torch.allclose(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.skipif(native_missing(), reason="the native loops were not built (no C compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, d, block, band, sinks, far, lengths", [
    (37, 16, 4, 1, 2, 3, [37, 3]),  # 10 blocks (one vector, padded), a row whose blocks are mostly queryless
    (200, 24, 4, 2, 3, 6, [200, 150]),  # 50 blocks: four vectors of them; D not a multiple of 16
    (70, 32, 8, 0, 0, 2, [70, 61]),  # a last block of 6 queries, 5 real: a short group
])
def test_native_pool_and_choice_scores_match_the_reference(n, d, block, band, sinks, far, lengths, dtype):
    """The native pool and select stages (the block means and the choice logits in C, from q, k
    and v as they are) against the reference's: means to float32 rounding, the same counts,
    the same -inf scores (band, empty blocks, query blocks with no real query), the same
    chosen blocks."""
    from clusterserve.kernels.native.banded import NATIVE
    from clusterserve.kernels.reference import banded as reference

    q, k, v = qkv(b=2, h=3, n=n, d=d, dv=8, dtype=dtype, seed=n + d)
    mask = padding_mask(2, n, lengths)
    spec = banded(band, block, sinks, far)
    expected, got = reference.pool(k, v, mask, spec), NATIVE.pool(k, v, mask, spec)
    assert torch.equal(got.counted, expected.counted) and torch.equal(got.log_count, expected.log_count)
    assert torch.isinf(expected.log_count).any()
    for name in ("keys", "values"):
        assert torch.allclose(getattr(got, name), getattr(expected, name), atol=1e-6, rtol=1e-5), name
    want = reference.choice_scores(q, expected, mask, spec, 0.25)
    scores = reference.choice_scores(q, expected, mask, spec, 0.25, block_max=native.banded_block_max)
    queryless = torch.isinf(want).all(dim=-1)
    assert queryless.any() and not queryless.all() and torch.equal(torch.isinf(scores), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(scores[finite], want[finite], atol=1e-5, rtol=1e-5)
    chosen = NATIVE.select(q, got, mask, spec, 0.25).chosen
    assert torch.equal(chosen, reference.select(q, expected, mask, spec, 0.25).chosen) and (chosen >= 0).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, block, band, sinks, far, lengths", [
    (37, 8, 1, 3, 0, [37, 22]), (40, 16, 0, 2, 0, None), (37, 8, 0, 3, 2, [37, 22]), (70, 32, 0, 1, 1, [70, 50]),
])
def test_triton_matches_reference(n, block, band, sinks, far, lengths, dtype):
    q, k, v = qkv(b=2, h=1, n=n, d=16, dtype=dtype, seed=n + 2)
    mask = padding_mask(2, n, lengths) if lengths else None
    spec = banded(band, block, sinks, far)
    expected = attention(q, k, v, spec, mask, backend="reference")
    out = attention(q, k, v, spec, mask, backend="triton")
    assert out.dtype == dtype
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("key_tile, n, block, band, sinks, far, lengths", [
    (32, 70, 16, 0, 2, 3, [70, 45]),  # a GPU's shape: one query block a program, two far blocks a tile
    (64, 70, 16, 1, 1, 5, None),  # four far blocks a tile, the last one's slots partly empty
    (32, 50, 7, 1, 3, 3, [41, 50]),  # blocks that do not divide the tile: lanes past the last block idle
])
def test_triton_far_tiles_of_several_blocks_match_reference(key_tile, n, block, band, sinks, far, lengths,
                                                            monkeypatch):
    """Key tiles longer than a block, as on a GPU (128 keys over blocks of 64): a far tile takes
    several chosen blocks, lane by lane, and the band and pooled loops take the longer tiles too."""
    from clusterserve.kernels.triton import banded as banded_triton

    monkeypatch.setattr(banded_triton, "key_tile", lambda head_dim, dtype, interpreted: key_tile)
    q, k, v = qkv(b=2, h=1, n=n, d=16, dtype=torch.float32, seed=n + block)
    mask = padding_mask(2, n, lengths) if lengths else None
    spec = banded(band, block, sinks, far)
    expected = attention(q, k, v, spec, mask, backend="reference")
    out = attention(q, k, v, spec, mask, backend="triton")
    assert torch.allclose(out, expected, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_reads_packed_heads_in_place(dtype, monkeypatch):
    """q, k, v as the encoders pass them, heads of (B, N, H, D) tokens (rows H x D apart): the
    result of contiguous copies bit for bit, no copy made, and the output token-major too."""
    n, h = 70, 2
    q, k, v = (t.transpose(1, 2) for t in qkv(b=2, h=n, n=h, d=16, dtype=dtype, seed=5))  # (B, N, H, D) -> (B, H, N, D)
    assert not q.is_contiguous() and q.stride(-1) == 1
    mask = padding_mask(2, n, [70, 50])
    spec = banded(1, 8, sinks=3, far_blocks=2)
    expected = attention(q.contiguous(), k.contiguous(), v.contiguous(), spec, mask, backend="triton")
    copies = []
    original = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous",
                        lambda x, *a, **kw: copies.append(x.is_contiguous()) or original(x, *a, **kw))
    out = attention(q, k, v, spec, mask, backend="triton")
    assert torch.equal(out, expected)
    assert False not in copies  # only tensors already contiguous were asked to be
    assert out.transpose(1, 2).is_contiguous()  # token-major: the encoder packs it back without a copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, block, band, lengths", [(37, 8, 0, [37, 22]), (70, 32, 1, [70, 50]), (25, 4, 2, [25, 3])])
def test_triton_choice_scores_match_the_reference(n, block, band, lengths, dtype):
    """The scores that choose the far blocks: the Triton kernel against the reference's matrix
    product, -inf within the band, for a block of no counted key and where a query block has
    no real query."""
    from clusterserve.kernels.reference import banded as reference
    from clusterserve.kernels.triton import banded_pool, banded_select

    q, k, v = qkv(b=2, h=2, n=n, d=16, dtype=dtype, seed=n + 4)
    mask = padding_mask(2, n, lengths)
    spec = banded(band, block, 2, far_blocks=2)
    expected = reference.choice_scores(q, reference.pool(k, v, mask, spec), mask, spec, 0.25)
    got = banded_select.choice_scores(q, banded_pool.pool(k, v, mask, spec), mask, spec, 0.25)
    assert torch.isinf(expected).any() and torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert finite.any() and torch.allclose(got[finite], expected[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, block, band, far, lengths", [(37, 8, 0, 2, [37, 22]), (70, 4, 1, 5, [70, 50]),
                                                          (25, 4, 2, 8, [25, 3])])
def test_triton_select_chooses_the_reference_blocks(n, block, band, far, lengths, dtype):
    """The far blocks each query block attends: the Triton choice scores and top-k kernels against
    the reference's (ascending ids, -1 where fewer blocks than far_blocks have a finite score)."""
    from clusterserve.kernels.reference import banded as reference
    from clusterserve.kernels.triton import banded_pool, banded_select

    q, k, v = qkv(b=2, h=2, n=n, d=16, dtype=dtype, seed=n + 6)
    mask = padding_mask(2, n, lengths)
    spec = banded(band, block, 2, far_blocks=far)
    expected = reference.select(q, reference.pool(k, v, mask, spec), mask, spec, 0.25).chosen
    got = banded_select.select(q, banded_pool.pool(k, v, mask, spec), mask, spec, 0.25).chosen
    assert got.shape == expected.shape and (expected >= 0).any() and (expected < 0).any()
    assert torch.equal(got, expected)


def test_triton_select_falls_back_to_torch_topk_for_long_rows(monkeypatch):
    """Rows of more blocks than the top-k kernel holds on chip take torch's topk, counted as a
    kernel fallback, with the same choice."""
    from clusterserve.kernels import fallbacks
    from clusterserve.kernels.reference import banded as reference
    from clusterserve.kernels.triton import banded_pool, banded_select

    monkeypatch.setattr(banded_select, "TOP_BLOCKS_MAX", 4)
    q, k, v = qkv(b=2, h=1, n=37, d=16, seed=9)
    mask = padding_mask(2, 37, [37, 22])
    spec = banded(0, 4, 2, far_blocks=3)
    key = ("banded_triton", "blocks_over_on_chip")
    before = fallbacks.counts()[key]
    got = banded_select.select(q, banded_pool.pool(k, v, mask, spec), mask, spec, 0.25).chosen
    assert fallbacks.counts()[key] == before + 1
    assert torch.equal(got, reference.select(q, reference.pool(k, v, mask, spec), mask, spec, 0.25).chosen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, block, sinks, lengths", [(37, 8, 3, [37, 22]), (70, 32, 1, [70, 50]), (25, 4, 0, [25, 3])])
def test_triton_pool_matches_the_reference(n, block, sinks, lengths, dtype):
    """The pooled blocks: mean key and value over each block's real non-sink keys, log count,
    and which keys count, the Triton kernel against the reference."""
    from clusterserve.kernels.reference import banded as reference
    from clusterserve.kernels.triton.banded_pool import pool

    q, k, v = qkv(b=2, h=2, n=n, d=16, dv=8, dtype=dtype, seed=n + 5)
    mask = padding_mask(2, n, lengths)
    spec = banded(1, block, sinks)
    expected = reference.pool(k, v, mask, spec)
    got = pool(k, v, mask, spec)
    assert torch.equal(got.counted.bool(), expected.counted) and torch.isinf(expected.log_count).any()
    assert torch.equal(got.log_count, expected.log_count.float())
    assert torch.allclose(got.keys, expected.keys.float(), atol=1e-6, rtol=1e-6)
    tol = 1e-6 if dtype == torch.float32 else 2**-8  # the mean value rounded once to the half dtype
    assert got.values.dtype == dtype and torch.allclose(got.values.float(), expected.values.float(), atol=tol, rtol=tol)
    if dtype != torch.float32:  # the keys' half parts add up to the float32 mean: hi + mid / S + lo / S^2
        split = 1.0 if dtype == torch.bfloat16 else 2048.0
        hi, mid, lo = got.key_parts.float()
        assert torch.allclose(hi + mid / split + lo / split**2, got.keys, atol=1e-6, rtol=1e-6)
    assert torch.equal(got.sinks, expected.sinks) and torch.equal(got.sink_real, expected.sink_real)


BACKENDS = ["reference", "triton"] + ([] if native_missing() else ["native"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n, block, band, sinks, far", [
    (37, 8, 4, 3, 0), (30, 64, 0, 5, 0), (33, 16, 2, 0, 0), (37, 8, 0, 3, 4), (37, 8, 2, 0, 2), (33, 4, 1, 2, 8),
])
def test_exact_when_the_band_and_far_blocks_cover_the_sequence(backend, n, block, band, sinks, far):
    q, k, v = qkv(b=2, h=1, n=n, d=16, seed=n + 3)
    mask = padding_mask(2, n, [n, n - 7])
    spec = banded(band, block, sinks, far)
    assert exact_by_knobs(spec, n)
    out = attention(q, k, v, spec, mask, backend=backend)
    assert torch.allclose(out, attention(q, k, v, FULL, mask), atol=2e-6)


def test_exact_by_knobs_and_resolution():
    assert exact_by_knobs(banded(3, 64), 256) and not exact_by_knobs(banded(2, 64), 256)
    assert exact_by_knobs(banded(0, 64), 64) and not exact_by_knobs(banded(0, 64), 65)
    assert exact_by_knobs(banded(1, 64, far_blocks=2), 256) and not exact_by_knobs(banded(1, 64, far_blocks=1), 256)
    resolved = resolve_auto(banded(3, 64), 200)
    assert resolved.spec.method == "full" and resolved.echo["exact_by_knobs"]["method"] == "banded"
    assert resolve_auto(banded(1, 64), 4096).spec == banded(1, 64)
    assert banded(1, 64, 8).used_knobs() == {"method": "banded", "band": 1, "block": 64, "sinks": 8, "far_blocks": 0}


@pytest.mark.parametrize("field, value", [("band", -1), ("band", 4097), ("block", 0), ("sinks", 65), ("block", 2.0),
                                          ("far_blocks", -1), ("far_blocks", 1025)])
def test_knobs_are_validated(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        AttentionSpec(method="banded", **{field: value})


def test_self_attention_only():
    q, _, _ = qkv(n=16)
    k, v = qkv(n=24)[1:]
    with pytest.raises(ValueError, match="self-attention"):
        attention(q, k, v, banded(1, 8), backend="reference")


def test_no_sequence_by_sequence_tensor(monkeypatch):
    """The reference never builds an N x N tensor: its logits are (blocks, block, band + sinks +
    blocks) per step."""
    import clusterserve.kernels.reference.banded as module

    n = 512
    q, k, v = qkv(b=1, h=1, n=n, d=8)
    seen = []
    original = torch.Tensor.__matmul__

    def watch(a, b):
        out = original(a, b)
        seen.append(out.shape[-2:].numel())
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", watch)
    module.attend(q, k, v, module.pool(k, v, torch.ones(1, n, dtype=torch.bool), banded(1, 16)),
                  torch.ones(1, n, dtype=torch.bool), banded(1, 16), 0.3, q.dtype)
    assert seen and max(seen) < n * n // 4
