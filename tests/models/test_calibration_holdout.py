"""The shipped CPU calibration tables (float32 and bfloat16, of both models), checked on texts
they were not measured on.

For each length and fidelity target, the table's choice embeds held-back documents (Debian
license texts outside the calibration set); its cosine to the exact embedding must meet the
target in at least 90% of the cases where the table chose an approximation. A configuration
chosen at several of the lengths checked is checked at the first of them. The cosine is to
exact attention in float32, whatever dtype the table serves. Exact choices
meet any target by definition and are not counted, so the check cannot pass vacuously: it
also requires approximate choices to exist, for 0.99 and 0.995 among them.
"""

from __future__ import annotations

import pytest
import torch

from clusterserve.bench.calibration.build import pooled_and_chunks
from clusterserve.bench.common import HELD_BACK_TEXTS, LICENSE_DIR, long_text_ids
from clusterserve.models import load_encoder
from clusterserve.models.planning.calibration import SHIPPED_DIR, load_calibration, table_name
from clusterserve.models.runtime.precision import cpu_has_bf16

# Each configuration is checked at the first of these lengths that chooses it, so a length adds
# time only where its table chooses something new: both tables choose at 8k as at 4k, float32's
# i-clustered for 0.95 at 16k.
LENGTHS = (4096, 8192, 16384)
TARGETS = (0.95, 0.98, 0.99, 0.995)
DOCS = 2


@pytest.mark.skipif(not (LICENSE_DIR / HELD_BACK_TEXTS[0]).is_file(), reason="needs Debian's license texts")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_choices_meet_their_target_on_held_back_texts(default_encoder, full_spec, dtype):
    encoder = default_encoder if dtype == "float32" else load_encoder("all-MiniLM-L6-v2", dtype=dtype)
    table = load_calibration(SHIPPED_DIR / table_name(encoder.name, "cpu", dtype))
    assert table.dtype == dtype
    outcomes: list[tuple[int, float, str, float]] = []
    checked: set = set()  # configurations checked at a shorter length
    for n in LENGTHS:
        chosen = {target: table.choose(n, target).spec for target in TARGETS}
        chosen = {t: spec for t, spec in chosen.items() if spec.method != "full" and spec not in checked}
        if not chosen:
            continue
        docs = [long_text_ids(default_encoder, n, offset=4000 * d, texts=HELD_BACK_TEXTS) for d in range(DOCS)]
        exact = default_encoder.embed(docs, full_spec, max_batch_tokens=n)
        embedded: dict = {}
        for target, spec in chosen.items():
            if spec not in embedded:
                embedded[spec] = encoder.embed(docs, spec, max_batch_tokens=n)
            cosines = torch.nn.functional.cosine_similarity(embedded[spec], exact, dim=-1)
            outcomes += [(n, target, spec.to_json(), c) for c in cosines.tolist()]
        checked |= set(embedded)
    print("\n".join(f"{n} target {t}: {s} cosine {c:.4f}" for n, t, s, c in outcomes))
    assert len(outcomes) >= 4, "the table chose exact attention almost everywhere: nothing was checked"
    for target in (0.99, 0.995):  # the high targets too have approximate choices to check
        assert any(t == target for _, t, _, _ in outcomes), f"target {target}: exact attention everywhere"
    met = sum(c >= t for _, t, _, c in outcomes)
    assert met >= 0.9 * len(outcomes), outcomes


def pooled_and_chunk_vectors(encoder, docs: list[list[int]], spec) -> tuple[torch.Tensor, torch.Tensor]:
    """The documents' pooled vectors, and their 256-token chunks' vectors, from one pass each."""
    passes = [pooled_and_chunks(encoder, ids, spec) for ids in docs]
    return torch.cat([pooled for pooled, _ in passes]), torch.cat([chunks for _, chunks in passes])


@pytest.fixture(scope="module")
def nomic_held_back_4k(nomic_encoder, full_spec):
    """2 held-back documents of 4,096 tokens and exact attention's float32 vectors of them."""
    docs = [long_text_ids(nomic_encoder, 4096, offset=4000 * d, texts=HELD_BACK_TEXTS) for d in range(DOCS)]
    return docs, pooled_and_chunk_vectors(nomic_encoder, docs, full_spec)


@pytest.mark.skipif(not (LICENSE_DIR / HELD_BACK_TEXTS[0]).is_file(), reason="needs Debian's license texts")
@pytest.mark.parametrize(
    "dtype",
    [
        "float32",
        pytest.param(
            "bfloat16",
            marks=pytest.mark.skipif(
                not cpu_has_bf16(),
                reason="no bfloat16 instructions on this CPU: dtype auto serves float32 here",
            ),
        ),
    ],
)
def test_the_default_models_choices_meet_their_target_on_held_back_texts(nomic_encoder, nomic_held_back_4k, dtype):
    """nomic-embed-text-v1.5's CPU table of each dtype at 4k, where it chooses banded attention
    with far blocks for the default target (0.98) and for 0.99, for whole documents and, by
    their chunks' fidelity, for late-chunking windows, run by an encoder in that dtype: each
    document choice keeps its target for every held-back document's vector; each window choice
    for at least 80% of the documents' 256-token chunks, and none more than 0.01 below it: the
    table's worst chunk is the worst of 2 calibration documents, and a few chunks of other
    texts fall a little below it (at 0.98, 4 of 32 held-back chunks, the worst at 0.976).
    bfloat16 is checked where the CPU has bfloat16 instructions, the only CPUs whose server
    runs it by default (dtype auto); elsewhere it runs emulated and slowly."""
    encoder = nomic_encoder if dtype == "float32" else load_encoder(None, dtype=dtype)
    table = load_calibration(SHIPPED_DIR / table_name(encoder.name, "cpu", dtype))
    assert table.dtype == dtype
    n, targets = 4096, (0.98, 0.99)
    documents = {target: table.choose(n, target).spec for target in targets}
    windows = {target: table.choose(n, target, chunks=True).spec for target in targets}
    chosen = [*documents.values(), *windows.values()]
    assert all(spec.method == "banded" and spec.far_blocks for spec in chosen), chosen
    assert windows != documents, "the chunks' fidelity chose as the documents' did: nothing new is checked"
    docs, exact = nomic_held_back_4k
    embedded = {spec: pooled_and_chunk_vectors(encoder, docs, spec) for spec in set(chosen)}
    for target in targets:
        spec = documents[target]
        cosines = torch.nn.functional.cosine_similarity(embedded[spec][0], exact[0], dim=-1)
        print(f"{dtype} {n} target {target}: {spec.to_json()} document cosines {cosines.tolist()}")
        assert (cosines >= target).all(), (target, spec, cosines)
        spec = windows[target]
        cosines = torch.nn.functional.cosine_similarity(embedded[spec][1], exact[1], dim=-1)
        met = (cosines >= target).float().mean().item()
        print(f"{dtype} {n} target {target}: {spec.to_json()} chunks: worst {cosines.min():.4f}, {met:.0%} meet it")
        assert met >= 0.8 and cosines.min() >= target - 0.01, (target, spec, sorted(cosines.tolist())[:5])


@pytest.mark.skipif(not (LICENSE_DIR / HELD_BACK_TEXTS[0]).is_file(), reason="needs Debian's license texts")
@pytest.mark.skipif(not cpu_has_bf16(), reason="no bfloat16 instructions on this CPU: dtype auto serves float32 here")
def test_an_input_between_buckets_runs_the_lines_choice_and_keeps_its_target(nomic_encoder, full_spec):
    """At 1,536 tokens, between the bfloat16 table's 1k bucket (where nothing pays 1.1x) and its
    2k one, the speed-up on the line between the two chooses banded attention with far blocks;
    its vectors of held-back documents keep the default target to exact float32 attention."""
    table = load_calibration(SHIPPED_DIR / table_name(nomic_encoder.name, "cpu", "bfloat16"))
    n, target = 1536, 0.98
    choice = table.choose(n, target)
    assert choice.spec.method == "banded" and choice.spec.far_blocks, choice
    assert [b.tokens for b in table.around(n)] == [1024, 2048] and choice.speedup >= 1.1
    docs = [long_text_ids(nomic_encoder, n, offset=4000 * d, texts=HELD_BACK_TEXTS) for d in range(DOCS)]
    exact = nomic_encoder.embed(docs, full_spec, max_batch_tokens=n)
    got = load_encoder(None, dtype="bfloat16").embed(docs, choice.spec, max_batch_tokens=n)
    cosines = torch.nn.functional.cosine_similarity(got, exact, dim=-1)
    print(f"bfloat16 {n} target {target}: {choice.spec.to_json()} cosines {cosines.tolist()}")
    assert (cosines >= target).all(), cosines
