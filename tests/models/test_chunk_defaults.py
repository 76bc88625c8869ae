"""Chunking defaults per model (models.planning.chunk_defaults): a request that does not set
`late` gets the model's, and late chunking's window is the one measured for it."""

from __future__ import annotations

from clusterserve.models.planning.chunk_defaults import GENERAL, chunk_defaults
from clusterserve.models.planning.chunk_plan import plan_chunks
from clusterserve.models.planning.chunking import ChunkingSpec, ChunkLimits, naive_chunk_within_limit, window_sizes


def test_late_absent_takes_the_models_default_and_a_request_overrides_it():
    naive_model = ChunkLimits(framing=8, max_tokens=8192, native_positions=8192, late=False, window=512)
    assert ChunkingSpec().late is None
    assert ChunkingSpec().resolved(naive_model).late is False
    assert ChunkingSpec(late=True).resolved(naive_model).late is True
    assert ChunkingSpec().resolved(ChunkLimits(framing=8, max_tokens=512, native_positions=512)).late is True
    # The naive chunk's rule applies to a body without `late` where the model's default is naive.
    assert naive_chunk_within_limit({"size": 8190}, naive_model).field == "size"
    assert naive_chunk_within_limit({"size": 8190, "late": True}, naive_model) is None
    # The measured window, at most the length limit; without one, the trained positions.
    assert window_sizes(ChunkingSpec(late=True), naive_model) == (504, 126)
    assert ChunkLimits(framing=8, max_tokens=256, native_positions=8192, window=512).default_window == 256
    assert ChunkLimits(framing=8, max_tokens=8192, native_positions=2048).default_window == 2048


def test_the_served_default_chunks_naively_and_runs_late_chunking_in_512_token_windows(nomic_encoder, full_spec):
    assert chunk_defaults("all-MiniLM-L6-v2") is GENERAL
    measured = chunk_defaults(nomic_encoder.name)
    assert (measured.late, measured.window) == (False, 512) and "naive" in measured.finding
    text = " ".join(f"Sentence {i} says something about item {i}." for i in range(300))  # ~3k tokens
    naive = plan_chunks(nomic_encoder.checkpoint, [text], full_spec, ChunkingSpec())
    assert not naive.late and all(p.tokens <= 256 + 8 for p in naive.plan.inputs)
    late = plan_chunks(nomic_encoder.checkpoint, [text], full_spec, ChunkingSpec(late=True))
    assert late.late and len(late.plan.inputs) > 5 and max(p.tokens for p in late.plan.inputs) == 512
