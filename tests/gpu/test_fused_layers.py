"""The GPU's fused layers on a GPU: the row-wise kernels against their PyTorch definitions at
the default model's shape, and a fused tiny NomicBERT against the same checkpoint run unfused
on the CPU.

    python -m pytest -m gpu tests/gpu/test_fused_layers.py -rA     # on a CUDA machine

Without CUDA the module skips; tests/kernels/test_rowwise_triton.py and
tests/models/test_fused_layers.py run the same code under the interpreter and on the CPU on
every `make test`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from clusterserve.kernels import AttentionSpec, add_layer_norm, gated
from clusterserve.kernels.reference.rowwise import add_layer_norm_torch, gated_torch
from clusterserve.models import load_encoder

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA: the kernels' device arithmetic", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
from tiny_checkpoints import make_checkpoint  # noqa: E402

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=0.0, rtol=8e-3)}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_row_wise_kernels_equal_their_definitions(dtype):
    generator = torch.Generator("cuda").manual_seed(0)
    x, branch = (torch.randn(16389, 768, device="cuda", generator=generator).to(dtype) for _ in range(2))
    weight, bias = (torch.randn(768, device="cuda", generator=generator).to(dtype) for _ in range(2))
    torch.testing.assert_close(add_layer_norm(x, branch, weight, bias, 1e-12),
                               add_layer_norm_torch(x, branch, weight, bias, 1e-12), **TOLERANCE[dtype])
    gate_up = torch.randn(16389, 6144, device="cuda", generator=generator).to(dtype)
    torch.testing.assert_close(gated(gate_up, "silu"), gated_torch(gate_up, F.silu), **TOLERANCE[dtype])


def test_a_fused_cuda_model_gives_the_cpu_model_states(tmp_path):
    folder = make_checkpoint("nomic-bert", tmp_path)
    cpu, gpu = load_encoder(folder), load_encoder(folder, device="cuda")
    assert gpu.model.layers[0].attn.qkv is not None and gpu.model.layers[0].mlp_gate_up is not None
    sequences = [list(range(100, 400)), [101, 102, 103], list(range(500, 590))]
    specs = [AttentionSpec(method="full")] * len(sequences)
    for got, want in zip(gpu.token_states(sequences, specs), cpu.token_states(sequences, specs)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_padded_exact_attention_runs_varlen_and_gives_the_masked_result():
    """Padded self-attention in bfloat16 takes torch's varlen flash kernel (seqused_k), no mask:
    the masked SDPA's result within bfloat16 rounding, and the fallback flag stays down."""
    from clusterserve.kernels.reference import full

    generator = torch.Generator("cuda").manual_seed(1)
    q, k, v = (torch.randn(3, 8192, 12, 64, device="cuda", generator=generator).to(torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    mask = torch.arange(8192, device="cuda")[None, :] < torch.tensor([8192, 7900, 100], device="cuda")[:, None]
    got = full.padded_varlen(q, k, v, mask, 0.125)
    assert got is not None and not full._varlen_failed
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=0.125)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
