"""Every approximate method on every backend and dtype, as one matrix, checked two ways:

- against the PyTorch reference backend on the same inputs: in float32 to float rounding;
  in a half precision, its error from the method's float64 result at most twice the
  reference's own error in that precision (both round the same products, in other orders);
- against exact attention where the knobs make the method exact (`exact_by_knobs`: one
  query a cluster, every key recomputed, one SMYRF cluster, a band that covers the sequence):
  to the dtype's tolerance.

The method-specific files test each backend's stages; this one is the whole call, the same
way for all. Triton runs under its interpreter on CPU tensors (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import padding_mask, qkv

from clusterserve.kernels import AttentionSpec, attention
from clusterserve.kernels.reference.full import full_attention
from clusterserve.kernels.spec import exact_by_knobs

N = 40
LENGTHS = [40, 27]  # row 1 padded: padded keys get no weight, padded queries give 0
APPROXIMATE = {
    "clustered": AttentionSpec(method="clustered", clusters=5, iterations=4, refine=1, seed=2),
    "i-clustered": AttentionSpec(method="i-clustered", clusters=5, topk=6, iterations=4, refine=1, seed=2),
    # no LSH codes: each query starts at its nearest seed query
    "i-clustered, seeded": AttentionSpec(method="i-clustered", clusters=5, topk=6, bits=0, refine=1, seed=2),
    "smyrf": AttentionSpec(method="smyrf", hash_rounds=2, cluster_size=8, seed=2),
    "banded": AttentionSpec(method="banded", band=1, block=8, sinks=2, far_blocks=1),
}
EXACT = {
    "clustered": AttentionSpec(method="clustered", clusters=64, iterations=2, refine=1),
    "i-clustered": AttentionSpec(method="i-clustered", clusters=3, topk=64, iterations=2, refine=1),
    "smyrf": AttentionSpec(method="smyrf", hash_rounds=1, cluster_size=64),
    "banded": AttentionSpec(method="banded", band=2, block=8, sinks=0, far_blocks=2),
}
CELLS = [
    ("reference", torch.float64),
    ("reference", torch.float32),
    ("native", torch.float32),
    ("native", torch.bfloat16),
    ("triton", torch.float32),
    ("triton", torch.bfloat16),
]
# Exact attention through a method's own path, from exact attention computed alike.
EXACT_TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}


def inputs(dtype):
    q, k, v = qkv(n=N, d=16, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), padding_mask(2, N, LENGTHS)


@pytest.mark.parametrize("method", list(APPROXIMATE))
@pytest.mark.parametrize("backend, dtype", CELLS, ids=lambda x: str(x).removeprefix("torch."))
def test_the_backend_matches_the_reference(method, backend, dtype):
    spec = APPROXIMATE[method]
    q, k, v, mask = inputs(dtype)
    got = attention(q, k, v, spec, key_padding_mask=mask, backend=backend)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got[1, :, LENGTHS[1]:] == 0).all()
    if dtype == torch.float64 or (dtype == torch.float32 and backend == "reference"):
        # The reference itself: not exact attention (the knobs approximate), and its float32 run
        # within float rounding of its float64 one.
        exact = full_attention(q, k, v, mask, 16**-0.5)
        assert (got.double() - exact.double()).abs().max() > 1e-3
        wide = attention(*(t.double() for t in (q, k, v)), spec, key_padding_mask=mask, backend="reference")
        assert (got.double() - wide).abs().max() <= 1e-4
        return
    expected = attention(q, k, v, spec, key_padding_mask=mask, backend="reference")
    if dtype == torch.float32:
        assert (got - expected).abs().max() <= 1e-4
        return
    wide = attention(*(t.double() for t in (q, k, v)), spec, key_padding_mask=mask, backend="reference")
    error, reference_error = ((x.double() - wide).abs().max() for x in (got, expected))
    assert error <= 2 * reference_error + 1e-5, (error, reference_error)


@pytest.mark.parametrize("method", list(EXACT))
@pytest.mark.parametrize("backend, dtype", CELLS, ids=lambda x: str(x).removeprefix("torch."))
def test_exact_by_its_knobs_equals_exact_attention(method, backend, dtype):
    spec = EXACT[method]
    assert exact_by_knobs(spec, N)
    q, k, v, mask = inputs(dtype)
    got = attention(q, k, v, spec, key_padding_mask=mask, backend=backend)
    expected = full_attention(*(t.double() for t in (q, k, v)), mask, 16**-0.5)
    expected[1, :, LENGTHS[1]:] = 0
    assert (got.double() - expected).abs().max() <= EXACT_TOLERANCE[dtype]
