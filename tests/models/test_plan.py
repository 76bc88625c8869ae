"""The plan (one resolution per input, by its own length) and packed batches."""

from __future__ import annotations

import copy

import pytest
import torch

from clusterserve.kernels import AttentionSpec
from clusterserve.models.batch.packing import pack
from clusterserve.models.planning.calibration import parse_calibration
from clusterserve.models.planning.chunk_plan import plan_chunks
from clusterserve.models.planning.chunking import ChunkingSpec
from clusterserve.models.planning.plan import UnknownAdapter, fits, plan

SMALL = dict(clusters=16, topk=16, iterations=5, refine=1, hash_rounds=2, cluster_size=32, seed=3)


def _table(model: str):
    """Exact attention at 1024 tokens (nothing approximate pays there), clustered 100 at 2048."""
    config = {"attention": {"method": "clustered", "clusters": 100}, "fidelity_min": 0.99, "fidelity_mean": 0.99}
    return parse_calibration(
        {
            "format": "clusterserve-calibration/1", "model": model, "device": "cpu",
            "buckets": [
                {"tokens": 1024, "exact_ms": 10.0, "configs": [{**config, "ms": 50.0}]},
                {"tokens": 2048, "exact_ms": 100.0, "configs": [{**config, "ms": 20.0}]},
            ],
        },
        "test",
    )  # fmt: skip


def test_pack_lays_sequences_end_to_end_grouped_by_spec_and_length():
    a, b = AttentionSpec(method="full"), AttentionSpec(method="smyrf")
    sequences = [[1, 2, 3], [4, 5], [6, 7, 8], [9, 10, 11], [12]]
    ids, packed = pack(sequences, [a, a, b, a, b], torch.device("cpu"))
    # Spec a first (its first input came first), longest first within it; stable otherwise.
    assert packed.order == (0, 3, 1, 2, 4)
    assert ids.tolist() == [1, 2, 3, 9, 10, 11, 4, 5, 6, 7, 8, 12]
    assert packed.positions.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 0, 1, 2, 0]
    assert [(g.first, g.count, g.length, g.start, g.spec.method) for g in packed.groups] == [
        (0, 2, 3, 0, "full"), (2, 1, 2, 6, "full"), (3, 1, 3, 8, "smyrf"), (4, 1, 1, 11, "smyrf"),
    ]  # fmt: skip
    hidden = torch.arange(12.0)[:, None]
    assert [part.flatten().tolist() for part in packed.split(hidden)] == [
        [0.0, 1.0, 2.0], [6.0, 7.0], [8.0, 9.0, 10.0], [3.0, 4.0, 5.0], [11.0],
    ]  # fmt: skip


def test_packed_attention_runs_each_group_as_one_call_on_its_own_tokens():
    spec = AttentionSpec(method="full")
    _, packed = pack([[1] * 4, [1] * 4, [1] * 2], [spec] * 3, torch.device("cpu"))
    q = torch.randn(10, 2, 8)
    shapes = []

    def attend(q, k, v, spec, mask):
        assert mask is None  # unpadded: no padding to mask
        shapes.append(tuple(q.shape))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    out = packed.attend(q, q, q, attend)
    assert shapes == [(2, 2, 4, 8), (1, 2, 2, 8)]
    for start, stop in ((0, 4), (4, 8), (8, 10)):
        alone = q[start:stop].transpose(0, 1)[None]  # (1, H, n, D)
        expected = torch.nn.functional.scaled_dot_product_attention(alone, alone, alone)[0].transpose(0, 1)
        torch.testing.assert_close(out[start:stop], expected)


def test_fits_is_a_budget_of_real_tokens():
    assert fits(0, 50_000, 100)  # an empty batch takes anything: a long input runs alone
    assert fits(60, 40, 100) and not fits(61, 40, 100)


def test_auto_is_resolved_by_each_inputs_own_length(default_encoder, long_text):
    encoder = copy.copy(default_encoder)
    encoder.calibration = _table(encoder.name)
    short, long = long_text(780, seed=1), long_text(2300, seed=2)
    call = plan(encoder, [short, long], AttentionSpec(method="auto"), target_fidelity=0.98)
    tokens = [p.tokens for p in call.inputs]
    assert tokens[0] <= 1024 and tokens[1] >= 2048  # judged by the first bucket, by the last
    assert [p.spec.method for p in call.inputs] == ["full", "clustered"]
    assert call.inputs[1].attention.echo["calibration_bucket"] == 2048
    assert call.echo()["target_fidelity"] == 0.98 and len(call.echo()["inputs"]) == 2
    # Alone, the short input plans the same; embedded together or alone, the same vector.
    alone = plan(encoder, [short], AttentionSpec(method="auto"), target_fidelity=0.98)
    assert alone.inputs[0].attention == call.inputs[0].attention
    together = encoder.embed([short, long], AttentionSpec(method="auto"), target_fidelity=0.98)
    by_itself = encoder.embed([short], AttentionSpec(method="auto"), target_fidelity=0.98)
    assert torch.nn.functional.cosine_similarity(together[:1], by_itself).item() >= 1 - 1e-6


def test_auto_runs_a_late_chunking_window_exact_and_a_naive_chunk_by_the_table(default_encoder, long_text):
    encoder = copy.copy(default_encoder)
    # 100 clusters keep 0.99 of a document but 0.95 of its late chunks; 200 keep 0.99 of both.
    cheap = {"attention": {"method": "clustered", "clusters": 100}, "fidelity_min": 0.99, "fidelity_mean": 0.99,
             "chunk_fidelity_min": 0.95, "ms": 20.0}
    dear = {"attention": {"method": "clustered", "clusters": 200}, "fidelity_min": 0.995, "fidelity_mean": 0.995,
            "chunk_fidelity_min": 0.99, "ms": 30.0}
    encoder.calibration = parse_calibration(
        {"format": "clusterserve-calibration/1", "model": encoder.name, "device": "cpu",
         "buckets": [{"tokens": 2048, "exact_ms": 100.0, "configs": [cheap, dear]}]},
        "test",
    )  # fmt: skip
    text, auto = long_text(2300, seed=2), AttentionSpec(method="auto")
    whole = plan(encoder, [text], auto, target_fidelity=0.98).inputs[0]
    assert whole.spec.clusters == 100 and "calibrated_for" not in whole.attention.echo
    late = plan_chunks(encoder, [text], auto, ChunkingSpec(window=2200), target_fidelity=0.98).plan.inputs
    assert len(late) == 2 and late[0].tokens == 2200  # a window in the 2048 bucket, and the rest
    assert all(one.spec.method == "full" for one in late)
    assert late[0].attention.echo == {"method": "full", "late_windows": "exact", "target_fidelity": 0.98}
    concrete = plan_chunks(encoder, [text], AttentionSpec(method="clustered", clusters=100), ChunkingSpec(window=2200))
    assert concrete.plan.inputs[0].spec.method == "clustered"  # a method asked for runs as asked
    naive = plan_chunks(encoder, [text], auto, ChunkingSpec(late=False, size=2100), target_fidelity=0.98).plan.inputs
    assert naive[0].tokens >= 2048 and naive[0].spec.clusters == 100  # a naive chunk is a document of its own


@pytest.mark.parametrize("method", ["full", "clustered", "i-clustered", "smyrf"])
def test_an_inputs_vector_does_not_depend_on_its_batch(default_encoder, long_text, method):
    spec = AttentionSpec(method=method, **SMALL)
    texts = [long_text(40, seed=4), long_text(300, seed=5), long_text(120, seed=6), long_text(300, seed=7)]
    together = default_encoder.embed(texts, spec)
    alone = torch.cat([default_encoder.embed([text], spec) for text in texts])
    assert torch.nn.functional.cosine_similarity(together, alone).min() >= 1 - 1e-6
    # Approximate methods: the same clusters, so the same vector to float rounding.
    torch.testing.assert_close(together, alone, atol=1e-6, rtol=0)
    # Batched by a budget that splits them differently: still the same.
    torch.testing.assert_close(default_encoder.embed(texts, spec, max_batch_tokens=200), alone, atol=1e-6, rtol=0)


def test_plan_names_what_is_wrong(default_encoder):
    with pytest.raises(UnknownAdapter, match="adapter: unknown adapter 'x'; known: none"):
        plan(default_encoder, ["a"], AttentionSpec(), adapter="x")
    with pytest.raises(ValueError, match='target_fidelity: applies to method "auto" only'):
        plan(default_encoder, ["a"], AttentionSpec(method="full"), target_fidelity=0.9)
    with pytest.raises(ValueError, match=r"target_fidelity: must be a number in \(0, 1\]"):
        plan(default_encoder, ["a"], AttentionSpec(method="auto"), target_fidelity=1.5)
    with pytest.raises(ValueError, match="spec: must be a kernels.AttentionSpec"):
        plan(default_encoder, ["a"], "full")


def test_batches_pack_real_tokens_longest_first(default_encoder, long_text):
    texts = [long_text(n, seed=n) for n in (10, 90, 50, 30)]
    call = plan(default_encoder, texts, AttentionSpec(method="full"))
    tokens = [p.tokens for p in call.inputs]
    batches = call.batches(max_batch_tokens=tokens[1] + tokens[2])
    assert batches == [[1, 2], [3, 0]]
    assert all(sum(tokens[i] for i in b) <= tokens[1] + tokens[2] for b in batches)


@pytest.mark.parametrize("method", ["full", "i-clustered"])
def test_sequences_that_leave_a_running_pass_leave_the_rest_unchanged(default_encoder, long_text, method):
    spec = AttentionSpec(method=method, **SMALL)
    sequences = default_encoder.prepare([long_text(60, seed=1), long_text(200, seed=2), long_text(120, seed=3)])
    forward = default_encoder.start(sequences, [spec] * 3)
    forward.step()
    forward.step()
    forward.keep([0, 2])
    while not forward.finished:
        forward.step()
    assert forward.done == forward.layers == 6
    alone = default_encoder.run([sequences[0], sequences[2]], [spec] * 2)
    torch.testing.assert_close(forward.pooled(), alone, atol=1e-6, rtol=0)


def test_a_check_that_raises_stops_the_pass_between_attention_stages(default_encoder, long_text):
    class Stop(Exception):
        pass

    calls = []

    def check():
        calls.append(1)
        if len(calls) == 3:
            raise Stop

    spec = AttentionSpec(method="i-clustered", **SMALL)
    forward = default_encoder.start(default_encoder.prepare([long_text(200, seed=2)]), [spec], check=check)
    with pytest.raises(Stop):
        forward.step()
    assert len(calls) == 3 and forward.done == 0  # inside the first layer's attention
