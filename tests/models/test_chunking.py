"""Chunking (models.planning.chunking, models.planning.chunk_plan, Encoder.embed_chunks / encode): where chunks
fall, that naive chunks are the chunks embedded alone, that late chunks are the mean of the
token states over their spans, whole-context and in overlapping windows, and Jina's form.
Short real text (Debian's licence texts) on the default model, exact attention."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from clusterserve.kernels import AttentionSpec
from clusterserve.models.planning.chunk_plan import plan_chunks, plan_late_inputs
from clusterserve.models.planning.chunking import ChunkingSpec, chunk_spans, unit_starts, windows
from clusterserve.models.planning.inputs import EmptyInput
from clusterserve.models.pooling import EVERY_TOKEN, POOLED, Output

GPL = Path("/usr/share/common-licenses/GPL-3")


@pytest.fixture(scope="module")
def text() -> str:
    """~300 tokens of real prose with sentences and paragraphs."""
    if GPL.is_file():
        return GPL.read_text()[:1500]
    return ("The licence says what you may do. " * 10 + "\n\n") * 4


@pytest.mark.parametrize("size, overlap", [(1, 0), (4, 0), (4, 3), (16, 5), (64, 63)])
@pytest.mark.parametrize("units", ["tokens", "random"])
def test_chunk_spans_cover_every_token_within_size_and_overlap(size, overlap, units):
    tokens = 200
    rng = random.Random(size * 100 + overlap)
    starts = list(range(tokens)) if units == "tokens" else sorted({0, *rng.sample(range(1, tokens), 40)})
    spans = chunk_spans(starts, tokens, size, overlap)
    assert spans[0][0] == 0 and spans[-1][1] == tokens
    for (a, b), (c, d) in zip(spans, spans[1:]):
        assert a < c and b < d, "every chunk starts later and reaches further than the one before"
        assert c <= b, "no token is left out"
        assert b - c <= overlap
    assert all(0 < b - a <= size for a, b in spans)
    if units == "tokens":
        assert [b - a for a, b in spans[:-1]] == [size] * (len(spans) - 1)
        assert all(c == b - overlap for (_, b), (c, _) in zip(spans, spans[1:]))
    # Chunks begin and end where units (or the pieces of a unit longer than size) do.
    ends = [*starts[1:], tokens]
    pieces = {begin for start, end in zip(starts, ends) for begin in range(start, end, size)}
    assert all(a in pieces and (b in pieces or b == tokens) for a, b in spans)


def test_sentence_and_paragraph_units_start_at_token_starts(default_encoder):
    text = 'One sentence here. Another one! A "quoted." Then\n\nA new paragraph? Yes.'
    tokens = default_encoder.tokenizer.encode_body([text])[0]
    words = [text[a:b] for a, b in tokens.offsets]
    sentences = unit_starts(text, tokens.offsets, "sentences")
    assert [words[i] for i in sentences] == ["One", "Another", "A", "Then", "A", "Yes"]
    paragraphs = unit_starts(text, tokens.offsets, "paragraphs")
    assert [words[i] for i in paragraphs] == ["One", "A"] and paragraphs[1] == sentences[4]
    assert unit_starts(text, tokens.offsets, "tokens") == list(range(len(tokens.ids)))


@pytest.mark.parametrize("tokens, room, overlap", [(100, 510, 128), (1000, 510, 128), (1021, 510, 0), (7000, 510, 255)])
def test_windows_keep_every_token_once(tokens, room, overlap):
    spans = windows(tokens, room, overlap)
    kept = [t for start, stop, keep in spans for t in range(keep, stop)]
    assert kept == list(range(tokens))
    assert all(stop - start <= room for start, stop, _ in spans)
    assert all(keep - start == (overlap if i else 0) for i, (start, _, keep) in enumerate(spans))


@pytest.mark.parametrize(
    "fields, name",
    [({"size": 0}, "size"), ({"overlap": 8, "size": 8}, "overlap"), ({"overlap": -1}, "overlap"),
     ({"boundaries": "words"}, "boundaries"), ({"late": 1}, "late"), ({"window": 0}, "window"),
     ({"window_overlap": -2}, "window_overlap"), ({"size": True}, "size")],
)  # fmt: skip
def test_chunking_spec_names_the_bad_field(fields, name):
    with pytest.raises(ValueError, match=f"^{name}: "):
        ChunkingSpec(**fields)


def test_naive_chunks_are_the_chunks_embedded_alone(default_encoder, full_spec, text):
    chunked = default_encoder.embed_chunks([text], full_spec, ChunkingSpec(size=48, overlap=8, late=False))[0]
    ids = default_encoder.tokenize([text])[0].ids
    assert len(chunked.chunks) == chunked.vectors.shape[0] > 4
    for chunk, vector in zip(chunked.chunks, chunked.vectors):
        start, stop = chunk.token_span
        assert 1 <= start < stop <= len(ids) - 1 and stop - start <= 48
        alone = default_encoder.embed([[ids[0], *ids[start:stop], ids[-1]]], full_spec)[0]
        torch.testing.assert_close(vector, alone, atol=1e-6, rtol=0)
        # The text span is what the tokens cover.
        first, last = default_encoder.tokenize([text])[0].offsets[start], default_encoder.tokenize([text])[0].offsets[stop - 1]
        assert chunk.text_span == (first[0], last[1])


def test_late_chunks_over_the_whole_context_are_span_means(default_encoder, full_spec, text):
    chunking = ChunkingSpec(size=40, window=1024)
    chunked = default_encoder.embed_chunks([text], full_spec, chunking, normalize=False)[0]
    ids = default_encoder.tokenize([text])[0].ids
    states = default_encoder.token_states([ids], [full_spec])[0]
    expected = torch.stack([states[a:b].mean(dim=0) for a, b in (c.token_span for c in chunked.chunks)])
    torch.testing.assert_close(chunked.vectors, expected, atol=1e-5, rtol=0)


def test_late_chunks_in_windows_pool_each_token_from_the_window_that_keeps_it(default_encoder, full_spec, text):
    window, overlap = 96, 32
    chunking = ChunkingSpec(size=40, boundaries="tokens", window=window, window_overlap=overlap)
    chunked = default_encoder.embed_chunks([text], full_spec, chunking, normalize=False)[0]
    ids = default_encoder.tokenize([text])[0].ids
    body = ids[1:-1]
    kept = []
    for start, stop, keep in windows(len(body), window - 2, overlap):
        states = default_encoder.token_states([[ids[0], *body[start:stop], ids[-1]]], [full_spec])[0]
        kept.append(states[1 + keep - start : 1 + stop - start])
    kept = torch.cat(kept)  # one state per body token
    assert kept.shape[0] == len(body)
    expected = torch.stack([kept[a - 1 : b - 1].mean(dim=0) for a, b in (c.token_span for c in chunked.chunks)])
    torch.testing.assert_close(chunked.vectors, expected, atol=1e-5, rtol=0)
    # Some chunk straddles two windows: its vector mixes both.
    assert any(a - 1 < window - 2 < b - 1 for a, b in (c.token_span for c in chunked.chunks))


def test_jina_form_runs_the_inputs_as_one_text(default_encoder, full_spec):
    pieces = ["The first chunk talks about licences.", " The second one about software.", " A third."]
    call = plan_late_inputs(default_encoder, pieces, full_spec)
    assert len(call.inputs) == 1 and len(call.inputs[0].chunks) == 3 and len(call.plan.inputs) == 1
    vectors = default_encoder.run_chunks(call)[0]
    bodies = [t.ids for t in default_encoder.tokenizer.encode_body(pieces)]
    joined = [101, *[t for b in bodies for t in b], 102]
    states = default_encoder.token_states([joined], [full_spec])[0]
    bounds = [1]
    for b in bodies:
        bounds.append(bounds[-1] + len(b))
    expected = torch.stack([states[a:b].mean(dim=0) for a, b in zip(bounds, bounds[1:])])
    torch.testing.assert_close(vectors, expected, atol=1e-5, rtol=0)
    assert [c.token_span for c in call.inputs[0].chunks] == list(zip(bounds, bounds[1:]))
    with pytest.raises(EmptyInput):
        plan_late_inputs(default_encoder, ["text", "   "], full_spec)


def test_limits_and_errors(default_encoder, full_spec, text):
    with pytest.raises(ValueError, match="^chunking: "):
        plan_chunks(default_encoder, [[101, 102]], full_spec, ChunkingSpec())
    with pytest.raises(ValueError, match="^size: "):
        plan_chunks(default_encoder, [text], full_spec, ChunkingSpec(size=40000, late=False))
    with pytest.raises(ValueError, match="^window: "):
        plan_chunks(default_encoder, [text], full_spec, ChunkingSpec(window=2))
    with pytest.raises(ValueError, match="^window_overlap: "):
        plan_chunks(default_encoder, [text], full_spec, ChunkingSpec(window=130, window_overlap=128))


@pytest.mark.parametrize("late", [False, True])
def test_a_text_without_tokens_of_its_own_is_one_chunk_its_own_embedding(default_encoder, full_spec, text, late):
    # blanks and a private-use character: the tokenizer keeps none of them
    for empty in ["   ", "\U000F180D"]:
        chunking = ChunkingSpec(size=16, late=late)
        chunked = default_encoder.embed_chunks([empty, text], full_spec, chunking)
        assert [c.text_span for c in chunked[0].chunks] == [(0, len(empty))]
        assert [c.token_span for c in chunked[0].chunks] == [(0, len(default_encoder.tokenize([empty])[0].ids))]
        torch.testing.assert_close(chunked[0].vectors, default_encoder.embed([empty], full_spec), atol=1e-6, rtol=0)
        # the other input's chunks are those it gets alone
        alone = default_encoder.embed_chunks([text], full_spec, chunking)[0]
        torch.testing.assert_close(chunked[1].vectors, alone.vectors, atol=1e-5, rtol=0)


def test_a_document_longer_than_one_pass_is_chunked_and_truncate_cuts_it_first(full_spec, text):
    from clusterserve.models import load_encoder

    short = load_encoder("all-MiniLM-L6-v2", max_input_tokens=64)
    whole = plan_chunks(short, [text], full_spec, ChunkingSpec(size=16, window=64, window_overlap=16))
    assert whole.inputs[0].tokens > 64 and max(planned.tokens for planned in whole.plan.inputs) <= 64
    naive = plan_chunks(short, [text], full_spec, ChunkingSpec(size=16, late=False))
    assert len(naive.inputs[0].chunks) == len(whole.inputs[0].chunks)
    right = plan_chunks(short, [text], full_spec, ChunkingSpec(size=16), truncate=True)
    left = plan_chunks(short, [text], full_spec, ChunkingSpec(size=16), truncate=True, truncation_direction="left")
    assert right.inputs[0].tokens == left.inputs[0].tokens == 64
    assert right.inputs[0].chunks[0].text_span[0] == len(text) - len(text.lstrip())
    assert left.inputs[0].chunks[-1].text_span[1] == len(text.rstrip())


def test_each_chunk_resolves_its_own_attention_and_auto_runs_windows_exact(default_encoder, text):
    auto = AttentionSpec(method="auto", auto_threshold=100, auto_method="clustered")
    call = plan_chunks(default_encoder, [text], auto, ChunkingSpec(size=120, late=False, boundaries="tokens"))
    methods = [planned.spec.method for planned in call.plan.inputs]
    lengths = [planned.tokens for planned in call.plan.inputs]
    assert methods == ["clustered" if n >= 100 else "full" for n in lengths] and "full" in methods
    windows = plan_chunks(default_encoder, [text], auto, ChunkingSpec(window=128, window_overlap=16)).plan.inputs
    assert max(w.tokens for w in windows) >= 100 and {w.spec.method for w in windows} == {"full"}


def test_encode_gives_each_sequence_its_output_in_one_batch(default_encoder, full_spec, text):
    sequences = [t.ids for t in default_encoder.tokenize([text, "a short one", "another short text here"])]
    outputs = [Output("spans", ((1, 5), (0, 3))), POOLED, EVERY_TOKEN]
    rows = default_encoder.encode(sequences, [full_spec] * 3, outputs)
    assert [r.shape[0] for r in rows] == [2, 1, len(sequences[2])]
    states = default_encoder.token_states(sequences, [full_spec] * 3)
    torch.testing.assert_close(rows[0], torch.stack([states[0][1:5].mean(0), states[0][0:3].mean(0)]), atol=1e-6, rtol=0)
    torch.testing.assert_close(rows[1], default_encoder.run(sequences[1:2], [full_spec]), atol=1e-6, rtol=0)
    torch.testing.assert_close(rows[2], states[2], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="^spans: "):
        default_encoder.encode(sequences[1:2], [full_spec], [Output("spans", ((0, 99),))])


def test_a_prompt_runs_in_every_sequence_and_in_no_chunk(default_encoder, full_spec, text):
    import copy

    from clusterserve.models.prompts import Prompts

    encoder = copy.copy(default_encoder)
    encoder.prompts = Prompts({"document": "search document: "})
    prompt = encoder.tokenizer.encode_body(["search document: "])[0].ids
    naive = plan_chunks(encoder, [text], full_spec, ChunkingSpec(size=64, late=False), prompt_name="document")
    late = plan_chunks(encoder, [text], full_spec, ChunkingSpec(size=64, window=128), prompt_name="document")
    assert naive.plan.prompt_name == late.plan.prompt_name == "document"
    for call in (naive, late):
        assert all(p.ids[1 : 1 + len(prompt)] == prompt for p in call.plan.inputs)
    # The spans of a window start after [CLS] and the prompt.
    assert min(a for output in late.outputs for a, _ in output.spans) == 1 + len(prompt)
    # token_span still indexes the text's own tokens ([CLS] text [SEP]), without the prompt.
    assert [c.token_span for c in naive.inputs[0].chunks] == [c.token_span for c in late.inputs[0].chunks]
    assert naive.inputs[0].chunks[0].token_span[0] == 1
    assert naive.inputs[0].tokens == default_encoder.count_tokens([text])[0] + len(prompt)
