"""The served default, nomic-embed-text-v1.5 from its GGUF, against llama.cpp (llama-cpp-python)
on the same file: the same token ids and, with exact attention, the same vectors to a cosine
of 0.9999 at about 10, 500 and 2,000 tokens, and past the 2,048 trained positions where
llama.cpp is given the rotary base that the published dynamic NTK scaling gives at that
length. Also the default's published facts: 768 dimensions, 8,192 positions, its prompts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from default_model import require_default_model, require_llama_cpp

from clusterserve.kernels import AttentionSpec
from clusterserve.models.networks.rotary import rotary_base

FULL = AttentionSpec(method="full")
LICENCES = Path("/usr/share/common-licenses")


def _document(chars: int) -> str:
    text = (LICENCES / "GPL-3").read_text() + (LICENCES / "Apache-2.0").read_text()
    return "search_document: " + text[:chars]


def _llama(context: int, rope_freq_base: float | None = None):
    llama_cpp = require_llama_cpp()
    extra = {} if rope_freq_base is None else {"rope_freq_base": rope_freq_base}
    return llama_cpp.Llama(
        model_path=str(require_default_model()), embedding=True, n_ctx=context, n_batch=context, n_ubatch=context,
        n_threads=2, verbose=False, **extra,
    )


def _cosine(ours, llama, text: str) -> tuple[int, float]:
    ids = ours.tokenize([text])[0].ids
    assert llama.tokenize(text.encode(), add_bos=True, special=False) == ids
    a = ours.embed([text], FULL)[0].numpy()
    b = np.asarray(llama.embed(text), dtype=np.float64)
    return len(ids), float(a @ b / np.linalg.norm(b))


def test_default_model_is_nomic_embed_text_v15(nomic_encoder):
    info = nomic_encoder.info()
    assert (info["model"], info["architecture"], info["dim"]) == ("nomic-embed-text-v1.5", "nomic-bert", 768)
    assert (info["max_input_tokens"], info["native_positions"], info["position_extension"]) == (8192, 8192, None)
    assert info["prompts"]["query"] == "search_query: " and info["default_prompt_name"] == "document"
    config = nomic_encoder.model.config
    assert (config.rope_theta, config.rope_type, config.rope_factor, config.rope_original_positions) == (
        1000.0, "dynamic", 2.0, 2048,
    )


@pytest.mark.timeout(900)
def test_exact_attention_equals_llama_cpp_within_the_trained_positions(nomic_encoder):
    llama = _llama(2048)
    for chars, tokens in ((40, 10), (2500, 505), (9500, 1869)):
        n, cosine = _cosine(nomic_encoder, llama, _document(chars))
        assert n == tokens
        assert cosine >= 0.9999, (n, cosine)


@pytest.mark.timeout(900)
def test_exact_attention_equals_llama_cpp_past_them_with_the_same_scaling(nomic_encoder):
    text = _document(14000)
    n = len(nomic_encoder.tokenize([text])[0].ids)
    assert 2048 < n <= 8192
    # Dynamic NTK at this length is a plain rotary base; llama.cpp takes it as rope_freq_base.
    config = nomic_encoder.model.config
    base = rotary_base(n, config.head_dim, config.rope_theta, config.rope_type, config.rope_factor, 2048)
    llama = _llama(4096, base)
    _, cosine = _cosine(nomic_encoder, llama, text)
    assert cosine >= 0.9999, (n, base, cosine)
