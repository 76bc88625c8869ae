"""The rotary Triton kernel on a GPU: bit for bit PyTorch's element-wise definition
(kernels.reference.rotary.apply_rotary_torch) at the default model's shape, with fast math on
the device (the launch keeps the product and the sum apart, as PyTorch computes them).

    python -m pytest -m gpu tests/gpu/test_rotary.py -rA     # on a CUDA machine

Without CUDA the module skips; tests/kernels/test_rotary_triton.py runs the kernel under the
interpreter on every `make test`.
"""

from __future__ import annotations

import pytest
import torch

from clusterserve.kernels import AttentionSpec, apply_rotary
from clusterserve.kernels.reference.rotary import apply_rotary_torch
from clusterserve.models.batch.packing import pack
from clusterserve.models.networks.rotary import packed_rotary

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA: the kernel's device arithmetic", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("interleaved", [False, True])
def test_equals_the_definition(dtype, interleaved):
    lengths = [16389, 700, 3]  # a packed batch: each token at its own sequence's position
    _, packed = pack([[1] * n for n in lengths], [AttentionSpec()] * len(lengths), torch.device("cuda"))
    cos, sin = packed_rotary(packed, 64, 1000.0, torch.device("cuda"), "dynamic", 2.0, 2048, interleaved)
    x = torch.randn(sum(lengths), 12, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).to(dtype)
    got = apply_rotary(x, cos, sin, interleaved)
    assert torch.equal(got, apply_rotary_torch(x, cos, sin, interleaved))
