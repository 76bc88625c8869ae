"""Late chunks find passages at least as well as naive chunks (the default model of this suite,
all-MiniLM-L6-v2, whose default is late chunking), on a small set of Debian's license texts.

Each query is a verbatim 24-word span from inside one text that occurs in no other; a text
scores by its best chunk. Recall@1 is counted in queries, and the noise allowed is two of
them. So that the comparison can fail, a control that drops what chunks are for, one vector a
document (the mean of its chunk vectors), must fall below naive chunks by more than the noise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clusterserve.bench.common import LICENSE_DIR
from clusterserve.bench.quality.corpus import Document, passages
from clusterserve.bench.quality.retrieval import rank_scores
from clusterserve.models.planning.chunking import ChunkingSpec

TEXTS = ("Apache-2.0", "Artistic", "CC0-1.0", "GFDL-1.3", "GPL-2", "LGPL-2.1", "MPL-1.1", "MPL-2.0")
NOISE_QUERIES = 2


@pytest.mark.skipif(not all((LICENSE_DIR / n).is_file() for n in TEXTS), reason="needs Debian's license texts")
def test_late_chunks_retrieve_at_least_as_well_as_naive_chunks(default_encoder, full_spec):
    texts = [(LICENSE_DIR / name).read_text() for name in TEXTS]
    docs = [Document(n, t, c) for n, t, c in zip(TEXTS, texts, default_encoder.count_tokens(texts))]
    queries = passages(docs, 4, 24, seed=0)
    assert len(queries) >= 24
    asked = default_encoder.embed([q.text for q in queries], full_spec)
    answers = [q.document for q in queries]

    def recall(chunking: ChunkingSpec | None) -> tuple[float, list[torch.Tensor]]:
        vectors = [c.vectors for c in default_encoder.embed_chunks(texts, full_spec, chunking)]
        return rank_scores(asked, vectors, answers)[0], vectors

    naive, _ = recall(ChunkingSpec(size=128, late=False))
    late, vectors = recall(ChunkingSpec(size=128))  # the model's default: late chunking
    whole = [F.normalize(v.mean(dim=0, keepdim=True), dim=-1) for v in vectors]
    control = rank_scores(asked, whole, answers)[0]
    noise = NOISE_QUERIES / len(queries)
    print(f"recall@1 over {len(queries)} passages: naive {naive:.3f}, late {late:.3f}, one vector a text {control:.3f}")
    assert control < naive - noise, "the set cannot tell chunk vectors from one vector a text"
    assert late >= naive - noise
