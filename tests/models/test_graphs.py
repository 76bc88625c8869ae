"""Length buckets, the padded packed layout and the CUDA-graph cache (models.runtime.graphs), on CPU.

The graph cache is driven by a stand-in backend whose "graph" runs the captured function
again, so its bookkeeping (warm-up, one capture per signature and layer, replay, LRU, eager
fallback, a changed signature after keep) and the numbers a replayed step gives are checked
here; tests/gpu/test_cuda_graphs.py captures real CUDA graphs.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from clusterserve.kernels import AttentionSpec
from clusterserve.kernels.reference.hashing import hash_planes, holding_device_constants, on_device
from clusterserve.models.batch.packing import BUCKET_STEPS, bucket_length, pack
from clusterserve.models.batch.passes import run_pass
from clusterserve.models.config import EncoderConfig
from clusterserve.models.networks import bert, eurobert, modernbert, rotary_bert
from clusterserve.models.pooling import POOLING_MODES, pool
from clusterserve.models.runtime.encoder import Forward
from clusterserve.models.runtime.graphs import LayerGraphs, Signature

CPU = torch.device("cpu")
SPECS = {
    "full": AttentionSpec(method="full"),
    "clustered": AttentionSpec(method="clustered", clusters=3, bits=8, iterations=3, refine=1),
    "i-clustered": AttentionSpec(method="i-clustered", clusters=3, topk=5, bits=8, iterations=3, refine=1),
    "smyrf": AttentionSpec(method="smyrf", hash_rounds=2, cluster_size=8),
}
SIZES = dict(vocab_size=60, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=24)
ARCHITECTURES = {
    "bert": (bert.BertModel, dict(model_type="bert")),
    "modernbert": (modernbert.ModernBertModel, dict(
        model_type="modernbert", local_attention=8, layer_types=("full_attention", "sliding_attention"),
        activation="gelu_new", norm_bias=False,
    )),
    # dynamic NTK: rotary tables that depend on each sequence's own length
    "nomic-bert": (rotary_bert.RotaryBertModel, dict(
        model_type="nomic-bert", rope_type="dynamic", rope_factor=2.0, rope_original_positions=16, mlp_gated=True,
        activation="silu",
    )),
    "jina-embeddings-v3": (rotary_bert.RotaryBertModel, dict(
        model_type="jina-embeddings-v3", adapters=("query", "passage"), lora_rank=2,
    )),
    "eurobert": (eurobert.EuroBertModel, dict(model_type="eurobert", num_kv_heads=1, activation="silu")),
}  # fmt: skip


def tiny(arch: str, dtype: torch.dtype = torch.float64):
    """A two-layer model of `arch` with random weights, in `dtype`."""
    cls, fields = ARCHITECTURES[arch]
    torch.manual_seed(0)
    model = cls(EncoderConfig(**SIZES, **fields)).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def sequences(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, SIZES["vocab_size"], (n,), generator=g).tolist() for n in lengths]


class StandIn:
    """A graph backend whose graph runs the function again; fails every capture with `fail`."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.pools = self.captures = self.attempts = 0

    def pool(self):
        self.pools += 1
        return object()

    def capture(self, run, pool):
        self.attempts += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        run()  # the warm-up on the capture stream
        self.captures += 1
        return run


def start(model, seqs, specs, graphs=None, adapter=None, padded=True) -> Forward:
    ids, packed = pack(seqs, specs, CPU, bucket_length if padded else None, pad_id=0)
    with torch.inference_mode():
        state = model.begin(ids, packed, "reference", adapter)
    return Forward(model, state, "mean", graphs)


def finish(forward: Forward) -> torch.Tensor:
    while not forward.finished:
        forward.step()
    return forward.pooled()


# ---- buckets and the padded layout ----------------------------------------------------------


def test_buckets_pad_under_a_tenth_and_are_monotone_and_idempotent():
    lengths = range(1, 65537)
    buckets = [bucket_length(n) for n in lengths]
    for n, b in zip(lengths, buckets):
        assert n <= b and (b - n) < b / BUCKET_STEPS < b / 10, (n, b)
        assert bucket_length(b) == b, (n, b)
    assert all(a <= b for a, b in zip(buckets, buckets[1:]))
    assert buckets[:32] == list(range(1, 33))  # short lengths are exact
    assert len(set(buckets)) == 208
    assert bucket_length(1000) % 32 == 0 and bucket_length(5000) % 256 == 0
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="n: must be a positive integer"):
            bucket_length(bad)


def test_padded_layout_puts_padding_after_each_sequence_and_masks_it():
    full, smyrf = SPECS["full"], SPECS["smyrf"]
    seqs = [[5] * 40, [6] * 3, [7] * 39, [8] * 37]  # slots 40, 3, 40, 38
    ids, packed = pack(seqs, [full, full, full, smyrf], CPU, bucket_length, pad_id=1)
    assert packed.lengths == (40, 39, 3, 37) and packed.slots == (40, 40, 3, 38) and packed.order == (0, 2, 1, 3)
    assert [(g.first, g.count, g.length, g.start, g.spec.method) for g in packed.groups] == [
        (0, 2, 40, 0, "full"), (2, 1, 3, 80, "full"), (3, 1, 38, 83, "smyrf"),
    ]  # fmt: skip
    assert ids.tolist() == [5] * 40 + [7] * 39 + [1] + [6] * 3 + [8] * 37 + [1]
    assert packed.real.tolist() == [True] * 79 + [False] + [True] * 40 + [False]
    assert packed.positions.tolist() == [*range(40), *range(39), 0, *range(3), *range(37), 0]
    hidden = torch.arange(121.0)[:, None]
    assert [part.flatten().tolist() for part in packed.split(hidden)] == [
        list(map(float, range(40))), list(map(float, range(80, 83))), list(map(float, range(40, 79))),
        list(map(float, range(83, 120))),
    ]  # fmt: skip
    assert pool(hidden, packed, "lasttoken").flatten().tolist() == [39.0, 82.0, 78.0, 119.0]

    kept, rows = packed.keep([2, 3])
    assert kept.lengths == (39, 37) and kept.slots == (40, 38) and kept.order == (0, 1)
    assert rows.tolist() == [*range(40, 80), *range(83, 121)]
    assert kept.real.tolist() == [True] * 39 + [False] + [True] * 37 + [False]
    assert [(g.count, g.length, g.spec.method) for g in kept.groups] == [(1, 40, "full"), (1, 38, "smyrf")]


def test_packed_attention_hands_each_group_its_padding_mask():
    """A group with padding gets its key mask; one whose sequences fill their slots gets none
    (exact attention then runs SDPA's unmasked flash kernel)."""
    spec = SPECS["full"]
    _, packed = pack([[1] * 39, [1] * 40, [1] * 3], [spec] * 3, CPU, bucket_length)
    masks = []

    def attend(q, k, v, spec, mask):
        masks.append(None if mask is None else mask.tolist())
        return v

    packed.attend(*[torch.zeros(83, 2, 4)] * 3, attend)
    assert [g.padded for g in packed.groups] == [True, False]
    assert masks == [[[True] * 40, [True] * 39 + [False]], None]


@pytest.mark.parametrize("method", list(SPECS))
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_padded_pass_gives_the_unpadded_vectors_and_token_states(arch, method):
    """Every architecture (learned, rotary and dynamic-NTK positions, local layers, LoRA,
    grouped-query attention) and every method, reference backend in float64."""
    model = tiny(arch)
    seqs = sequences([45, 7, 33, 40, 39])  # slots 46, 7, 34, 40, 40
    specs = [SPECS[method]] * 4 + [SPECS["full"]]
    adapter = 1 if arch == "jina-embeddings-v3" else None
    results = []
    for padded in (False, True):
        ids, packed = pack(seqs, specs, CPU, bucket_length if padded else None)
        with torch.inference_mode():
            hidden = run_pass(model, model.begin(ids, packed, "reference", adapter))
        assert hidden.shape[0] == (sum(packed.slots) if padded else 164)
        results.append((hidden, packed))
    (plain, plain_layout), (padded, padded_layout) = results
    assert sorted(padded_layout.slots) == [7, 34, 40, 40, 46]
    for a, b in zip(plain_layout.split(plain), padded_layout.split(padded)):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=0)
    for mode in POOLING_MODES:
        torch.testing.assert_close(pool(padded, padded_layout, mode), pool(plain, plain_layout, mode), atol=1e-10, rtol=0)


# ---- the graph cache ------------------------------------------------------------------------


def eager_vectors(model, seqs, specs, adapter=None, padded=True) -> torch.Tensor:
    return finish(start(model, seqs, specs, None, adapter, padded))


def test_first_run_warms_up_second_captures_then_replays():
    model, backend = tiny("nomic-bert"), StandIn()
    graphs = LayerGraphs(backend, capacity=4)
    seqs, specs = sequences([67, 39]), [SPECS["i-clustered"], SPECS["full"]]  # slots 68, 40
    expected = eager_vectors(model, seqs, specs)

    first = finish(start(model, seqs, specs, graphs))
    assert graphs.counts == dict(captured=0, replayed=0, failed=0, evicted=0) and backend.pools == 0
    second = finish(start(model, seqs, specs, graphs))
    assert graphs.counts["captured"] == 2 and graphs.counts["replayed"] == 2
    assert backend.captures == 2 and backend.pools == 1 and graphs.signatures == 1
    # Same slots, other real lengths (67 -> 65), both still padded: the same signature, replayed.
    other = sequences([65, 39], seed=1)
    third = finish(start(model, other, specs, graphs))
    assert graphs.counts["captured"] == 2 and graphs.counts["replayed"] == 4 and backend.captures == 2
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert torch.equal(third, eager_vectors(model, other, specs))
    torch.testing.assert_close(second, eager_vectors(model, seqs, specs, padded=False), atol=1e-10, rtol=0)


def test_signature_is_the_groups_slots_specs_and_adapter():
    model = tiny("jina-embeddings-v3")
    spec = SPECS["smyrf"]
    base = Signature.of(start(model, sequences([67, 39]), [spec, spec], adapter=0).state)
    assert base == Signature.of(start(model, sequences([65, 39]), [spec, spec], adapter=0).state)
    assert base.groups == ((1, 68, spec, True), (1, 40, spec, True))
    assert base != Signature.of(start(model, sequences([69, 39]), [spec, spec], adapter=0).state)  # slot 72
    filled = Signature.of(start(model, sequences([68, 39]), [spec, spec], adapter=0).state)
    assert filled.groups[0] == (1, 68, spec, False)  # no padding: captured without a mask
    assert base != Signature.of(start(model, sequences([45, 40]), [spec, spec], adapter=1).state)
    assert base != Signature.of(start(model, sequences([45, 40]), [spec, SPECS["full"]], adapter=0).state)


def test_least_recently_used_signature_is_dropped_and_captured_again_when_back():
    model, backend = tiny("bert"), StandIn()
    graphs = LayerGraphs(backend, capacity=1)
    spec = [SPECS["clustered"]]
    short, long = sequences([20]), sequences([50])
    for seqs in (short, short, long, long):
        finish(start(model, seqs, spec, graphs))
    assert graphs.counts["captured"] == 4 and graphs.counts["evicted"] == 1 and graphs.signatures == 1
    vectors = finish(start(model, short, spec, graphs))  # warm already: captured again at once
    assert graphs.counts["captured"] == 6 and graphs.counts["evicted"] == 2 and backend.pools == 3
    assert torch.equal(vectors, eager_vectors(model, short, spec))
    graphs.clear()
    assert graphs.signatures == 0


def test_a_failed_capture_is_logged_once_and_the_signature_runs_eagerly(caplog):
    model, backend = tiny("modernbert"), StandIn(fail=True)
    graphs = LayerGraphs(backend)
    seqs, specs = sequences([45, 7]), [SPECS["smyrf"]] * 2
    expected = eager_vectors(model, seqs, specs)
    with caplog.at_level(logging.WARNING, logger="clusterserve"):
        runs = [finish(start(model, seqs, specs, graphs)) for _ in range(3)]
    assert backend.attempts == 1 and graphs.counts["failed"] == 1 and graphs.counts["replayed"] == 0
    assert graphs.signatures == 0
    warnings = [r.getMessage() for r in caplog.records if "CUDA graph capture failed" in r.getMessage()]
    assert len(warnings) == 1 and "[46, 7]" in warnings[0] and "runs eagerly" in warnings[0]
    for vectors in runs:
        assert torch.equal(vectors, expected)


def test_after_keep_the_pass_has_a_new_signature_and_runs_it_eagerly():
    model, backend = tiny("eurobert"), StandIn()
    graphs = LayerGraphs(backend)
    seqs, specs = sequences([45, 30, 12]), [SPECS["i-clustered"], SPECS["smyrf"], SPECS["full"]]
    for _ in range(2):
        finish(start(model, seqs, specs, graphs))
    replayed = graphs.counts["replayed"]
    forward = start(model, seqs, specs, graphs)
    forward.step()
    assert graphs.counts["replayed"] == replayed + 1
    forward.keep([0, 2])
    forward.step()  # the kept layout is a signature not seen before: eager
    assert graphs.counts["replayed"] == replayed + 1 and graphs.counts["captured"] == 2
    reference = start(model, seqs, specs)
    reference.step()
    reference.keep([0, 2])
    assert torch.equal(finish(forward), finish(reference))
    torch.testing.assert_close(finish(forward), eager_vectors(model, [seqs[0], seqs[2]], [specs[0], specs[2]]),
                               atol=1e-10, rtol=0)  # fmt: skip


def test_passes_of_one_signature_interleaved_layer_by_layer_keep_their_own_layouts():
    """The static buffers hold one pass's layout at a time: each step reloads it when
    another pass used them last (real lengths differ within a bucket)."""
    model, backend = tiny("nomic-bert"), StandIn()
    graphs = LayerGraphs(backend)
    specs = [SPECS["clustered"], SPECS["full"]]
    a, b = sequences([67, 39]), sequences([66, 39], seed=3)
    finish(start(model, a, specs, graphs))  # warm-up
    first, second = start(model, a, specs, graphs), start(model, b, specs, graphs)
    while not first.finished:
        first.step()
        second.step()
    assert graphs.counts["replayed"] == 4 and backend.captures == 2
    assert torch.equal(first.pooled(), eager_vectors(model, a, specs))
    assert torch.equal(second.pooled(), eager_vectors(model, b, specs))


def test_unpadded_passes_skip_the_graphs():
    model = tiny("bert")
    graphs = LayerGraphs(StandIn())
    for _ in range(3):
        finish(start(model, sequences([20]), [SPECS["full"]], graphs, padded=False))
    assert graphs.counts["captured"] == graphs.counts["replayed"] == 0


def test_graph_settings_are_checked():
    for name, bad in (("capacity", 0), ("max_length", -1), ("capacity", True)):
        with pytest.raises(ValueError, match=name):
            LayerGraphs(StandIn(), **{name: bad})
    graphs = LayerGraphs(StandIn(), max_length=100)
    assert graphs.takes([100, 3]) and not graphs.takes([101]) and not graphs.takes([])


def test_captures_keep_the_device_constants_they_read():
    with holding_device_constants() as held:
        planes = on_device(hash_planes, (2, 4, 8, 0), CPU)
    assert len(held) == 1 and held[0] is planes
    on_device(hash_planes, (2, 4, 8, 1), CPU)
    assert len(held) == 1  # outside the block nothing is collected


# ---- the encoder ----------------------------------------------------------------------------


def test_load_encoder_keeps_no_graphs_on_a_cpu_and_checks_their_settings():
    from clusterserve.models import load_encoder

    assert load_encoder("all-MiniLM-L6-v2", max_input_tokens=128).graphs is None
    for name, bad in (("cuda_graphs", -1), ("cuda_graph_max_length", 0)):
        with pytest.raises(ValueError, match=name):
            load_encoder("all-MiniLM-L6-v2", max_input_tokens=128, **{name: bad})


def test_encoder_pads_and_replays_only_with_graphs_and_short_enough_inputs(default_encoder, long_text):
    assert default_encoder.graphs is None  # CPU: unpadded, every layer eager
    spec = SPECS["i-clustered"]
    texts = [long_text(60, seed=1), long_text(150, seed=2)]
    ids = default_encoder.prepare(texts)
    plain = default_encoder.run(ids, [spec, spec])
    assert default_encoder.start(ids, [spec, spec]).state.packed.real is None

    encoder = copy.copy(default_encoder)
    encoder.graphs = LayerGraphs(StandIn(), max_length=max(map(len, ids)))
    runs = [encoder.run(ids, [spec, spec]) for _ in range(3)]
    assert encoder.graphs.counts["captured"] == 6 and encoder.graphs.counts["replayed"] == 12
    assert torch.equal(runs[1], runs[0]) and torch.equal(runs[2], runs[0])
    torch.testing.assert_close(runs[0], plain, atol=2e-5, rtol=0)
    states = encoder.token_states(ids, [spec, spec])
    assert [s.shape[0] for s in states] == [len(i) for i in ids]

    encoder.graphs = LayerGraphs(StandIn(), max_length=max(map(len, ids)) - 1)
    assert encoder.start(ids, [spec, spec]).state.packed.real is None  # too long to graph
