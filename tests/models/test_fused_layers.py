"""The GPU's fused layers of the rotary BERTs (RotaryBertModel.fuse_projections: one q/k/v
product, one gate/up product, kernels.add_layer_norm and kernels.gated) compute what the
separate products and ops compute, on a CPU in float32 through the same code: tiny NomicBERT and
GTE checkpoints, a batch of mixed lengths, every token's states. A Jina v3 model, whose task
adapters act on each product apart, keeps its products."""

import sys
from pathlib import Path

import pytest
import torch

from clusterserve.kernels import AttentionSpec
from clusterserve.models import load_encoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
from tiny_checkpoints import make_checkpoint  # noqa: E402

pytest.importorskip("transformers")

ATOL = RTOL = 1e-5  # float32: the fused products sum in another order


def _sequences(encoder, long_text):
    texts = [long_text(300, seed=5), "a short query", long_text(90, seed=6)]
    return [t.ids for t in encoder.tokenize(texts)]


def _parameter_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("arch", ["nomic-bert", "gte"])
def test_fused_layers_give_the_separate_layers_states(arch, tmp_path, long_text):
    encoder = load_encoder(make_checkpoint(arch, tmp_path))
    sequences = _sequences(encoder, long_text)
    specs = [AttentionSpec(method="full")] * len(sequences)
    separate = encoder.token_states(sequences, specs)
    model = encoder.model
    size = _parameter_bytes(model)
    model.fuse_projections()
    layer = model.layers[0]
    assert layer.attn.qkv is not None and not hasattr(layer.attn, "q")
    assert (layer.mlp_gate_up is not None) == layer.gated and not hasattr(layer, "mlp_up")
    assert _parameter_bytes(model) == size  # the fused weights replace the separate ones
    fused = encoder.token_states(sequences, specs)
    for got, want in zip(fused, separate):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # Guard: the states are not a trivial function of the input (two sequences differ).
    assert not torch.allclose(fused[0][:10], fused[2][:10], atol=0.1)


def test_a_model_with_task_adapters_keeps_its_products(tmp_path):
    encoder = load_encoder(make_checkpoint("jina-embeddings-v3", tmp_path))
    encoder.model.fuse_projections()
    layer = encoder.model.layers[0]
    assert layer.attn.qkv is None and hasattr(layer.attn, "q") and layer.mlp_gate_up is None


def test_a_cpu_model_is_loaded_unfused(tmp_path):
    layer = load_encoder(make_checkpoint("nomic-bert", tmp_path)).model.layers[0]
    assert layer.attn.qkv is None and layer.mlp_gate_up is None
