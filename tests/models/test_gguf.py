"""GGUF checkpoints: files written by the `gguf` package's writer load into the same model as
the checkpoint folder they were made from; quantised tensors and other architectures are
refused by name; the architecture table's published facts hold for nomic-embed-text."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gguf_files import minilm_gguf, nomic_gguf

from clusterserve.kernels import AttentionSpec
from clusterserve.models import UnsupportedArchitecture, load_encoder
from clusterserve.models.gguf_checkpoint import ARCHITECTURES, NOMIC_PROMPTS, read_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
from tiny_checkpoints import make_checkpoint  # noqa: E402

FULL = AttentionSpec(method="full")
# Weights stored in 16 bits move a vector by rounding alone; float32 files load bit for bit.
MIN_COSINE = {"F32": 1 - 1e-6, "F16": 0.9999, "BF16": 0.999}


@pytest.fixture(scope="module")
def minilm():
    return load_encoder("all-MiniLM-L6-v2", max_input_tokens=512)


@pytest.fixture(scope="module")
def texts(long_text):
    return ["hello world", "Ünïcode café, naïve résumé — CJK 中文 and emoji 🙂!", long_text(300)]


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16"])
def test_minilm_as_bert_gguf_is_the_folder_model(kind, tmp_path, minilm, texts):
    encoder = load_encoder(minilm_gguf(tmp_path / f"minilm-{kind}.gguf", kind))
    assert (encoder.architecture, encoder.dim, encoder.max_input_tokens) == ("bert", 384, 512)
    assert encoder.name == f"minilm-{kind}"
    assert (encoder.pooling.mode, encoder.pooling.normalize) == ("mean", True)
    assert [t.ids for t in encoder.tokenize(texts)] == [t.ids for t in minilm.tokenize(texts)]
    assert [t.offsets for t in encoder.tokenize(texts)] == [t.offsets for t in minilm.tokenize(texts)]
    cosines = (encoder.embed(texts, FULL) * minilm.embed(texts, FULL)).sum(-1)
    assert cosines.min().item() >= MIN_COSINE[kind], cosines


def test_tiny_nomic_gguf_is_its_folder_model(tmp_path, texts, long_text):
    folder = make_checkpoint("nomic-bert", tmp_path / "nomic")
    from_folder = load_encoder(folder, max_input_tokens=2048)
    from_file = load_encoder(nomic_gguf(folder, tmp_path / "nomic.gguf"))
    # The file's context (1024 trained positions) is published 4x longer with dynamic NTK, as
    # nomic-embed-text is; below the trained length both run the same angles.
    assert (from_file.architecture, from_file.native_positions) == ("nomic-bert", 4096)
    assert from_file.prompts.prompts == NOMIC_PROMPTS and from_file.prompts.default_name == "document"
    a = from_file.embed(texts, FULL, prompt_name="query")
    b = from_folder.embed(texts, FULL, prompt_name="query")
    assert torch.nn.functional.cosine_similarity(a, b).min().item() >= 1 - 1e-6
    assert (from_file.model.config.rope_type, from_file.model.config.rope_factor) == ("dynamic", 2.0)
    long = [long_text(1400)]  # past the trained 1024 positions: the published scaling applies
    scaled = from_file.embed(long, FULL, prompt_name="query")
    assert torch.nn.functional.cosine_similarity(scaled, from_folder.embed(long, FULL, prompt_name="query")).item() < 1 - 1e-6


def test_default_prompt_is_not_added_to_a_text_that_carries_one(tmp_path):
    folder = make_checkpoint("nomic-bert", tmp_path / "nomic")
    encoder = load_encoder(nomic_gguf(folder, tmp_path / "nomic.gguf"))
    ids = encoder.prepare(["search_query: what is attention?", "what is attention?"])
    named = encoder.prepare(["what is attention?"], prompt_name="query")
    document = encoder.prepare(["what is attention?"], prompt_name="document")
    assert ids[0] == named[0] and ids[1] == document[0] and ids[0] != ids[1]


def test_a_quantised_tensor_is_refused_by_its_type(tmp_path):
    path = minilm_gguf(tmp_path / "q.gguf", "F16", quantise="blk.0.ffn_up.weight")
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight is Q8_0, a quantised type"):
        load_encoder(path)


def test_other_architectures_and_files_are_refused(tmp_path):
    from gguf_files import write_gguf

    meta = dict(block_count=1, context_length=8, embedding_length=4, feed_forward_length=4, head_count=1, layer_norm_eps=1e-5)
    path = write_gguf(tmp_path / "llama.gguf", "llama", meta, ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], {})
    with pytest.raises(UnsupportedArchitecture, match="GGUF architecture 'llama'.*bert, nomic-bert"):
        load_encoder(path)
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(not_gguf)


def test_one_table_names_every_gguf_architecture():
    assert set(ARCHITECTURES) == {"bert", "nomic-bert"}
