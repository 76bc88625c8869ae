"""kernels/reference/local.py: chunked sliding-window attention against a dense banded-mask reference."""

import pytest
import torch

from clusterserve.kernels import AttentionSpec, attention
from clusterserve.kernels.reference.local import local_attention, local_attention_dense


@pytest.mark.parametrize("n", [1, 7, 64, 130, 301])
@pytest.mark.parametrize("window", [0, 2, 9, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_dense_banded_reference(n, window, dtype):
    g = torch.Generator().manual_seed(n * 1000 + window)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=dtype) for _ in range(3))
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, n // 2 + 1 :] = False  # second sequence right-padded
    out = local_attention(q, k, v, window, key_padding_mask=mask)
    ref = local_attention_dense(q, k, v, window, key_padding_mask=mask)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    assert torch.isfinite(out).all()
    assert (out[1, :, n // 2 + 1 :] == 0).all(), "padded query rows must be 0"


def test_dense_reference_is_a_band():
    # The reference itself: a window covering everything is exact attention, and with
    # window 0 each token only sees itself.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 4, generator=g, dtype=torch.float64) for _ in range(3))
    full = attention(q, k, v, AttentionSpec(method="full"))
    torch.testing.assert_close(local_attention_dense(q, k, v, 40), full)
    torch.testing.assert_close(local_attention(q, k, v, 40), full)
    torch.testing.assert_close(local_attention(q, k, v, 0), v)


def test_padded_keys_get_no_weight():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 50, 4, generator=g) for _ in range(3))
    mask = torch.arange(50)[None, :] < 30
    out = local_attention(q, k, v, 16, key_padding_mask=mask)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 30:] = 100.0
    v2[:, :, 30:] = -7.0
    out2 = local_attention(q, k2, v2, 16, key_padding_mask=mask)
    torch.testing.assert_close(out[:, :, :30], out2[:, :, :30], atol=0, rtol=0)


def test_bad_arguments_raise():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(ValueError, match="window"):
        local_attention(q, q, q, -1)
    with pytest.raises(ValueError, match="key_padding_mask"):
        local_attention(q, q, q, 2, key_padding_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="self-attention"):
        local_attention(q, torch.randn(1, 1, 5, 2), torch.randn(1, 1, 5, 2), 2)
