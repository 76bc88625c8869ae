"""clusterserve.bench.gpu.pack_model's stand-in for the default model on a GPU machine: `--shape` here is small
enough to carry, and `--fill` there gives a folder that loads as the default model's
architecture with every weight at its own tensor's scale."""

import torch

from clusterserve.bench.gpu.pack_model import fill, pack_shape
from clusterserve.models import load_encoder

CARRY_LIMIT = 64 * 2**20  # what the device tool carries in all


def test_a_filled_shape_loads_as_the_default_models_architecture(tmp_path):
    folder = pack_shape(tmp_path / "nomic-embed-text-v1.5")
    assert sum(p.stat().st_size for p in folder.rglob("*")) < CARRY_LIMIT / 32
    fill(folder)
    stand_in, real = load_encoder(folder), load_encoder(None)
    assert (stand_in.name, stand_in.architecture, stand_in.max_input_tokens) == (real.name, real.architecture, 8192)
    assert stand_in.model.config == real.model.config
    ids = real.tokenize(["a long document"])[0].ids
    assert stand_in.tokenize(["a long document"])[0].ids == ids
    real_state = real.model.state_dict()
    for name, weight in stand_in.model.state_dict().items():
        want = real_state[name].float()
        assert weight.shape == want.shape, name
        if want.numel() > 1000:  # a normal draw of this many keeps the tensor's deviation within a few %
            assert abs(weight.float().std().item() / want.std().item() - 1) < 0.05, name
            assert not torch.equal(weight.float(), want), name
