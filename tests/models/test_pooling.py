"""Pooling modes and reading sentence-transformers' modules.json / 1_Pooling/config.json."""

import json

import pytest
import torch

from clusterserve.kernels import AttentionSpec
from clusterserve.models import UnsupportedArchitecture
from clusterserve.models.batch.packing import pack
from clusterserve.models.pooling import PoolingConfig, pool, read_pooling

HIDDEN = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)  # (B, N, C); sequence 1 has 2 tokens


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("mean", torch.stack([HIDDEN[0].mean(0), HIDDEN[1, :2].mean(0)])),
        ("cls", HIDDEN[:, 0]),
        ("lasttoken", torch.stack([HIDDEN[0, 3], HIDDEN[1, 1]])),
        ("max", torch.stack([HIDDEN[0].amax(0), HIDDEN[1, :2].amax(0)])),
    ],
)
def test_pool_modes_per_packed_sequence(mode, expected):
    # The caller sends the 2-token sequence first; packing puts the longer one first, and
    # pooling must give the rows back in the caller's order.
    _, packed = pack([[1, 2], [1, 2, 3, 4]], [AttentionSpec(method="full")] * 2, torch.device("cpu"))
    assert packed.order == (1, 0) and packed.lengths == (4, 2)
    hidden = torch.cat([HIDDEN[0], HIDDEN[1, :2]])  # (T, C) in packed order
    torch.testing.assert_close(pool(hidden, packed, mode), expected.flip(0))


def _write(folder, modules, pooling=None):
    (folder / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}


def test_read_pooling_legacy_and_new_formats(tmp_path):
    assert read_pooling(tmp_path) == PoolingConfig(mode="mean", normalize=False)  # no modules.json
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    normalize = {"idx": 2, "name": "2", "path": "", "type": "sentence_transformers.models.Normalize"}
    flags = {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}
    _write(legacy, [TRANSFORMER, POOLING, normalize], flags)
    assert read_pooling(legacy) == PoolingConfig(mode="cls", normalize=True)
    new = tmp_path / "new"
    new.mkdir()
    _write(new, [TRANSFORMER, POOLING], {"embedding_dimension": 8, "pooling_mode": "lasttoken"})
    assert read_pooling(new) == PoolingConfig(mode="lasttoken", normalize=False)


def test_read_pooling_refuses_what_it_cannot_reproduce(tmp_path):
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    _write(tmp_path, [TRANSFORMER, POOLING, dense], {"pooling_mode": "mean"})
    with pytest.raises(UnsupportedArchitecture, match="Dense"):
        read_pooling(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps([TRANSFORMER, POOLING]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": ["mean", "max"]}))
    with pytest.raises(UnsupportedArchitecture, match="pooling mode"):
        read_pooling(tmp_path)
