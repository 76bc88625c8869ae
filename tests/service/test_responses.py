"""clusterserve.service.responses: vectors as JSON numbers that give their float32 values back, in 9 digits."""

import json
from decimal import Decimal

import numpy as np
import torch

from clusterserve.service.responses import json_rows


def _values() -> np.ndarray:
    rng = np.random.default_rng(0)
    spread = rng.standard_normal(4000) * 10.0 ** rng.integers(-12, 8, 4000)  # magnitudes 1e-12..1e8
    powers = np.array([10.0**e for e in range(-12, 9)], dtype=np.float32)
    around = np.concatenate([np.nextafter(powers, 0), powers, np.nextafter(powers, np.float32(np.inf))])
    edges = np.array([0.0, -0.0, 1e-30, -3e-42, 3.4e38, 1.0, -1.0, 0.1, 1 / 3], dtype=np.float32)  # tiny, subnormal, huge
    return np.concatenate([spread.astype(np.float32), around, -around, edges]).astype(np.float32)


def test_every_float32_comes_back_bit_for_bit_through_json():
    values = _values()
    rows = json.loads(json.dumps(json_rows(torch.from_numpy(values).reshape(-1, 1))))
    back = np.array(rows, dtype=np.float32).reshape(-1)
    np.testing.assert_array_equal(back.view(np.uint32), values.view(np.uint32))  # -0.0 and +0.0 told apart


def _digits(printed: str) -> int:
    return len(Decimal(printed).normalize().as_tuple().digits)


def test_numbers_take_at_most_nine_significant_digits():
    values = torch.nn.functional.normalize(torch.randn(8, 384), dim=-1)
    printed = [repr(x) for row in json_rows(values) for x in row]
    assert max(map(_digits, printed)) <= 9, max(printed, key=_digits)
    assert sum(map(len, printed)) < 0.7 * sum(len(repr(x)) for row in values.tolist() for x in row)
    everywhere = [repr(x) for x in json_rows(torch.from_numpy(_values()))]  # tiny and huge ones too
    assert max(map(_digits, everywhere)) <= 9, max(everywhere, key=_digits)


def test_shapes_and_dtypes_as_tolist():
    vectors = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    rows = json_rows(vectors)
    assert np.array(rows).shape == (2, 3, 4)
    assert np.array_equal(np.array(rows, dtype=np.float32), vectors.float().numpy())
    assert json_rows(torch.empty(0, 384)) == []
