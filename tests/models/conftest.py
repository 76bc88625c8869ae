"""Shared fixtures for the models tests: the plumbing encoder (all-MiniLM-L6-v2, small and
fast: `default_encoder`) and the served default, nomic-embed-text-v1.5 (`nomic_encoder`), each
loaded once."""

import os
import random

import pytest

# transformers / sentence-transformers are test references only; never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_encoder():
    from clusterserve.models import load_encoder

    return load_encoder("all-MiniLM-L6-v2")


@pytest.fixture(scope="session")
def nomic_encoder():
    from default_model import require_default_model

    from clusterserve.models import load_encoder

    require_default_model()
    return load_encoder(None, dtype="float32")


@pytest.fixture(scope="session")
def full_spec():
    from clusterserve.kernels import AttentionSpec

    return AttentionSpec(method="full")


@pytest.fixture(scope="session")
def long_text():
    """make(words, seed=0): deterministic English-like text of `words` words (~1 token each)."""
    return _long_text


def _long_text(words: int, seed: int = 0) -> str:
    vocab = (
        "the model reads long documents and groups similar queries into clusters so that "
        "attention costs grow linearly with length while the embedding stays close to exact "
        "attention on real text about science history music cooking travel and law"
    ).split()
    rng = random.Random(seed)
    return " ".join(rng.choice(vocab) for _ in range(words)) + "."
