"""Compact vectors (models.compact): the int8 steps and their range, the bit order of binary
and ubinary, and the inverse a client applies."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from clusterserve.models.compact import FORMATS, GENERAL_RANGE, LEVELS, calibration, compact, expand, int8_step


def unit_rows(n: int, d: int, seed: int = 0) -> torch.Tensor:
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=-1)


@pytest.mark.parametrize("d", [64, 384, 768])
def test_int8_codes_are_within_half_a_step_of_the_value_and_keep_its_direction(d):
    x = unit_rows(32, d)
    q = compact(x, "int8", 6.0)
    assert q.dtype == np.int8 and q.shape == (32, d)
    step = int8_step(6.0, d)
    assert step == pytest.approx(6.0 / (127 * math.sqrt(d)))
    inside = np.abs(x.numpy()) <= LEVELS * step
    error = np.abs(q.astype(np.float64) * step - x.numpy())
    assert error[inside].max() <= step / 2 + 1e-9
    back = expand(q, "int8", 6.0, d)
    assert F.cosine_similarity(back, x, dim=-1).min() > 0.999


def test_int8_clips_at_the_range_and_is_symmetric():
    d = 16
    x = torch.zeros(1, d)
    x[0, 0], x[0, 1], x[0, 2] = 0.9, -0.9, 0.0  # 0.9 * sqrt(16) = 3.6 > a range of 2
    q = compact(x, "int8", 2.0)
    assert (q[0, 0], q[0, 1], q[0, 2]) == (127, -127, 0)
    y = unit_rows(4, d)
    np.testing.assert_array_equal(compact(-y, "int8", 6.0), -compact(y, "int8", 6.0))


def test_uint8_is_int8_moved_up_by_128():
    x = unit_rows(8, 384)
    q, u = compact(x, "int8", 5.0), compact(x, "uint8", 5.0)
    assert u.dtype == np.uint8
    np.testing.assert_array_equal(u.astype(np.int16), q.astype(np.int16) + 128)
    assert u.min() >= 1
    torch.testing.assert_close(expand(u, "uint8", 5.0, 384), expand(q, "int8", 5.0, 384))


def test_bits_are_signs_first_dimension_in_the_high_bit_last_byte_padded():
    x = torch.tensor([[1.0, -1.0, 0.0, 2.0, -3.0, -1.0, -1.0, 0.5, 0.1, 0.0, -1.0]])  # 11 dimensions: 2 bytes
    u = compact(x, "ubinary", 6.0)
    assert u.dtype == np.uint8 and u.tolist() == [[0b10010001, 0b10000000]]  # 0 is not > 0: bit 0
    b = compact(x, "binary", 6.0)
    assert b.dtype == np.int8 and b.tolist() == [[0b10010001 - 128, 0]]
    for encoding, codes in (("ubinary", u), ("binary", b)):
        signs = expand(codes, encoding, 6.0, 11)
        torch.testing.assert_close(signs, torch.where(x > 0, 1.0, -1.0))


@pytest.mark.parametrize("encoding", FORMATS)
def test_every_format_ranks_a_vector_first_against_itself(encoding):
    x = unit_rows(50, 256, seed=3)
    codes = expand(compact(x, encoding, 6.0), encoding, 6.0, 256)
    assert torch.equal((codes @ codes.T).argmax(dim=1), torch.arange(50))


def test_measured_models_have_their_range_and_others_the_general_one():
    assert calibration("nomic-embed-text-v1.5").measured and calibration("all-MiniLM-L6-v2").measured
    other = calibration("some-local-checkpoint")
    assert (other.range, other.measured) == (GENERAL_RANGE, False)
    with pytest.raises(ValueError, match="encoding"):
        compact(unit_rows(1, 8), "int4", 6.0)
