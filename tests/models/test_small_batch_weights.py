"""Linear layers on a CPU keep a oneDNN-packed copy of their weight (models.networks.linear): in
float32 for products of few rows, or of any number where oneDNN leads MKL on long products on
this CPU (timed once at load), in bfloat16 for every product. It is made for every layer; in
float32 the inputs within the limit run on it, the rest and everything outside its conditions
run through F.linear, and both give the same vectors to float rounding; in bfloat16 every input
runs on it and gets F.linear's bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from clusterserve.models import load_encoder
from clusterserve.models.networks import linear
from clusterserve.models.networks.linear import (
    PACKED_LEAD,
    SMALL_BATCH_ROWS,
    Linear,
    float32_packed_rows,
    pack_small_batches,
    packed_lead,
    small_batches_supported,
)

pytestmark = pytest.mark.skipif(
    not small_batches_supported("cpu", torch.float32), reason="this torch build has no oneDNN linear"
)
PACKED_OP = "mkldnn::_linear_pointwise"


def _ops(run) -> dict[str, int]:
    """op name -> calls, for what run() does."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return {e.key: e.count for e in prof.key_averages()}


def _layer(rows_in: int = 96, rows_out: int = 160, seed: int = 0) -> Linear:
    generator = torch.Generator().manual_seed(seed)
    layer = Linear(rows_in, rows_out)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(rows_out, rows_in, generator=generator))
        layer.bias.copy_(torch.randn(rows_out, generator=generator))
    return layer


@pytest.mark.parametrize("rows", [1, 7, SMALL_BATCH_ROWS])
def test_a_product_of_few_rows_runs_on_the_packed_copy_and_equals_f_linear(rows):
    layer = _layer()
    assert pack_small_batches(layer) == 160 * 96 * 4
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ops = _ops(lambda: layer(x))
        got = layer(x)
        strided = layer(torch.randn(96, rows).t())  # any layout of the rows
    assert ops.get(PACKED_OP) == 1, ops
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert strided.shape == (rows, 160)


def test_more_rows_than_the_limit_autograd_and_other_dtypes_run_f_linear_bit_for_bit():
    layer = _layer()
    pack_small_batches(layer)
    long = torch.randn(2, SMALL_BATCH_ROWS // 2 + 1, 96)  # 2 rows more than the limit, in a batch of 2
    short = torch.randn(3, 96)
    with torch.inference_mode():
        assert PACKED_OP not in _ops(lambda: layer(long))
        assert torch.equal(layer(long), F.linear(long, layer.weight, layer.bias))
        with pytest.raises(RuntimeError, match="same dtype"):  # not the packed copy: F.linear, which refuses
            layer(short.double())
    with torch.enable_grad():
        out = layer(short)
    assert torch.equal(out, F.linear(short, layer.weight, layer.bias)) and out.requires_grad


@pytest.mark.parametrize("lead", [1.0, PACKED_LEAD])  # MKL as fast; oneDNN just far enough ahead
def test_the_encoder_packs_every_linear_layer_and_long_inputs_take_the_library_measured_faster(
    monkeypatch, lead, full_spec, long_text
):
    monkeypatch.setattr(linear, "packed_lead", lambda *shape_and_threads: lead)
    encoder = load_encoder("all-MiniLM-L6-v2")
    layers = [m for m in encoder.model.modules() if isinstance(m, Linear)]
    limit = None if lead >= PACKED_LEAD else SMALL_BATCH_ROWS
    assert len(layers) == 36 and all(m.small_batch_weight is not None and m.packed_rows == limit for m in layers)
    short, long = ["a short query"], [long_text(700)]
    assert _ops(lambda: encoder.embed(long, full_spec)).get(PACKED_OP) == (len(layers) if limit is None else None)
    assert _ops(lambda: encoder.embed(short, full_spec)).get(PACKED_OP) == len(layers)

    plain = load_encoder("all-MiniLM-L6-v2", small_batch_weights=False)
    assert all(m.small_batch_weight is None for m in plain.model.modules() if isinstance(m, Linear))
    assert PACKED_OP not in _ops(lambda: plain.embed(short, full_spec))
    for text in ("a short query", long_text(40), long_text(700)):  # each alone: the packed copies against F.linear
        cosine = F.cosine_similarity(encoder.embed([text], full_spec), plain.embed([text], full_spec))
        assert cosine.item() >= 1 - 1e-6, (text, cosine)


def test_the_float32_limit_follows_the_lead_measured_once_a_process_on_the_widest_layer(monkeypatch):
    lead = packed_lead(96, 160, torch.get_num_threads())
    assert 0 < lead < float("inf") and packed_lead(96, 160, torch.get_num_threads()) == lead  # cached: no new timing
    model = torch.nn.Sequential(_layer(96, 160), torch.nn.ReLU(), _layer(160, 8))
    asked = []
    for measured, limit in ((PACKED_LEAD, None), (2.0, None), (PACKED_LEAD - 0.01, SMALL_BATCH_ROWS)):
        monkeypatch.setattr(linear, "packed_lead", lambda *shape, measured=measured: asked.append(shape) or measured)
        assert float32_packed_rows(model) == limit
    assert asked == [(96, 160, torch.get_num_threads())] * 3
    assert float32_packed_rows(torch.nn.Sequential(torch.nn.ReLU())) == SMALL_BATCH_ROWS  # no linear layer


bf16_packed = pytest.mark.skipif(
    not small_batches_supported("cpu", torch.bfloat16), reason="oneDNN has no bfloat16 kernels for this CPU"
)


@bf16_packed
@pytest.mark.parametrize("rows", [1, 7, SMALL_BATCH_ROWS + 1, 300])
def test_bfloat16_runs_every_product_on_the_packed_copy_with_f_linears_bits(rows):
    layer = _layer().to(torch.bfloat16)
    assert pack_small_batches(layer) == 160 * 96 * 2
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.inference_mode():
        ops = _ops(lambda: layer(x))
        got = layer(x)
        with pytest.raises(RuntimeError):  # a float32 input is not the copy's: F.linear, which refuses
            layer(x.float())
    assert ops.get(PACKED_OP) == 1, ops
    assert torch.equal(got, F.linear(x, layer.weight, layer.bias))


@bf16_packed
def test_a_bfloat16_encoder_runs_short_and_long_inputs_on_the_copies_with_the_same_vectors(full_spec, long_text):
    encoder = load_encoder("all-MiniLM-L6-v2", dtype="bfloat16")
    layers = [m for m in encoder.model.modules() if isinstance(m, Linear)]
    assert all(m.small_batch_weight is not None for m in layers)
    plain = load_encoder("all-MiniLM-L6-v2", dtype="bfloat16", small_batch_weights=False)
    for texts in (["a short query"], [long_text(700), "a short query"]):
        assert _ops(lambda: encoder.embed(texts, full_spec)).get(PACKED_OP) == len(layers)
        assert PACKED_OP not in _ops(lambda: plain.embed(texts, full_spec))
        assert torch.equal(encoder.embed(texts, full_spec), plain.embed(texts, full_spec))


def test_no_copy_off_the_cpu_or_in_other_dtypes():
    assert not small_batches_supported("meta", torch.float32) and not small_batches_supported("meta", torch.bfloat16)
    assert not small_batches_supported("cpu", torch.float16) and not small_batches_supported("cpu", torch.float64)
