"""CUDA graphs of the encoder's layers (models.runtime.graphs) on a GPU: captured, replayed, and the
vectors the eager layers give.

    python -m pytest -m gpu tests/gpu/test_cuda_graphs.py -rA -s     # on a CUDA machine

A model in bfloat16, graphs as the service runs them. Per method and length, one
input runs three times through the graphs (its batch shape's eager warm-up on the padded
layout, the capture, a replay) and once with every layer launched eagerly, unpadded:
- the captured and the replayed vectors are equal bit for bit, and within bfloat16 rounding
  of the padded eager warm-up (the same kernels at the same shapes);
- every one of them is within bfloat16 tolerance of the unpadded eager vector (cosine; the
  padded layout masks its padding, so SDPA and the GEMMs run other shapes and kernels, and
  a clustering decision within rounding of a tie may go the other way).
Also: a packed batch of mixed lengths and specs, two passes of one batch shape interleaved
layer by layer, a pass that drops an input part-way, and a capture that fails (a host sync in
the layer) running eagerly with the device still usable. Launch counts and times are
bench/gpu/speed.py's (`graph_ms` of the embed rows); nothing here is timed.

all-MiniLM-L6-v2 unless GPU_TEST_MODEL names a checkpoint folder. Without CUDA the module skips.
"""

from __future__ import annotations

import functools
import logging
import os

import pytest
import torch

from clusterserve.bench.common import SPECS, eager_layers, long_text_ids
from clusterserve.models.runtime.graphs import CudaGraphs, LayerGraphs

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA: it captures real CUDA graphs", allow_module_level=True)

LENGTHS = [40, 300, 1000, 3000]  # buckets 40, 304, 1024, 3072: all under cuda_graph_max_length
BF16_ULP = 2.0**-8
# Cosine to the unpadded eager vector: bfloat16 hidden states rounded differently.
MIN_COSINE = {"full": 0.9995}
MIN_COSINE_APPROXIMATE = 0.995


@functools.lru_cache(maxsize=1)
def encoder():
    from clusterserve.models import load_encoder

    model = os.environ.get("GPU_TEST_MODEL", "all-MiniLM-L6-v2")
    return load_encoder(model, max_input_tokens=4096, device="cuda", dtype=torch.bfloat16)


@pytest.fixture
def enc():
    """The encoder with a fresh set of graphs (counts per test), restored after."""
    encoder_ = encoder()
    kept = encoder_.graphs
    assert kept is not None, "load_encoder on CUDA with the triton backend keeps CUDA graphs"
    encoder_.graphs = LayerGraphs(CudaGraphs(encoder_.device), capacity=8)
    with torch.inference_mode():
        yield encoder_
    encoder_.graphs = kept
    torch.cuda.empty_cache()


def eager(enc, sequences, specs) -> torch.Tensor:
    """The pooled vectors with every layer launched eagerly on the unpadded batch."""
    with eager_layers(enc):
        return enc.run(sequences, specs)


def close_in_bf16(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() <= 2 * BF16_ULP * b.abs().max().item()


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def min_cosine(spec) -> float:
    return MIN_COSINE.get(spec.method, MIN_COSINE_APPROXIMATE)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("label", list(SPECS))
def test_replayed_vectors_equal_the_eager_ones(enc, label, n):
    spec, layers = SPECS[label], len(enc.model.layers)
    ids = long_text_ids(enc, n)
    warm, captured, replayed = (enc.run([ids], [spec]) for _ in range(3))
    assert enc.graphs.counts == dict(captured=layers, replayed=2 * layers, failed=0, evicted=0)
    unpadded = eager(enc, [ids], [spec])
    cosine = cosines(replayed, unpadded).item()
    print(f"\nN={n} {label}: replay vs padded eager max diff {(replayed - warm).abs().max().item():.3g}, "
          f"cosine to unpadded eager {cosine:.6f}")
    assert torch.equal(captured, replayed)
    assert close_in_bf16(replayed, warm)
    assert cosine >= min_cosine(spec)


def test_a_mixed_batch_and_two_passes_interleaved(enc):
    spec_of = [SPECS["i-clustered"], SPECS["full"], SPECS["smyrf"], SPECS["i-clustered"], SPECS["clustered"]]
    lengths = [300, 41, 1000, 290, 3000]  # slots 304, 42, 1024, 304, 3072: 300 and 290 one group
    batch = [long_text_ids(enc, n, offset=7 * i) for i, n in enumerate(lengths)]
    runs = [enc.run(batch, spec_of) for _ in range(3)]
    layers = len(enc.model.layers)
    assert enc.graphs.counts["captured"] == layers and enc.graphs.counts["failed"] == 0
    assert torch.equal(runs[1], runs[2]) and close_in_bf16(runs[2], runs[0])
    alone = torch.cat([eager(enc, [ids], [spec]) for ids, spec in zip(batch, spec_of)])
    assert all(c >= min_cosine(s) for c, s in zip(cosines(runs[2], alone).tolist(), spec_of))

    # The same batch shape with other real lengths in the same buckets, stepped in turn with
    # the first: the graphs' buffers are reloaded with each pass's own layout.
    other = [long_text_ids(enc, n, offset=100) for n in [299, 42, 1001, 289, 2999]]
    first, second = enc.start(batch, spec_of), enc.start(other, spec_of)
    while not first.finished:
        first.step()
        second.step()
    assert enc.graphs.counts["captured"] == layers  # replayed only
    assert torch.equal(first.pooled(), runs[2])
    assert close_in_bf16(second.pooled(), eager_padded(enc, other, spec_of))


def eager_padded(enc, sequences, specs) -> torch.Tensor:
    """The padded layout's vectors with every layer launched eagerly (a cache that never captures)."""
    graphs = enc.graphs
    enc.graphs = LayerGraphs(CudaGraphs(enc.device), max_length=graphs.max_length)
    try:
        return enc.run(sequences, specs)  # first sight of the batch shape: eager
    finally:
        enc.graphs = graphs


def test_a_pass_that_drops_an_input_goes_on_eagerly(enc):
    specs = [SPECS["i-clustered"], SPECS["smyrf"], SPECS["full"]]
    batch = [long_text_ids(enc, n) for n in (1000, 2000, 500)]
    for _ in range(2):
        enc.run(batch, specs)
    forward = enc.start(batch, specs)
    forward.step()
    forward.step()
    replayed = enc.graphs.counts["replayed"]
    forward.keep([0, 2])
    while not forward.finished:
        forward.step()
    assert enc.graphs.counts["replayed"] == replayed  # the kept layout is a new batch shape
    kept = eager(enc, [batch[0], batch[2]], [specs[0], specs[2]])
    assert all(c >= min_cosine(s) for c, s in zip(cosines(forward.pooled(), kept).tolist(), [specs[0], specs[2]]))


class SyncingModel:
    """The encoder's model with a host synchronisation in every layer: not capturable."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):  # everything but advance is the model's
        return getattr(self.model, name)

    def advance(self, state):
        state.x.float().sum().item()
        self.model.advance(state)


def test_a_capture_that_fails_runs_eagerly_and_the_device_stays_usable(enc, caplog):
    spec = SPECS["i-clustered"]
    ids = long_text_ids(enc, 700)
    expected = eager_padded(enc, [ids], [spec])
    runs = []
    caplog.set_level(logging.WARNING, logger="clusterserve")
    for _ in range(3):
        forward = enc.start([ids], [spec])
        forward.model = SyncingModel(enc.model)
        while not forward.finished:
            forward.step()
        runs.append(forward.pooled())
    assert enc.graphs.counts["failed"] == 1 and enc.graphs.counts["captured"] == 0
    assert "CUDA graph capture failed" in caplog.text
    for vectors in runs:
        assert torch.equal(vectors, expected)
    # Graphs still capture and replay afterwards.
    good = [enc.run([ids[:-100]], [spec]) for _ in range(3)]
    torch.cuda.synchronize()
    assert enc.graphs.counts["captured"] == len(enc.model.layers) and torch.equal(good[1], good[2])
